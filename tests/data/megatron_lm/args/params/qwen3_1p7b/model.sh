#!/bin/bash
# Qwen3-1.7B for Megatron-LM's pretrain_gpt.py (numbers from Qwen/Qwen3-1.7B's config.json):
# source this file, then pass "${MODEL_ARGS[@]}" after pretrain_gpt.py.
# Test data for tests/test_import_megatron_args.py: imported, it equals params/models/qwen3_1p7b.yaml.

NUM_LAYERS=28
HIDDEN_SIZE=2048
FFN_HIDDEN_SIZE=6144
NUM_HEADS=16
NUM_KV_HEADS=8          # grouped-query attention: 2 query heads per KV head
HEAD_DIM=128

MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl transformer_engine
    --num-layers ${NUM_LAYERS}
    --hidden-size $HIDDEN_SIZE
    --ffn-hidden-size ${FFN_HIDDEN_SIZE}
    --num-attention-heads ${NUM_HEADS}
    --group-query-attention
    --num-query-groups ${NUM_KV_HEADS}
    --kv-channels ${HEAD_DIM}
    --qk-layernorm
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --max-position-embeddings 40960
    --make-vocab-size-divisible-by 128
    --padded-vocab-size 151936   # the embedding's rows; the tokenizer itself has 151,669 ids
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --attention-backend flash    # tied embeddings: Qwen3-1.7B has tie_word_embeddings true
)
