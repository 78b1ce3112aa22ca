"""Launchers of the study's five stages (``impl="baseline"`` .. ``"split_kv_v4"``).

Each launcher keeps its stage's grid and warp count from the study (``shared/seed``):

| stage          | grid                                 | warps | kernel module                 |
|----------------|--------------------------------------|-------|-------------------------------|
| baseline       | (batch, num_q_heads)                 | 4     | kernels/baseline.py           |
| fused_v1       | (batch, num_q_heads)                 | 4     | kernels/fused_v1.py           |
| vectorized_v2  | (batch, num_q_heads)                 | 1     | kernels/fused_v1.py (shared)  |
| gqa_reuse_v3   | (batch, num_kv_heads)                | 4     | kernels/gqa_reuse_v3.py       |
| split_kv_v4    | (batch, num_q_heads, num_splits)     | 1     | kernels/split_kv_v4.py        |
|  + its merge   | (batch, num_q_heads)                 | 1     | kernels/split_kv_v4.py        |

Inputs are already validated by ``pagedattn.api``; caches arrive as NHD-shaped views.
"""

from __future__ import annotations

import torch
import triton

from pagedattn._env import sm_count_for
from pagedattn.kernels.baseline import _baseline_kernel
from pagedattn.kernels.fused_v1 import _single_head_kernel
from pagedattn.kernels.gqa_reuse_v3 import _gqa_reuse_v3_kernel
from pagedattn.kernels.split_kv_v4 import _split_kv_v4_kernel, _split_kv_v4_merge_kernel
from pagedattn.launch._common import LOG2E, block_d, decode_strides, record

# gqa_reuse_v3 computes [BLOCK_G, BLOCK_N, BLOCK_D] products in registers; this many elements
# per slice keeps it at about 64 fp32 values per thread with 4 warps.
_V3_SLICE_ELEMENTS = 8192
# split_kv_v4 default: aim for this many resident single-warp programs per SM (the study's
# point is to fill the machine when batch x heads is small) ...
_V4_PROGRAMS_PER_SM = 16
# ... but never more splits than this, and never a split shorter than this many tokens.
_V4_MAX_SPLITS = 16
_V4_MIN_TOKENS_PER_SPLIT = 16


def _dims(query, key_cache):
    batch, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    return batch, num_q_heads, head_dim, page_size, num_kv_heads


def _single_head(name, num_warps, query, key_cache, value_cache, block_tables, context_lens,
                 out, *, scale, kernel=_single_head_kernel):
    batch, num_q_heads, head_dim, page_size, num_kv_heads = _dims(query, key_cache)
    compiled = kernel[(batch, num_q_heads)](
        query, key_cache, value_cache, block_tables, context_lens, out,
        scale * LOG2E, page_size, block_tables.shape[1], num_q_heads // num_kv_heads,
        *decode_strides(query, key_cache, value_cache, block_tables, context_lens),
        *out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), num_warps=num_warps,
    )
    record(name, compiled)


def baseline(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
             num_splits=None):
    """Stage 0: one program per (sequence, query head); each of the head_dim rows recomputes
    the whole q·k (study: "baseline", 119.98 ms, DRAM 2.4 %). ``num_splits`` is ignored."""
    _single_head("baseline", 4, query, key_cache, value_cache, block_tables, context_lens, out,
                 scale=scale, kernel=_baseline_kernel)


def fused_v1(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
             num_splits=None):
    """Stage 1: cooperative 128-thread block per (sequence, query head); block-wide reduction
    per token (study: 7.50 ms, DRAM 37.9 %). ``num_splits`` is ignored."""
    _single_head("fused_v1", 4, query, key_cache, value_cache, block_tables, context_lens, out,
                 scale=scale)


def vectorized_v2(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
                  num_splits=None):
    """Stage 2: one warp per (sequence, query head), 16-byte loads, warp-only reduction
    (study: 4.95 ms, DRAM 57.4 %). ``num_splits`` is ignored."""
    _single_head("vectorized_v2", 1, query, key_cache, value_cache, block_tables, context_lens,
                 out, scale=scale)


def gqa_reuse_v3(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
                 num_splits=None):
    """Stage 3: one program per (sequence, kv head) serving the whole query group from one load
    of each page slice (study: 3.35 ms, DRAM 84.9 %). ``num_splits`` is ignored."""
    batch, num_q_heads, head_dim, page_size, num_kv_heads = _dims(query, key_cache)
    group = num_q_heads // num_kv_heads
    bd = block_d(head_dim)
    bg = triton.next_power_of_2(group)
    bn = max(1, min(triton.next_power_of_2(page_size), _V3_SLICE_ELEMENTS // (bg * bd)))
    compiled = _gqa_reuse_v3_kernel[(batch, num_kv_heads)](
        query, key_cache, value_cache, block_tables, context_lens, out,
        scale * LOG2E, page_size, block_tables.shape[1], group,
        *decode_strides(query, key_cache, value_cache, block_tables, context_lens),
        *out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_G=bg, BLOCK_N=bn, num_warps=4,
    )
    record("gqa_reuse_v3", compiled)


def default_v4_splits(query, block_tables, page_size) -> int:
    """Splits so that ``batch * num_q_heads * num_splits`` single-warp programs fill about
    ``_V4_PROGRAMS_PER_SM`` per SM, capped by the table's capacity (no host sync)."""
    batch, num_q_heads, _ = query.shape
    want = triton.cdiv(_V4_PROGRAMS_PER_SM * sm_count_for(query), max(1, batch * num_q_heads))
    cap = triton.cdiv(block_tables.shape[1] * page_size, _V4_MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, _V4_MAX_SPLITS, cap))


def split_kv_v4(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
                num_splits=None):
    """Stage 4: split each context into ``num_splits`` chunks (one warp each), then a
    log-sum-exp merge kernel (study: 3.92 ms + 22.6 us merge, DRAM 73.4 %)."""
    batch, num_q_heads, head_dim, page_size, num_kv_heads = _dims(query, key_cache)
    splits = num_splits or default_v4_splits(query, block_tables, page_size)
    bd = block_d(head_dim)
    part_ml = torch.empty(batch, num_q_heads, splits, 2, dtype=torch.float32,
                          device=query.device)
    part_acc = torch.empty(batch, num_q_heads, splits, bd, dtype=torch.float32,
                           device=query.device)
    max_pages = block_tables.shape[1]
    compiled = _split_kv_v4_kernel[(batch, num_q_heads, splits)](
        query, key_cache, value_cache, block_tables, context_lens, part_ml, part_acc,
        scale * LOG2E, page_size, max_pages, num_q_heads // num_kv_heads, splits,
        *decode_strides(query, key_cache, value_cache, block_tables, context_lens),
        HEAD_DIM=head_dim, BLOCK_D=bd, num_warps=1,
    )
    record("split_kv_v4", compiled)
    compiled = _split_kv_v4_merge_kernel[(batch, num_q_heads)](
        context_lens, part_ml, part_acc, out, page_size, max_pages, splits,
        context_lens.stride(0), *out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=bd, num_warps=1,
    )
    record("split_kv_v4_merge", compiled)
