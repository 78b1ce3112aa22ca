"""Stages ``fused_v1`` and ``vectorized_v2`` of the study: one query head per program.

Grid ``(batch, num_q_heads)``; one program owns one (sequence, query head) and walks its tokens
one at a time. The ``head_dim`` lanes split the ``q·k`` dot product and reduce it (``tl.sum``:
warp shuffles, plus a shared-memory exchange across warps when the program has several), then
each lane updates its own output dims with the online softmax. The redundancy of ``baseline``
is gone.

The two stages share this body and differ in the launch, as in the study:
* ``fused_v1``: a cooperative block of 4 warps (128 threads), one output dim per thread at
  head_dim 128, so every token pays a cross-warp reduction through shared memory and a barrier.
* ``vectorized_v2``: a single warp, so each lane owns ``head_dim / 32`` contiguous dims (4 fp32
  at head_dim 128: 16-byte vector loads) and the reduction is warp-only, with no barrier.

The token loop, :func:`_attend_tokens`, is also the inner loop of ``split_kv_v4``, which runs
it on a token range.
"""

import triton
import triton.language as tl

from pagedattn.kernels.paging import _dim_mask, _kv_token_offsets, _program_sequence
from pagedattn.kernels.softmax import _normalize, _softmax_token_step


@triton.jit
def _attend_tokens(
    q, offs_d, mask_d, b, kv_head, start, end,
    key_cache_ptr, value_cache_ptr, block_tables_ptr, page_size,
    stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_b, stride_bt_p,
    BLOCK_D: tl.constexpr,
):
    """Online softmax of one query vector ``q`` ``[BLOCK_D]`` (pre-scaled by scale·log2 e) over
    tokens ``[start, end)``, one token at a time. Returns the unnormalized state
    ``(m, l, acc[BLOCK_D])``. The inner loop of ``fused_v1``/``vectorized_v2`` and of
    ``split_kv_v4``'s split kernel."""
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for t in range(start, end):
        k_off = _kv_token_offsets(block_tables_ptr, b, stride_bt_b, stride_bt_p, t, True,
                                  page_size, kv_head, stride_k_page, stride_k_tok, stride_k_head)
        v_off = _kv_token_offsets(block_tables_ptr, b, stride_bt_b, stride_bt_p, t, True,
                                  page_size, kv_head, stride_v_page, stride_v_tok, stride_v_head)
        k = tl.load(key_cache_ptr + k_off + offs_d * stride_k_d, mask=mask_d,
                    other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + v_off + offs_d * stride_v_d, mask=mask_d,
                    other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=0)  # the one reduction per token
        m, l, acc = _softmax_token_step(m, l, acc, s, v)
    return m, l, acc


@triton.jit
def _single_head_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    scale_log2,
    page_size, max_pages, group,
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_b, stride_bt_p, stride_ctx,
    stride_o_b, stride_o_h, stride_o_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, h, ctx = _program_sequence(context_lens_ptr, stride_ctx, max_pages, page_size)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    q = tl.load(query_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h + offs_d * stride_q_d,
                mask=mask_d, other=0.0).to(tl.float32) * scale_log2
    m, l, acc = _attend_tokens(
        q, offs_d, mask_d, b, h // group, 0, ctx,
        key_cache_ptr, value_cache_ptr, block_tables_ptr, page_size,
        stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
        stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
        stride_bt_b, stride_bt_p, BLOCK_D,
    )
    o_row = out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h
    tl.store(o_row + offs_d * stride_o_d, _normalize(acc, l).to(out_ptr.dtype.element_ty),
             mask=mask_d)
