"""Serving integration: a paged KV cache, the KV-append and decode kernels as torch custom ops,
a small Llama (SmolLM2) over the cache, continuous batching, and ``pagedattn generate``.

Modules (imported on demand; nothing is imported here): ``cache`` (PagedKVCache), ``ops``
(torch.library ops), ``gguf_loader`` (weights), ``model`` (Llama forward), ``engine``
(continuous batching), ``generate`` (CLI), ``bench_model`` (GPU throughput and agreement).
"""
