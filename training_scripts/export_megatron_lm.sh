#!/usr/bin/env bash
# export_megatron_lm.sh RUN SAVE_DIR [--iteration N] [--force]: a checkpoint of RUN as a Megatron-LM checkpoint (--pretrained-checkpoint SAVE_DIR)
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration export-megatron-lm "$@"
