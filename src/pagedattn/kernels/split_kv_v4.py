"""Stage ``split_kv_v4`` of the study: split the context, then merge with log-sum-exp.

Split kernel, grid ``(batch, num_q_heads, num_splits)``: one single-warp program (the
``vectorized_v2`` decomposition) owns one (sequence, query head, split) and runs the online
softmax over the split's tokens ``[split * chunk, min((split + 1) * chunk, len))`` with
``chunk = ceil(len / num_splits)``. It writes the unnormalized partial state (max ``m``, sum
``l``, output ``acc``) to a workspace. A split with no tokens writes nothing.

Merge kernel, grid ``(batch, num_q_heads)``: rescales the non-empty splits' partials to their
common max and normalizes: ``out = Σ acc_s·2^(m_s−M) / Σ l_s·2^(m_s−M)``. Empty splits are
recognized from the length (not from the workspace) and skipped, so an uninitialized or
NaN-filled workspace entry is never read and ``-inf − (-inf)`` is never formed. A sequence of
length 0 gets an all-zero row.

This is Flash-Decoding's context parallelism (Dao et al., 2023) on the study's stage 4: more
programs for small batches and long contexts, but no GQA reuse (each query head reads its K/V).
"""

import triton
import triton.language as tl

from pagedattn.kernels.fused_v1 import _attend_tokens
from pagedattn.kernels.paging import _clamped_context_len, _dim_mask
from pagedattn.kernels.softmax import _merge_partials, _normalize


@triton.jit
def _split_kv_v4_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr,
    part_ml_ptr,  # [batch, num_q_heads, num_splits, 2] fp32: (m, l) in the exp2 domain
    part_acc_ptr,  # [batch, num_q_heads, num_splits, BLOCK_D] fp32, unnormalized
    scale_log2,
    page_size, max_pages, group, num_splits,
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_b, stride_bt_p, stride_ctx,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1)
    ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, max_pages * page_size)
    chunk = tl.cdiv(ctx, num_splits)
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)
    if start < end:  # an empty split writes nothing; the merge skips it by the same rule
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
        q = tl.load(query_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h
                    + offs_d * stride_q_d, mask=mask_d, other=0.0).to(tl.float32) * scale_log2
        m, l, acc = _attend_tokens(
            q, offs_d, mask_d, b, h // group, start, end,
            key_cache_ptr, value_cache_ptr, block_tables_ptr, page_size,
            stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
            stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
            stride_bt_b, stride_bt_p, BLOCK_D,
        )
        row = (b.to(tl.int64) * num_q_heads + h) * num_splits + split
        tl.store(part_ml_ptr + row * 2, m)
        tl.store(part_ml_ptr + row * 2 + 1, l)
        tl.store(part_acc_ptr + row * BLOCK_D + offs_d, acc)


@triton.jit
def _split_kv_v4_merge_kernel(
    context_lens_ptr, part_ml_ptr, part_acc_ptr, out_ptr,
    page_size, max_pages, num_splits,
    stride_ctx, stride_o_b, stride_o_h, stride_o_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, max_pages * page_size)
    chunk = tl.cdiv(ctx, num_splits)
    num_nonempty = tl.cdiv(ctx, tl.maximum(chunk, 1))  # splits [0, num_nonempty) hold tokens
    offs_d = tl.arange(0, BLOCK_D)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    base = (b.to(tl.int64) * num_q_heads + h) * num_splits
    for split in range(0, num_nonempty):
        m_s = tl.load(part_ml_ptr + (base + split) * 2)
        l_s = tl.load(part_ml_ptr + (base + split) * 2 + 1)
        acc_s = tl.load(part_acc_ptr + (base + split) * BLOCK_D + offs_d)
        m, l, acc = _merge_partials(m, l, acc, m_s, l_s, acc_s)
    out = _normalize(acc, l)
    o_row = out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h
    tl.store(o_row + offs_d * stride_o_d, out.to(out_ptr.dtype.element_ty),
             mask=_dim_mask(offs_d, HEAD_DIM, BLOCK_D))
