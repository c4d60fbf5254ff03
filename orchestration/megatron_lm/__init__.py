"""ENGINE=megatron-lm: run Megatron-LM's ``pretrain_gpt.py`` from the same params and ZeRO table.

    ENGINE=megatron-lm MEGATRON_LM_DIR=/opt/Megatron-LM python -m orchestration start ...

program (what torchrun runs on every rank, either engine) -> render (``pretrain_gpt.py``'s argv),
checkout (a checkout's version and flags, read from source), validate (Megatron-LM's own argument
check in a child process) -> flags (the one model of Megatron-LM's flags: FlagSpec, FlagTable, the
shipped core_v0.16.1 table, split_flags).
"""
