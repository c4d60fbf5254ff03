"""Where an import writes: the two YAML files, checked before anything is read, written after.

    python -m orchestration import-megatron-args model.sh data.sh --model-out m.yaml --data-out d.yaml [--force]

:func:`check_outputs` refuses outputs that are not ``.yaml``, the same file twice, or existing
files without ``--force`` (a dry run writes nothing, so it refuses nothing of that);
:func:`write_outputs` writes them. Side effects: :func:`write_outputs` only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from megatron_ext.run_spec.errors import UserError


def check_outputs(model_out: str, data_out: str, force: bool, dry_run: bool) -> tuple[Path, Path]:
    outputs = (Path(model_out), Path(data_out))
    for path in outputs:
        if path.suffix not in (".yaml", ".yml"):
            raise UserError(f"{path}: an output must be a .yaml file (train and start take it as MODEL or DATA)")
    if outputs[0].resolve() == outputs[1].resolve():
        raise UserError(f"--model-out and --data-out are both {outputs[0]}; give two files")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not force and not dry_run:
        raise UserError(f"{' and '.join(existing)} already exist(s); give --force to overwrite, or other output paths")
    return outputs


def write_outputs(outputs: Sequence[Path], texts: Sequence[str]) -> None:
    for path, text in zip(outputs, texts):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
