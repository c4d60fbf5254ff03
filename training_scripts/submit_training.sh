#!/usr/bin/env bash
# submit_training.sh MODEL DATA RUN [--nodes N] [--gpus-per-node G] [--time T] [--partition P] [--account A]: sbatch a job that runs RUN on its nodes
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration submit "$@"
