"""Which program torchrun runs on every rank: this project's (megatron-core) or Megatron-LM's.

    ENGINE=megatron-lm MEGATRON_LM_DIR=/opt/Megatron-LM python -m orchestration start ...

:func:`plan_program` (pure) returns the program part of the torchrun command line and the
environment changes every rank needs (the ZeRO stage's, for both engines). For Megatron-LM it
renders ``pretrain_gpt.py``'s arguments from the same params and ZeRO table for the checkout the
start read (:mod:`orchestration.megatron_lm.checkout`), and names the check a start runs before
anything starts: :func:`check_arguments`, Megatron-LM's own ``parse_args`` + ``validate_args`` at
the run's world size (:mod:`orchestration.megatron_lm.validate`, a child process); where the
checkout does not import here, every flag is checked against the checkout's source instead and
the note says so (where this Python is older than the checkout's requires-python, the note says
that every node's preflight refuses it). Either way a refusal is a :class:`UserError` before
anything starts. The extra arguments (``MEGATRON_LM_EXTRA_ARGS``, ``training.megatron_lm_extra_args``)
lose or change the flags of older releases the checkout retired, one note each
(:mod:`orchestration.megatron_lm.retired_flags`).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from megatron_ext.run_spec.engines import MEGATRON_CORE, MEGATRON_LM, engine_named
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import RunParams
from megatron_ext.run_spec.python_version import python_problem
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.wandb_run import wandb_resume_env
from megatron_ext.run_spec.zero import stage_environment
from orchestration.launch_env import LaunchEnv
from orchestration.megatron_lm.checkout import Checkout
from orchestration.megatron_lm.render import NodeKernels, check_flags, integrity_flags, load_flags, render_pretrain_gpt
from orchestration.megatron_lm.retired_flags import retire_flags
from orchestration.megatron_lm.validate import DEFAULT_DEVICE_ARCH, Validation, validate_with_megatron
from orchestration.node.wire import CheckpointChoice, NodeReport

if TYPE_CHECKING:
    from megatron_ext.data.prepare import PreparedData

CHECK_ARGUMENTS = "check-arguments"
BUILD_HELPERS = "build-dataset-helpers"


@dataclass(frozen=True, kw_only=True)
class ProgramPlan:
    engine: str
    argv: tuple[str, ...]
    """What follows torchrun's own options: ``-m module ...`` or ``script.py ...``."""
    env: dict[str, str | None]
    """Environment changes for every rank (None = unset)."""
    notes: tuple[str, ...] = field(default=())
    """What the user should know about the program (printed to stderr)."""
    save_signal: str = MEGATRON_CORE.save_signal
    """The signal that makes every rank save at the next step and end (the supervisor sends it to
    each rank on a preemption, a time limit or ``stop --save``)."""
    checks: tuple[tuple[str, str], ...] = ()
    """(step name, what it checks): what a start (and its dry run) checks before anything starts."""
    prepare: tuple[tuple[str, str], ...] = ()
    """(step name, what it does): what a start (not its dry run) does before the nodes start."""
    program_args: tuple[str, ...] = ()
    """Megatron-LM: ``pretrain_gpt.py``'s arguments alone (what its own parser checks)."""
    resume_args: tuple[str, ...] = ()
    """Megatron-LM: appended for an attempt that starts with a checkpoint the plan's argv does not load
    (a run that started afresh and restarts: ``--load``)."""
    checkpoint_choice: CheckpointChoice | None = None
    """Megatron-LM: node 0 picks each attempt's checkpoint (``--ckpt-step``, ``--verify-integrity``)."""


def device_arch(launch: LaunchEnv) -> int:
    """The compute capability Megatron-LM's argument check assumes without a GPU (MEGATRON_DEVICE_ARCH)."""
    text = launch.megatron_device_arch_text
    if text is None:
        return DEFAULT_DEVICE_ARCH
    if not text.isdigit():
        raise UserError(f"MEGATRON_DEVICE_ARCH={text!r} must be a compute capability's major number, e.g. 9 (Hopper) "
                        f"or 10 (Blackwell); unset it for {DEFAULT_DEVICE_ARCH}")
    return int(text)


def check_megatron_lm_params(params: RunParams) -> None:
    """What Megatron-LM's pretrain_gpt.py cannot do with these params, before its checkout is even read."""
    if params.hf_weights:
        raise UserError(
            f"ENGINE=megatron-lm cannot start from the Hugging Face weights in {params.model.hf_checkpoint} (its "
            "pretrain_gpt.py reads Megatron checkpoints only; the architecture flags do come from config.json): convert "
            "them first with Megatron-Bridge (python examples/conversion/convert_checkpoints.py import --hf-model "
            f"{params.model.hf_checkpoint} --megatron-path DIR) and continue from DIR with Megatron-LM's "
            "--pretrained-checkpoint, or use ENGINE=megatron-core (reads them directly), or set training.init: random"
        )


FSDP_SAVE_HANG = ("Megatron-LM {version}'s Megatron-FSDP hangs at the first checkpoint save when a data-parallel "
                  "rank holds an empty shard of a parameter, which a real model at data-parallel size 2 and more "
                  "always has (ranks build different sets of optimizer-state DTensors: upstream NVIDIA/Megatron-LM "
                  "issue 4910, open at core_v0.16.1 and seen again at core_v0.19.0)")
STAGE1_NO_RESUME = ("Megatron-LM {version}'s distributed optimizer cannot resume on nodes without transformer-engine "
                    "or apex: it falls back to torch's Adam, whose state is empty when the checkpoint loads "
                    "(distrib_optimizer.py `assert len(steps) == 1`: line 642 at core_v0.16.1, 839 at core_v0.19.0; "
                    "or KeyError 'step')")
KNOWN_LIMITS_UP_TO = (0, 19)
"""The newest Megatron-LM release these limits were read in and measured on: core_v0.16.1, and
core_v0.19.0 (its own pretrain_gpt.py on 2 CPU ranks through the device shim, issue 40: the
distributed optimizer's resume asserts, Megatron-FSDP's first save hangs). A newer release gets no
refusal until it is measured (the start then says only what it renders)."""


def known_limits(params: RunParams, version: tuple[int, ...], kernels: NodeKernels, has_checkpoint: bool,
                 extra_args: Sequence[str]) -> list[str]:
    """Megatron-LM's own limits for this run, before it starts: a UserError where the run would
    hang or cannot resume, notes where it is only worth knowing. Pure."""
    t, notes = params.training, []
    if t.fp8 and not (kernels.gpus and kernels.transformer_engine):
        raise UserError(f"training.fp8={t.fp8} needs transformer-engine on GPUs (Megatron-LM's --fp8-format runs in its "
                        f"layers), and the nodes have {'no transformer-engine' if kernels.gpus else 'no GPU'}; remove "
                        "training.fp8 (BF16), or start on nodes with transformer-engine")
    if tuple(version[:2]) > KNOWN_LIMITS_UP_TO:
        return notes
    v = ".".join(map(str, version))
    saves = t.save_interval > 0  # the render gives --save only then (training.save_interval: 0 = no checkpoints)
    if t.zero_stage >= 2 and saves and "--no-save-optim" not in extra_args:
        raise UserError(
            f"ZERO_STAGE={t.zero_stage} with ENGINE=megatron-lm would hang at every checkpoint save: "
            + FSDP_SAVE_HANG.format(version=v) + "; use ENGINE=megatron-core (its stage 2-3 checkpoints save and "
            "resume), ZERO_STAGE=0 or 1, or save without the optimizer state (MEGATRON_LM_EXTRA_ARGS=--no-save-optim: "
            "a resume then starts the optimizer afresh, not exactly where it stopped)")
    if t.zero_stage >= 2 and saves:
        notes.append("--no-save-optim: checkpoints hold no optimizer state (the Megatron-FSDP save hang avoided); a "
                     "resume starts the optimizer afresh")
    if t.zero_stage == 1 and saves and not (kernels.gpus and (kernels.transformer_engine or kernels.apex)):
        why = STAGE1_NO_RESUME.format(version=v)
        if has_checkpoint:
            raise UserError(f"this start would resume the run's checkpoint at ZERO_STAGE=1, and {why}; resume on nodes "
                            "with transformer-engine or apex, or start afresh (another RUN name), or use ENGINE=megatron-core")
        if t.resilience.max_restarts:
            raise UserError(f"MAX_RESTARTS={t.resilience.max_restarts} restarts from the latest checkpoint, and {why}; set "
                            "MAX_RESTARTS=0, use ZERO_STAGE=0, nodes with transformer-engine or apex, or ENGINE=megatron-core")
        notes.append(f"the checkpoints of this run cannot be resumed: {why}")
    return notes


def retire_extra_args(checkout: Checkout, given: Sequence[tuple[str, Sequence[str]]]) -> tuple[tuple[str, ...], list[str]]:
    """The extra arguments (``given``: (where they come from, their words), in order) for the checkout:
    flags of older releases it renamed translated, those whose effect is its default dropped, one
    line each (:mod:`orchestration.megatron_lm.retired_flags`); a UserError for one it refuses. Pure."""
    words, lines = retire_flags([(source, word) for source, words in given for word in words], checkout.table,
                                where=lambda w: w[0], text=lambda w: w[1], rename=lambda w, flag: (w[0], flag))
    return tuple(word for _, word in words), lines


def plan_program(params: RunParams, model: str, data: str, paths: RunPaths, launch: LaunchEnv,
                 checkout: Checkout | None = None, prepared: PreparedData | None = None,
                 answers: Sequence[NodeReport] | None = None, has_checkpoint: bool = False) -> ProgramPlan:
    """The program of every rank; ENGINE=megatron-lm needs the ``checkout``, where the data is (or
    will be) ``prepared``, and renders for what the nodes ``answers`` say they have (without them:
    GPUs with transformer-engine and apex where this machine has GPUs, else the CPU). Pure."""
    t = params.training
    if not engine_named(t.engine).runs_checkout:
        elastic = ("--global-batch-size", str(t.global_batch_size)) if t.resilience.min_nodes else ()
        return ProgramPlan(engine=MEGATRON_CORE.name, argv=(
            *MEGATRON_CORE.program.split(), "--model", model, "--data", data, "--run-name", paths.run,
            "--zero-stage", str(t.zero_stage), "--train-iters", str(t.train_iters), *elastic,
        ), env=stage_environment(t.zero_stage))
    check_megatron_lm_params(params)
    if checkout is None or prepared is None:
        raise UserError("ENGINE=megatron-lm needs MEGATRON_LM_DIR, the Megatron-LM checkout holding pretrain_gpt.py")
    kernels = NodeKernels.from_answers(answers) if answers else NodeKernels(*(launch.visible_gpus > 0,) * 3)
    extra, retired = retire_extra_args(checkout, [("training.megatron_lm_extra_args", t.megatron_lm_extra_args),
                                                  ("MEGATRON_LM_EXTRA_ARGS", launch.megatron_lm_extra_args)])
    limits = known_limits(params, checkout.version, kernels, has_checkpoint, extra)
    render = render_pretrain_gpt(params, prepared, paths, checkout.version[:2], kernels, known=checkout.flags,
                                 wandb=launch.wandb, extra_args=extra, load=has_checkpoint)
    signal_note = (f"a save request (preemption, time limit, stop --save) reaches Megatron-LM's "
                   f"--exit-signal-handler as {render.save_signal}, sent to each rank directly"
                   + ("" if "--exit-signal" in checkout.flags else " (this checkout has no --exit-signal: SIGTERM, its default)")
                   if "--exit-signal-handler" in render.args else
                   "this checkout has no --exit-signal-handler: a save request ends the run without a save")
    wandb_env = wandb_resume_env(launch.wandb, paths) if launch.wandb else {}  # one W&B run across restarts
    check = (CHECK_ARGUMENTS, f"Megatron-LM {checkout.version_text}'s own parse_args + validate_args on the arguments at "
                              f"world size {launch.world_size}, and its tokenizer build (a child process)")
    kernel_note = f"Megatron-LM renders for the nodes: {kernels.describe()}" + ("" if answers else " (assumed: no node answered)")
    if checkout.gpt_model_deprecated:
        limits = (*limits, f"Megatron-LM {checkout.version_text} deprecates GPTModel (each rank logs 'GPTModel IS "
                           "DEPRECATED': bug fixes only, HybridModel and pretrain_hybrid.py are its successors); its "
                           "pretrain_gpt.py still trains it, and that is what this launcher runs: docs/megatron-lm.md")
    helpers = (BUILD_HELPERS, f"build Megatron-LM's dataset helpers for the ranks' Python ({launch.python}) with the "
                              "checkout's Makefile, here on node 0 where its rank 0 would (dataset_helpers.py)")
    return ProgramPlan(engine=MEGATRON_LM.name, argv=(str(checkout.root / MEGATRON_LM.program), *render.args),
                       env={**render.env, **wandb_env}, notes=(kernel_note, signal_note, *retired, *limits), save_signal=render.save_signal,
                       checks=(check,), prepare=(helpers,),
                       program_args=tuple(render.args), resume_args=tuple(load_flags(paths)) if not has_checkpoint else (),
                       checkpoint_choice=CheckpointChoice(integrity_args=tuple(integrity_flags(t.zero_stage, checkout.flags))
                                                          if t.verify_integrity else (),
                                                          init_checkpoint=t.init_checkpoint or ""))


@dataclass(frozen=True, kw_only=True)
class ArgumentCheck:
    """One argument list for Megatron-LM's check, its ranks' environment and its child's settings."""

    root: str
    argv: tuple[str, ...]
    world_size: int
    env: tuple[tuple[str, str], ...]
    device_arch: int
    python: str
    build_tokenizer: bool


Verdicts = Mapping[ArgumentCheck, Validation]


def argument_check(program: ProgramPlan | None, launch: LaunchEnv, checkout: Checkout | None, tokenizer_path: str | None,
                   data_ready: bool) -> ArgumentCheck | tuple[str, ...]:
    """What Megatron-LM's own check of ``program``'s arguments runs on (the tokenizer too, unless the
    data preparation still has to make it); where it does not run, the notes (another engine: none;
    a Python the checkout refuses: the source reader's, or its UserError)."""
    if program is None or not engine_named(program.engine).runs_checkout or checkout is None:
        return ()
    requirement = checkout.python_requirement
    problem = (python_problem(requirement, sys.version_info[:3], launch.python, "the launcher")
               if requirement is not None and launch.python == sys.executable else None)
    if problem is not None:  # its import would fail in the child: say why, and what the preflight does with it
        return _checked_from_source(program, checkout, "Megatron-LM's own argument check cannot run here, and every "
                                    f"node's preflight refuses a start on this Python: {problem}")
    rank_env = {k: v for k, v in launch.forwarded.items() if k not in program.env}
    rank_env.update({k: v for k, v in program.env.items() if v is not None and not k.startswith("WANDB_")})
    # (W&B's: validate_args reads none, and a fresh WANDB_RUN_ID per plan would make no two checks alike)
    return ArgumentCheck(root=str(checkout.root), argv=tuple(program.program_args), world_size=launch.world_size,
                         env=tuple(sorted(rank_env.items())), device_arch=device_arch(launch), python=launch.python,
                         build_tokenizer=data_ready or tokenizer_path is not None)


def run_argument_checks(checks: Iterable[ArgumentCheck]) -> dict[ArgumentCheck, Validation]:
    """Every check's verdict: one child (one import of Megatron-LM, ~5 s here) for the checks that
    share all but their argument list and environment. Side effects: those children."""
    groups: dict[ArgumentCheck, list[ArgumentCheck]] = {}
    for check in dict.fromkeys(checks):
        groups.setdefault(dataclasses.replace(check, argv=(), env=()), []).append(check)
    verdicts: dict[ArgumentCheck, Validation] = {}
    for child, members in groups.items():
        answers = validate_with_megatron(Path(child.root), [(m.argv, dict(m.env)) for m in members], child.world_size,
                                         child.device_arch, python=child.python, build_tokenizer=child.build_tokenizer)
        verdicts.update(zip(members, answers))
    return verdicts


def check_arguments(program: ProgramPlan | None, launch: LaunchEnv, checkout: Checkout | None, tokenizer_path: str | None,
                    data_ready: bool, verdicts: Verdicts | None = None) -> tuple[str, ...]:
    """Megatron-LM's own check of ``program``'s arguments (see the module docstring): its notes, or a
    UserError; the verdict from ``verdicts`` where it holds this very check, else from a child."""
    check = argument_check(program, launch, checkout, tokenizer_path, data_ready)
    if not isinstance(check, ArgumentCheck):
        return check
    verdict = (verdicts or {}).get(check) or run_argument_checks([check])[check]
    return judge_arguments(check, verdict, program, launch, checkout, tokenizer_path)


def judge_arguments(check: ArgumentCheck, verdict: Validation, program: ProgramPlan, launch: LaunchEnv, checkout: Checkout,
                    tokenizer_path: str | None) -> tuple[str, ...]:
    """``verdict``'s notes or UserError (unavailable: the source reader's)."""
    if verdict.status == "refused":
        raise UserError(
            f"Megatron-LM {checkout.version_text} ({checkout.root}) refuses the rendered arguments at world size "
            f"{launch.world_size}: {verdict.message}; change the params, ZERO_STAGE or the cluster shape"
        )
    if verdict.status == "tokenizer":
        raise UserError(
            f"Megatron-LM {checkout.version_text} ({checkout.root}) cannot build the run's tokenizer "
            f"{tokenizer_path} as its ranks would ({verdict.message}); give a tokenizer that "
            "transformers' AutoTokenizer.from_pretrained loads (a directory with tokenizer.json and tokenizer_config.json)"
        )
    made = ("" if check.build_tokenizer else
            "; the tokenizer is made by the data preparation: it is built when the start has prepared the data")
    if verdict.status == "accepted":
        note = (f"Megatron-LM {checkout.version_text}'s own parse_args + validate_args accept the arguments at world size "
                f"{launch.world_size}")
        return (note + (f" ({verdict.message})" if verdict.message else "") + made,)
    return _checked_from_source(program, checkout, f"Megatron-LM's own argument check cannot run here "
                                f"({verdict.message}); checked every flag against the checkout's source instead")


def _checked_from_source(program: ProgramPlan, checkout: Checkout, note: str) -> tuple[str, ...]:
    """Every flag checked against the checkout's source where its own check cannot run: ``note``,
    or a UserError naming the flag with ``note`` under it."""
    try:
        check_flags(list(program.program_args), checkout.flags, checkout.version_text)
    except UserError as exc:
        raise UserError(f"{exc}\nnote: {note}") from None
    return (note,)
