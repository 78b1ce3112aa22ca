"""Stage ``baseline`` of the study: the deliberately redundant kernel.

Grid ``(batch, num_q_heads)``; one program owns one (sequence, query head). In the study each
of its ``head_dim`` threads owns one output dimension and recomputes the *whole* ``q·k`` dot
product for every token. Here the program holds a ``[BLOCK_D, BLOCK_D]`` tile: row ``d`` is
"thread d", which loads all of ``k`` and reduces ``q·k`` itself, so the dot product is done
``head_dim`` times per token, exactly the redundancy the study measured (SM and L1 busy,
DRAM idle). Each row keeps its own online-softmax state. Tokens are visited one at a time.

The query is scaled by ``scale · log2(e)`` once, before the loop, as in the other stages:
scaling each score after its reduction (``s = (q·k) · c``) let the GPU compiler fuse that
product into ``s - m_new`` and turn all-equal logits of ~2e11 into ``exp2(±1e4)`` (case N15);
``_probs`` now guards against the pattern as well.
"""

import triton
import triton.language as tl

from pagedattn.kernels.paging import _clamped_context_len, _dim_mask, _kv_token_offsets
from pagedattn.kernels.softmax import _normalize, _softmax_token_step


@triton.jit
def _baseline_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    scale_log2,  # softmax scale * log2(e)
    page_size, max_pages, group,
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_b, stride_bt_p, stride_ctx,
    stride_o_b, stride_o_h, stride_o_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // group
    ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, max_pages * page_size)

    offs_d = tl.arange(0, BLOCK_D)  # the output dim each "thread" owns
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_dd = mask_d[:, None] & mask_d[None, :]  # [BLOCK_D, BLOCK_D]
    q_row = query_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h
    # every "thread" d holds the whole query vector: [BLOCK_D, BLOCK_D], rows identical
    q = tl.load(q_row + offs_d[None, :] * stride_q_d + offs_d[:, None] * 0, mask=mask_dd,
                other=0.0).to(tl.float32) * scale_log2

    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for t in range(0, ctx):
        k_off = _kv_token_offsets(block_tables_ptr, b, stride_bt_b, stride_bt_p, t, True,
                                  page_size, kv_head, stride_k_page, stride_k_tok, stride_k_head)
        v_off = _kv_token_offsets(block_tables_ptr, b, stride_bt_b, stride_bt_p, t, True,
                                  page_size, kv_head, stride_v_page, stride_v_tok, stride_v_head)
        # each "thread" loads all of k and reduces its own copy of q·k: [BLOCK_D, BLOCK_D]
        k = tl.load(key_cache_ptr + k_off + offs_d[None, :] * stride_k_d + offs_d[:, None] * 0,
                    mask=mask_dd, other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=1)  # [BLOCK_D], the same score in every row
        v = tl.load(value_cache_ptr + v_off + offs_d * stride_v_d, mask=mask_d,
                    other=0.0).to(tl.float32)  # [BLOCK_D], "thread" d reads v[d]
        m, l, acc = _softmax_token_step(m, l, acc, s, v)

    o_row = out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h
    tl.store(o_row + offs_d * stride_o_d, _normalize(acc, l).to(out_ptr.dtype.element_ty),
             mask=mask_d)
