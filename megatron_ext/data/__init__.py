"""Text -> Megatron indexed datasets: preparation, tokenizers, the embedded corpus.

Used by the launcher (the Megatron-LM engine prepares data once before any node starts) and by
the training program. Depends on :mod:`megatron_ext.run_spec`; imports torch / megatron-core only
inside the functions that write datasets.
"""
