"""Serving integration: a paged KV cache, the KV-append and decode kernels as torch custom ops,
a small Llama (SmolLM2) over the cache, continuous batching with CUDA-graph decode, and the
``pagedattn generate`` / ``pagedattn bench-model`` commands.

Modules (imported on demand; nothing is imported here): ``cache`` (PagedKVCache, fp8 scales),
``ops`` (torch.library ops), ``families`` (the model families, as data), ``config`` (the model
seam, Hugging Face checkpoints), ``gguf_loader`` (weights; the ``--gguf`` checks), ``model``
(gpt-fast-style modules and the paged attention backend), ``runner`` (decode steps in batch
buckets, eager or CUDA graphs), ``engine`` (continuous batching), ``tokenizer``, ``generate``
(CLI), ``baselines`` (dense backend and transformers, for the benchmark and the tests),
``bench_model`` (CLI: throughput and agreement).
"""
