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

The token loop, ``kernels.common._attend_tokens``, is also the inner loop of ``split_kv_v4``,
which runs it on a token range.
"""

import triton
import triton.language as tl

from pagedattn.kernels.common import _attend_tokens, _dim_mask, _normalize, _program_sequence


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
