"""The columns of a benchmark run: our impls (each planned once per batch when it is planned)
and the peers, as :class:`Entry` values the harness (:mod:`pagedattn.bench.harness`) measures
one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from pagedattn._cli_types import ArgumentError
from pagedattn.bench import step
from pagedattn.bench.peers import PEERS, PeerUnsupported
from pagedattn.bench.shapes import BenchBatch, BenchShape

Factory = Callable[[BenchShape, BenchBatch, bool], Callable[[], torch.Tensor]]
StepFactory = Callable[[BenchShape, list[BenchBatch]], Callable[[], object]]


class Entry(NamedTuple):
    """One column of a run: ``kind`` is "ours" (an impl name) or "peer". ``check`` (ours)
    runs the call once through ``compiled_kernels`` and returns ``(out, kernels)``;
    ``make_step`` builds a decode step over several layers' batches (default: ``make`` per
    layer, :func:`pagedattn.bench.step.per_layer_step`)."""

    name: str
    kind: str
    make: Factory
    check: Callable[[BenchBatch], tuple[Any, dict]] | None = None
    make_step: StepFactory | None = None


def impl_names() -> tuple[str, ...]:
    """The names of our impls (``pagedattn.api.IMPLS``)."""
    from pagedattn.api import IMPLS

    return tuple(IMPLS)


def impl_entry(impl: str) -> Entry:
    """Our ``impl`` as an :class:`Entry`: ``paged_decode(..., impl=impl)`` on the batch (a
    planned impl: ``plan_decode`` once per batch, then ``plan.run``)."""
    import pagedattn.api as api

    name = impl

    def supported(shape: BenchShape) -> None:
        if not api.IMPLS[impl].fp8 and shape.cache_dtype != shape.dtype:
            raise PeerUnsupported(f"{name}: {impl!r} takes no fp8 cache")

    def plan_for(shape: BenchShape, b: BenchBatch):
        m = shape.model
        return api.plan_decode(b.block_tables, b.context_lens, num_q_heads=m.num_q_heads,
                               num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                               page_size=shape.page_size, q_dtype=shape.dtype,
                               kv_dtype=shape.cache_dtype,
                               host_context_lens=list(shape.context_lens))

    def make(shape: BenchShape, b: BenchBatch, for_graph: bool = False):
        supported(shape)
        if api.IMPLS[impl].planned:  # planned once per batch, like the peers' plan() calls
            plan = plan_for(shape, b)
            return lambda: plan.run(*b.tensors[:3], **b.scales)
        return lambda: api.paged_decode(*b.tensors, impl=impl, **b.scales)

    def make_step(shape: BenchShape, layers: list[BenchBatch]):
        if not api.IMPLS[impl].planned:
            return step.per_layer_step(make, shape, layers)
        supported(shape)
        plan = plan_for(shape, layers[0])  # one plan per step, run per layer, as in serving
        return lambda: [plan.run(*lb.tensors[:3], **lb.scales) for lb in layers]

    def check(b: BenchBatch):
        return api.compiled_kernels(*b.tensors, impl=impl, **b.scales)

    return Entry(name, "ours", make, check, make_step)


def entries(impls: list[str], peers: list[str], peer_files=()) -> list[Entry]:
    """Our impls, then the built-in peers, then peers loaded with ``--peer-file``. Raises
    ArgumentError (a ValueError) when two rows would share a name (the table keys on it)."""
    rows = ([impl_entry(i) for i in impls]
            + [Entry(p, "peer", PEERS[p]) for p in peers]
            + [Entry(p.name, "peer", p.factory) for p in peer_files])
    names = [e.name for e in rows]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ArgumentError(f"--peer-file: the row name {dup!r} is taken twice; name the peer "
                            "with NAME=PATH[:FUNC]")
    return rows
