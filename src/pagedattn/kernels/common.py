"""``@triton.jit`` helpers and constants shared by the decode kernels.

Every kernel works in the exp2 domain: scores are ``q·k · scale · log2(e)``, so the softmax
uses ``exp2`` (one ``ex2`` instruction on a GPU) and a natural-log LSE is ``(m + log2 l) · LN2``.

Addressing (in the style of attention-gym's pointer helpers):

* ``_clamped_context_len``: a sequence's length, clamped to ``[0, max_pages * page_size]`` so a
  kernel never dereferences block-table entries past the table (lengths are not validated on
  the device in the hot path; see ``pagedattn._validation``).
* ``_page_ids`` / ``_kv_token_offsets``: physical pages and element offsets of tokens through
  the block table, in 64-bit (``page_id * stride_page`` passes 2^31 on large caches).
* ``_dim_mask``: the mask of the real head dims, a constant splat when ``head_dim`` is a power
  of two.

Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), NaN-safe:

* ``_rescale``: the factor ``exp2(m_old - m_new)`` applied to old state; 0 when ``m_old`` is
  -inf (a row that has seen no score yet), so ``-inf - (-inf)`` is never formed.
* ``_probs``: ``exp2(s - m_new)`` for scores ``s`` against their running max, clamped to
  ``[0, 1]`` and exactly 1 where ``s`` *is* the max. On a GPU the compiler may fuse a product
  that feeds ``s`` into the subtraction (an FMA computes ``x·c - round(x·c)``, the rounding
  error of the score, not 0); at |s| ~ 3e11 that error is ~1e4 and ``exp2`` of it is inf. The
  interpreter never fuses, so only a GPU showed it (case N15).
* ``_softmax_token_step``: one token (or one element-wise row of tokens) folded into the state.
* ``_softmax_block_step``: a ``[rows, BLOCK_N]`` tile of scores; returns the new max, the
  rescale factor and the tile's probabilities (the caller forms ``P·V`` its own way).
* ``_soft_cap``: Gemma 2's logit soft-cap ``cap · tanh(s / cap)`` on exp2-domain scores.
* ``_fold_sink``: an attention sink (gpt-oss) folded into a final state: one more term of the
  denominator, none of the numerator.
* ``_merge_partials``: fold one partial state ``(m_s, l_s, acc_s)`` (a split of the context)
  into a running one; the log-sum-exp merge of Flash-Decoding (Dao et al., 2023).
"""

import triton
import triton.language as tl

# constexpr *instances*: Triton 3.6's code generator rejects a global that is only annotated
# ``x: tl.constexpr = 1.0`` ("Cannot access global variable"); the interpreter does not check
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): natural-log scores -> exp2 domain
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): exp2-domain LSE -> natural log


@triton.jit
def _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity):
    """A sequence's length clamped to ``[0, capacity]`` in the dtype it is stored in, then
    narrowed to int32 (an int64 length past 2^31 clamps to the capacity, never wraps)."""
    n = tl.load(context_lens_ptr + b * stride_ctx)
    return tl.minimum(tl.maximum(n, 0), capacity).to(tl.int32)


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
def _dim_mask(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mask of the real head dims. When ``head_dim`` is a power of two the mask is a constant
    splat, so Triton knows it is uniform along the contiguous dim and emits 16-byte vector
    loads (an ``offs_d < HEAD_DIM`` mask would force one load per element)."""
    tl.static_assert(HEAD_DIM <= BLOCK_D, "BLOCK_D must cover head_dim")
    tl.static_assert((BLOCK_D & (BLOCK_D - 1)) == 0, "BLOCK_D must be a power of two")
    if HEAD_DIM == BLOCK_D:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return offs_d < HEAD_DIM


@triton.jit
def _rescale(m_old, m_new):
    """``exp2(m_old - m_new)``, 0 when ``m_old`` is -inf (never forms -inf - -inf)."""
    return tl.where(m_old == float("-inf"), 0.0, tl.exp2(m_old - m_new))


@triton.jit
def _probs(s, m_new):
    """``exp2(s - m_new)`` in ``[0, 1]``: exactly 1 where ``s == m_new`` and never above 1 (see
    the module docstring: an FMA-fused score may differ from its rounded max); exactly 0 for
    ``s = -inf`` (a masked token), even when ``m_new`` is -inf too."""
    p = tl.where(s == m_new, 1.0, tl.exp2(tl.minimum(s - m_new, 0.0)))
    return tl.where(s == float("-inf"), 0.0, p)


@triton.jit
def _softmax_token_step(m, l, acc, s, v):
    """Fold one token with score ``s`` and value ``v`` into ``(m, l, acc)``; shapes broadcast
    (``m``, ``l``, ``s`` scalars or ``[BLOCK_D]``; ``acc``, ``v`` ``[BLOCK_D]``)."""
    m_new = tl.maximum(m, s)
    alpha = _rescale(m, m_new)
    p = _probs(s, m_new)
    return m_new, l * alpha + p, acc * alpha + p * v


@triton.jit
def _softmax_block_step(m, l, s):
    """A tile of scores ``s`` ``[rows, BLOCK_N]`` (masked tokens at -inf) against the state
    ``m``, ``l`` ``[rows]``. Returns ``(m_new, alpha, p, l_new)``; the caller updates its
    accumulator as ``acc * alpha[:, None] + P·V``."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = _rescale(m, m_new)
    p = _probs(s, m_new[:, None])
    return m_new, alpha, p, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _merge_partials(m, l, acc, m_s, l_s, acc_s):
    """Fold the partial state of one split (``m_s`` finite: the split held tokens) into the
    running ``(m, l, acc)``: both are rescaled to the common max ``2^(m_* - M)``."""
    m_new = tl.maximum(m, m_s)
    alpha = _rescale(m, m_new)
    beta = _rescale(m_s, m_new)
    return m_new, l * alpha + l_s * beta, acc * alpha + acc_s * beta


@triton.jit
def _normalize(acc, l):
    """``acc / l``, and 0 for a row that saw no token (``l == 0``). The divisor of such a row
    is 1, not 0: Triton's interpreter computes both sides of a ``where`` with numpy, and an
    empty row's ``0 / 0`` (a decode bucket's padding row) warned the user."""
    return tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)


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
def _soft_cap(s, cap):
    """Gemma 2's soft-cap on exp2-domain scores ``s = s_nat · log2 e``: returns
    ``cap · tanh(s_nat / cap) · log2 e``. With ``x = s_nat / cap``: for ``|x| >= 1/16``,
    ``tanh`` as ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` (no overflow for any ``|x|``:
    huge logits give exactly ±cap); below, ``s · (1 - x²/3 + 2x⁴/15)`` (tanh's odd series
    times ``cap / x``, relative error < 4e-9), where ``1 - e`` would cancel: with a cap far
    above the logits the quotient lost all precision (a cap of 1e8 gave uniform attention),
    and a subnormal ``x`` flushed to zero still gives ``s``."""
    x = s * (LN2 / cap)  # s_nat / cap
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    series = s * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0)))
    return tl.where(ax < 0.0625, series, tl.where(x < 0, -t, t) * (cap * LOG2E))


@triton.jit
def _fold_sink(m, l, sink2):
    """Fold a sink logit ``sink2`` (exp2 domain) into a final state ``(m, l)``: the
    denominator gains ``2^sink2``, the numerator nothing. Returns ``(m_new, l_new, alpha)``;
    the caller scales its accumulator by ``alpha``. A row that saw no key (``m = -inf``,
    ``l = 0``) gets ``m_new = sink2, l_new = 1``: out 0 and LSE = the sink, also for a sink of
    ``-inf`` (a head without one: the sink's term is 1 where it equals the new max, never
    ``exp2(-inf - -inf)``)."""
    m_new = tl.maximum(m, sink2)
    alpha = _rescale(m, m_new)
    return m_new, l * alpha + tl.where(sink2 == m_new, 1.0, tl.exp2(sink2 - m_new)), alpha


@triton.jit
def _natural_lse(m, l):
    """Natural-log LSE of an exp2-domain running state ``(m, l)``: ``(m + log2 l) · ln 2``."""
    return (m + tl.log2(l)) * LN2


# --- programmatic dependent launch (PDL; perf-notes step 32) ---------------------------------
# A per-group merge is launched with ``launch_pdl=True``: its programs may start while the main
# kernel's last programs still run (once every main program has signalled), load their length,
# and wait on ``griddepcontrol.wait`` (the main grid complete, its writes visible) before their
# first read of the workspace. Both helpers compile to nothing when ``PDL`` is off (the
# interpreter, pre-Hopper GPUs, one-unit plans, the per-head merge), so the kernels' code is
# unchanged there.


@triton.jit
def _pdl_launch_dependents(PDL: tl.constexpr):
    """The main kernel: let the next kernel of the stream (its merge) launch early."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """The merge kernel: wait until the main kernel has finished and its partials are visible
    (a no-op when the kernel was launched without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
