#!/bin/bash
# A 70/30 blend of two preprocessed corpora (tools/preprocess_data.py --append-eod output),
# Qwen3's tokenizer and the schedule, for Megatron-LM's pretrain_gpt.py:
# source model.sh and this file, then pass "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${LOGGING_ARGS[@]}".
# Test data for tests/test_import_megatron_args.py.

DATA_ROOT=/data
BLEND="0.7 ${DATA_ROOT}/a_text_document 0.3 ${DATA_ROOT}/b_text_document"
TOKENIZER_DIR=/models/Qwen3-1.7B
CHECKPOINT_DIR=${CHECKPOINT_DIR:-/checkpoints/qwen3_1p7b}

DATA_ARGS=(
    --data-path $BLEND
    --split 99,1,0
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER_DIR}"
    --data-cache-path /tmp/megatron_index_cache
    --num-workers 2
)

TRAINING_ARGS=(
    --seq-length 4096
    --micro-batch-size 1
    --global-batch-size 256
    --train-iters 20000
    --lr 3.0e-4
    --min-lr 3.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --lr-decay-iters 20000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --clip-grad 1.0
    --init-method-std 0.02
    --seed 1234
    --bf16
    --grad-reduce-in-bf16
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 1000
    --eval-iters 10
    --save-interval 1000
    --save ${CHECKPOINT_DIR}
    --load ${CHECKPOINT_DIR}
    --tensorboard-dir ${CHECKPOINT_DIR}/tensorboard
)
