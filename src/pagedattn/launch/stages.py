"""Launchers of the study's five stages (``impl="baseline"`` .. ``"split_kv_v4"``).

Each launcher keeps its stage's grid and warp count from the study:

| stage          | grid                                 | warps | kernel module                 |
|----------------|--------------------------------------|-------|-------------------------------|
| baseline       | (batch, num_q_heads)                 | 4     | kernels/baseline.py           |
| fused_v1       | (batch, num_q_heads)                 | 4     | kernels/fused_v1.py           |
| vectorized_v2  | (batch, num_q_heads)                 | 1     | kernels/fused_v1.py (shared)  |
| gqa_reuse_v3   | (batch, num_kv_heads)                | 4     | kernels/gqa_reuse_v3.py       |
| split_kv_v4    | (batch, num_q_heads, num_splits)     | 1     | kernels/split_kv_v4.py        |
|  + its merge   | (batch, num_q_heads)                 | 1     | kernels/split_kv_v4.py        |

Every launcher has one signature, so a dispatch table can call any of them the same way::

    launcher(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
             num_splits=None) -> dict[str, compiled kernel]

``num_splits`` is part of that one signature and is used by ``split_kv_v4`` only (``None``: its
own heuristic). The other stages do not split the context, so for them it has no meaning and is
not read (the public contract: impls that do not split ignore it).
Each returns ``{kernel name: what kernel[grid](...) returned}`` (on a GPU the compiled kernel,
with ``n_regs``, ``n_spills`` and ``metadata``; ``None`` under the interpreter). Launches pass
every kernel argument by keyword, and run under the tensors' CUDA device.

Inputs are already validated by ``pagedattn.api``; caches arrive as NHD-shaped views.
"""

from __future__ import annotations

import torch

from pagedattn._env import sm_count_for
from pagedattn._validation import kernel_max_pages
from pagedattn.kernels.baseline import _baseline_kernel
from pagedattn.kernels.fused_v1 import _single_head_kernel
from pagedattn.kernels.gqa_reuse_v3 import _gqa_reuse_v3_kernel
from pagedattn.kernels.split_kv_v4 import _split_kv_v4_kernel, _split_kv_v4_merge_kernel
from pagedattn.launch._common import (
    LOG2E,
    block_d,
    cdiv,
    named_strides,
    next_power_of_2,
    on_tensor_device,
)

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


def _inputs(query, key_cache, value_cache, block_tables, context_lens, scale) -> dict:
    """The keyword arguments every stage kernel shares: pointers, scale, sizes, strides."""
    batch, num_q_heads, head_dim, page_size, num_kv_heads = _dims(query, key_cache)
    return dict(
        query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
        block_tables_ptr=block_tables, context_lens_ptr=context_lens,
        scale_log2=scale * LOG2E, page_size=page_size,
        # at most MAX_CONTEXT_LEN tokens: max_pages * page_size is an int32 product there
        max_pages=kernel_max_pages(block_tables.shape[1], page_size),
        group=num_q_heads // num_kv_heads,
        **named_strides("q", query, "b h d"),
        **named_strides("k", key_cache, "page tok head d"),
        **named_strides("v", value_cache, "page tok head d"),
        **named_strides("bt", block_tables, "b p"),
        stride_ctx=context_lens.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
    )


def _single_head(name, num_warps, kernel, query, key_cache, value_cache, block_tables,
                 context_lens, out, scale) -> dict:
    batch, num_q_heads = query.shape[:2]
    compiled = kernel[(batch, num_q_heads)](
        **_inputs(query, key_cache, value_cache, block_tables, context_lens, scale),
        out_ptr=out, **named_strides("o", out, "b h d"), num_warps=num_warps,
    )
    return {name: compiled}


@on_tensor_device
def baseline(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
             num_splits=None) -> dict:
    """Stage 0: one program per (sequence, query head); each of the head_dim rows recomputes
    the whole q·k (study: "baseline", 119.98 ms, DRAM 2.4 %). Does not split (``num_splits``
    unused)."""
    return _single_head("baseline", 4, _baseline_kernel, query, key_cache, value_cache,
                        block_tables, context_lens, out, scale)


@on_tensor_device
def fused_v1(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
             num_splits=None) -> dict:
    """Stage 1: cooperative 128-thread block per (sequence, query head); block-wide reduction
    per token (study: 7.50 ms, DRAM 37.9 %). Does not split (``num_splits`` unused)."""
    return _single_head("fused_v1", 4, _single_head_kernel, query, key_cache, value_cache,
                        block_tables, context_lens, out, scale)


@on_tensor_device
def vectorized_v2(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
                  num_splits=None) -> dict:
    """Stage 2: one warp per (sequence, query head), 16-byte loads, warp-only reduction
    (study: 4.95 ms, DRAM 57.4 %). Does not split (``num_splits`` unused)."""
    return _single_head("vectorized_v2", 1, _single_head_kernel, query, key_cache,
                        value_cache, block_tables, context_lens, out, scale)


@on_tensor_device
def gqa_reuse_v3(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
                 num_splits=None) -> dict:
    """Stage 3: one program per (sequence, kv head) serving the whole query group from one load
    of each page slice (study: 3.35 ms, DRAM 84.9 %). Does not split (``num_splits`` unused)."""
    batch, num_q_heads, head_dim, page_size, num_kv_heads = _dims(query, key_cache)
    bd = block_d(head_dim)
    bg = next_power_of_2(num_q_heads // num_kv_heads)
    bn = max(1, min(next_power_of_2(page_size), _V3_SLICE_ELEMENTS // (bg * bd)))
    compiled = _gqa_reuse_v3_kernel[(batch, num_kv_heads)](
        **_inputs(query, key_cache, value_cache, block_tables, context_lens, scale),
        out_ptr=out, **named_strides("o", out, "b h d"),
        BLOCK_G=bg, BLOCK_N=bn, num_warps=4,
    )
    return {"gqa_reuse_v3": compiled}


def default_v4_splits(query, block_tables, page_size) -> int:
    """Splits so that ``batch * num_q_heads * num_splits`` single-warp programs fill about
    ``_V4_PROGRAMS_PER_SM`` per SM, capped by the table's capacity (no host sync)."""
    batch, num_q_heads, _ = query.shape
    want = cdiv(_V4_PROGRAMS_PER_SM * sm_count_for(query), max(1, batch * num_q_heads))
    cap = cdiv(block_tables.shape[1] * page_size, _V4_MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, _V4_MAX_SPLITS, cap))


@on_tensor_device
def split_kv_v4(query, key_cache, value_cache, block_tables, context_lens, out, *, scale,
                num_splits=None) -> dict:
    """Stage 4: split each context into ``num_splits`` chunks (one warp each; ``None``:
    :func:`default_v4_splits`), then a log-sum-exp merge kernel (study: 3.92 ms + 22.6 us
    merge, DRAM 73.4 %)."""
    batch, num_q_heads, head_dim, page_size, num_kv_heads = _dims(query, key_cache)
    splits = num_splits or default_v4_splits(query, block_tables, page_size)
    bd = block_d(head_dim)
    part_ml = torch.empty(batch, num_q_heads, splits, 2, dtype=torch.float32,
                          device=query.device)
    part_acc = torch.empty(batch, num_q_heads, splits, bd, dtype=torch.float32,
                           device=query.device)
    args = _inputs(query, key_cache, value_cache, block_tables, context_lens, scale)
    split = _split_kv_v4_kernel[(batch, num_q_heads, splits)](
        **args, part_ml_ptr=part_ml, part_acc_ptr=part_acc, num_splits=splits, num_warps=1,
    )
    merge = _split_kv_v4_merge_kernel[(batch, num_q_heads)](
        context_lens_ptr=context_lens, part_ml_ptr=part_ml, part_acc_ptr=part_acc,
        out_ptr=out, page_size=page_size, max_pages=args["max_pages"], num_splits=splits,
        stride_ctx=args["stride_ctx"], **named_strides("o", out, "b h d"),
        HEAD_DIM=head_dim, BLOCK_D=bd, num_warps=1,
    )
    return {"split_kv_v4": split, "split_kv_v4_merge": merge}
