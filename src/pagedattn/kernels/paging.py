"""Where a program's keys are: ``@triton.jit`` helpers for sequence lengths, the block table,
head dims, sliding windows and the device-side split of the context into units.

Addressing (in the style of attention-gym's pointer helpers):

* ``_clamped_context_len``: a sequence's length, clamped to ``[0, max_pages * page_size]`` so a
  kernel never dereferences block-table entries past the table (lengths are not validated on
  the device in the hot path; see ``pagedattn._validation``).
* ``_page_ids`` / ``_kv_token_offsets``: physical pages and element offsets of tokens through
  the block table, in 64-bit (``page_id * stride_page`` passes 2^31 on large caches).
* ``_dim_mask``: the mask of the real head dims, a constant splat when ``head_dim`` is a power
  of two.
* ``_program_sequence``: a ``(batch, heads)`` grid program's sequence, head and clamped length.
* ``_window_first`` / ``_visible_tokens``: the keys a sliding window leaves visible, in whole
  tiles.

The split planner of the production kernel (:mod:`pagedattn.kernels.decode`), in the order a
unit runs it: ``_plan_unit`` (the batch's split size, ``_batch_chunk`` over
``_total_and_max_tokens``, and the row's sequence, ``_locate_row`` with ``_chunk_of``), then
``_unit_tokens`` (the row's token range). The scans read ``context_lens`` on the device at
every launch, so one plan serves every layer and lengths updated in place are honoured.

Nothing here imports another kernels module; :mod:`pagedattn.kernels.steps` builds on it.
"""

import triton
import triton.language as tl


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
    so a quarter of the resident programs: docs/perf-notes.md); keys before the window in
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


# ---- the split planner: which sequence and tokens a unit row owns ----


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
