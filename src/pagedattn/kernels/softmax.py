"""The online softmax's math in the exp2 domain: ``@triton.jit`` helpers on a running state
``(m, l, acc)``, with no memory access.

Every kernel works in the exp2 domain: scores are ``q·k · scale · log2(e)``, so the softmax
uses ``exp2`` (one ``ex2`` instruction on a GPU) and a natural-log LSE is ``(m + log2 l) · LN2``.

Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), NaN-safe:

* ``_rescale``: the factor ``exp2(m_old - m_new)`` applied to old state; 0 when ``m_old`` is
  -inf (a row that has seen no score yet), so ``-inf - (-inf)`` is never formed.
* ``_probs``: ``exp2(s - m_new)`` for scores ``s`` against their running max, clamped to
  ``[0, 1]`` and exactly 1 where ``s`` *is* the max. On a GPU the compiler may fuse a product
  that feeds ``s`` into the subtraction (an FMA computes ``x·c - round(x·c)``, the rounding
  error of the score, not 0); at |s| ~ 3e11 that error is ~1e4 and ``exp2`` of it is inf. The
  interpreter never fuses, so only a GPU showed it (case N15). ``_exact_mul`` is the product
  that is never fused.
* ``_softmax_token_step``: one token (or one element-wise row of tokens) folded into the state.
* ``_softmax_block_step``: a ``[rows, BLOCK_N]`` tile of scores; returns the new max, the
  rescale factor and the tile's probabilities (the caller forms ``P·V`` its own way).
* ``_merge_partials`` / ``_merge_row``: fold one partial state ``(m_s, l_s, acc_s)`` (a split
  of the context) into a running one; the log-sum-exp merge of Flash-Decoding (Dao et al.,
  2023). ``_normalize``: ``acc / l``, 0 for a row without keys.
* ``_soft_cap``: Gemma 2's logit soft-cap ``cap · tanh(s / cap)`` on exp2-domain scores.
* ``_fold_sink``: an attention sink (gpt-oss) folded into a final state: one more term of the
  denominator, none of the numerator. ``_natural_lse``: the state's natural-log LSE.

Nothing here imports another kernels module; :mod:`pagedattn.kernels.steps` builds on it.
"""

import triton
import triton.language as tl

# constexpr *instances*: Triton 3.6's code generator rejects a global that is only annotated
# ``x: tl.constexpr = 1.0`` ("Cannot access global variable"); the interpreter does not check
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): natural-log scores -> exp2 domain
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): exp2-domain LSE -> natural log


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
def _softmax_block_step(m, l, s, LEAN: tl.constexpr = False):
    """A tile of scores ``s`` ``[rows, BLOCK_N]`` (masked tokens at -inf) against the state
    ``m``, ``l`` ``[rows]``. Returns ``(m_new, alpha, p, l_new)``; the caller updates its
    accumulator as ``acc * alpha[:, None] + P·V``. ``LEAN``: every row of the tile holds at
    least one seen key and the scores are exactly rounded products (:func:`_exact_mul`), so
    the new max is finite, ``s - m_new`` is exactly 0 at the max and negative elsewhere, and
    a masked score (``-inf``) gives ``exp2(-inf) = 0``: neither clamp nor select is needed."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if LEAN:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
    else:
        alpha = _rescale(m, m_new)
        p = _probs(s, m_new[:, None])
    return m_new, alpha, p, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _exact_mul(x, y, ASM: tl.constexpr):
    """``x · y`` rounded once and never contracted into a later subtraction (``mul.rn``:
    ptxas fuses a plain ``mul`` into an FMA, which leaves the rounding error of the product
    where ``s - max(s)`` should be 0; case N15). The interpreter never contracts."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return x * y


@triton.jit
def _merge_partials(m, l, acc, m_s, l_s, acc_s):
    """Fold the partial state of one split (``m_s`` finite: the split held tokens) into the
    running ``(m, l, acc)``: both are rescaled to the common max ``2^(m_* - M)``."""
    m_new = tl.maximum(m, m_s)
    alpha = _rescale(m, m_new)
    beta = _rescale(m_s, m_new)
    return m_new, l * alpha + l_s * beta, acc * alpha + acc_s * beta


@triton.jit
def _merge_row(m, l, acc, m_r, l_r, acc_r, MAY_BE_EMPTY: tl.constexpr):
    """Fold one split row's partial ``(m_r, l_r, acc_r)`` (``[BLOCK_H]``, ``[BLOCK_H,
    BLOCK_D]``) into the running merge state, both rescaled to the common max. ``m`` is
    finite from the first row on when every row held tokens; ``MAY_BE_EMPTY`` (several
    query tokens): a row may have seen no key of its split (``m_r = -inf``), weighted 0."""
    m_new = tl.maximum(m, m_r)
    alpha = _rescale(m, m_new)
    w = _rescale(m_r, m_new) if MAY_BE_EMPTY else tl.exp2(m_r - m_new)
    l = l * alpha + l_r * w
    acc = acc * alpha[:, None] + acc_r * w[:, None]
    return m_new, l, acc


@triton.jit
def _normalize(acc, l):
    """``acc / l``, and 0 for a row that saw no token (``l == 0``). The divisor of such a row
    is 1, not 0: Triton's interpreter computes both sides of a ``where`` with numpy, and an
    empty row's ``0 / 0`` (a decode bucket's padding row) warned the user."""
    return tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)


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
