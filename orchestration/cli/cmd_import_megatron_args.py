"""python -m orchestration import-megatron-args model.sh data.sh --model-out m.yaml --data-out d.yaml"""

from megatron_ext.run_spec.errors import EXIT_OK
from orchestration.import_args.importer import import_arg_files
from orchestration.import_args.outputs import check_outputs, write_outputs
from orchestration.import_args.yaml_files import imported_yaml, render_report
from orchestration.launch_env import LaunchEnv

HELP = ("Megatron-LM argument files (shell arrays or a pretrain_gpt.py command line) -> a model preset and a data set YAML; "
        "lists every flag without a counterpart")


def add_arguments(parser) -> None:
    parser.add_argument("files", nargs="+", help="shell files, read in order like sourcing them (later ones override)")
    parser.add_argument("--model-out", required=True, help="the model preset to write (.yaml)")
    parser.add_argument("--data-out", required=True, help="the data set to write (.yaml: data and training)")
    parser.add_argument("--megatron-lm-dir", help="read the flags from this checkout (default $MEGATRON_LM_DIR, else "
                        "Megatron-LM core_v0.16.1's flag table)")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable the files use but do not set, or a script argument (5=/data/x_text_document)")
    parser.add_argument("--force", action="store_true", help="overwrite existing outputs")
    parser.add_argument("--dry-run", action="store_true", help="print both YAML files and the list, write nothing (DRY_RUN=1)")


def run(args, launch: LaunchEnv) -> int:
    outputs = check_outputs(args.model_out, args.data_out, args.force, launch.dry_run)
    result = import_arg_files(args.files, args.var, args.megatron_lm_dir or launch.megatron_lm_dir)
    texts = imported_yaml(result)
    print(render_report(result), end="", flush=True)
    if launch.dry_run:
        for path, text in zip(outputs, texts):
            print(f"--- {path} (dry run: not written)\n{text}", end="")
        return EXIT_OK
    write_outputs(outputs, texts)
    for path in outputs:
        print(f"wrote {path}")
    return EXIT_OK
