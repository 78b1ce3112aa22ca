"""Small host helpers shared by the launchers."""

from __future__ import annotations

import math

import triton

from pagedattn.launch import LAST_COMPILED

LOG2E = 1.0 / math.log(2.0)


def record(name: str, compiled: object) -> None:
    """Keep the last compiled kernel handle for the profiling tools."""
    LAST_COMPILED[name] = compiled


def block_d(head_dim: int) -> int:
    """Head dims are padded to a power of two; the tail lanes are masked."""
    return triton.next_power_of_2(head_dim)


def decode_strides(query, key_cache, value_cache, block_tables, context_lens) -> tuple:
    """Strides in the kernels' argument order (caches as NHD-shaped views)."""
    return (
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        context_lens.stride(0),
    )
