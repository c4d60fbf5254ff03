"""a checkpoint of RUN (any stage, any data-parallel size) in another format: export-hf and
export-megatron-lm, one command per format (:data:`VERBS`), written by megatron_ext/export_hf.py or
export_megatron_lm.py in a child process (the launcher imports no torch); DRY_RUN=1 prints that command

    python -m orchestration export-hf demo /tmp/demo_hf [--iteration N]    # a Hugging Face model directory
    python -m orchestration export-megatron-lm demo /tmp/demo_save          # a Megatron-LM --save folder
"""

import shlex
from pathlib import Path

from megatron_ext.run_spec.errors import EXIT_OK
from orchestration.launch_env import LaunchEnv
from orchestration.runner.export import export_argv, run_export
from orchestration.runner.nodes import require_run

VERBS = {name: f"a checkpoint of RUN (any stage, any data-parallel size) as {what}" for name, what in (
    ("export-hf", "a Hugging Face model directory: config.json, safetensors, generation_config.json, the tokenizer"),
    ("export-megatron-lm", "a Megatron-LM --save folder (torch_dist, weights only) that --pretrained-checkpoint and "
                           "training.init_checkpoint start from"))}
"""Its commands and their help: one per format."""


def add_arguments(parser) -> None:
    parser.add_argument("run"), parser.add_argument("out", help="the directory to write")
    parser.add_argument("--iteration", type=int, help="the checkpoint's iteration (default: the latest)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT")


def run(args, launch: LaunchEnv) -> int:
    require_run(launch, args.run)
    argv = export_argv(launch, args.run, Path(args.out), args.iteration, args.force, args.command.removeprefix("export-"))
    if launch.dry_run:
        print(shlex.join(argv), flush=True)
        return EXIT_OK
    return run_export(launch, argv)
