"""megatron-core GPT pretraining with a ZeRO switch: params, data, model, the torchrun program."""
