"""Stage ``gqa_reuse_v3`` of the study: one program per (sequence, kv head), KV read once.

Grid ``(batch, num_kv_heads)``; one program (4 warps, as the study's 128-thread block) owns a
sequence and one kv head, and serves the whole query group ``[BLOCK_G, head_dim]`` of that kv
head. It walks the sequence page by page: the page's block-table entry is read once, the page's
K and V rows are staged in ``BLOCK_N``-token slices, each slice loaded once and used by every
query head of the group (the study stages a page in shared memory and gives each warp one query
head; here the slice lives in registers spread over the warps and Triton moves it through
shared memory for the reductions). So each KV byte crosses DRAM once per group instead of once
per query head: the stage that made the study DRAM-bound.

Scores are ``[BLOCK_G, BLOCK_N]`` broadcast-multiply-reductions on CUDA cores (no tensor cores,
as in the study); the online softmax keeps a state per query head.
"""

import triton
import triton.language as tl

from pagedattn.kernels.paging import _dim_mask, _page_ids, _program_sequence
from pagedattn.kernels.softmax import _normalize, _softmax_block_step


@triton.jit
def _gqa_reuse_v3_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    scale_log2,
    page_size, max_pages, group,
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_b, stride_bt_p, stride_ctx,
    stride_o_b, stride_o_h, stride_o_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tl.static_assert((BLOCK_G & (BLOCK_G - 1)) == 0, "BLOCK_G must be a power of two")
    tl.static_assert((BLOCK_N & (BLOCK_N - 1)) == 0, "BLOCK_N must be a power of two")
    b, kv_head, ctx = _program_sequence(context_lens_ptr, stride_ctx, max_pages, page_size)

    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_g = offs_g < group
    heads = kv_head * group + offs_g  # [BLOCK_G] query heads of this kv head
    q_ptrs = (query_ptr + b.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h
              + offs_d[None, :] * stride_q_d)
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    q = q * scale_log2  # [BLOCK_G, BLOCK_D]

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    num_used_pages = tl.cdiv(ctx, page_size)
    for page in range(0, num_used_pages):
        page_id = _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p, page, True)
        k_page = key_cache_ptr + page_id * stride_k_page + kv_head.to(tl.int64) * stride_k_head
        v_page = value_cache_ptr + page_id * stride_v_page + kv_head.to(tl.int64) * stride_v_head
        valid = tl.minimum(ctx - page * page_size, page_size)  # tokens used in this page
        for n0 in range(0, valid, BLOCK_N):
            tok = n0 + offs_n
            mask_n = tok < valid
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_page + tok[:, None] * stride_k_tok + offs_d[None, :] * stride_k_d,
                        mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_page + tok[:, None] * stride_v_tok + offs_d[None, :] * stride_v_d,
                        mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m, alpha, p, l = _softmax_block_step(m, l, s)  # masked tokens: p = 0
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)

    out = _normalize(acc, l[:, None])
    o_ptrs = (out_ptr + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h
              + offs_d[None, :] * stride_o_d)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
