"""megatron-core version gate: run only on versions whose APIs this project uses.

    python -c "from megatron_ext.training.versions import check_megatron_core; check_megatron_core()"
"""

from __future__ import annotations

from megatron_ext.spec.errors import UserError

SUPPORTED_MEGATRON_CORE = ((0, 14), (0, 16))
"""Inclusive (major, minor) range whose APIs the program uses (Megatron-FSDP as
``use_megatron_fsdp``, ``get_gpt_layer_local_spec(normalization=...)``)."""
TESTED_MEGATRON_CORE = ("0.16.1", "0.15.3", "0.14.0")
"""0.16.1 in CI; 0.15.3 and 0.14.0 by hand (CPU path, every stage)."""


def parse_version(text: str) -> tuple[int, int]:
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UserError(f"cannot read a version from {text!r}") from None


def check_megatron_core(version: str | None = None) -> str:
    """Return the installed megatron-core version or raise with the supported range."""
    if version is None:
        try:
            from megatron.core import package_info
        except ImportError:
            raise UserError(
                "megatron-core is not importable; install it with "
                "`pip install megatron-core==0.16.1` (or run training_scripts/setup_env.sh)"
            ) from None
        version = package_info.__version__
    lo, hi = SUPPORTED_MEGATRON_CORE
    if not lo <= parse_version(version) <= hi:
        raise UserError(
            f"megatron-core {version} is outside the supported range "
            f"{lo[0]}.{lo[1]}.x-{hi[0]}.{hi[1]}.x (tested: {', '.join(TESTED_MEGATRON_CORE)}); "
            "install one with `pip install 'megatron-core>=0.14,<0.17'`"
        )
    return version
