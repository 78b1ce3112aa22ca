"""The paged prefill kernel: causal attention of many new tokens per sequence over a paged
cache (chunked prefill, prompts after a cached prefix, mixed batches), a kernel of its own
designed for its roofline: a long chunk is bound by the tensor cores, not by the bytes.

**Rows.** A program owns ``BLOCK_M`` query rows of one sequence: ``TOKENS = BLOCK_M //
G_PACK`` consecutive new tokens times ``G_PACK`` query heads of one kv head (``G_PACK = 1``:
one head, FlashAttention's tiles; ``G_PACK = group``: the GQA group packed into the rows, for
short chunks, as FA3's PackGQA), so both dots are ``[BLOCK_M, BLOCK_N]``-shaped wgmma tiles
(``BLOCK_M`` 128 on Hopper, eight warps). Row ``i`` is token ``i // G_PACK`` of the block and
query head ``head0 + i % G_PACK``.

**Grid.** ``(block rows, num_q_heads // G_PACK)``: block row ``r`` is found on the device by a
vector scan of ``query_start_loc`` (no host sync; the grid is sized from shapes, so one CUDA
graph serves any lengths), each sequence's blocks longest first (its last block, which sees
the most keys, has the lowest row). Programs past the batch's blocks exit.

**Keys, in up to three loops.** The block's tokens sit at positions ``P0 .. P1`` (``P0 =
seq_len - q_len + first token``). Keys below ``P0`` rounded down to a tile are seen by every
row: that loop is **unmasked** (no mask, no clamp, no select: ``exp2(s·scale - max)``, the
scale folded into one FMA). The tiles that hold ``P0 .. P1`` (the diagonal) are masked per
row. Tiles above ``P1`` are never visited. With a window (``HAS_WINDOW``), the loop starts at
the first token's window start (rounded down to a tile; its keys before the window read the
window's first row, never a page before it), its first tiles are masked until every row's
window holds them, then the unmasked middle, then the diagonal.

**Values read.** Every key row read lies in ``[window start, P1]`` of the sequence: a token
past it (the last tile's tail) reads the last visible row instead, masked from the scores.
Page ids are read once per tile and clamped to ``[0, num_pages)``, a length to the table's
capacity, a query row to the query's rows: whatever the metadata says, the kernel reads and
writes inside its tensors, and reports what it clamped (:mod:`pagedattn.kernels.errors`).

**Numbers.** Scores live in the exp2 domain (``q·k · scale · log2 e``); fp8 caches dot in
fp16 (converted in registers, exact; a bf16/fp32 query scaled per row by a power of two into
fp16's range first, as in the decode kernel), fp32 in split bf16 (``bf16x3``). The unmasked
loop takes a row's max of the raw scores and scales it once (``max(qk) · c == max(qk · c)``
for ``c >= 0``, which the host knows: ``SCALE_NONNEG``), so a score costs one FMA before its
``exp2``. Variants (``VARIANTS``: window, soft-cap, sinks, ALiBi) are constexpr flags that
leave no code when off.

Builds on :mod:`pagedattn.kernels.softmax`, ``paging`` and ``steps`` (the query load, the
sink) and ``errors``; the launcher is :mod:`pagedattn.launch.prefill`.
"""

import triton
import triton.language as tl

from pagedattn.kernels.errors import (
    BLOCK_TABLES,
    QUERY_START_LOC,
    SEQ_LENS,
    SEQ_LENS_SHORT,
    _checked_page_ids,
    _report,
)
from pagedattn.kernels.paging import _dim_mask
from pagedattn.kernels.softmax import (
    LOG2E,
    _exact_mul,
    _natural_lse,
    _normalize,
    _probs,
    _rescale,
    _soft_cap,
)
from pagedattn.kernels.steps import _add_sink, _load_query


@triton.jit
def _prefill_block(query_start_loc_ptr, r, batch, first_row, num_tokens,
                   TOKENS: tl.constexpr, BLOCK_B: tl.constexpr):
    """Block row ``r``: ``(b, row0, q_len, m, bad)``, its sequence (``batch`` past the last
    block), the block's first query row, the sequence's new tokens and the block's index
    within them (the lowest rows take a sequence's last blocks: longest first). Entries of
    ``query_start_loc`` are clamped so that every sequence's rows lie in ``[first_row,
    num_tokens]``; ``bad``: the first entry that was clamped, or entry 0 when it is not
    ``first_row`` (``-1``: none)."""
    b = 0
    start = 0
    running = 0
    bad = -1
    for b0 in range(0, batch, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        valid = offs_b < batch
        lo_raw = tl.load(query_start_loc_ptr + offs_b, mask=valid, other=0)
        hi_raw = tl.load(query_start_loc_ptr + offs_b + 1, mask=valid, other=0)
        lo = tl.minimum(tl.maximum(lo_raw, first_row), num_tokens)
        hi = tl.minimum(tl.maximum(hi_raw, lo), num_tokens)
        wrong = valid & ((lo != lo_raw) | (hi != hi_raw)
                         | ((offs_b == 0) & (lo_raw != first_row)))
        first_wrong = tl.min(tl.where(wrong, offs_b, 2147483647))
        bad = tl.where((bad < 0) & (first_wrong < 2147483647), first_wrong, bad)
        blocks = tl.where(valid, tl.cdiv(hi - lo, TOKENS), 0)
        ends = running + tl.cumsum(blocks, axis=0)
        before = (ends <= r) & valid
        b += tl.sum(before.to(tl.int32))
        start = tl.maximum(start, tl.max(tl.where(before, ends, 0)))
        running += tl.sum(blocks)
    lo = tl.minimum(tl.maximum(tl.load(query_start_loc_ptr + b, mask=b < batch, other=0),
                               first_row), num_tokens)
    hi = tl.minimum(tl.maximum(tl.load(query_start_loc_ptr + b + 1, mask=b < batch, other=0),
                               lo), num_tokens)
    q_len = hi - lo
    n_blocks = tl.cdiv(q_len, TOKENS)
    m = n_blocks - 1 - (r - start)  # longest first
    return b, lo + m * TOKENS, q_len, m, bad


@triton.jit
def _block_seq_len(seq_lens_ptr, errors_ptr, b, stride_sl, q_len, m_blk, qsl_bad, reporter,
                   max_pages, num_pages, valid, PAGE_SIZE: tl.constexpr, TOKENS: tl.constexpr,
                   MASKED: tl.constexpr):
    """A block's sequence length clamped to the table, ``(seq_len, raw_len)``. ``reporter``:
    this program reports the length (one a sequence: its last block) if it was clamped, or if
    it is shorter than its new tokens (unless ``query_start_loc`` was clamped: then that is
    the cause, reported alone). ``MASKED``: the block may lie past the batch (``valid``
    says whether it does not; nothing is read then)."""
    capacity = max_pages * PAGE_SIZE * (num_pages > 0)  # no page: every length clamps to 0
    if MASKED:
        raw_len = tl.load(seq_lens_ptr + b * stride_sl, mask=valid, other=0)
    else:
        raw_len = tl.load(seq_lens_ptr + b * stride_sl)
    seq_len = tl.minimum(tl.maximum(raw_len, 0), capacity).to(tl.int32)
    report = (m_blk == tl.cdiv(q_len, TOKENS) - 1) & reporter  # one program a sequence
    _report(errors_ptr, report & (seq_len != raw_len), SEQ_LENS, b, raw_len)
    # a sequence whose rows come from a clamped query_start_loc is short as a consequence:
    # only the cause is reported (programs race to the word; a consequence could win)
    _report(errors_ptr, report & (seq_len == raw_len) & (seq_len < q_len) & (qsl_bad < 0),
            SEQ_LENS_SHORT, b, raw_len)
    return seq_len, raw_len


@triton.jit(do_not_specialize=["batch", "first_row", "num_tokens", "num_pages", "max_pages"])
def _prefill_schedule_kernel(query_start_loc_ptr, seq_lens_ptr, sched_ptr, errors_ptr,
                             batch, first_row, num_tokens, num_pages, max_pages, stride_sl,
                             TOKENS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                             BLOCK_B: tl.constexpr):
    """The Gluon prefill kernel's schedule (:mod:`pagedattn.kernels.prefill_gluon`; Gluon 3.6
    has no ``cumsum``): block row ``r`` (a program each) as eight int32 at ``sched_ptr + 8 r``:
    its sequence (``-1``: past the batch's blocks), first query row, rows, first token's
    position, ``kv_end`` (keys ``[0, kv_end)`` are visible to some row) and whether the
    sequence's length was taken as given (so a clamped page id is worth a report). The
    metadata is clamped and reported as the plain kernel does it."""
    r = tl.program_id(0)
    b, row0, q_len, m_blk, qsl_bad = _prefill_block(query_start_loc_ptr, r, batch, first_row,
                                                    num_tokens, TOKENS, BLOCK_B)
    _report(errors_ptr, (r == 0) & (qsl_bad >= 0), QUERY_START_LOC, qsl_bad, qsl_bad)
    valid = (b < batch) & (m_blk >= 0)
    seq_len, raw_len = _block_seq_len(seq_lens_ptr, errors_ptr, b, stride_sl, q_len, m_blk,
                                      qsl_bad, valid, max_pages, num_pages, valid, PAGE_SIZE,
                                      TOKENS, True)
    rows_here = tl.minimum(q_len - m_blk * TOKENS, TOKENS)
    p0 = seq_len - q_len + m_blk * TOKENS
    kv_end = tl.maximum(tl.minimum(p0 + rows_here, seq_len), 0)
    out = sched_ptr + r * 8
    tl.store(out, tl.where(valid, b, -1))
    tl.store(out + 1, tl.where(valid, row0, first_row))
    tl.store(out + 2, tl.where(valid, rows_here, 0))
    tl.store(out + 3, tl.where(valid, p0, 0))
    tl.store(out + 4, tl.where(valid, kv_end, 0))
    tl.store(out + 5, (valid & (seq_len == raw_len)).to(tl.int32))


@triton.jit
def _scaled_row_max(qk, qk_scale):
    """``max(qk · c)`` over each row for a scale ``c >= 0`` per row, as ``max(qk) · c``: the same
    float32 (rounding is monotone), one product a row instead of one a score."""
    return tl.max(qk, axis=1) * qk_scale


@triton.jit
def _scores(qk, qk_scale, alibi2, softcap, tok, pos, VARIANTS: tl.constexpr):
    """A tile's exp2-domain scores with the soft-cap and ALiBi (each when on)."""
    s = qk * qk_scale[:, None]
    if VARIANTS.HAS_SOFTCAP:
        s = _soft_cap(s, softcap)
    if VARIANTS.HAS_ALIBI:
        s += alibi2[:, None] * (tok[None, :] - pos[:, None]).to(tl.float32)
    return s


@triton.jit
def _unmasked_probs(qk, qk_scale, m_i, alibi2, softcap, tok, pos, VARIANTS: tl.constexpr,
                    SCALE_NONNEG: tl.constexpr):
    """``(m_new, alpha, p)`` of a tile every row sees whole: finite scores, so no select.
    With ``SCALE_NONNEG`` and neither soft-cap nor ALiBi, a row's max is taken before the
    scale (:func:`_scaled_row_max`): one FMA and one ``exp2`` a score. The clamp at 0 stays: a
    product fused into the subtraction may exceed its rounded max (case N15)."""
    if SCALE_NONNEG and not (VARIANTS.HAS_SOFTCAP or VARIANTS.HAS_ALIBI):
        m_new = tl.maximum(m_i, _scaled_row_max(qk, qk_scale))
        p = tl.exp2(tl.minimum(qk * qk_scale[:, None] - m_new[:, None], 0.0))
    else:
        s = _scores(qk, qk_scale, alibi2, softcap, tok, pos, VARIANTS)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(tl.minimum(s - m_new[:, None], 0.0))
    return m_new, tl.exp2(m_i - m_new), p


@triton.jit
def _masked_probs(qk, qk_scale, m_i, alibi2, softcap, tok, pos, kv_end, window_left,
                  VARIANTS: tl.constexpr, ASM: tl.constexpr):
    """``(m_new, alpha, p)`` of a diagonal (or window-edge) tile: a row sees the keys ``tok <=
    min(pos, kv_end - 1)`` (and ``>= pos - window_left`` with a window); a row may have seen
    none yet (its max stays -inf). Without soft-cap and ALiBi the scores are exactly rounded
    products (:func:`_exact_mul`), so ``s - max`` is exactly 0 at the max and never above: one
    subtraction and one ``exp2`` a score, against a row max of 0 where it is -inf (every score
    of such a row is -inf: ``exp2(-inf) = 0``)."""
    seen = tok[None, :] <= tl.minimum(pos, kv_end - 1)[:, None]
    if VARIANTS.HAS_WINDOW:
        seen = seen & (tok[None, :] >= pos[:, None] - window_left)
    if VARIANTS.HAS_SOFTCAP or VARIANTS.HAS_ALIBI:
        s = tl.where(seen, _scores(qk, qk_scale, alibi2, softcap, tok, pos, VARIANTS),
                     float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = _probs(s, m_new[:, None])
    else:
        s = tl.where(seen, _exact_mul(qk, qk_scale[:, None], ASM), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
    return m_new, _rescale(m_i, m_new), p


@triton.jit
def _prefill_tiles(acc, m_i, l_i, q, qk_scale, alibi2, pos, lo, hi, kv_lo, kv_end, window_left,
                   softcap, key_cache_ptr, value_cache_ptr, bt_row_ptr, stride_bt_p,
                   num_pages, page_bad, kv_head_off_k, kv_head_off_v, offs_n, offs_d, mask_d,
                   stride_k_page, stride_k_tok, stride_k_d, stride_v_page, stride_v_tok,
                   stride_v_d, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   VARIANTS: tl.constexpr, MASKED: tl.constexpr, SCALE_NONNEG: tl.constexpr,
                   ASM: tl.constexpr):
    """Key tiles ``[lo, hi)`` (multiples of ``BLOCK_N``) folded into the rows' state ``(acc,
    m_i, l_i)``. ``MASKED``: each row sees the keys ``p <= pos`` within ``[kv_lo, kv_end)``
    (and its window), and the tokens outside ``[kv_lo, kv_end)`` read that range's nearest
    row (:func:`_masked_probs`); unmasked: every row sees every key of every tile (the caller
    guarantees it), so no mask, clamp or select is formed (:func:`_unmasked_probs`).
    ``page_bad``: whether a page id was clamped so far."""
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + offs_n  # [BLOCK_N]
        if MASKED:
            tok_ld = tl.minimum(tl.maximum(tok, kv_lo), kv_end - 1)
        else:
            tok_ld = tok
        raw = tl.load(bt_row_ptr + (tok_ld // PAGE_SIZE) * stride_bt_p)
        page, bad = _checked_page_ids(raw, num_pages)
        page_bad = page_bad | (tl.max(bad.to(tl.int32), axis=0) > 0)
        slot = (tok_ld % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_k_page + slot * stride_k_tok + kv_head_off_k  # [BLOCK_N]
        v_off = page * stride_v_page + slot * stride_v_tok + kv_head_off_v
        k = tl.load(key_cache_ptr + k_off[:, None] + offs_d[None, :] * stride_k_d,
                    mask=mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D], as V's tile
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        if MASKED:
            m_new, alpha, p = _masked_probs(qk, qk_scale, m_i, alibi2, softcap, tok, pos,
                                            kv_end, window_left, VARIANTS, ASM)
        else:
            m_new, alpha, p = _unmasked_probs(qk, qk_scale, m_i, alibi2, softcap, tok, pos,
                                              VARIANTS, SCALE_NONNEG)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_v_d,
                    mask=mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i, page_bad


@triton.jit(do_not_specialize=["batch", "first_row", "num_tokens", "num_pages", "max_pages",
                               "window_left", "stride_q_t", "stride_o_t", "stride_bt_b"])
def _paged_prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, out_ptr, lse_ptr, errors_ptr,
    k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale,  # [num_kv_heads] or 0-d
    k_scale_val, v_scale_val, scale_log2,
    sinks_ptr, alibi_ptr,  # [num_q_heads] fp32 (HAS_SINKS / HAS_ALIBI only)
    window_left, softcap,  # HAS_WINDOW / HAS_SOFTCAP only
    batch, first_row, num_tokens, num_pages, max_pages, group,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_b, stride_bt_p, stride_sl,
    stride_o_t, stride_o_h, stride_o_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows a program: TOKENS x G_PACK
    BLOCK_N: tl.constexpr,  # keys a tile (may span pages)
    G_PACK: tl.constexpr,  # query heads packed into the rows (1, or the group)
    PAGE_SIZE: tl.constexpr, BLOCK_B: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    Q_POW2_SCALE: tl.constexpr,  # fp8 caches: each query row scaled into fp16's range
    SCALE_FROM_PTR: tl.constexpr, HAS_LSE: tl.constexpr,
    VARIANTS: tl.constexpr,  # pagedattn.options.Variants
    SCALE_NONNEG: tl.constexpr,  # scale >= 0 (k_scale > 0: the API's contract)
    ASM: tl.constexpr,  # inline PTX (not in the interpreter): softmax._exact_mul
):
    TOKENS: tl.constexpr = BLOCK_M // G_PACK
    r = tl.program_id(0)
    hg = tl.program_id(1)
    b, row0, q_len, m_blk, qsl_bad = _prefill_block(query_start_loc_ptr, r, batch, first_row,
                                                    num_tokens, TOKENS, BLOCK_B)
    first = (r == 0) & (hg == 0)
    _report(errors_ptr, first & (qsl_bad >= 0), QUERY_START_LOC, qsl_bad, qsl_bad)
    if (b >= batch) | (m_blk < 0):  # past the batch's blocks (the grid is sized from shapes)
        return
    seq_len, raw_len = _block_seq_len(seq_lens_ptr, errors_ptr, b, stride_sl, q_len, m_blk,
                                      qsl_bad, hg == 0, max_pages, num_pages, True, PAGE_SIZE,
                                      TOKENS, False)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok_i = offs_m // G_PACK  # the row's token within the block
    heads = hg * G_PACK + offs_m % G_PACK  # [BLOCK_M] query heads
    kv_head = (hg * G_PACK) // group
    rows_here = tl.minimum(q_len - m_blk * TOKENS, TOKENS)
    mask_m = (tok_i < rows_here) & (offs_m < TOKENS * G_PACK)  # a group of 3, 7: pad rows
    p0 = seq_len - q_len + m_blk * TOKENS  # the block's first token's position
    pos = p0 + tok_i  # [BLOCK_M]
    p1 = p0 + rows_here - 1  # the block's last token's position
    kv_end = tl.minimum(p1 + 1, seq_len)  # keys [kv_lo, kv_end) are visible to some row
    kv_lo = 0
    if VARIANTS.HAS_WINDOW:
        kv_lo = tl.maximum(p0 - window_left, 0)
    kv_end = tl.maximum(kv_end, kv_lo)  # a length below q_len (reported): no key
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)

    q_rows = row0 + tok_i
    q_ptrs = (query_ptr + q_rows.to(tl.int64)[:, None] * stride_q_t
              + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d)
    mask_md = mask_m[:, None] & mask_d[None, :]
    if SCALE_FROM_PTR:
        k_scale = tl.load(k_scale_ptr + kv_head * stride_k_scale).to(tl.float32)
        v_scale = tl.load(v_scale_ptr + kv_head * stride_v_scale).to(tl.float32)
    else:
        k_scale = k_scale_val
        v_scale = v_scale_val
    q, qk_scale = _load_query(q_ptrs, mask_md, scale_log2, k_scale, BLOCK_M, DOT_DTYPE,
                              Q_POW2_SCALE)
    alibi2 = 0.0
    if VARIANTS.HAS_ALIBI:
        alibi2 = tl.load(alibi_ptr + heads) * LOG2E

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt_b
    k_head = kv_head.to(tl.int64) * stride_k_head
    v_head = kv_head.to(tl.int64) * stride_v_head
    page_bad = tl.zeros([], tl.int1)
    # keys below full_end are <= p0: every row sees them (causal); with a window, keys from
    # win_full on are in every row's window
    full_end = tl.maximum(p0 + 1, 0) // BLOCK_N * BLOCK_N
    lo0 = kv_lo // BLOCK_N * BLOCK_N
    a_end = lo0
    if VARIANTS.HAS_WINDOW:
        win_full = tl.cdiv(tl.maximum(p1 - window_left, 0), BLOCK_N) * BLOCK_N
        a_end = tl.maximum(tl.minimum(win_full, full_end), lo0)
        acc, m_i, l_i, page_bad = _prefill_tiles(
            acc, m_i, l_i, q, qk_scale, alibi2, pos, lo0, a_end, kv_lo, kv_end, window_left,
            softcap, key_cache_ptr, value_cache_ptr, bt_row, stride_bt_p, num_pages, page_bad,
            k_head, v_head, offs_n, offs_d, mask_d, stride_k_page, stride_k_tok, stride_k_d,
            stride_v_page, stride_v_tok, stride_v_d, PAGE_SIZE, BLOCK_N, DOT_DTYPE,
            DOT_PRECISION, VARIANTS, True, SCALE_NONNEG, ASM)
    acc, m_i, l_i, page_bad = _prefill_tiles(
        acc, m_i, l_i, q, qk_scale, alibi2, pos, a_end, full_end, kv_lo, kv_end, window_left,
        softcap, key_cache_ptr, value_cache_ptr, bt_row, stride_bt_p, num_pages, page_bad,
        k_head, v_head, offs_n, offs_d, mask_d, stride_k_page, stride_k_tok, stride_k_d,
        stride_v_page, stride_v_tok, stride_v_d, PAGE_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
        VARIANTS, False, SCALE_NONNEG, ASM)
    acc, m_i, l_i, page_bad = _prefill_tiles(
        acc, m_i, l_i, q, qk_scale, alibi2, pos, tl.maximum(full_end, a_end), kv_end, kv_lo,
        kv_end, window_left, softcap, key_cache_ptr, value_cache_ptr, bt_row, stride_bt_p,
        num_pages, page_bad, k_head, v_head, offs_n, offs_d, mask_d, stride_k_page,
        stride_k_tok, stride_k_d, stride_v_page, stride_v_tok, stride_v_d, PAGE_SIZE, BLOCK_N,
        DOT_DTYPE, DOT_PRECISION, VARIANTS, True, SCALE_NONNEG, ASM)
    # a length past the table (reported) reads entries that hold no page: a consequence
    _report(errors_ptr, page_bad & (seq_len == raw_len), BLOCK_TABLES, b, -1)

    if VARIANTS.HAS_SINKS:
        m_i, l_i, acc = _add_sink(m_i, l_i, acc, sinks_ptr, heads, mask_m)
    out = acc * _normalize(v_scale, l_i)[:, None]
    o_ptrs = (out_ptr + q_rows.to(tl.int64)[:, None] * stride_o_t
              + heads[:, None] * stride_o_h + offs_d[None, :] * stride_o_d)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_md)
    if HAS_LSE:
        num_q_heads = tl.num_programs(1) * G_PACK
        tl.store(lse_ptr + q_rows.to(tl.int64) * num_q_heads + heads, _natural_lse(m_i, l_i),
                 mask=mask_m)
