"""The program torchrun runs on every rank (``python -m megatron_ext.pretrain``): model presets on
megatron-core, data-parallel trainers for each ZeRO stage (CPU and CUDA behind one interface),
datasets, CPU compatibility, the training loop.

Depends on :mod:`megatron_ext.run_spec` and :mod:`megatron_ext.data`; the launcher never imports it.
"""
