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
* ``_program_sequence``: a ``(batch, heads)`` grid program's sequence, head and clamped length.

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

The production kernel's steps (``kernels/decode.py``) close the module, in the order a unit
runs them: the device-side split planner (``_plan_unit``: ``_batch_chunk``, ``_locate_row``;
``_unit_tokens``), the tile's rows and pointers (``_tile_rows``, ``_tile_ptrs``,
``_lse_ptrs``), the query and scales (``_kv_scales``, ``_load_query``, ``_v_tile_view``), the
token loop's ``_score_and_mask`` and ``_online_softmax_step(_pairs)``, the epilogues
(``_store_result``, ``_store_partial``), the folded merge's arrival (``_arrive``) and the
merges' ``_merge_group_rows`` (``_merge_row`` per split row), ``_store_merged``,
``_store_empty`` / ``_empty_seq_result``, ``_seq_rows`` / ``_empty_seq_rows`` and
``_add_sink``. Each keeps the kernel's flags as constexpr arguments, so a flag that is off
leaves no code, and Triton inlines each: the kernels compile to the instructions and registers
they had as one body (``docs/perf-notes.md``, step 31, which also says why the K/V loads stay
in the kernel's loop).
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
def _program_sequence(context_lens_ptr, stride_ctx, max_pages, page_size):
    """Grid ``(batch, heads, ...)``: this program's sequence ``b``, its head (the grid's second
    axis: a query or a kv head, as the kernel's grid has it) and the sequence's length clamped
    to the table's ``max_pages * page_size`` tokens (:func:`_clamped_context_len`)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    return b, head, _clamped_context_len(context_lens_ptr, b, stride_ctx, max_pages * page_size)


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


@triton.jit
def _window_first(n, window_left, Q_LEN: tl.constexpr):
    """The first key that any of the ``Q_LEN`` query tokens of a sequence of ``n`` keys sees
    through a sliding window (vector or scalar ``n``): the first token sits at ``n - Q_LEN``
    and its window starts ``window_left`` keys before it."""
    return tl.maximum(n - Q_LEN - window_left, 0)


@triton.jit
def _visible_tokens(n, window_left, Q_LEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(start, count)``: the key range ``[start, n)`` that the planner splits and the tiles
    walk: from :func:`_window_first` rounded down to a whole tile, so every tile and split
    starts at a multiple of ``BLOCK_N`` as without a window. The compiler then knows that
    tiles are page-aligned (a window starting mid-tile cost 160 registers against 118, and
    so a quarter of the resident programs: perf-notes step 23); keys before the window in
    the first tile read the window's first row instead (their addresses are clamped to it)
    and are masked from the scores only, so no byte before the window is fetched."""
    start = _window_first(n, window_left, Q_LEN) // BLOCK_N * BLOCK_N
    return start, n - start


@triton.jit
def _total_and_max_tokens(context_lens_ptr, batch, stride_ctx, capacity, window_left,
                          BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, Q_LEN: tl.constexpr,
                          HAS_WINDOW: tl.constexpr):
    """Σ clamped lengths (with a window, the visible tokens only: the split work scales with
    the window) (64-bit: with shared, prefix-cached pages the batch's tokens are not
    bounded by the cache size, and 1,024 sequences of 256 k tokens pass 2^31) and the longest
    clamped length. ``BLOCK_B`` lengths per vector load: the batch is a runtime value."""
    total = tl.full([], 0, tl.int64)
    longest = tl.full([], 0, tl.int32)
    for b0 in range(0, batch, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        n = tl.load(context_lens_ptr + offs_b * stride_ctx, mask=offs_b < batch, other=0)
        n = tl.minimum(tl.maximum(n, 0), capacity).to(tl.int32)  # clamped before narrowing
        if HAS_WINDOW:
            _, n = _visible_tokens(n, window_left, Q_LEN, BLOCK_N)
        total += tl.sum(n.to(tl.int64))
        longest = tl.maximum(longest, tl.max(n))
    return total, longest


@triton.jit
def _chunk_of(n, chunk, forced_splits, BLOCK_N: tl.constexpr):
    """Tokens per split for a sequence of length ``n`` (vector or scalar): ``n`` cut into
    ``ceil(n / chunk)`` (or ``forced_splits``) near-equal pieces, rounded up to whole tiles.
    Equal pieces, not ``chunk``-sized ones and a remainder: a 2048-token sequence with a
    1344-token chunk splits 1024 + 1024, not 1344 + 704 (the longest unit sets the tail)."""
    splits = tl.where(forced_splits > 0, forced_splits, tl.cdiv(n, chunk))
    piece = tl.cdiv(n, tl.maximum(splits, 1))
    return tl.maximum(tl.cdiv(piece, BLOCK_N) * BLOCK_N, BLOCK_N)


@triton.jit
def _locate_row(context_lens_ptr, r, batch, stride_ctx, capacity, chunk, forced_splits,
                window_left, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                Q_LEN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Sequence ``b`` owning split row ``r`` and the first row ``start_b`` it owns."""
    b = 0
    start = 0
    running = 0
    for b0 in range(0, batch, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        n = tl.load(context_lens_ptr + offs_b * stride_ctx, mask=offs_b < batch, other=0)
        n = tl.minimum(tl.maximum(n, 0), capacity).to(tl.int32)  # clamped before narrowing
        if HAS_WINDOW:  # split the visible tokens only
            _, n = _visible_tokens(n, window_left, Q_LEN, BLOCK_N)
        rows = tl.cdiv(n, _chunk_of(n, chunk, forced_splits, BLOCK_N))
        ends = running + tl.cumsum(rows, axis=0)
        before = (ends <= r) & (offs_b < batch)
        b += tl.sum(before.to(tl.int32))
        start = tl.maximum(start, tl.max(tl.where(before, ends, 0)))
        running += tl.sum(rows)
    return b, start


@triton.jit
def _varlen_block(query_start_loc_ptr, r, batch, BLOCK_B: tl.constexpr, Q_LEN: tl.constexpr):
    """A varlen launch's block row ``r`` (``VARLEN``: the batch's new tokens in blocks of
    ``Q_LEN``, sequence-major, a sequence of ``q_len_b = query_start_loc[b + 1] -
    query_start_loc[b]`` new tokens holding ``ceil(q_len_b / Q_LEN)`` of them): the sequence
    ``b`` (``batch`` past the last block), the block's first query row ``q_row0`` and the
    sequence's ``q_len_b`` and block index ``m``. A vector scan of ``query_start_loc`` in
    ``BLOCK_B`` slices (the batch is a runtime value), as :func:`_locate_row` scans lengths."""
    b = 0
    start = 0
    running = 0
    for b0 in range(0, batch, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        valid = offs_b < batch
        lo = tl.load(query_start_loc_ptr + offs_b, mask=valid, other=0)
        hi = tl.load(query_start_loc_ptr + offs_b + 1, mask=valid, other=0)
        blocks = tl.cdiv(tl.maximum(hi - lo, 0), Q_LEN)
        ends = running + tl.cumsum(blocks, axis=0)
        before = (ends <= r) & valid
        b += tl.sum(before.to(tl.int32))
        start = tl.maximum(start, tl.max(tl.where(before, ends, 0)))
        running += tl.sum(blocks)
    m = r - start
    lo = tl.load(query_start_loc_ptr + b, mask=b < batch, other=0)
    hi = tl.load(query_start_loc_ptr + b + 1, mask=b < batch, other=0)
    return b, lo + m * Q_LEN, hi - lo, m


@triton.jit
def _token_rows(offs_h, kv_head, group, Q_LEN: tl.constexpr):
    """Multi-token tiles (``Q_LEN > 1``): row ``i`` is query token ``i // group`` of query
    head ``kv_head * group + i % group``. Returns ``(q_tok, heads, mask_h)`` ``[BLOCK_H]``."""
    return offs_h // group, kv_head * group + offs_h % group, offs_h < Q_LEN * group


@triton.jit
def _fp8_dim_pairs(w, FP8: tl.constexpr, ASM: tl.constexpr):
    """fp8 V tile read as 16-bit words ``w`` (``[BLOCK_N, BLOCK_D // 2]``: dims ``2j`` in the
    low byte, ``2j + 1`` in the high byte) -> ``(even, odd)`` fp16 tiles, each exact. A tile of
    bytes whose reduction dim (tokens) is strided cannot go through ``ldmatrix.trans`` (16-bit
    only): the byte tile was read from shared memory one byte per instruction (perf-notes step
    28). Words transpose like fp16, and each pair of words becomes two fp16 pairs by one
    ``prmt`` and two packed ``cvt`` (``ASM``: inline PTX, sm_89+; else plain Triton casts,
    which the interpreter runs). ``FP8``: 1 e4m3, 2 e5m2."""
    if ASM and FP8 == 1:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    elif ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
            "cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            "=r,=r,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        fp8: tl.constexpr = tl.float8e4nv if FP8 == 1 else tl.float8e5
        even = (w & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
        odd = ((w >> 8) & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
        return even, odd


# ---- the production kernel's pieces (kernels/decode.py), in the order a unit runs them ----
# Each is inlined by Triton, and each constexpr flag stays a constexpr argument, so a flag
# that is off leaves no code: the kernels compile to the instructions they had when these
# lines stood in their bodies (docs/perf-notes.md, step 31).


@triton.jit
def _batch_chunk(context_lens_ptr, batch, stride_ctx, capacity, num_kv_heads, min_chunk,
                 target_units, target_units_ragged, window_left, BLOCK_B: tl.constexpr,
                 BLOCK_N: tl.constexpr, Q_LEN: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 BATCH_INVARIANT: tl.constexpr):
    """The batch-wide split size in tokens (a multiple of ``BLOCK_N``): the launcher's fixed
    ``min_chunk`` under ``BATCH_INVARIANT`` (a sequence's splits, and so its arithmetic, never
    depend on the rest of the batch), else the batch's token-work spread over
    ``target_units`` units (``target_units_ragged`` for a ragged batch: mean length under
    half the longest, whose whole-sequence units of unequal lengths leave a tail that
    smaller units fill)."""
    if BATCH_INVARIANT:
        chunk = min_chunk.to(tl.int32)
    else:
        total, longest = _total_and_max_tokens(context_lens_ptr, batch, stride_ctx, capacity,
                                               window_left, BLOCK_B, BLOCK_N, Q_LEN,
                                               HAS_WINDOW)
        work = total * num_kv_heads  # int64
        ragged = total * 2 < longest.to(tl.int64) * batch
        target = tl.where(ragged, target_units_ragged, target_units)
        # a multiple of BLOCK_N, so the near-equal pieces of _chunk_of are never more than
        # ceil(len / chunk) per sequence (the workspace bound of the launcher)
        chunk = tl.cdiv(tl.maximum(tl.cdiv(work, target), min_chunk), BLOCK_N) * BLOCK_N
        chunk = tl.minimum(chunk, capacity + BLOCK_N).to(tl.int32)  # no sequence is longer
    return chunk



@triton.jit
def _plan_unit(context_lens_ptr, r, batch, stride_ctx, capacity, num_kv_heads, min_chunk,
               target_units, target_units_ragged, forced_splits, window_left,
               BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, Q_LEN: tl.constexpr,
               HAS_WINDOW: tl.constexpr, BATCH_INVARIANT: tl.constexpr,
               ONE_UNIT: tl.constexpr):
    """Which sequence unit row ``r`` belongs to: ``(b, start_b, chunk)``, the sequence, the
    first row it owns and the batch's split size (:func:`_batch_chunk`, :func:`_locate_row`;
    ``b >= batch``: a row past the last real one). ``ONE_UNIT``: the launcher knows that no
    sequence splits, so row ``r`` is sequence ``r``, with no chunk to size and no scan of the
    lengths."""
    if ONE_UNIT:
        b = r
        start_b = r
        chunk = 0
    else:
        chunk = _batch_chunk(context_lens_ptr, batch, stride_ctx, capacity, num_kv_heads,
                             min_chunk, target_units, target_units_ragged, window_left,
                             BLOCK_B, BLOCK_N, Q_LEN, HAS_WINDOW, BATCH_INVARIANT)
        b, start_b = _locate_row(context_lens_ptr, r, batch, stride_ctx, capacity, chunk,
                                 forced_splits, window_left, BLOCK_B, BLOCK_N, Q_LEN,
                                 HAS_WINDOW)
    return b, start_b, chunk


@triton.jit
def _unit_tokens(ctx, r, start_b, chunk, forced_splits, window_left, Q_LEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, ONE_UNIT: tl.constexpr):
    """The tokens ``[tok_start, tok_end)`` that unit row ``r`` of a sequence of ``ctx`` keys
    (rows from ``start_b``) walks, the sequence's row count ``n_rows`` and the window's first
    key ``win_first`` (``ctx`` when there is no window: unused). With a window only its
    tiles are split (:func:`_visible_tokens`); ``ONE_UNIT``: the whole visible range, one
    row (an empty sequence is one row too: it writes 0, and -inf or the sink)."""
    n_vis = ctx
    win_first = ctx
    if HAS_WINDOW:  # the window's tiles only: splits cut [start, ctx), no page before is read
        win_first = _window_first(ctx, window_left, Q_LEN)
        first, n_vis = _visible_tokens(ctx, window_left, Q_LEN, BLOCK_N)
    if ONE_UNIT:
        n_rows = 1
        tok_start = 0
        if HAS_WINDOW:
            tok_start = first
        tok_end = ctx
    else:
        chunk_b = _chunk_of(n_vis, chunk, forced_splits, BLOCK_N)
        n_rows = tl.cdiv(n_vis, chunk_b)
        tok_start = (r - start_b) * chunk_b
        if HAS_WINDOW:
            tok_start += first
        tok_end = tl.minimum(tok_start + chunk_b, ctx)
    return tok_start, tok_end, n_rows, win_first


@triton.jit
def _tile_rows(offs_h, kv_head, group, ctx, Q_LEN: tl.constexpr):
    """The tile's rows: ``(q_tok, heads, mask_h, q_pos)`` ``[BLOCK_H]``. One query token: row
    ``i`` is query head ``kv_head * group + i`` (``q_tok``, ``q_pos``: 0, unused); ``Q_LEN >
    1``: :func:`_token_rows`, and row ``i`` sits at position ``ctx - Q_LEN + q_tok`` (< 0: it
    sees no key)."""
    if Q_LEN > 1:
        q_tok, heads, mask_h = _token_rows(offs_h, kv_head, group, Q_LEN)
        q_pos = ctx - Q_LEN + q_tok
    else:
        q_tok = 0
        q_pos = 0
        mask_h = offs_h < group
        heads = kv_head * group + offs_h
    return q_tok, heads, mask_h, q_pos


@triton.jit
def _tile_ptrs(base_ptr, b, q_tok, heads, offs_d, stride_b, stride_t, stride_h, stride_d,
               Q_LEN: tl.constexpr):
    """``[BLOCK_H, BLOCK_D]`` pointers of the tile's rows (:func:`_tile_rows`) in a query or
    output ``[batch, (Q_LEN,) heads, head_dim]`` (``stride_t``: the token's, ``Q_LEN > 1``
    only); sequence offsets in 64-bit."""
    if Q_LEN > 1:
        return base_ptr + (b.to(tl.int64) * stride_b + q_tok * stride_t
                           + heads * stride_h)[:, None] + offs_d[None, :] * stride_d
    else:
        return (base_ptr + b.to(tl.int64) * stride_b + heads[:, None] * stride_h
                + offs_d[None, :] * stride_d)


@triton.jit
def _lse_ptrs(lse_ptr, b, q_tok, heads, num_q_heads, Q_LEN: tl.constexpr):
    """``[BLOCK_H]`` pointers of the tile's rows in a contiguous LSE ``[batch, (Q_LEN,)
    num_q_heads]``."""
    if Q_LEN > 1:
        return lse_ptr + (b.to(tl.int64) * Q_LEN + q_tok) * num_q_heads + heads
    else:
        return lse_ptr + b.to(tl.int64) * num_q_heads + heads


@triton.jit
def _kv_scales(k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale, k_scale_val,
               v_scale_val, kv_head, SCALE_FROM_PTR: tl.constexpr):
    """``(k_scale, v_scale)`` of a kv head: from the tensors (``SCALE_FROM_PTR``: per head or
    0-d, graph-safe) or the Python floats."""
    if SCALE_FROM_PTR:
        k_scale = tl.load(k_scale_ptr + kv_head * stride_k_scale).to(tl.float32)
        v_scale = tl.load(v_scale_ptr + kv_head * stride_v_scale).to(tl.float32)
    else:
        k_scale = k_scale_val
        v_scale = v_scale_val
    return k_scale, v_scale


@triton.jit
def _load_query(q_ptrs, mask_hd, scale_log2, k_scale, BLOCK_H: tl.constexpr,
                DOT_DTYPE: tl.constexpr, Q_POW2_SCALE: tl.constexpr):
    """The query tile as the dots' operand and the per-row score scale ``(q_dot, qk_scale)``.
    The scale (``scale · log2 e · k_scale``) applies to the fp32 scores, never to a 16-bit
    ``q`` (which would round the scores by the query's precision, case B16).
    ``Q_POW2_SCALE`` (fp8 caches dot in fp16): a bf16/fp32 query may exceed fp16's range
    (65,504), so each row is scaled by 2^e into [2^13, 2^14) first; a power of two is exact,
    and ``qk_scale`` divides it back out (no cast narrows the caller's range, case N07); the
    exponent is at most 126, so 2^e and 2^-e stay finite (a row with max |q| below 2^-114,
    about 5e-35, made 2^e inf and the row NaN): such a row's largest element lands below
    2^12, still exact, and its scores are ~0 whatever fp16 rounds away."""
    q = tl.load(q_ptrs, mask=mask_hd, other=0.0).to(tl.float32)
    qk_scale = tl.zeros([BLOCK_H], tl.float32) + scale_log2 * k_scale  # per query row
    if Q_POW2_SCALE:
        amax = tl.max(tl.abs(q), axis=1)
        e = tl.minimum(tl.where(amax > 0, 14.0 - tl.ceil(tl.log2(amax)), 0.0), 126.0)
        q = q * tl.exp2(e)[:, None]
        qk_scale = qk_scale * tl.exp2(-e)
    return q.to(DOT_DTYPE), qk_scale  # unscaled: exact for fp16/bf16 queries


@triton.jit
def _load_latent_query(q_ptrs, qpe_ptrs, mask_hd, mask_hr, scale_log2, k_scale,
                       BLOCK_H: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       Q_POW2_SCALE: tl.constexpr):
    """MLA's query tile (``MLA``): its latent part ``q_nope`` ``[BLOCK_H, BLOCK_D]`` and rope
    part ``q_pe`` ``[BLOCK_H, BLOCK_DR]`` as the dots' operands, and the per-row score scale
    ``(q_dot, qpe_dot, qk_scale)``, as :func:`_load_query`. A row's score is the sum of both
    parts' dots, so ``Q_POW2_SCALE`` scales the two parts of a row by one power of two, from
    the row's largest ``|q|`` over both."""
    q = tl.load(q_ptrs, mask=mask_hd, other=0.0).to(tl.float32)
    qr = tl.load(qpe_ptrs, mask=mask_hr, other=0.0).to(tl.float32)
    qk_scale = tl.zeros([BLOCK_H], tl.float32) + scale_log2 * k_scale  # per query row
    if Q_POW2_SCALE:
        amax = tl.maximum(tl.max(tl.abs(q), axis=1), tl.max(tl.abs(qr), axis=1))
        e = tl.minimum(tl.where(amax > 0, 14.0 - tl.ceil(tl.log2(amax)), 0.0), 126.0)
        q = q * tl.exp2(e)[:, None]
        qr = qr * tl.exp2(e)[:, None]
        qk_scale = qk_scale * tl.exp2(-e)
    return q.to(DOT_DTYPE), qr.to(DOT_DTYPE), qk_scale


@triton.jit
def _v_tile_view(value_cache_ptr, offs_d, mask_d, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, FP8_V_PAIRS: tl.constexpr):
    """How the value tiles are read: ``(base, offs, mask_d)``. ``FP8_V_PAIRS``: the cache as
    16-bit words, two fp8 dims each (``BLOCK_D // 2`` per row; the launcher sets the flag
    only for 16-byte strides and a unit dim stride, so the mask is a splat: 16-byte loads);
    else the cache and the dims themselves."""
    if FP8_V_PAIRS:
        offs_w = tl.arange(0, BLOCK_D // 2)
        v_words = value_cache_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        return v_words, offs_w, _dim_mask(offs_w, HEAD_DIM // 2, BLOCK_D // 2)
    else:
        return value_cache_ptr, offs_d, mask_d


@triton.jit
def _score_and_mask(q_dot, k, qk_scale, tok, mask_n, ctx, q_pos, alibi2, win_first,
                    window_left, softcap, qpe_dot, kpe, DOT_DTYPE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, Q_LEN: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    LEAN: tl.constexpr = False, ASM: tl.constexpr = False,
                    MLA: tl.constexpr = False):
    """A tile's exp2-domain scores ``[BLOCK_H, BLOCK_N]``: ``q·kᵀ · qk_scale``, then the
    soft-cap (Gemma 2, on the natural-domain logit, before any bias), ALiBi's ``+ slope·(p -
    i)`` (``alibi2``: slopes times log2 e, per row), and -inf where a key is not seen: past
    the unit's range, after the row's own position (``Q_LEN > 1``: causal, bottom-right
    aligned) or before its window (each row's with several tokens; one token: the first
    tile's keys before ``win_first``). ``LEAN``: the product is exactly rounded
    (:func:`_exact_mul`, inline PTX with ``ASM``), as :func:`_softmax_block_step`'s
    ``LEAN`` form needs. ``MLA``: the keys are ``[latent | rope]``, so the rope parts' dot
    ``qpe_dot·kpeᵀ`` accumulates onto the latent one (unused otherwise)."""
    dot = tl.dot(q_dot, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    if MLA:
        dot = tl.dot(qpe_dot, tl.trans(kpe.to(DOT_DTYPE)), dot, input_precision=DOT_PRECISION)
    s = _exact_mul(dot, qk_scale[:, None], ASM) if LEAN else dot * qk_scale[:, None]
    if HAS_SOFTCAP:
        s = _soft_cap(s, softcap)
    if HAS_ALIBI:
        if Q_LEN > 1:
            s += alibi2[:, None] * (tok[None, :] - q_pos[:, None]).to(tl.float32)
        else:
            s += alibi2[:, None] * (tok - (ctx - 1)).to(tl.float32)[None, :]
    if Q_LEN > 1:  # per row: causal, and the row's own window ([first, ctx) is the union)
        seen = mask_n[None, :] & (tok[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (tok[None, :] >= q_pos[:, None] - window_left)
        s = tl.where(seen, s, float("-inf"))
    elif HAS_WINDOW:
        s = tl.where((mask_n & (tok >= win_first))[None, :], s, float("-inf"))
    else:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    return s


@triton.jit
def _online_softmax_step(m, l, acc, s, v, DOT_DTYPE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, LEAN: tl.constexpr = False):
    """Fold a tile of scores ``s`` and values ``v`` ``[BLOCK_N, BLOCK_D]`` into the state
    ``(m, l, acc)``: :func:`_softmax_block_step`, then ``acc · alpha + P·V`` (``tl.dot``)."""
    m, alpha, p, l = _softmax_block_step(m, l, s, LEAN)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                        input_precision=DOT_PRECISION)
    return m, l, acc


@triton.jit
def _online_softmax_step_pairs(m, l, acc_even, acc_odd, s, v, FP8: tl.constexpr,
                               ASM: tl.constexpr, LEAN: tl.constexpr = False):
    """:func:`_online_softmax_step` for fp8 values read as 16-bit dim pairs ``v``
    (:func:`_fp8_dim_pairs`): the even and odd dims accumulate apart, in two half-width
    fp16 P·V dots."""
    m, alpha, p, l = _softmax_block_step(m, l, s, LEAN)
    v_even, v_odd = _fp8_dim_pairs(v, FP8, ASM)
    p16 = p.to(tl.float16)
    acc_even = acc_even * alpha[:, None] + tl.dot(p16, v_even)
    acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd)
    return m, l, acc_even, acc_odd


@triton.jit
def _attend_tiles(q_dot, qk_scale, alibi2, qpe_dot, key_cache_ptr, value_cache_ptr,
                  block_tables_ptr, b, kv_head, k_head, v_head, tok_start, tok_end, ctx, q_pos,
                  win_first,
                  window_left, softcap, offs_n, offs_d, mask_d,
                  stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
                  stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
                  stride_bt_b, stride_bt_p, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_LEN: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  FP8_V_PAIRS: tl.constexpr, ASM: tl.constexpr, LEAN_SOFTMAX: tl.constexpr,
                  SLOT_OFFSETS_I32: tl.constexpr, MLA: tl.constexpr = False,
                  ROPE_DIM: tl.constexpr = 0, BLOCK_DR: tl.constexpr = 1):
    """The token loop: the online softmax of the tile's rows (``q_dot``, ``qk_scale``,
    ``alibi2``: :func:`_load_query` and the ALiBi slopes) over tokens ``[tok_start,
    tok_end)`` of sequence ``b``, kv head ``kv_head`` (``k_head``/``v_head``: its 64-bit
    offsets in the caches), ``BLOCK_N`` tokens a tile that may span pages. Returns the
    unnormalized state ``(m, l, acc)``: ``[BLOCK_H]``, ``[BLOCK_H]``, ``[BLOCK_H, BLOCK_D]``
    (``-inf``, 0, 0 for an empty range). Both schedules run it: a split unit's range, or one
    piece of a persistent program's share (:mod:`pagedattn.kernels.persistent`). The next
    tile's page ids are loaded one iteration ahead, so the K/V loads never wait on a
    block-table load of their own iteration and the pipeliner keeps several tiles in
    flight.

    ``MLA`` (absorbed multi-head latent attention): the keys are ``[latent | rope]`` and the
    values the latent itself, so ``key_cache_ptr`` is the latent cache (``HEAD_DIM`` =
    ``d_latent``), ``value_cache_ptr`` the rope cache (``ROPE_DIM`` dims, ``BLOCK_DR``
    padded; ``stride_v_*`` its strides) and ``qpe_dot`` the query's rope part
    (:func:`_load_latent_query`; unused otherwise): each latent tile is loaded once and
    serves as the keys of the scores and as the values of ``P·V``."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if FP8_V_PAIRS:  # even and odd dims accumulate apart (see _fp8_dim_pairs)
        acc_even = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
    v_base, offs_v, v_mask_d = _v_tile_view(value_cache_ptr, offs_d, mask_d, HEAD_DIM, BLOCK_D,
                                            FP8_V_PAIRS)
    # page ids of the first tile; inside the loop the next tile's ids are fetched one
    # iteration ahead, so the K/V loads never wait on a block-table load of their own
    # iteration and the pipeliner can keep several tiles in flight
    tok = tok_start + offs_n
    if HAS_WINDOW:  # the first tile's keys before the window read win_first's row
        tok = tl.maximum(tok, win_first)
    page_id = _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p, tok // PAGE_SIZE,
                        tok < tok_end)
    if SLOT_OFFSETS_I32:  # int32 instead (the launcher checked that every in-page offset fits)
        k_head = kv_head * stride_k_head
        v_head = kv_head * stride_v_head
    if MLA:  # the rope part's dims
        offs_r = tl.arange(0, BLOCK_DR)
        mask_r = _dim_mask(offs_r, ROPE_DIM, BLOCK_DR)
    for n0 in range(tok_start, tok_end, BLOCK_N):
        tok = n0 + offs_n
        mask_n = tok < tok_end
        # the K/V loads stand here, in the loop's own body, not in a helper of their own: an
        # inlined helper's debug-scope labels split ptxas's blocks, and inside the loop that
        # cost the ALiBi kernel 162 registers against 128, the soft-cap one 12 spilled bytes
        # (perf-notes step 31). A token's offset is page_id · stride_page (64-bit: pages pass
        # 2^31 elements on large caches) plus its slot's and head's offsets, in int32 where
        # they fit (SLOT_OFFSETS_I32: one 64-bit product a row, not three; perf-notes step
        # 38). With a window, keys before it read win_first's row (see above)
        slot = (tl.maximum(tok, win_first) if HAS_WINDOW else tok) % PAGE_SIZE
        if not SLOT_OFFSETS_I32:
            slot = slot.to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        if SLOT_OFFSETS_I32:
            k_off = page_id * stride_k_page + (slot * stride_k_tok + k_head)
        else:
            k_off = page_id * stride_k_page + slot * stride_k_tok + k_head
        k = tl.load(key_cache_ptr + k_off[:, None] + offs_d[None, :] * stride_k_d,
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if SLOT_OFFSETS_I32:
            v_off = page_id * stride_v_page + (slot * stride_v_tok + v_head)
        else:
            v_off = page_id * stride_v_page + slot * stride_v_tok + v_head
        if MLA:  # the keys' rope part [BLOCK_N, BLOCK_DR]; the values are the latent tile k
            v = tl.load(value_cache_ptr + v_off[:, None] + offs_r[None, :] * stride_v_d,
                        mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        elif FP8_V_PAIRS:  # [BLOCK_N, BLOCK_D // 2] 16-bit words, two fp8 dims each
            w_row = tl.multiple_of(v_off // 2, 8)  # the launcher's strides: 16-byte multiples
            v = tl.load(v_base + w_row[:, None] + offs_v[None, :],
                        mask=mask_n[:, None] & v_mask_d[None, :], other=0)
        else:
            v = tl.load(value_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_v_d,
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        tok_next = tok + BLOCK_N  # entries past the unit's end are masked, never read
        page_id = _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p,
                            tok_next // PAGE_SIZE, tok_next < tok_end)
        s = _score_and_mask(q_dot, k, qk_scale, tok, mask_n, ctx, q_pos, alibi2, win_first,
                            window_left, softcap, qpe_dot, v, DOT_DTYPE, DOT_PRECISION, Q_LEN,
                            HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, LEAN_SOFTMAX, ASM, MLA)
        if MLA:  # P·V over the latent tile the scores read
            m, l, acc = _online_softmax_step(m, l, acc, s, k, DOT_DTYPE, DOT_PRECISION,
                                             LEAN_SOFTMAX)
        elif FP8_V_PAIRS:
            m, l, acc_even, acc_odd = _online_softmax_step_pairs(m, l, acc_even, acc_odd, s, v,
                                                                 FP8_V_PAIRS, ASM,
                                                                 LEAN_SOFTMAX)
        else:
            m, l, acc = _online_softmax_step(m, l, acc, s, v, DOT_DTYPE, DOT_PRECISION,
                                             LEAN_SOFTMAX)
    if FP8_V_PAIRS:  # dims 2j, 2j + 1 back in place: [BLOCK_H, BLOCK_D]
        acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_H, BLOCK_D])
    return m, l, acc


@triton.jit
def _add_sink(m, l, acc, sinks_ptr, heads, mask_h):
    """The sink logits of the tile's rows (``[num_q_heads]`` natural-domain) folded into a
    final state (:func:`_fold_sink`), once: ``(m, l, acc)``."""
    m, l, alpha = _fold_sink(m, l, tl.load(sinks_ptr + heads, mask=mask_h, other=0.0) * LOG2E)
    return m, l, acc * alpha[:, None]


@triton.jit
def _store_result(out_ptr, lse_ptr, sinks_ptr, b, q_tok, heads, mask_h, offs_d, mask_hd, m,
                  l, acc, v_scale, num_q_heads, stride_o_b, stride_o_t, stride_o_h,
                  stride_o_d, Q_LEN: tl.constexpr, HAS_SINKS: tl.constexpr,
                  HAS_LSE: tl.constexpr, ONE_UNIT: tl.constexpr):
    """The epilogue of a sequence's only unit: the sink folded in (once, here), ``out = acc ·
    v_scale / l`` and the LSE written. A row that saw no key (a token before the sequence's
    start, or an empty sequence under ``ONE_UNIT``) gets 0, never 0 / 0."""
    if HAS_SINKS:
        m, l, acc = _add_sink(m, l, acc, sinks_ptr, heads, mask_h)
    if Q_LEN > 1 or ONE_UNIT:
        out = acc * _normalize(v_scale, l)[:, None]
    else:
        out = acc * (v_scale / l)[:, None]
    o_ptrs = _tile_ptrs(out_ptr, b, q_tok, heads, offs_d, stride_o_b, stride_o_t, stride_o_h,
                        stride_o_d, Q_LEN)
    lse_ptrs = _lse_ptrs(lse_ptr, b, q_tok, heads, num_q_heads, Q_LEN)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_hd)
    if HAS_LSE:
        tl.store(lse_ptrs, _natural_lse(m, l), mask=mask_h)


@triton.jit
def _store_partial(part_ml_ptr, part_acc_ptr, r, q_tok, heads, mask_h, offs_d, m, l, acc,
                   v_scale, num_q_heads, BLOCK_D: tl.constexpr, Q_LEN: tl.constexpr):
    """The epilogue of one of several units: its unnormalized partial ``(m, l)`` and ``acc ·
    v_scale`` at workspace row ``r`` (per query token and head with ``Q_LEN > 1``)."""
    if Q_LEN > 1:
        row = (r.to(tl.int64) * Q_LEN + q_tok) * num_q_heads + heads
    else:
        row = r * num_q_heads + heads.to(tl.int64)  # [BLOCK_H]
    tl.store(part_ml_ptr + row * 2, m, mask=mask_h)
    tl.store(part_ml_ptr + row * 2 + 1, l, mask=mask_h)
    tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc * v_scale,
             mask=mask_h[:, None])



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
def _merge_group_rows(part_ml_ptr, part_acc_ptr, start, n_rows, q_tok, heads, mask_h, offs_d,
                      num_q_heads, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      Q_LEN: tl.constexpr, CACHE: tl.constexpr):
    """The merge of one (sequence, kv head): split rows ``[start, start + n_rows)`` of the
    tile's rows, in row order, folded by :func:`_merge_row` (one ``[BLOCK_H, BLOCK_D]`` tile
    per row; their loads do not depend on each other, so they pipeline). The per-group merge
    kernel and a folded merge (``FOLD_MERGE``) both run it, so their sums are the same, term
    for term. ``CACHE``: the loads' cache modifier (``".cg"``: from L2, past this SM's L1,
    for rows other programs wrote during this launch)."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for r in range(start, start + n_rows):
        if Q_LEN > 1:
            row = (q_tok + r * Q_LEN).to(tl.int64) * num_q_heads + heads
        else:
            row = r * num_q_heads + heads.to(tl.int64)  # [BLOCK_H], 64-bit
        m_r = tl.load(part_ml_ptr + row * 2, mask=mask_h, other=0.0, cache_modifier=CACHE)
        l_r = tl.load(part_ml_ptr + row * 2 + 1, mask=mask_h, other=0.0, cache_modifier=CACHE)
        acc_r = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :],
                        mask=mask_h[:, None], other=0.0,
                        cache_modifier=CACHE)  # [BLOCK_H, BLOCK_D]
        # several tokens: a row may have seen no key of this split (m_r = -inf)
        m, l, acc = _merge_row(m, l, acc, m_r, l_r, acc_r, Q_LEN > 1)
    return m, l, acc


@triton.jit
def _store_merged(out_ptrs, lse_ptrs, sinks_ptr, heads, mask_h, mask_hd, m, l, acc,
                  Q_LEN: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr):
    """The epilogue of a merge (:func:`_merge_group_rows`): the sink folded in (once, after
    every row), ``out = acc / l`` and the LSE. Padding rows of the tile stay finite (never
    stored); with several query tokens, a token that saw no key gets 0."""
    if HAS_SINKS:
        m, l, acc = _add_sink(m, l, acc, sinks_ptr, heads, mask_h)
    l = tl.where(mask_h & (l > 0), l, 1.0) if Q_LEN > 1 else tl.where(mask_h, l, 1.0)
    tl.store(out_ptrs, (acc / l[:, None]).to(out_ptrs.dtype.element_ty), mask=mask_hd)
    if HAS_LSE:
        tl.store(lse_ptrs, _natural_lse(m, l), mask=mask_h)


@triton.jit
def _store_empty(out_ptrs, lse_ptrs, sinks_ptr, heads, mask_h, mask_hd, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr):
    """The result of a sequence without keys for the tile's rows: out 0, and LSE ``-inf``
    (the sink's logit with ``HAS_SINKS``: the denominator is the sink alone)."""
    tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(out_ptrs.dtype.element_ty),
             mask=mask_hd)
    if HAS_LSE:
        if HAS_SINKS:
            tl.store(lse_ptrs, tl.load(sinks_ptr + heads, mask=mask_h, other=0.0), mask=mask_h)
        else:
            tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=mask_h)


@triton.jit
def _arrive(arrivals_ptr, b, kv_head, num_kv_heads, n_rows):
    """A folded merge's arrival (``FOLD_MERGE``), after a unit has stored its partial: the
    CTA barrier orders every thread's stores before one ``acq_rel`` atomic increment of the
    (sequence, kv head)'s counter at GPU scope (the release publishes the partial to the
    other programs; the acquire, in the last arrival, makes theirs visible to it). Returns
    whether this unit arrived last; that unit also resets the counter to 0, so the next
    launch (a graph replay too) finds it zeroed and needs no fill."""
    tl.debug_barrier()
    counter = arrivals_ptr + b * num_kv_heads + kv_head
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_rows - 1
    if last:  # every other unit of the pair has arrived: nothing else touches it this launch
        tl.store(counter, 0)
    return last


@triton.jit
def _empty_seq_result(out_ptr, lse_ptr, sinks_ptr, context_lens_ptr, u, batch, num_kv_heads,
                      group, num_q_heads, stride_ctx, capacity, stride_o_b, stride_o_t,
                      stride_o_h, stride_o_d, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr, Q_LEN: tl.constexpr, HAS_SINKS: tl.constexpr,
                      HAS_LSE: tl.constexpr):
    """A folded merge's empty sequences (``FOLD_MERGE``: no merge kernel runs, and an empty
    sequence has no unit): program ``u < batch · num_kv_heads`` writes the result of
    (sequence ``u // num_kv_heads``, kv head ``u % num_kv_heads``) when that sequence is
    empty (:func:`_store_empty`), as the merge kernel would."""
    if u < batch * num_kv_heads:  # noqa: SIM102 (the length is loaded for a real pair only)
        b = u // num_kv_heads
        if _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity) == 0:
            offs_d = tl.arange(0, BLOCK_D)
            q_tok, heads, mask_h, _ = _tile_rows(tl.arange(0, BLOCK_H), u % num_kv_heads,
                                                 group, 0, Q_LEN)
            mask_hd = mask_h[:, None] & _dim_mask(offs_d, HEAD_DIM, BLOCK_D)[None, :]
            out_ptrs = _tile_ptrs(out_ptr, b, q_tok, heads, offs_d, stride_o_b, stride_o_t,
                                  stride_o_h, stride_o_d, Q_LEN)
            lse_ptrs = _lse_ptrs(lse_ptr, b, q_tok, heads, num_q_heads, Q_LEN)
            _store_empty(out_ptrs, lse_ptrs, sinks_ptr, heads, mask_h, mask_hd, BLOCK_H,
                         BLOCK_D, HAS_SINKS, HAS_LSE)


@triton.jit
def _seq_rows(seq_rows_ptr, b):
    """A merge's split rows of sequence ``b``: ``(start, n_rows)``, which the main kernel
    writes for every sequence (:func:`_empty_seq_rows` for an empty one)."""
    start = tl.load(seq_rows_ptr + b * 2)
    n_rows = tl.load(seq_rows_ptr + b * 2 + 1)
    return start, n_rows


@triton.jit
def _empty_seq_rows(seq_rows_ptr, context_lens_ptr, u, batch, stride_ctx, capacity):
    """Program ``u < batch`` of a split launch writes ``(0, 0)`` as sequence ``u``'s merge
    rows when the sequence is empty: no unit of its own writes that entry, and the merges
    load every sequence's entry beside its length (one round of loads), so the entry is
    never uninitialized memory (initcheck) and a fresh workspace needs no fill kernel."""
    if u < batch:  # noqa: SIM102 (the length is loaded only for a real sequence)
        if _clamped_context_len(context_lens_ptr, u, stride_ctx, capacity) == 0:
            tl.store(seq_rows_ptr + u * 2, 0)
            tl.store(seq_rows_ptr + u * 2 + 1, 0)


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
