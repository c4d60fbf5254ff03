"""An imported set of Megatron-LM arguments as YAML (the model preset, the data set) and the report.

    python -m orchestration import-megatron-args model.sh data.sh --model-out m.yaml --data-out d.yaml --dry-run

Values the files did not set are marked ``Megatron-LM default``; conversions carry their note; the
flags without a counterpart head both files. :func:`check_rendered` loads the two texts back as
the run specification does. Pure.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import (DataParams, ModelPreset, RunParams, TokenizerParams, TrainingParams, build_dataclass,
                                          validate_run_params)
from orchestration.import_args.flag_reader import FIXED, LAUNCHER, NOT_IMPORTED
from orchestration.import_args.mapping import ImportedArgs


def _yaml_value(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).split("\n...")[0].strip()


def _line(indent: str, key: str, value: Any, comment: str | None) -> str:
    text = f"{indent}{key}: {_yaml_value(value)}"
    return f"{text}  # {comment}" if comment else text


def _header(result: ImportedArgs, what: str, sections: set[str]) -> list[str]:
    lines = [f"# {what} imported from Megatron-LM arguments (flags of Megatron-LM {result.release}) by",
             "# `python -m orchestration import-megatron-args`, from:"]
    lines += [f"#   {s}" for s in result.sources]
    lines += ["# A value marked \"Megatron-LM default\" is one the files do not set: it is Megatron-LM's, so this",
              "# means what the files meant."]
    listed = [n for n in result.not_imported if n.kind == NOT_IMPORTED and n.section in sections]
    if listed:
        lines.append("# Not imported (no counterpart here; the import's output says more):")
        lines += [f"#   {n.describe()}" for n in listed]
    return lines


def render_model_yaml(result: ImportedArgs) -> str:
    lines = _header(result, "Model preset", {"model"})
    for f in dataclasses.fields(ModelPreset):
        if f.name in result.model:
            lines.append(_line("", f.name, result.model[f.name], result.comments.get(f"model.{f.name}")))
    return "\n".join(lines) + "\n"


def render_data_yaml(result: ImportedArgs) -> str:
    lines = _header(result, "Data set and schedule", {"data", "training", "other"}) + ["data:"]
    d, c = result.data, result.comments
    for f in dataclasses.fields(DataParams):
        if f.name == "tokenizer":
            lines.append(f"  tokenizer:{'  # ' + c['data.tokenizer'] if 'data.tokenizer' in c else ''}")
            for t in dataclasses.fields(TokenizerParams):
                if t.name in d["tokenizer"]:
                    lines.append(_line("    ", t.name, d["tokenizer"][t.name], c.get(f"data.tokenizer.{t.name}")))
        elif f.name == "paths" and d.get("paths"):
            lines.append("  paths:")
            lines += [f"    - {_yaml_value(p)}" for p in d["paths"]]
        elif f.name in d and (f.name != "weights" or d["weights"]):
            lines.append(_line("  ", f.name, d[f.name], c.get(f"data.{f.name}")))
    lines.append("training:")
    for f in dataclasses.fields(TrainingParams):
        if f.name in result.training:
            lines.append(_line("  ", f.name, result.training[f.name], c.get(f"training.{f.name}")))
    return "\n".join(lines) + "\n"


def _value_at(result: ImportedArgs, key: str) -> Any:
    """``model.x`` / ``data.tokenizer.x`` / ``training.x`` -> the value."""
    section, *path = key.split(".")
    value: Any = {"model": result.model, "data": result.data, "training": result.training}[section]
    for part in path:
        value = value.get(part)
    return value


def render_report(result: ImportedArgs) -> str:
    lines = [f"read (flags of Megatron-LM {result.release}): " + "; ".join(result.sources)]
    lines += [f"note: {n}" for n in result.notes]
    defaults = [(k, v) for k, v in result.comments.items() if v.startswith("Megatron-LM default")]
    if defaults:
        lines.append("Megatron-LM defaults applied (the files do not set these flags):")
        lines += [f"  {k} = {_yaml_value(_value_at(result, k))}{v[len('Megatron-LM default'):]}" for k, v in defaults]
    converted = [(k, v) for k, v in result.comments.items() if not v.startswith("Megatron-LM default")]
    if converted:
        lines.append("converted or worth knowing:")
        lines += [f"  {k} = {_yaml_value(_value_at(result, k))}: {v}" for k, v in converted]
    lines += [f"{kind}: {n.describe()}" for kind in (NOT_IMPORTED, LAUNCHER, FIXED) for n in result.not_imported if n.kind == kind]
    return "\n".join(lines) + "\n"


def check_rendered(model_text: str, data_text: str) -> None:
    """The two YAML texts load as a model preset and a data set and pass the run's checks."""
    model, data = yaml.safe_load(model_text), yaml.safe_load(data_text)
    try:
        params = RunParams(build_dataclass(ModelPreset, {"name": "imported", **model}, "the imported model"),
                           build_dataclass(DataParams, data["data"], "the imported data"),
                           build_dataclass(TrainingParams, data["training"], "the imported training"), "imported")
        validate_run_params(params)
    except UserError as exc:
        raise UserError(f"the files' flags do not make a valid run here: {exc}") from None


def imported_yaml(result: ImportedArgs) -> tuple[str, str]:
    """The model preset's and the data set's YAML, checked to load and validate as a run."""
    texts = render_model_yaml(result), render_data_yaml(result)
    check_rendered(*texts)
    return texts
