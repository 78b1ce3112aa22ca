"""``@triton.jit`` helpers shared by every decode kernel.

* ``_clamped_context_len``: a sequence's length, clamped to ``[0, max_pages * page_size]`` so a
  kernel never dereferences block-table entries past the table (lengths are not validated on
  the device in the hot path; see ``pagedattn._validation``).
* ``_kv_token_offsets``: element offsets of tokens ``offs_n`` of one kv head, through the
  block table, in 64-bit (``page_id * stride_page`` can pass 2^31 on large caches).
* ``_rescale``: the online-softmax rescale factor ``exp2(m_old - m_new)`` (Milakov &
  Gimelshein 2018; FlashAttention, Dao et al. 2022), NaN-safe when a row has seen no score yet.
  Every kernel works in the exp2 domain: scores are ``q·k · scale · log2(e)``.
"""

import triton
import triton.language as tl


@triton.jit
def _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity):
    n = tl.load(context_lens_ptr + b * stride_ctx).to(tl.int32)
    return tl.minimum(tl.maximum(n, 0), capacity)


@triton.jit
def _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p, page_idx, mask):
    """Physical page ids of logical pages ``page_idx`` (int64; masked entries read as 0)."""
    row = block_tables_ptr + b.to(tl.int64) * stride_bt_b
    return tl.load(row + page_idx * stride_bt_p, mask=mask, other=0).to(tl.int64)


@triton.jit
def _kv_token_offsets(block_tables_ptr, b, stride_bt_b, stride_bt_p, offs_n, mask_n,
                      page_size, kv_head, stride_page, stride_tok, stride_head):
    """Offsets (int64) of token positions ``offs_n`` of sequence ``b``, kv head ``kv_head``."""
    page_id = _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p, offs_n // page_size,
                        mask_n)
    slot = (offs_n % page_size).to(tl.int64)
    return page_id * stride_page + slot * stride_tok + kv_head.to(tl.int64) * stride_head


@triton.jit
def _rescale(m_old, m_new):
    """``exp2(m_old - m_new)``, 0 when ``m_old`` is -inf (never forms -inf - -inf)."""
    return tl.where(m_old == float("-inf"), 0.0, tl.exp2(m_old - m_new))


@triton.jit
def _dim_mask(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mask of the real head dims. When ``head_dim`` is a power of two the mask is a constant
    splat, so Triton knows it is uniform along the contiguous dim and emits 16-byte vector
    loads (an ``offs_d < HEAD_DIM`` mask would force one load per element)."""
    if HEAD_DIM == BLOCK_D:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return offs_d < HEAD_DIM


#: ln 2: LSEs live in the exp2 domain inside the kernels and leave them in natural log
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _natural_lse(m, l):
    """Natural-log LSE of an exp2-domain running state ``(m, l)``: ``(m + log2 l) · ln 2``."""
    return (m + tl.log2(l)) * LN2


@triton.jit
def _online_softmax_step(m, l, acc, s):
    """One online-softmax update over exp2-domain scores ``s [rows, tokens]`` (masked entries
    -inf, at least one finite per row): returns ``(m_new, l_new, acc · alpha, p)``; the caller
    adds ``p · V`` to the rescaled ``acc``. NaN-safe on the first tile (``m`` = -inf)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = _rescale(m, m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l * alpha + tl.sum(p, axis=1)
    return m_new, l_new, acc * alpha[:, None], p
