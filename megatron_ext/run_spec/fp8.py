"""Whether a run's FP8 setting can run here: one rule for the rank's edge and the launcher's preflight.

    python -c "from megatron_ext.run_spec.fp8 import fp8_problem; print(fp8_problem('hybrid', None, (9, 0)))"

``training.fp8`` (``hybrid`` or ``e4m3``, Megatron-LM's ``--fp8-format``) runs the matrix
multiplications through transformer-engine's ``fp8_autocast``, which megatron-core enters for
its transformer-engine layers (``megatron/core/fp8_utils.py``: ``get_fp8_context``, from
transformer-engine 1.0). FP8 tensor cores exist from compute capability 8.9 (Ada) and 9.0
(Hopper) on; a GPU without them, or a machine without transformer-engine, cannot run it, and
megatron-core's local layers have no FP8 path. Pure: the caller reads the transformer-engine
version and the compute capability at its edge.
"""

from __future__ import annotations

MIN_TRANSFORMER_ENGINE = "1.0"
"""megatron-core 0.16's fp8 context needs transformer-engine 1.0 or later (fp8_utils.py ~L362)."""
MIN_COMPUTE_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0) and later."""


def te_at_least(version: str, minimum: str) -> bool:
    """Whether transformer-engine ``version`` is ``minimum`` or later, as megatron-core decides it:
    its ``is_te_min_version(minimum)`` compares packaging's versions, ``PkgVersion(te) >=
    PkgVersion(minimum)`` (megatron/core/utils.py L340-349 at core_v0.16.1, L326-335 at
    core_v0.19.0), so a development build "2.10.0.dev0+abc" is below "2.10", and a local tag
    ("2.12.0+cu13") counts as its release. A version packaging cannot read counts as too old. Pure."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) >= Version(minimum)
    except InvalidVersion:
        return False


def fp8_problem(fp8_setting: str | None, transformer_engine_version: str | None,
                compute_capability: tuple[int, int] | None) -> str | None:
    """Why ``training.fp8 = fp8_setting`` cannot run with this transformer-engine version (None:
    not installed) on a GPU of this compute capability (None: no GPU); None when it can (or
    when FP8 is off). One message: the value, the rule, the fix."""
    if fp8_setting is None:
        return None
    fix = "set training.fp8: null in the data set (BF16)"
    if compute_capability is None:
        return (f"training.fp8={fp8_setting} needs a GPU with FP8 tensor cores (compute capability "
                f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} or later) and this run has none; {fix}")
    if tuple(compute_capability) < MIN_COMPUTE_CAPABILITY:
        return (f"training.fp8={fp8_setting} needs FP8 tensor cores (compute capability "
                f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} or later: Ada, Hopper, Blackwell); this GPU "
                f"is {compute_capability[0]}.{compute_capability[1]}; {fix}, or run on H100/H200-class GPUs")
    if transformer_engine_version is None:
        return (f"training.fp8={fp8_setting} runs through transformer-engine's fp8_autocast, and transformer-engine "
                f"is not installed; use an image that has it (NGC PyTorch), install it (pip install -e .[gpu]), or {fix}")
    if not te_at_least(transformer_engine_version, MIN_TRANSFORMER_ENGINE):
        return (f"training.fp8={fp8_setting} needs transformer-engine {MIN_TRANSFORMER_ENGINE} or later (megatron-core's fp8 context); "
                f"this one is {transformer_engine_version}; upgrade it, or {fix}")
    return None


def fp8_config_fields(fp8_setting: str | None, amax_history_len: int, amax_compute_algo: str) -> dict:
    """megatron-core TransformerConfig fields for the setting (Megatron-LM's --fp8-format,
    --fp8-recipe delayed, --fp8-amax-history-len, --fp8-amax-compute-algo); empty for BF16."""
    if fp8_setting is None:
        return {}
    return {"fp8": fp8_setting, "fp8_recipe": "delayed", "fp8_amax_history_len": amax_history_len,
            "fp8_amax_compute_algo": amax_compute_algo}
