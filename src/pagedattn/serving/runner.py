"""Decode steps padded to batch-size buckets, run eagerly or by replaying one CUDA graph per
bucket.

A step of ``n`` sequences runs at the smallest bucket ``b >= n`` of :data:`BUCKETS` (capped at
the engine's ``max_batch_size``). Its inputs live in static per-bucket device buffers, updated
in place before each step with one host-to-device copy for the metadata (slots, positions,
context lengths, block tables of fixed width ``max_pages``) and one for the token ids. Rows
``n..b-1`` are padding: slot -1 (``append_kv`` skips it), context length 0, a block-table row of
page 0, token 0; their logits are dropped.

The eager and graph paths share all of this; they differ only in :meth:`DecodeRunner._run`:
eager calls ``model.decode`` on the static buffers, the graph path captures that same call
once per bucket (lazily, on the bucket's first step: a warm-up call, which writes the same K/V
the replay writes, then the capture) and replays it. Both end with the greedy token of every
row (``argmax``, inside the graph), copied without a sync into a pinned host buffer: a step
returns a :class:`DecodeStep` whose :meth:`~DecodeStep.token_ids` waits for it. A step can also
take its token ids from the previous step on the device (``tokens=None``), so the engine can
launch step ``k + 1`` before it reads step ``k``'s tokens and the host's work overlaps the GPU's.
``compile=True`` wraps ``model.decode`` in ``torch.compile(fullgraph=True, dynamic=True)``
(inductor fuses the elementwise work of a layer; the graph then captures the compiled kernels).

The buckets also price a run in Triton's interpreter on the CPU: :func:`engine_steps` lists the
bucket of every decode step the engine takes, :func:`decode_seconds` what they cost (the
estimate ``pagedattn generate`` and ``bench-model`` print before they start).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from pagedattn.serving.cache import PagedKVCache
from pagedattn.serving.model import Transformer

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket ``>= n``. Raises ValueError for ``n < 1`` or above the largest."""
    if n < 1 or n > buckets[-1]:
        raise ValueError(f"batch: expected 1..{buckets[-1]} sequences, got {n}")
    return next(b for b in buckets if b >= n)


def buckets_up_to(max_batch_size: int) -> tuple[int, ...]:
    """The buckets a runner of ``max_batch_size`` uses: :data:`BUCKETS` below it, then the
    bucket that holds it. Raises ValueError naming ``max_batch_size`` outside 1 to the
    largest bucket."""
    if not 1 <= max_batch_size <= BUCKETS[-1]:
        raise ValueError(f"max_batch_size: expected 1..{BUCKETS[-1]} (the largest decode "
                         f"bucket), got {max_batch_size}")
    top = bucket_for(max_batch_size)
    return tuple(b for b in BUCKETS if b <= top)


# -- how long serving runs take in Triton's interpreter on the CPU, said before they start
# (``pagedattn generate``, ``pagedattn bench-model``): every decode step of the engine costs
# STEP_S at its bucket, scaled by the model's layers x query heads.

#: CPU seconds of one eager decode step of SmolLM2-135M (30 layers, 9/3 heads, head_dim 64,
#: bf16 cache) in Triton's interpreter at a bucket of ``b`` sequences: ``STEP_S[0] +
#: STEP_S[1] * b``, twice that with an fp8 cache (:data:`FP8_STEP_FACTOR`); fitted to the
#: docs/usage.md's smoke run (177 s of CPU time, 16 steps, the 2-core CI machine): an
#: estimate, and a busy machine takes longer (``generate``'s fp32 steps of ``gqa_reuse_v3``
#: took 2.5 s at b 1 and 9.3 s at b 4 on that machine, busy)
STEP_S = (0.6, 2.7)
FP8_STEP_FACTOR = 2.0
#: the model :data:`STEP_S` was fitted to: layers x query heads (the interpreter's work per
#: step grows with both)
SMOLLM2_LAYER_HEADS = 30 * 9


def engine_steps(requests: list[int], max_batch: int, *, warm: bool = True) -> list[int]:
    """The bucket of every decode step the engine takes for requests making ``requests[i]``
    tokens each, at most ``max_batch`` running (the first token of each comes from its
    prefill): with ``warm``, the warm-up's buckets and its 2-token run first (bench-model's),
    then the run itself, with requests admitted in order as slots free up."""
    top = bucket_for(min(max_batch, BUCKETS[-1]))
    steps = [b for b in BUCKETS if b <= top] if warm else []
    for tokens in ([2] * len(requests) if warm else [], list(requests)):
        left = [n - 1 for n in tokens if n > 1]  # decode steps each still needs, in order
        while left:
            running, rest = left[:max_batch], left[max_batch:]
            k = min(running)  # steps until the first of them finishes
            steps += [bucket_for(len(running))] * k
            left = [n - k for n in running if n > k] + rest
    return steps


def decode_seconds(steps: list[int], *, fp8: bool = False, layer_heads: int =
                   SMOLLM2_LAYER_HEADS) -> float:
    """About how long the decode ``steps`` (their buckets, :func:`engine_steps`) take in the
    interpreter, for a model of ``layer_heads`` layers x query heads."""
    scale = (FP8_STEP_FACTOR if fp8 else 1.0) * layer_heads / SMOLLM2_LAYER_HEADS
    return scale * sum(STEP_S[0] + STEP_S[1] * b for b in steps)


class DecodeStep:
    """One launched decode step: ``logits`` ``[n, vocab]`` (a view of the bucket's output,
    overwritten by the bucket's next step) and the greedy token ids, read by
    :meth:`token_ids`."""

    __slots__ = ("logits", "_ids", "_done")

    def __init__(self, logits: torch.Tensor, ids: torch.Tensor, done: Any):
        self.logits, self._ids, self._done = logits, ids, done

    def token_ids(self) -> list[int]:
        """The step's greedy tokens (``argmax``, ties to the lowest id); waits for the step."""
        if self._done is not None:
            self._done.synchronize()
        return self._ids.tolist()


class DecodeRunner:
    """Decode steps of ``model`` over ``cache``.

    Args:
        model, cache: the model and its paged cache.
        max_batch_size: most sequences per step (at most ``BUCKETS[-1]``).
        max_pages: block-table width of every step (covers the longest sequence).
        graphs: replay a CUDA graph per bucket (needs a CUDA model) instead of eager calls.
        compile: run ``model.decode`` through ``torch.compile`` (both modes).

    Raises ValueError for ``graphs`` on a CPU model or bad sizes.
    """

    def __init__(self, model: Transformer, cache: PagedKVCache, *, max_batch_size: int,
                 max_pages: int, graphs: bool = False, compile: bool = False):
        if graphs and model.device.type != "cuda":
            raise ValueError(f"graphs: CUDA graphs need a CUDA model, got {model.device}")
        if max_pages < 1:
            raise ValueError(f"max_pages: expected >= 1, got {max_pages}")
        self.model, self.cache, self.max_pages, self.graphs = model, cache, max_pages, graphs
        self.buckets = buckets_up_to(max_batch_size)
        dev = model.device
        self._meta = {b: torch.zeros(cache.metadata_size(b, max_pages), dtype=cache.index_dtype,
                                     device=dev) for b in self.buckets}
        self._tokens = {b: torch.zeros(b, dtype=torch.long, device=dev) for b in self.buckets}
        # per bucket, the host side of both copies (metadata, then token ids), pinned on a
        # GPU and reused every step: no host allocation or pinning per step; an event after
        # the copies says when the buffers may be written again
        pin = dev.type == "cuda"
        self._staging = {b: (torch.empty(cache.metadata_size(b, max_pages),
                                         dtype=cache.index_dtype, pin_memory=pin),
                             torch.empty(b, dtype=torch.long, pin_memory=pin))
                         for b in self.buckets}
        self._copied = torch.cuda.Event() if pin else None
        # the greedy tokens of a step come back through one of two pinned host buffers (a
        # step in flight and the one being read never share one), each with its event
        self._ids_host = [torch.empty(self.buckets[-1], dtype=torch.long, pin_memory=pin)
                          for _ in range(2)]
        self._ids_done = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._flip = 0
        self._last: tuple[int, torch.Tensor] | None = None  # (bucket, device token ids)
        self._decode = (torch.compile(model.decode, fullgraph=True, dynamic=True) if compile
                        else model.decode)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool, after the first capture

    def step(self, seq_ids: Sequence[Hashable], tokens: Sequence[int] | None) -> DecodeStep:
        """Reserve one slot per sequence, fill the bucket's static buffers and launch the step.

        ``tokens``: each sequence's input token, or None for the previous step's greedy tokens
        taken on the device (the same sequences in the same order as that step: the caller's
        contract). Returns the launched :class:`DecodeStep` (its logits are a view of the
        bucket's output: read them before the next step). Raises CacheFullError (nothing
        changed) when the pages run out, ValueError for ``tokens=None`` without a previous
        step of the same bucket.
        """
        n = len(seq_ids)
        b = bucket_for(n, self.buckets)
        if tokens is None and (self._last is None or self._last[0] != b):
            raise ValueError("tokens: None needs a previous step of the same batch bucket")
        meta_host, tokens_host = self._staging[b]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies left the staging buffers
        meta = self.cache.prepare_step(seq_ids, [1] * n, max_pages=self.max_pages, pad_to=b,
                                       out=self._meta[b], staging=meta_host)
        if tokens is None:
            self._tokens[b].copy_(self._last[1])  # device to device, after the last step
        else:
            ids = tokens_host.numpy()
            ids[:n] = tokens
            ids[n:] = 0
            self._tokens[b].copy_(tokens_host, non_blocking=True)
        stream = None
        if self._copied is not None:
            stream = torch.cuda.current_stream(self.model.device)
            self._copied.record(stream)
        logits, next_ids = self._run(b, meta)
        self._last = (b, next_ids)
        host, done = self._ids_host[self._flip][:b], self._ids_done[self._flip]
        self._flip ^= 1
        host.copy_(next_ids, non_blocking=done is not None)
        if done is not None:
            done.record(stream)
        return DecodeStep(logits[:n], host[:n], done)

    def warmup(self) -> None:
        """Run (eager: compile the kernels) or capture (graphs) every bucket on a batch of
        padding rows only: nothing is written to the cache, no page is taken."""
        for b in self.buckets:
            meta = self.cache.build_metadata([], [], max_pages=self.max_pages, pad_to=b,
                                             out=self._meta[b])
            self._tokens[b].zero_()
            self._run(b, meta)

    def _run(self, b: int, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[b, vocab]`` and greedy token ids ``[b]`` of the bucket's step."""
        tokens = self._tokens[b]
        with torch.inference_mode():
            if not self.graphs:
                logits = self._decode(tokens, meta, self.cache)
                return logits, logits.argmax(dim=-1)
            if b not in self._graphs:
                self._graphs[b] = self._capture(tokens, meta)
            graph, logits, next_ids = self._graphs[b]
            graph.replay()
            return logits, next_ids

    def _capture(self, tokens: torch.Tensor, meta):
        """Warm up on a side stream (compiles kernels; writes the same K/V as the replay),
        then capture ``decode`` on the static buffers into a graph sharing one memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._decode(tokens, meta, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._decode(tokens, meta, self.cache)
            next_ids = logits.argmax(dim=-1)
        self._pool = graph.pool()
        return graph, logits, next_ids
