"""The persistent, byte-balanced schedule of the production kernel (``PERSISTENT``).

The split schedule (:mod:`pagedattn.kernels.decode`) cuts each sequence into near-equal
splits and launches one program per (split, kv head): a wave of units with a ramp and a tail,
and a merge after them. Here a fixed number of programs ``P`` (``num_programs``: a few per SM)
shares the step's K/V bytes instead, stream-K style (LeanAttention, Sanovar et al. 2024;
FlashMLA's tile scheduler):

* **Work.** The step's ``BLOCK_N``-token tiles in one line, sequence-major, then kv head:
  segment ``(b, kv head)`` holds ``n_b = ceil(len_b / BLOCK_N)`` tiles (with a window, the
  tiles of the visible keys, :func:`~pagedattn.kernels.paging._visible_tokens`), and the
  line holds ``T = num_kv_heads · Σ_b n_b`` of them. Every tile reads the same bytes, so an
  equal share of tiles is an equal share of bytes.
* **Shares.** Program ``p`` takes tiles ``[⌊p·T/P'⌋, ⌊(p+1)·T/P'⌋)`` with ``P' = min(P, T)``
  (a program past ``P'`` has nothing to read): shares differ by at most one tile and cross
  sequence and kv-head boundaries. ``T`` is a scan of ``context_lens`` on the device at every
  launch (no host sync: one plan serves every layer and CUDA-graph replays, and lengths
  updated in place are honoured).
* **Pieces.** A program walks its share one segment at a time: each piece is the token loop
  of :func:`~pagedattn.kernels.steps._attend_tiles` over the piece's tiles. A piece that is a
  whole segment writes the result. Otherwise the piece is the first or the last of the
  program's share (a share's middle pieces are whole segments), so it stores its partial
  ``(m, l, acc)`` in the program's slot ``2p`` (first) or ``2p + 1`` (last).
* **Merge, in the same launch.** After storing a partial, a program counts itself in at the
  segment's arrival counter (:func:`~pagedattn.kernels.merge._arrive`: a CTA barrier, one
  ``acq_rel`` atomic at GPU scope). The programs of a segment are ``owner(first tile) ..
  owner(last tile)``, known from ``T`` and ``P'`` alone, so the one that arrives last knows it
  is last, merges the segment's slots in program order (:func:`_merge_slots`, ``BLOCK_R``
  slots a load round, ``.cg`` loads from L2) and resets the counter to 0 for the next launch.
  No program ever waits for another: the kernel runs under the interpreter, and cannot hang
  when fewer programs are resident than launched.
* **Empty sequences** hold no tile: program ``p`` writes the result (0, and LSE ``-inf`` or the
  sink) of each empty sequence ``b`` with ``b % P == p``, found in its scan of the lengths.

Everything else (dtypes, fp8 scales, layouts, the variants, multi-token rows, LSE) is the
split schedule's own code: the same token loop and epilogues.
"""

import triton
import triton.language as tl

from pagedattn.kernels.merge import _arrive, _empty_seq_result, _store_merged
from pagedattn.kernels.paging import (
    _clamped_context_len,
    _dim_mask,
    _visible_tokens,
    _window_first,
)
from pagedattn.kernels.softmax import LOG2E, _rescale
from pagedattn.kernels.steps import (
    _attend_tiles,
    _kv_scales,
    _load_latent_query,
    _load_query,
    _lse_ptrs,
    _store_result,
    _tile_ptrs,
    _tile_rows,
)


@triton.jit
def _tile_int(x, TILES_I64: tl.constexpr):
    """``x`` in the dtype of tile indices: int32, or int64 where the launcher found that
    ``T · P`` may pass 2^31 (``TILES_I64``). int32 keeps 64-bit divisions (a subroutine call
    on the GPU) out of the piece loop, which took 7 registers more and 33 spill instructions
    in the token loop at four programs per SM (docs/perf-notes.md)."""
    if TILES_I64:
        return x.to(tl.int64)
    else:
        return x.to(tl.int32)


@triton.jit
def _seq_tiles(n, window_left, Q_LEN: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_WINDOW: tl.constexpr):
    """Tiles of a segment of ``n`` clamped keys (vector or scalar): the visible keys' with a
    window (from its first key rounded down to a tile, as the split schedule walks them)."""
    if HAS_WINDOW:
        _, n = _visible_tokens(n, window_left, Q_LEN, BLOCK_N)
    return tl.cdiv(n, BLOCK_N)


@triton.jit
def _scan_lengths(context_lens_ptr, b0, batch, stride_ctx, capacity, BLOCK_B: tl.constexpr):
    """``BLOCK_B`` clamped lengths from sequence ``b0`` (0 past the batch) and their mask."""
    offs_b = b0 + tl.arange(0, BLOCK_B)
    valid = offs_b < batch
    n = tl.load(context_lens_ptr + offs_b * stride_ctx, mask=valid, other=0)
    return offs_b, valid, tl.minimum(tl.maximum(n, 0), capacity).to(tl.int32)


@triton.jit
def _total_tiles(context_lens_ptr, out_ptr, lse_ptr, sinks_ptr, p, num_programs, batch,
                 num_kv_heads, group, stride_ctx, capacity, window_left, stride_o_b,
                 stride_o_t, stride_o_h, stride_o_d, HEAD_DIM: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_N: tl.constexpr, Q_LEN: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, TILES_I64: tl.constexpr):
    """``T``, the step's tiles over every (sequence, kv head) (:func:`_tile_int`), from one scan of
    ``context_lens``; on the way, program ``p`` writes the result of each empty sequence ``b``
    with ``b % num_programs == p`` (it holds no tile, so no piece writes it)."""
    total = _tile_int(tl.full([], 0, tl.int32), TILES_I64)
    for b0 in range(0, batch, BLOCK_B):
        offs_b, valid, n = _scan_lengths(context_lens_ptr, b0, batch, stride_ctx, capacity,
                                         BLOCK_B)
        total += tl.sum(_tile_int(_seq_tiles(n, window_left, Q_LEN, BLOCK_N, HAS_WINDOW),
                                  TILES_I64))
        mine = valid & (n == 0) & (offs_b % num_programs == p)
        while tl.sum(mine.to(tl.int32)) > 0:  # rare: padding rows of a batch bucket
            b = tl.min(tl.where(mine, offs_b, batch))
            for kv_head in range(0, num_kv_heads):
                _empty_seq_result(out_ptr, lse_ptr, sinks_ptr, context_lens_ptr,
                                  b * num_kv_heads + kv_head, batch, num_kv_heads, group,
                                  num_kv_heads * group, stride_ctx, capacity, stride_o_b,
                                  stride_o_t, stride_o_h, stride_o_d, HEAD_DIM, BLOCK_H,
                                  BLOCK_D, Q_LEN, HAS_SINKS, HAS_LSE)
            mine = mine & (offs_b != b)
    return total * num_kv_heads


@triton.jit
def _locate_tile(context_lens_ptr, t, batch, num_kv_heads, stride_ctx, capacity, window_left,
                 BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, Q_LEN: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, TILES_I64: tl.constexpr):
    """The sequence ``b`` whose segments hold linear tile ``t`` and the line's first tile of
    that sequence, ``base = num_kv_heads · Σ_{b' < b} n_b'`` (:func:`_tile_int`); empty sequences
    before it are passed over (they end where they start)."""
    b = tl.full([], 0, tl.int32)
    base = _tile_int(tl.full([], 0, tl.int32), TILES_I64)
    running = _tile_int(tl.full([], 0, tl.int32), TILES_I64)
    for b0 in range(0, batch, BLOCK_B):
        _, valid, n = _scan_lengths(context_lens_ptr, b0, batch, stride_ctx, capacity, BLOCK_B)
        tiles = _tile_int(_seq_tiles(n, window_left, Q_LEN, BLOCK_N, HAS_WINDOW),
                          TILES_I64) * num_kv_heads
        ends = running + tl.cumsum(tiles, axis=0)
        before = (ends <= t) & valid
        b += tl.sum(before.to(tl.int32))
        base = tl.maximum(base, tl.max(tl.where(before, ends, 0)))
        running += tl.sum(tiles)
    return b, base


@triton.jit
def _owner(t, total, programs):
    """The program whose share holds linear tile ``t``: the largest ``p`` with ``⌊p·T/P'⌋ ≤
    t``, i.e. ``⌈(t + 1)·P'/T⌉ - 1``."""
    return ((t + 1) * programs - 1) // total


@triton.jit
def _store_slot(part_ml_ptr, part_acc_ptr, slot, offs_h, mask_h, offs_d, m, l, acc, v_scale,
                rows_per_slot, BLOCK_D: tl.constexpr):
    """A piece's partial ``(m, l, acc · v_scale)`` in workspace slot ``slot``: its
    ``rows_per_slot = Q_LEN · group`` tile rows (padding rows are not stored)."""
    row = slot.to(tl.int64) * rows_per_slot + offs_h  # [BLOCK_H]
    tl.store(part_ml_ptr + row * 2, m, mask=mask_h)
    tl.store(part_ml_ptr + row * 2 + 1, l, mask=mask_h)
    tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc * v_scale,
             mask=mask_h[:, None])


@triton.jit
def _merge_slots(part_ml_ptr, part_acc_ptr, p_first, slot_first, count, rows_per_slot, offs_hm,
                 mask_hm, offs_d, BLOCK_R: tl.constexpr, BLOCK_HM: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """The merge of one segment's pieces: programs ``p_first .. p_first + count - 1``, in
    program order, the first one's in slot ``2·p_first + slot_first`` (its share began before
    the segment: the segment is its last piece) and every other's in its first slot.
    ``BLOCK_R`` slots of ``BLOCK_HM`` rows a load round (no chain of dependent loads), from L2
    (``.cg``: other programs wrote them during this launch). A row that saw no key of a piece
    (``m = -inf``: several query tokens) weighs 0. Returns ``(m, l, acc)`` ``[BLOCK_HM]``,
    ``[BLOCK_HM]``, ``[BLOCK_HM, BLOCK_D]``."""
    m = tl.full([BLOCK_HM], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_HM], tl.float32)
    acc = tl.zeros([BLOCK_HM, BLOCK_D], tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    for i0 in range(0, count, BLOCK_R):
        i = i0 + offs_r
        slot = 2 * (p_first + i).to(tl.int64) + tl.where(i == 0, slot_first, 0)  # [BLOCK_R]
        row = slot[:, None] * rows_per_slot + offs_hm[None, :]  # [BLOCK_R, BLOCK_HM]
        mask = (i < count)[:, None] & mask_hm[None, :]
        m_r = tl.load(part_ml_ptr + row * 2, mask=mask, other=float("-inf"),
                      cache_modifier=".cg")
        l_r = tl.load(part_ml_ptr + row * 2 + 1, mask=mask, other=0.0, cache_modifier=".cg")
        acc_r = tl.load(part_acc_ptr + row[:, :, None] * BLOCK_D + offs_d[None, None, :],
                        mask=mask[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(m_r, axis=0))
        alpha = _rescale(m, m_new)
        w = _rescale(m_r, m_new[None, :])  # 0 for a masked or empty row
        l = l * alpha + tl.sum(l_r * w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(acc_r * w[:, :, None], axis=0)
        m = m_new
    return m, l, acc


@triton.jit
def _persistent_program(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, lse_ptr, part_ml_ptr, part_acc_ptr, counters_ptr,
    k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale, k_scale_val, v_scale_val,
    scale_log2, sinks_ptr, alibi_ptr, window_left, softcap, stride_q_t, stride_o_t,
    batch, num_kv_heads, group, max_pages,
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_b, stride_bt_p, stride_ctx,
    stride_o_b, stride_o_h, stride_o_d, num_pages,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_POW2_SCALE: tl.constexpr,
    SCALE_FROM_PTR: tl.constexpr, HAS_LSE: tl.constexpr, Q_LEN: tl.constexpr,
    VARIANTS: tl.constexpr, FP8_V_PAIRS: tl.constexpr, ASM: tl.constexpr,
    LEAN_SOFTMAX: tl.constexpr, SLOT_OFFSETS_I32: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HM: tl.constexpr, TILES_I64: tl.constexpr,
    MLA: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_DR: tl.constexpr, q_pe_ptr, stride_qpe_b,
    stride_qpe_t, stride_qpe_h, stride_qpe_d,
):
    """One program of the persistent schedule (see the module docstring): its share of the
    step's tiles, piece by piece, each piece's result or partial, and the merges of the
    segments whose last piece it finishes."""
    HAS_WINDOW: tl.constexpr = VARIANTS.HAS_WINDOW
    HAS_SINKS: tl.constexpr = VARIANTS.HAS_SINKS
    HAS_ALIBI: tl.constexpr = VARIANTS.HAS_ALIBI
    p = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_q_heads = num_kv_heads * group
    capacity = max_pages * PAGE_SIZE * (num_pages > 0)  # no page: every length clamps to 0
    total = _total_tiles(context_lens_ptr, out_ptr, lse_ptr, sinks_ptr, p, num_programs, batch,
                         num_kv_heads, group, stride_ctx, capacity, window_left, stride_o_b,
                         stride_o_t, stride_o_h, stride_o_d, HEAD_DIM, BLOCK_H, BLOCK_D,
                         BLOCK_B, BLOCK_N, Q_LEN, HAS_WINDOW, HAS_SINKS, HAS_LSE, TILES_I64)
    # P' = min(P, T): every share holds a tile
    programs = tl.minimum(total, _tile_int(num_programs, TILES_I64))
    if p < programs:
        t0 = p * total // programs
        t1 = (p + 1) * total // programs
        b, base = _locate_tile(context_lens_ptr, t0, batch, num_kv_heads, stride_ctx, capacity,
                               window_left, BLOCK_B, BLOCK_N, Q_LEN, HAS_WINDOW, TILES_I64)
        ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity)
        n_tiles = _seq_tiles(ctx, window_left, Q_LEN, BLOCK_N, HAS_WINDOW)
        kv_head = ((t0 - base) // n_tiles).to(tl.int32)
        j0 = ((t0 - base) % n_tiles).to(tl.int32)  # the piece's first tile in its segment

        offs_h = tl.arange(0, BLOCK_H)
        offs_hm = tl.arange(0, BLOCK_HM)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
        rows_per_slot = Q_LEN * group
        t = t0
        while t < t1:
            j1 = tl.minimum(n_tiles, j0 + (t1 - t)).to(tl.int32)
            win_first = ctx
            first = 0
            if HAS_WINDOW:
                win_first = _window_first(ctx, window_left, Q_LEN)
                first, n_visible = _visible_tokens(ctx, window_left, Q_LEN, BLOCK_N)
            tok_start = first + j0 * BLOCK_N
            tok_end = tl.minimum(first + j1 * BLOCK_N, ctx)

            q_tok, heads, mask_h, q_pos = _tile_rows(offs_h, kv_head, group, ctx, Q_LEN)
            q_ptrs = _tile_ptrs(query_ptr, b, q_tok, heads, offs_d, stride_q_b, stride_q_t,
                                stride_q_h, stride_q_d, Q_LEN)
            mask_hd = mask_h[:, None] & mask_d[None, :]
            k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, stride_k_scale,
                                          stride_v_scale, k_scale_val, v_scale_val, kv_head,
                                          SCALE_FROM_PTR)
            qpe_dot = 0.0  # MLA: the query's rope part (the split kernel's, kernels/decode)
            if MLA:
                offs_r = tl.arange(0, BLOCK_DR)
                q_dot, qpe_dot, qk_scale = _load_latent_query(
                    q_ptrs, _tile_ptrs(q_pe_ptr, b, q_tok, heads, offs_r, stride_qpe_b,
                                       stride_qpe_t, stride_qpe_h, stride_qpe_d, Q_LEN),
                    mask_hd, mask_h[:, None] & _dim_mask(offs_r, ROPE_DIM, BLOCK_DR)[None, :],
                    scale_log2, k_scale, BLOCK_H, DOT_DTYPE, Q_POW2_SCALE)
            else:
                q_dot, qk_scale = _load_query(q_ptrs, mask_hd, scale_log2, k_scale, BLOCK_H,
                                              DOT_DTYPE, Q_POW2_SCALE)
            alibi2 = 0.0
            if HAS_ALIBI:  # slopes in the exp2 domain, per row
                alibi2 = tl.load(alibi_ptr + heads, mask=mask_h, other=0.0) * LOG2E
            m, l, acc = _attend_tiles(
                q_dot, qk_scale, alibi2, qpe_dot, key_cache_ptr, value_cache_ptr,
                block_tables_ptr, b, kv_head, kv_head.to(tl.int64) * stride_k_head,
                kv_head.to(tl.int64) * stride_v_head, tok_start, tok_end, ctx, q_pos,
                win_first, window_left, softcap, offs_n, offs_d, mask_d, stride_k_page,
                stride_k_tok, stride_k_head, stride_k_d, stride_v_page, stride_v_tok,
                stride_v_head, stride_v_d, stride_bt_b, stride_bt_p, num_pages,
                HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_N, PAGE_SIZE, DOT_DTYPE, DOT_PRECISION, Q_LEN, VARIANTS, FP8_V_PAIRS, ASM,
                LEAN_SOFTMAX, SLOT_OFFSETS_I32, MLA, ROPE_DIM, BLOCK_DR)

            if (j0 == 0) & (j1 == n_tiles):  # the whole segment: the result, the sink once
                _store_result(out_ptr, lse_ptr, sinks_ptr, b, q_tok, heads, mask_h, offs_d,
                              mask_hd, m, l, acc, v_scale, num_q_heads, stride_o_b,
                              stride_o_t, stride_o_h, stride_o_d, Q_LEN, HAS_SINKS, HAS_LSE,
                              False)
            else:  # the share's first piece in slot 2p, its last in 2p + 1
                _store_slot(part_ml_ptr, part_acc_ptr, 2 * p + (t != t0).to(tl.int32), offs_h,
                            mask_h, offs_d, m, l, acc, v_scale, rows_per_slot, BLOCK_D)
                seg = base + kv_head * n_tiles  # the segment's first tile
                p_first = _owner(seg, total, programs)
                count = _owner(seg + n_tiles - 1, total, programs) - p_first + 1
                if _arrive(counters_ptr, b, kv_head, num_kv_heads, count.to(tl.int32)):
                    slot_first = (p_first * total // programs < seg).to(tl.int32)
                    m_m, l_m, acc_m = _merge_slots(
                        part_ml_ptr, part_acc_ptr, p_first, slot_first, count.to(tl.int32),
                        rows_per_slot, offs_hm, offs_hm < rows_per_slot, offs_d, BLOCK_R,
                        BLOCK_HM, BLOCK_D)
                    q_tok_m, heads_m, mask_hm, q_pos_m = _tile_rows(offs_hm, kv_head, group,
                                                                    ctx, Q_LEN)
                    _store_merged(_tile_ptrs(out_ptr, b, q_tok_m, heads_m, offs_d, stride_o_b,
                                             stride_o_t, stride_o_h, stride_o_d, Q_LEN),
                                  _lse_ptrs(lse_ptr, b, q_tok_m, heads_m, num_q_heads, Q_LEN),
                                  sinks_ptr, heads_m, mask_hm,
                                  mask_hm[:, None] & mask_d[None, :], m_m, l_m, acc_m,
                                  Q_LEN, HAS_SINKS, HAS_LSE)
            t += j1 - j0
            # the next segment: the next kv head, or the next sequence that holds keys
            j0 = tl.full([], 0, tl.int32)
            kv_head += 1
            if (kv_head == num_kv_heads) & (t < t1):
                kv_head = tl.full([], 0, tl.int32)
                base += _tile_int(n_tiles, TILES_I64) * num_kv_heads
                b += 1
                ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity)
                n_tiles = _seq_tiles(ctx, window_left, Q_LEN, BLOCK_N, HAS_WINDOW)
                while n_tiles == 0:  # t < t1: a sequence that holds keys follows
                    b += 1
                    ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity)
                    n_tiles = _seq_tiles(ctx, window_left, Q_LEN, BLOCK_N, HAS_WINDOW)
