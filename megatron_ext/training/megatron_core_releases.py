"""megatron-core version gate: run on the releases this project is tested with.

    python -c "from megatron_ext.training.megatron_core_releases import check_megatron_core; print(check_megatron_core())"

The tested releases are listed in :data:`TESTED_MEGATRON_CORE` (see the README's support matrix);
anything between the oldest and newest tested minor release is admitted. A newer, untested
release is refused naming the tested range, unless ``MEGATRON_EXT_ALLOW_UNTESTED=1`` asks to try
it: then the program starts with a one-line warning. Older releases lack APIs the program uses
(Megatron-FSDP as ``use_megatron_fsdp``, ``get_gpt_layer_local_spec(normalization=...)``) and are
always refused. Where an API moved between the tested releases, :mod:`megatron_ext.training.megatron_core_apis`
says so; nothing else checks versions.
"""

from __future__ import annotations

from megatron_ext.run_spec.errors import UserError

TESTED_MEGATRON_CORE: dict[tuple[int, int], str] = {
    (0, 14): "0.14.0",
    (0, 15): "0.15.3",
    (0, 16): "0.16.1",
    (0, 17): "0.17.1",
    (0, 18): "0.18.2",
    (0, 19): "0.19.2",
}
"""(major, minor) -> the release tested (CPU path, every stage; see README for Python versions)."""
ALLOW_UNTESTED_ENV = "MEGATRON_EXT_ALLOW_UNTESTED"


def parse_version(text: str) -> tuple[int, int]:
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UserError(f"cannot read a version from {text!r}") from None


def tested_range() -> str:
    return f"{min(TESTED_MEGATRON_CORE)[0]}.{min(TESTED_MEGATRON_CORE)[1]}-{max(TESTED_MEGATRON_CORE)[0]}.{max(TESTED_MEGATRON_CORE)[1]}"


def check_megatron_core(version: str | None = None, allow_untested: bool = False) -> tuple[str, str | None]:
    """(the megatron-core version, a warning or None); a UserError when it may not run."""
    if version is None:
        try:
            from megatron.core import package_info
        except ImportError as exc:
            raise UserError(
                f"megatron-core does not import ({exc}); install it with training_scripts/setup_env.sh "
                f"(tested releases: {', '.join(TESTED_MEGATRON_CORE.values())})"
            ) from None
        version = package_info.__version__
    release = parse_version(version)
    tested = ", ".join(TESTED_MEGATRON_CORE.values())
    if min(TESTED_MEGATRON_CORE) <= release <= max(TESTED_MEGATRON_CORE):
        return version, None
    if release > max(TESTED_MEGATRON_CORE) and allow_untested:
        return version, (f"warning: megatron-core {version} is newer than the tested releases ({tested}); "
                         f"running it because {ALLOW_UNTESTED_ENV}=1")
    hint = (f", or set {ALLOW_UNTESTED_ENV}=1 to try this newer release" if release > max(TESTED_MEGATRON_CORE) else "")
    raise UserError(
        f"megatron-core {version} is outside the tested range {tested_range()} (tested: {tested}); "
        f"install one of those (training_scripts/setup_env.sh){hint}"
    )
