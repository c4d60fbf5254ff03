"""Train/valid datasets through megatron-core: BlendedMegatronDatasetBuilder + GPTDataset.

The builder builds on global rank 0 first (writing its index cache under ``cache_dir``), then
on the other ranks, which read that cache: with several nodes the artifact root must be on a
file system every node sees (as the code is, see README). Side effects: the index cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_ext.data.prepare import PreparedData
from megatron_ext.data.tokenizers import NullTokenizer, load_tokenizer
from megatron_ext.run_spec.params import DataParams, TokenizerParams


def build_datasets(prepared: PreparedData, data: DataParams, seq_length: int, seed: int, num_train_samples: int,
                   num_valid_samples: int, cache_dir: Path, create_attention_mask: bool = False):
    """(train, valid) megatron-core GPT datasets of at least the given sample counts. No attention
    mask by default: causal attention kernels (SDPA, transformer-engine) need none; megatron-core's
    own DotProductAttention does."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if prepared.tokenizer_type == "null":
        tokenizer = NullTokenizer(prepared.vocab_size - 1)
    else:
        tokenizer = load_tokenizer(TokenizerParams(prepared.tokenizer_type, prepared.tokenizer_path))
    mock = data.source == "mock"
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=None if mock else (list(prepared.prefixes), list(prepared.weights) if len(prepared.prefixes) > 1 else None),
        split=data.split,
        path_to_cache=str(cache_dir),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=True,
    )
    cls = MockGPTDataset if mock else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, [num_train_samples, num_valid_samples, 0], lambda: True, config).build()
    return train, valid


def global_batch_slice(dataset, start_sample: int, dp_rank: int, dp_size: int,
                       micro_batch: int, micro_step: int) -> dict[str, torch.Tensor]:
    """One micro-batch for ``dp_rank``: the same samples in the same order whatever the stage.

    Sample ``start_sample + k`` of the global batch goes to rank ``(k // micro) % dp`` in
    micro-step ``k // (micro * dp)``, as Megatron's pretraining sampler lays them out.
    """
    first = start_sample + micro_step * micro_batch * dp_size + dp_rank * micro_batch
    samples = [dataset[(first + i) % len(dataset)] for i in range(micro_batch)]
    batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask", "position_ids")}
    batch["attention_mask"] = samples[0]["attention_mask"].unsqueeze(0) if "attention_mask" in samples[0] else None
    return batch
