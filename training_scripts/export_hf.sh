#!/usr/bin/env bash
# export_hf.sh RUN OUT_DIR [--iteration N] [--force]: a checkpoint of RUN as a Hugging Face model directory
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration export-hf "$@"
