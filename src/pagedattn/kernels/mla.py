"""The MLA decode kernel: absorbed multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2)
over a paged latent cache, a kernel of its own designed for its roofline. With 128 query
heads (TP1) every latent byte feeds about 256 FLOPs, past the H100/H200 ridge: the kernel is
bound by the tensor cores, and its tiles are sized for them.

**Rows.** A program owns ``BLOCK_H`` query rows of one sequence: ``Q_LEN`` tokens times
``HEADS`` query heads of one head block (row ``i`` is token ``i // HEADS``, head ``head0 + i %
HEADS``), 64 on Hopper: one wgmma M per warpgroup. Every head reads the same latent, so the
rows share each latent tile.

**Tiles.** ``BLOCK_N`` tokens a tile (64 on Hopper): the ``[BLOCK_N, latent]`` tile is loaded
once and is both the key (``S = q_nope · ckvᵀ + q_pe · kpeᵀ``) and the value (``O += P ·
ckv``). At eight warps Triton lays the ``[64, 512]`` fp32 accumulator out as two warpgroups
of 256 columns each (the output split by columns, as FlashMLA and TileLang's ``FullCol``).
The tile loop is pipelined (``num_stages`` 2: the gathers become ``cp.async``). Full tiles
that every row sees in full run **unmasked** (no mask, no clamp: one FMA and ``exp2`` a
score); only the sequence's last tile or two, which hold the tail and the causal edge of a
multi-token query, are masked.

**Schedule: balanced parts** (FlashMLA's rule). The grid is ``(NUM_PARTS, head blocks)``,
one program per SM. A sequence costs its ``BLOCK_N``-token tiles plus ``OVERHEAD`` tiles (its
epilogue); each part takes an equal share of the batch's total cost, cutting sequences where
the share ends. Every part finds its share by a vector scan of ``context_lens`` on the device
(no host sync; a plan is CUDA-graph safe). A sequence that lies wholly in one part is
finished there (the output and LSE written); a cut sequence leaves one normalized partial
``(o, log2 LSE)`` per part in the workspace (a part's first sequence in slot 0, its last in
slot 1), and :func:`_mla_merge_kernel` combines them (the log-sum-exp merge of
Flash-Decoding).

**Numbers.** Scores in the exp2 domain (``scale · log2 e`` folded into one multiply); fp8
latents dot in fp16 (converted in registers, exact; the query scaled per row into fp16's
range by a power of two), fp32 in split bf16. Variants: soft-cap, sinks and LSE are constexpr
flags that leave no code when off.

**Bounds.** Lengths are clamped to the table's capacity and page ids to the cache, both
reported (:mod:`pagedattn.kernels.errors`); a tile's tokens past the length read the last
token's row: whatever the metadata says, the kernel reads and writes inside its tensors.

Builds on :mod:`pagedattn.kernels.softmax`, ``paging``, ``steps`` (the query load, the sink)
and ``errors``; the launcher is :mod:`pagedattn.launch.mla`.
"""

import triton
import triton.language as tl

from pagedattn.kernels.errors import BLOCK_TABLES, CONTEXT_LENS, _checked_page_ids, _report
from pagedattn.kernels.paging import _dim_mask
from pagedattn.kernels.softmax import (
    _merge_row,
    _natural_lse,
    _normalize,
    _probs,
    _rescale,
    _soft_cap,
)
from pagedattn.kernels.steps import _add_sink, _load_latent_query


@triton.jit
def _mla_costs(context_lens_ptr, stride_ctx, batch, capacity, BLOCK_N: tl.constexpr,
               OVERHEAD: tl.constexpr, BLOCK_B: tl.constexpr):
    """The batch's total cost in tiles (each sequence: its ``BLOCK_N``-token tiles plus
    ``OVERHEAD``) over lengths clamped to ``[0, capacity]``, and the first
    sequence whose length was clamped (``-1``: none) with its raw length."""
    total = 0
    bad = -1
    bad_len = tl.zeros([], tl.int64)
    for b0 in range(0, batch, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        valid = offs_b < batch
        raw = tl.load(context_lens_ptr + offs_b * stride_ctx, mask=valid, other=0)
        n = tl.minimum(tl.maximum(raw, 0), capacity).to(tl.int32)
        total += tl.sum(tl.where(valid, tl.cdiv(n, BLOCK_N) + OVERHEAD, 0))
        wrong = valid & (n != raw)
        first = tl.min(tl.where(wrong, offs_b, 2147483647))
        first_len = tl.sum(tl.where(offs_b == first, raw, 0).to(tl.int64))
        take = (bad < 0) & (first < 2147483647)
        bad_len = tl.where(take, first_len, bad_len)
        bad = tl.where(take, first, bad)
    return total, bad, bad_len


@triton.jit
def _mla_locate(context_lens_ptr, stride_ctx, batch, capacity, at, BLOCK_N: tl.constexpr,
                OVERHEAD: tl.constexpr, BLOCK_B: tl.constexpr):
    """The sequence whose cost range holds tile ``at`` of the batch's cost, and where that
    range starts: ``(b, start)`` (``b = batch`` when ``at`` is past the total)."""
    b = 0
    start = 0
    running = 0
    for b0 in range(0, batch, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        valid = offs_b < batch
        n = tl.minimum(tl.maximum(tl.load(context_lens_ptr + offs_b * stride_ctx, mask=valid,
                                          other=0), 0), capacity).to(tl.int32)
        cost = tl.where(valid, tl.cdiv(n, BLOCK_N) + OVERHEAD, 0)
        ends = running + tl.cumsum(cost, axis=0)
        before = (ends <= at) & valid
        b += tl.sum(before.to(tl.int32))
        start = tl.maximum(start, tl.max(tl.where(before, ends, 0)))
        running += tl.sum(cost)
    return b, start


@triton.jit
def _mla_part(context_lens_ptr, stride_ctx, batch, capacity, part, errors_ptr, may_report,
              BLOCK_N: tl.constexpr, NUM_PARTS: tl.constexpr, OVERHEAD: tl.constexpr,
              BLOCK_B: tl.constexpr):
    """Part ``part``'s share of the batch's cost: ``(lo, hi, b, start, share)``, its cost
    range ``[lo, hi)``, the sequence holding ``lo`` and where that sequence's range starts,
    and the share every part takes. Part 0 reports the first length outside ``[0,
    capacity]`` when ``may_report`` (one program of the grid)."""
    total, bad, bad_len = _mla_costs(context_lens_ptr, stride_ctx, batch, capacity, BLOCK_N,
                                     OVERHEAD, BLOCK_B)
    _report(errors_ptr, (part == 0) & may_report & (bad >= 0), CONTEXT_LENS, bad, bad_len)
    share = tl.cdiv(total, NUM_PARTS)
    lo = part * share
    hi = tl.minimum(lo + share, total)
    b, start = _mla_locate(context_lens_ptr, stride_ctx, batch, capacity, lo, BLOCK_N,
                           OVERHEAD, BLOCK_B)
    return lo, hi, b, start, share


@triton.jit
def _mla_tiles(acc, m_i, l_i, q, qr, qk_scale, pos, lo, hi, seq_len, softcap, ckv_ptr, kpe_ptr,
               bt_row_ptr, stride_bt_p, num_pages, page_bad, offs_n, offs_d, offs_r, mask_d,
               mask_r, stride_c_page, stride_c_tok, stride_c_d, stride_r_page, stride_r_tok,
               stride_r_d, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               ROPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """Latent tiles ``[lo, hi)`` (multiples of ``BLOCK_N``) folded into the rows' state
    ``(acc, m_i, l_i)``. ``MASKED``: row ``i`` sees the tokens ``t <= pos[i]`` below
    ``seq_len``, and a token at or past ``seq_len`` reads the last token's row; unmasked:
    every row sees every token (the caller guarantees it), so no mask or clamp is formed."""
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + offs_n  # [BLOCK_N]
        if MASKED:
            tok_ld = tl.minimum(tok, seq_len - 1)
        else:
            tok_ld = tok
        if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page: one page id, a scalar
            raw = tl.load(bt_row_ptr + (n0 // PAGE_SIZE) * stride_bt_p)
            page, bad = _checked_page_ids(raw, num_pages)
            page_bad = page_bad | bad
        else:  # a page id per token
            raw = tl.load(bt_row_ptr + (tok_ld // PAGE_SIZE) * stride_bt_p)
            page, bad = _checked_page_ids(raw, num_pages)
            page_bad = page_bad | (tl.max(bad.to(tl.int32), axis=0) > 0)
        slot = (tok_ld % PAGE_SIZE).to(tl.int64)
        c_off = page * stride_c_page + slot * stride_c_tok  # [BLOCK_N]
        ckv = tl.load(ckv_ptr + c_off[:, None] + offs_d[None, :] * stride_c_d,
                      mask=mask_d[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(ckv), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        if ROPE:
            r_off = page * stride_r_page + slot * stride_r_tok
            kpe = tl.load(kpe_ptr + r_off[:, None] + offs_r[None, :] * stride_r_d,
                          mask=mask_r[None, :], other=0.0).to(DOT_DTYPE)
            qk = tl.dot(qr, tl.trans(kpe), qk, input_precision=DOT_PRECISION)
        s = qk * qk_scale[:, None]
        if HAS_SOFTCAP:
            s = _soft_cap(s, softcap)
        if MASKED:
            seen = (tok[None, :] <= pos[:, None]) & (tok < seq_len)[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = _rescale(m_i, m_new)
            p = _probs(s, m_new[:, None])
        else:  # every row sees every token: finite scores, one exp2 each
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(tl.minimum(s - m_new[:, None], 0.0))
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), ckv,
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i, page_bad


@triton.jit(do_not_specialize=["batch", "num_pages", "max_pages", "stride_q_b", "stride_o_b",
                               "stride_bt_b"])
def _mla_decode_kernel(
    q_ptr, qpe_ptr, ckv_ptr, kpe_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
    part_o_ptr, part_lse_ptr,  # the workspace: [NUM_PARTS, 2, rows, BLOCK_D], [.., rows]
    pieces_ptr,  # [batch, 2] int32: each sequence's first part and its number of pieces
    errors_ptr, kv_scale_ptr, kv_scale_val, scale_log2, sinks_ptr, softcap,
    batch, num_pages, max_pages, num_q_heads,
    stride_q_b, stride_q_t, stride_q_h, stride_q_d,
    stride_qr_b, stride_qr_t, stride_qr_h, stride_qr_d,
    stride_c_page, stride_c_tok, stride_c_d,
    stride_r_page, stride_r_tok, stride_r_d,
    stride_bt_b, stride_bt_p, stride_ctx,
    stride_o_b, stride_o_t, stride_o_h, stride_o_d,
    LATENT_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_DR: tl.constexpr, Q_LEN: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # rows a program: Q_LEN x HEADS, padded to a power of two
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_PARTS: tl.constexpr,
    OVERHEAD: tl.constexpr, BLOCK_B: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_POW2_SCALE: tl.constexpr,
    SCALE_FROM_PTR: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    part = tl.program_id(0)
    hb = tl.program_id(1)
    capacity = max_pages * PAGE_SIZE * (num_pages > 0)  # no page: every length clamps to 0
    lo, hi, b, start, share = _mla_part(context_lens_ptr, stride_ctx, batch, capacity, part,
                                        errors_ptr, hb == 0, BLOCK_N, NUM_PARTS, OVERHEAD,
                                        BLOCK_B)

    offs_m = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_DR)
    tok_i = offs_m // HEADS  # the row's query token
    heads = hb * HEADS + offs_m % HEADS
    mask_m = offs_m < Q_LEN * HEADS
    mask_d = _dim_mask(offs_d, LATENT_DIM, BLOCK_D)
    mask_r = offs_r < ROPE_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    rows = Q_LEN * num_q_heads  # a sequence's rows in the workspace and the LSE
    row_ids = tok_i * num_q_heads + heads  # [BLOCK_H]
    if SCALE_FROM_PTR:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
    else:
        kv_scale = kv_scale_val
    bad_row = -1  # the first sequence with a page id outside the cache
    while (b < batch) & (start < hi):
        raw_len = tl.load(context_lens_ptr + b * stride_ctx)
        seq_len = tl.minimum(tl.maximum(raw_len, 0), capacity).to(tl.int32)
        tiles = tl.cdiv(seq_len, BLOCK_N)
        t_lo = tl.maximum(lo - start, 0)
        t_hi = tl.minimum(hi - start, tiles)
        whole = (t_lo == 0) & (t_hi == tiles)
        if (start >= lo) & (hb == 0):  # this part owns the sequence's start: its pieces
            # the first piece's slot (this part's slot 0 when the sequence starts its share,
            # else slot 1: its last sequence), and how many parts hold a piece
            tl.store(pieces_ptr + 2 * b, part * 2 + (start > lo).to(tl.int32))
            tl.store(pieces_ptr + 2 * b + 1,
                     tl.where(tiles > 0, (start + tiles - 1) // share - part + 1, 0))
        if t_lo < t_hi:
            q_ptrs = (q_ptr + b.to(tl.int64) * stride_q_b + tok_i[:, None] * stride_q_t
                      + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d)
            qr_ptrs = (qpe_ptr + b.to(tl.int64) * stride_qr_b + tok_i[:, None] * stride_qr_t
                       + heads[:, None] * stride_qr_h + offs_r[None, :] * stride_qr_d)
            q, qr, qk_scale = _load_latent_query(q_ptrs, qr_ptrs, mask_md,
                                                 mask_m[:, None] & mask_r[None, :],
                                                 scale_log2, kv_scale, BLOCK_H, DOT_DTYPE,
                                                 Q_POW2_SCALE)
            pos = seq_len - Q_LEN + tok_i  # [BLOCK_H] each row's last visible token
            acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_H], tl.float32)
            bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt_b
            page_bad = tl.zeros([], tl.int1)
            # tiles below full_end hold only tokens every row sees (t <= seq_len - Q_LEN)
            full_end = tl.maximum(seq_len - Q_LEN + 1, 0) // BLOCK_N * BLOCK_N
            n_lo = t_lo * BLOCK_N
            n_hi = t_hi * BLOCK_N
            mid = tl.minimum(tl.maximum(full_end, n_lo), n_hi)
            acc, m_i, l_i, page_bad = _mla_tiles(
                acc, m_i, l_i, q, qr, qk_scale, pos, n_lo, mid, seq_len, softcap, ckv_ptr,
                kpe_ptr, bt_row, stride_bt_p, num_pages, page_bad, offs_n, offs_d, offs_r,
                mask_d, mask_r, stride_c_page, stride_c_tok, stride_c_d, stride_r_page,
                stride_r_tok, stride_r_d, PAGE_SIZE, BLOCK_N, ROPE_DIM > 0, DOT_DTYPE,
                DOT_PRECISION, HAS_SOFTCAP, False)
            acc, m_i, l_i, page_bad = _mla_tiles(
                acc, m_i, l_i, q, qr, qk_scale, pos, mid, n_hi, seq_len, softcap, ckv_ptr,
                kpe_ptr, bt_row, stride_bt_p, num_pages, page_bad, offs_n, offs_d, offs_r,
                mask_d, mask_r, stride_c_page, stride_c_tok, stride_c_d, stride_r_page,
                stride_r_tok, stride_r_d, PAGE_SIZE, BLOCK_N, ROPE_DIM > 0, DOT_DTYPE,
                DOT_PRECISION, HAS_SOFTCAP, True)
            bad_row = tl.where(page_bad & (bad_row < 0), b, bad_row)
            if whole:
                _mla_store(out_ptr, lse_ptr, sinks_ptr, b, tok_i, heads, mask_m, offs_d,
                           mask_md, m_i, l_i, acc, kv_scale, row_ids, rows, stride_o_b,
                           stride_o_t, stride_o_h, stride_o_d, HAS_SINKS, HAS_LSE)
            else:  # a cut sequence: this part's normalized partial and its log2 LSE
                slot = (part * 2 + (start > lo).to(tl.int32)).to(tl.int64) * rows
                o_ptrs = (part_o_ptr + (slot + row_ids)[:, None] * BLOCK_D + offs_d[None, :])
                tl.store(o_ptrs, acc * _normalize(1.0, l_i)[:, None], mask=mask_m[:, None])
                tl.store(part_lse_ptr + slot + row_ids, m_i + tl.log2(l_i), mask=mask_m)
        elif (tiles == 0) & (start >= lo):  # an empty sequence, owned by the part at its start
            _mla_store(out_ptr, lse_ptr, sinks_ptr, b, tok_i, heads, mask_m, offs_d, mask_md,
                       tl.full([BLOCK_H], float("-inf"), tl.float32),
                       tl.zeros([BLOCK_H], tl.float32), tl.zeros([BLOCK_H, BLOCK_D], tl.float32),
                       kv_scale, row_ids, rows, stride_o_b, stride_o_t, stride_o_h, stride_o_d,
                       HAS_SINKS, HAS_LSE)
        start += tiles + OVERHEAD
        b += 1
    _report(errors_ptr, bad_row >= 0, BLOCK_TABLES, bad_row, -1)


@triton.jit
def _mla_store(out_ptr, lse_ptr, sinks_ptr, b, tok_i, heads, mask_m, offs_d, mask_md, m, l,
               acc, v_scale, row_ids, rows, stride_o_b, stride_o_t, stride_o_h, stride_o_d,
               HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr):
    """A sequence's final rows: the sink folded in, ``out = acc · v_scale / l`` (0 for a row
    that saw no token) and the natural-log LSE."""
    if HAS_SINKS:
        m, l, acc = _add_sink(m, l, acc, sinks_ptr, heads, mask_m)
    out = acc * _normalize(v_scale, l)[:, None]
    o_ptrs = (out_ptr + b.to(tl.int64) * stride_o_b + tok_i[:, None] * stride_o_t
              + heads[:, None] * stride_o_h + offs_d[None, :] * stride_o_d)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_md)
    if HAS_LSE:
        tl.store(lse_ptr + b.to(tl.int64) * rows + row_ids, _natural_lse(m, l), mask=mask_m)


@triton.jit(do_not_specialize=["stride_o_b"])
def _mla_merge_kernel(
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, pieces_ptr, kv_scale_ptr, kv_scale_val,
    sinks_ptr, num_q_heads, stride_o_b, stride_o_t, stride_o_h, stride_o_d,
    LATENT_DIM: tl.constexpr, BLOCK_D: tl.constexpr, Q_LEN: tl.constexpr,
    BLOCK_R: tl.constexpr,  # workspace rows a program
    SCALE_FROM_PTR: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr,
):
    """The cut sequences' partials combined: grid ``(batch, cdiv(Q_LEN · num_q_heads,
    BLOCK_R))``. The main kernel wrote each sequence's first piece's slot and its number of
    pieces (``pieces_ptr``; the next pieces are slot 0 of the parts after the first); a
    sequence of one piece, finished where it ran, is left alone."""
    b = tl.program_id(0)
    rb = tl.program_id(1)
    first_slot = tl.load(pieces_ptr + 2 * b)
    n = tl.load(pieces_ptr + 2 * b + 1)
    if n > 1:
        rows = Q_LEN * num_q_heads
        offs_m = rb * BLOCK_R + tl.arange(0, BLOCK_R)  # workspace rows: token x head
        mask_m = offs_m < rows
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = _dim_mask(offs_d, LATENT_DIM, BLOCK_D)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for k in range(0, n):
            slot = tl.where(k == 0, first_slot, (first_slot // 2 + k) * 2).to(tl.int64)
            base = slot * rows + offs_m
            lse_k = tl.load(part_lse_ptr + base, mask=mask_m, other=float("-inf"))
            o_k = tl.load(part_o_ptr + base[:, None] * BLOCK_D + offs_d[None, :],
                          mask=mask_m[:, None], other=0.0)
            m, l, acc = _merge_row(m, l, acc, lse_k, tl.where(lse_k == float("-inf"), 0.0, 1.0),
                                   o_k, True)
        if SCALE_FROM_PTR:
            v_scale = tl.load(kv_scale_ptr).to(tl.float32)
        else:
            v_scale = kv_scale_val
        tok_i = offs_m // num_q_heads
        heads = offs_m % num_q_heads
        _mla_store(out_ptr, lse_ptr, sinks_ptr, b, tok_i, heads, mask_m, offs_d,
                   mask_m[:, None] & mask_d[None, :], m, l, acc, v_scale, offs_m, rows,
                   stride_o_b, stride_o_t, stride_o_h, stride_o_d, HAS_SINKS, HAS_LSE)


@triton.jit(do_not_specialize=["batch", "num_pages", "max_pages"])
def _mla_schedule_kernel(context_lens_ptr, sched_ptr, errors_ptr, batch, num_pages, max_pages,
                         stride_ctx, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_PARTS: tl.constexpr, OVERHEAD: tl.constexpr,
                         BLOCK_B: tl.constexpr):
    """The balanced parts for a kernel that cannot scan (the Gluon path,
    :mod:`pagedattn.kernels.mla_gluon`): grid ``(NUM_PARTS,)``, part ``p`` writes ``sched[p]
    = (lo, hi, first sequence, its cost start, share, 0, 0, 0)`` (int32) as
    :func:`_mla_decode_kernel` finds them, and part 0 reports the first length outside the
    table."""
    part = tl.program_id(0)
    capacity = max_pages * PAGE_SIZE * (num_pages > 0)
    lo, hi, b, start, share = _mla_part(context_lens_ptr, stride_ctx, batch, capacity, part,
                                        errors_ptr, True, BLOCK_N, NUM_PARTS, OVERHEAD, BLOCK_B)
    row = sched_ptr + part * 8
    tl.store(row, lo)
    tl.store(row + 1, hi)
    tl.store(row + 2, b)
    tl.store(row + 3, start)
    tl.store(row + 4, share)
