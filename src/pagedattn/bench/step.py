"""The serving-condition timing: one decode step of a model's layers, each layer reading its
own K/V cache, the layers' calls replayed as ONE CUDA graph.

A benchmark row times one call on one cache after an L2 flush. A served model runs the same
attention call once per layer, back to back, each layer on its own cache (the same block
table and lengths: a sequence's pages have the same ids in every layer), so nothing one layer
reads is in the L2 for the next. :func:`layer_batches` builds those layers from a row's batch:
layer ``i`` reads cache ``i % num_caches`` through the batch's block table and lengths, with a
query of its own; cache 0 is the batch's, the others are copies (distinct storage).
:func:`distinct_caches` says how many distinct caches fit in the device's free memory (all of
them, ``STEP_LAYERS`` = 32, when they fit: 32 caches of the largest peers rows, 2.15 GB each,
take 69 GB; fewer when the memory runs short, and the row's ``step_caches`` then says how many,
below ``step_layers``). The harness
(:mod:`pagedattn.bench.harness`) captures the step, our plan's ``plan.run`` once per layer
(one plan per step, as in serving) or a peer's runner built per layer, in one CUDA graph
(:func:`pagedattn.bench.timing.time_graph`: flush, replay, repeated) and reports the median
step divided by the number of layers: ``step_us_per_layer``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedattn.bench.shapes import BenchBatch, BenchShape

#: layers of the serving-condition step (Llama-3-8B and Qwen2.5-7B have 32 and 28)
STEP_LAYERS = 32
#: device memory the step leaves free: the peers' per-layer workspaces (FlashInfer's XQA
#: takes 256 MB a runner, 8 GiB for 32 layers), the flush buffer and the outputs
STEP_RESERVE_BYTES = 16 * 2**30


def cache_bytes(b: BenchBatch) -> int:
    """Bytes of one layer's caches (``key_cache`` and ``value_cache``, every page)."""
    return sum(t.untyped_storage().nbytes() for t in (b.key_cache, b.value_cache))


def distinct_caches(num_layers: int, per_layer_bytes: int, free_bytes: int,
                    reserve_bytes: int = STEP_RESERVE_BYTES) -> int:
    """How many distinct layer caches to allocate: ``num_layers`` if they fit in
    ``free_bytes - reserve_bytes`` beside the one that exists (the batch's own), else as many
    as fit, at least 1 (the batch's own). Raises ValueError for ``num_layers < 1``."""
    if num_layers < 1:
        raise ValueError(f"num_layers: expected >= 1, got {num_layers}")
    more = max(0, free_bytes - reserve_bytes) // max(per_layer_bytes, 1)
    return int(min(num_layers, 1 + more))


def layer_batches(b: BenchBatch, num_layers: int = STEP_LAYERS,
                  num_caches: int | None = None) -> list[BenchBatch]:
    """``num_layers`` batches for one decode step: each has ``b``'s block table, lengths and
    fp8 scales, its own query (a copy), and cache ``i % num_caches`` (default: one cache per
    layer); cache 0 is ``b``'s own, the others copies of it in storage of their own. Raises
    ValueError unless ``1 <= num_caches <= num_layers``."""
    num_caches = num_layers if num_caches is None else num_caches
    if not 1 <= num_caches <= num_layers:
        raise ValueError(f"num_caches: expected 1..{num_layers}, got {num_caches}")
    caches = [(b.key_cache, b.value_cache)]
    caches += [(b.key_cache.clone(), b.value_cache.clone()) for _ in range(num_caches - 1)]
    return [b._replace(query=b.query.clone(), key_cache=caches[i % num_caches][0],
                       value_cache=caches[i % num_caches][1]) for i in range(num_layers)]


def count_caches(layers: list[BenchBatch]) -> int:
    """Distinct K/V storages among ``layers`` (the ``step_caches`` column)."""
    return len({(lb.key_cache.untyped_storage().data_ptr(),
                 lb.value_cache.untyped_storage().data_ptr()) for lb in layers})


Factory = Callable[[BenchShape, BenchBatch, bool], Callable[[], torch.Tensor]]


def per_layer_step(make: Factory, shape: BenchShape,
                   layers: list[BenchBatch]) -> Callable[[], list[torch.Tensor]]:
    """One step from a runner factory called once per layer's batch (``for_graph=True``):
    the runners are built here, outside the timing, and called in layer order."""
    runners = [make(shape, lb, True) for lb in layers]

    def step() -> list[torch.Tensor]:
        return [run() for run in runners]

    step.keepalive = runners  # type: ignore[attr-defined]
    return step
