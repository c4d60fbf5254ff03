"""A run's checkpoint -> a Megatron-LM checkpoint that Megatron-LM's pretrain_gpt.py starts from.

    python -m megatron_ext.export_megatron_lm --artifact-root ART --run RUN --out SAVE_DIR [--iteration N]

(``training_scripts/export_megatron_lm.sh RUN SAVE_DIR`` runs this through the launcher.) Reads one
checkpoint of this program's run (the latest, or ``--iteration``; any ZeRO stage and data-parallel
size, as export_hf) and writes its model weights as the ``--save`` folder of a Megatron-LM run:
``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` in torch_dist format, the dtype the
checkpoint holds: fp32 from CPU runs and from GPU runs at stages 2-3 (Megatron-FSDP saves its fp32 main
weights), bf16 from GPU runs at stages 0-1 (the model's bf16 weights). Megatron-LM continues from it with
``--pretrained-checkpoint SAVE_DIR`` (iteration 0, a fresh optimizer and schedule), and so does
either engine given ``training.init_checkpoint: SAVE_DIR``. No optimizer state is written: the
optimizers of the two programs keep theirs differently. The folder is written beside SAVE_DIR
and renamed into place.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_ext.export_hf import (check_out, checkpoint_to_export, model_template, read_model_weights,
                                    read_run_model, run_exporter, tensors_of, write_atomically)
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.run_paths import RunPaths


def export(paths: RunPaths, out: Path, iteration: int | None = None, force: bool = False) -> list[str]:
    from megatron_ext.training.megatron_lm_weights import write_megatron_lm_checkpoint

    run = read_run_model(paths)
    if run.engine.runs_checkout:
        raise UserError(f"run {paths.run} ran Megatron-LM: {paths.checkpoints_dir} already is a Megatron-LM --save "
                        "folder; give it to --pretrained-checkpoint (or training.init_checkpoint) as it is")
    check_out(out, force)
    checkpoint = checkpoint_to_export(paths, iteration)
    weights = read_model_weights(checkpoint, tensors_of(model_template(run)))
    dtype = weights["embedding.word_embeddings.weight"].dtype
    module = model_template(run, device="cpu")
    module.to(dtype)
    module.load_state_dict(weights, strict=False)  # read_model_weights named every tensor the model has
    step = int(checkpoint.name.removeprefix("iter_"))
    written = write_atomically(out, lambda tmp: [str(write_megatron_lm_checkpoint(module, tmp, step).relative_to(tmp))])
    return [f"exported {checkpoint.name} of run {paths.run} ({run.params.model.name}, {str(dtype).removeprefix('torch.')}, "
            f"vocabulary {run.vocab} padded to {run.padded}) as a Megatron-LM checkpoint to {out}: {written[0]} and "
            f"latest_checkpointed_iteration.txt; start Megatron-LM from it with --pretrained-checkpoint {out} "
            "(or training.init_checkpoint)"]


def main(argv: list[str] | None = None) -> int:
    return run_exporter(export, "python -m megatron_ext.export_megatron_lm", __doc__, "the Megatron-LM --save folder to write",
                        argv)


if __name__ == "__main__":
    sys.exit(main())
