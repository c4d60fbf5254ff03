"""``import-megatron-args``: Megatron-LM argument files -> this project's model preset and data set YAML.

    python -m orchestration import-megatron-args model.sh data.sh --model-out params/models/m.yaml --data-out params/data/d.yaml

importer (the entry) -> shell (the files read as bash sources them; shell_lexer its tokens),
given_flags (the words split into flags by Megatron-LM's flag table), mapping (flags -> params
fields, or why not), report (the YAML and the report). Offline: reads files only. Depends on
:mod:`orchestration.megatron_lm` (its flag table and checkout reader), never the other way.
"""
