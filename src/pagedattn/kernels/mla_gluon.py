"""The MLA decode kernel's Hopper path in Gluon (``triton.experimental.gluon``): the same
rows, tiles, balanced parts, workspace and merge as :mod:`pagedattn.kernels.mla`, with the
two things plain Triton cannot express.

* **The score computed once.** Plain Triton lays a dot whose result feeds another dot out
  with every warp along M (``[8, 1]``), so at 64 rows and eight warps both warpgroups compute
  the whole ``[64, 64]`` score: the 576-deep score dot twice, half the tensor work wasted.
  Here the score's layout is ``[4, 2]``: each warpgroup computes 32 of the tile's 64 token
  columns (TileLang's ``FullCol``), the row max and sum cross the warpgroups through shared
  memory, and the probabilities go to shared memory once for both warpgroups' ``P · V``.
* **Explicit shared memory and copies.** The query (64 × 576) and two stages of the latent
  tile (64 × 576 each) live in NVMMA-swizzled shared memory (224 KB with ``P``: FlashMLA's
  budget); the tile gathers are ``cp.async`` row copies through the block table (any page
  size), one commit group a tile, so tile ``i + 2`` loads while tile ``i`` computes.

The work split comes from :func:`pagedattn.kernels.mla._mla_schedule_kernel` (plain Triton:
Gluon 3.6 has no ``cumsum`` for the scan): each part's ``(lo, hi, first sequence, its cost
start)``. Every tile is masked (the mask is 16 selects a thread against 64 × 1,088
multiply-adds a tile).

**An fp8 latent** (``KV_DTYPE`` fp8, ``DTYPE`` the query's 16-bit dtype) lands in fp8
stages (half the bytes a copy) and each tile is converted once, by all eight warps, into one
16-bit buffer that both dots read (fp8 converts exactly to either 16-bit dtype): 128 columns
at a time from shared memory to registers and back, so the conversion holds 32 elements a
thread beside the accumulator. Shared memory: the query, two fp8 stages, the converted tile
and ``P``, 224 KB as the 16-bit path's.

Not run by Triton's interpreter: its tests need a GPU, and CI compiles it for sm_90
(``scripts/compile_sm90.py``). API differences between Triton 3.6 and 3.9 go through
:mod:`pagedattn.kernels._gluon_compat`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from pagedattn.kernels._gluon_compat import (
    async_copy_global_to_shared,
    commit_group,
    fence_async_shared,
    landed,
    mbarrier,
    mbarrier_arrive,
    report_block_tables,
    thread_barrier,
    wait_group,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_LOG2E = gl.constexpr(1.4426950408889634)
_PRODUCER_THREADS = gl.constexpr(128)  # the warp-specialized kernel's producer warpgroup
_LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _cols(offs, DIM: gl.constexpr, BLOCK: gl.constexpr):
    """The mask of a row's real columns: a constant splat when ``DIM == BLOCK``, so the
    copies stay 16-byte vectors (``cp.async`` moves 4, 8 or 16 bytes)."""
    if DIM == BLOCK:
        return gl.full(offs.shape, 1, gl.int1, layout=offs.type.layout)
    else:
        return offs < DIM


@gluon.jit
def _issue_tile(k_buf, r_buf, ckv_ptr, kpe_ptr, bt_row_ptr, stride_bt_p, n0, seq_len,
                num_pages, stride_c_page, stride_c_tok, stride_r_page, stride_r_tok,
                LD: gl.constexpr, LD_R: gl.constexpr, PAGE_SIZE: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DR: gl.constexpr,
                LATENT_DIM: gl.constexpr, ROPE_DIM: gl.constexpr):
    """``cp.async`` the latent and rope rows of tokens ``n0 .. n0 + BLOCK_N`` into one stage
    (a token past the length reads the last token's row; a page id outside the cache reads
    page 0). Returns whether a page id was outside."""
    toks = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    toks = gl.minimum(toks, seq_len - 1)
    raw = gl.load(bt_row_ptr + (toks // PAGE_SIZE) * stride_bt_p).to(gl.int64)
    bad = (raw < 0) | (raw >= num_pages)
    page = gl.where(bad, 0, raw)
    off = page * stride_c_page + (toks % PAGE_SIZE).to(gl.int64) * stride_c_tok
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, LD))
    async_copy_global_to_shared(k_buf, ckv_ptr + off[:, None] + cols[None, :],
                                           mask=_cols(cols, LATENT_DIM, BLOCK_D)[None, :])
    toks_r = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD_R))
    toks_r = gl.minimum(toks_r, seq_len - 1)
    raw_r = gl.load(bt_row_ptr + (toks_r // PAGE_SIZE) * stride_bt_p).to(gl.int64)
    page_r = gl.where((raw_r < 0) | (raw_r >= num_pages), 0, raw_r)
    off_r = page_r * stride_r_page + (toks_r % PAGE_SIZE).to(gl.int64) * stride_r_tok
    cols_r = gl.arange(0, BLOCK_DR, layout=gl.SliceLayout(0, LD_R))
    async_copy_global_to_shared(r_buf, kpe_ptr + off_r[:, None] + cols_r[None, :],
                                           mask=_cols(cols_r, ROPE_DIM, BLOCK_DR)[None, :])
    return gl.max(bad.to(gl.int32), axis=0) > 0


@gluon.jit
def _issue_query(q_smem, qr_smem, q_ptr, qpe_ptr, b64, hb, m_ld, m_ldr, d_ld, d_ldr,
                 stride_q_b, stride_q_t, stride_q_h, stride_q_d, stride_qr_b, stride_qr_t,
                 stride_qr_h, stride_qr_d, LATENT_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
                 ROPE_DIM: gl.constexpr, BLOCK_DR: gl.constexpr, Q_LEN: gl.constexpr,
                 HEADS: gl.constexpr):
    """``cp.async`` sequence ``b64``'s query rows (token x head of head block ``hb``; rows past
    ``Q_LEN x HEADS`` zero) into shared memory: the latent part and the rope part."""
    tok_q = m_ld // HEADS
    head_q = hb * HEADS + m_ld % HEADS
    q_rows = b64 * stride_q_b + tok_q * stride_q_t + head_q * stride_q_h
    async_copy_global_to_shared(
        q_smem, q_ptr + q_rows[:, None] + d_ld[None, :] * stride_q_d,
        mask=(m_ld < Q_LEN * HEADS)[:, None] & _cols(d_ld, LATENT_DIM, BLOCK_D)[None, :])
    tok_r = m_ldr // HEADS
    head_r = hb * HEADS + m_ldr % HEADS
    qr_rows = b64 * stride_qr_b + tok_r * stride_qr_t + head_r * stride_qr_h
    async_copy_global_to_shared(
        qr_smem, qpe_ptr + qr_rows[:, None] + d_ldr[None, :] * stride_qr_d,
        mask=(m_ldr < Q_LEN * HEADS)[:, None] & _cols(d_ldr, ROPE_DIM, BLOCK_DR)[None, :])


@gluon.jit
def _convert_tile(k8, r8, kc, rc, DTYPE: gl.constexpr, BLOCK_D: gl.constexpr,
                  num_warps: gl.constexpr):
    """One fp8 stage (``k8`` latent, ``r8`` rope rows) converted into the 16-bit tile both dots
    read (``kc``, ``rc``): 128 latent columns at a time through registers (exact: fp8 fits
    either 16-bit dtype)."""
    CV: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    CV_R: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
    for c in gl.static_range(BLOCK_D // 128):
        x = k8.slice(c * 128, 128, dim=1).load(CV)
        kc.slice(c * 128, 128, dim=1).store(x.to(DTYPE))
    rc.store(r8.load(CV_R).to(DTYPE))


@gluon.jit
def _soft_cap(s, cap):
    """Gemma 2's soft-cap on exp2-domain scores (as :func:`pagedattn.kernels.softmax._soft_cap`)."""
    x = s * (_LN2 / cap)
    ax = gl.abs(x)
    e = gl.exp2(ax * (-2.0 * _LOG2E))
    t = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    series = s * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0)))
    return gl.where(ax < 0.0625, series, gl.where(x < 0, -t, t) * (cap * _LOG2E))


@gluon.jit
def _tile_step(q_smem, qr_smem, k_buf, r_buf, p_smem, acc, m_i, l_i, i, pos, seq_len, n_s,
               qk_scale, softcap, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
               DTYPE: gl.constexpr, HAS_SOFTCAP: gl.constexpr, S_L: gl.constexpr,
               O_L: gl.constexpr):
    """One latent tile (``k_buf``, ``r_buf``: tokens ``i * BLOCK_N ..``) folded into the rows'
    state: both score dots, the mask (each row's tokens ``<= pos``, below ``seq_len``), the
    online softmax in the exp2 domain, ``P`` through shared memory once for both warpgroups,
    the value dot. Returns ``(acc, m_i, l_i)``; every warp is done with the tile and ``P``."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
    s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(qr_smem, r_buf.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    s = s * qk_scale
    if HAS_SOFTCAP:
        s = _soft_cap(s, softcap)
    tok = i * BLOCK_N + n_s
    seen = (tok[None, :] <= pos[:, None]) & (tok < seq_len)[None, :]
    s = gl.where(seen, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - m_new))
    p = gl.where(s == float("-inf"), 0.0, gl.exp2(gl.minimum(s - m_new[:, None], 0.0)))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_smem.store(p.to(DTYPE))
    fence_async_shared()
    thread_barrier()
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    acc = warpgroup_mma(p_smem, k_buf, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    thread_barrier()  # every warp is done with this tile and with P
    return acc, m_new, l_i


@gluon.jit
def _store_sequence(acc, m_i, l_i, whole, b64, part, second, hb, kv_scale, out_ptr, lse_ptr,
                    part_o_ptr, part_lse_ptr, sinks_ptr, num_q_heads, rows, stride_o_b,
                    stride_o_t, stride_o_h, stride_o_d, m_s, m_o, d_o,
                    LATENT_DIM: gl.constexpr, BLOCK_D: gl.constexpr, HEADS: gl.constexpr,
                    Q_LEN: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr,
                    O_L: gl.constexpr):
    """A sequence's rows (token x head, in the score's and the output's layouts): ``whole``,
    the normalized output (the sink folded in) and its LSE; cut, this part's normalized
    partial and its log2 LSE in the workspace slot ``part * 2 + second``."""
    head_s = hb * HEADS + m_s % HEADS
    rid_s = (m_s // HEADS) * num_q_heads + head_s
    mask_s = m_s < Q_LEN * HEADS
    head_o = hb * HEADS + m_o % HEADS
    tok_o = m_o // HEADS
    rid_o = tok_o * num_q_heads + head_o
    mask_o = (m_o < Q_LEN * HEADS)[:, None] & (d_o < LATENT_DIM)[None, :]
    if whole:
        if HAS_SINKS:
            sink2 = gl.load(sinks_ptr + head_s, mask=mask_s, other=0.0) * _LOG2E
            m_f = gl.maximum(m_i, sink2)
            a_f = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - m_f))
            l_i = l_i * a_f + gl.where(sink2 == m_f, 1.0, gl.exp2(sink2 - m_f))
            m_i = m_f
            acc = acc * gl.convert_layout(a_f, gl.SliceLayout(1, O_L))[:, None]
        inv = gl.where(l_i > 0, kv_scale / gl.where(l_i > 0, l_i, 1.0), 0.0)
        o = acc * gl.convert_layout(inv, gl.SliceLayout(1, O_L))[:, None]
        o_ptrs = (out_ptr + b64 * stride_o_b + tok_o[:, None] * stride_o_t
                  + head_o[:, None] * stride_o_h + d_o[None, :] * stride_o_d)
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_o)
        if HAS_LSE:
            gl.store(lse_ptr + b64 * rows + rid_s, (m_i + gl.log2(l_i)) * _LN2, mask=mask_s)
    else:  # a cut sequence: this part's normalized partial and its log2 LSE
        slot = (part * 2 + second.to(gl.int32)).to(gl.int64) * rows
        inv = gl.where(l_i > 0, 1.0 / gl.where(l_i > 0, l_i, 1.0), 0.0)
        o = acc * gl.convert_layout(inv, gl.SliceLayout(1, O_L))[:, None]
        gl.store(part_o_ptr + (slot + rid_o)[:, None] * BLOCK_D + d_o[None, :], o,
                 mask=(m_o < Q_LEN * HEADS)[:, None])
        lse2 = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        gl.store(part_lse_ptr + slot + rid_s, lse2, mask=mask_s)


@gluon.jit
def _store_empty(b, hb, out_ptr, lse_ptr, sinks_ptr, num_q_heads, rows, stride_o_b, stride_o_t,
                 stride_o_h, stride_o_d, m_s, m_o, d_o, LATENT_DIM: gl.constexpr,
                 BLOCK_D: gl.constexpr, BLOCK_H: gl.constexpr, HEADS: gl.constexpr,
                 Q_LEN: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr,
                 S_L: gl.constexpr, O_L: gl.constexpr):
    """An empty sequence's rows (owned by the part at its start): zeros, and the LSE of no
    key (``-inf``, or the sink)."""
    head_s = hb * HEADS + m_s % HEADS
    rid_s = (m_s // HEADS) * num_q_heads + head_s
    mask_s = m_s < Q_LEN * HEADS
    head_o = hb * HEADS + m_o % HEADS
    tok_o = m_o // HEADS
    mask_o = (m_o < Q_LEN * HEADS)[:, None] & (d_o < LATENT_DIM)[None, :]
    o_ptrs = (out_ptr + b.to(gl.int64) * stride_o_b + tok_o[:, None] * stride_o_t
              + head_o[:, None] * stride_o_h + d_o[None, :] * stride_o_d)
    gl.store(o_ptrs, gl.zeros([BLOCK_H, BLOCK_D], out_ptr.dtype.element_ty, layout=O_L),
             mask=mask_o)
    if HAS_LSE:
        lse0 = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        if HAS_SINKS:
            lse0 = gl.load(sinks_ptr + head_s, mask=mask_s, other=0.0)
        gl.store(lse_ptr + b.to(gl.int64) * rows + rid_s, lse0, mask=mask_s)


@gluon.jit
def _latent_buffers(DTYPE: gl.constexpr, KV_DTYPE: gl.constexpr, BLOCK_H: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DR: gl.constexpr):
    """The Gluon MLA kernels' shared memory, in this order: the query's latent and rope parts,
    two stages of latent tiles (the cache's dtype), the converted 16-bit tile of an fp8
    cache (a 16-bit cache: stage 0 stands in, unused), and ``P``:
    ``(q, qr, k, r, kc, rc, p)``."""
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_D], DTYPE)
    QR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_DR], DTYPE)
    K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], DTYPE)
    R_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_DR], DTYPE)
    P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], DTYPE)
    q_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_H, BLOCK_D], Q_SL)
    qr_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_H, BLOCK_DR], QR_SL)
    if KV_DTYPE == DTYPE:
        k_smem = gl.allocate_shared_memory(DTYPE, [2, BLOCK_N, BLOCK_D], K_SL)
        r_smem = gl.allocate_shared_memory(DTYPE, [2, BLOCK_N, BLOCK_DR], R_SL)
        kc_smem = k_smem.index(0)  # unused: the dots read the stages
        rc_smem = r_smem.index(0)
    else:  # fp8 stages (16-byte copies of 16 elements), one converted 16-bit tile
        K8_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], KV_DTYPE)
        R8_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_DR],
                                                                   KV_DTYPE)
        k_smem = gl.allocate_shared_memory(KV_DTYPE, [2, BLOCK_N, BLOCK_D], K8_SL)
        r_smem = gl.allocate_shared_memory(KV_DTYPE, [2, BLOCK_N, BLOCK_DR], R8_SL)
        kc_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_N, BLOCK_D], K_SL)
        rc_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_N, BLOCK_DR], R_SL)
    p_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_H, BLOCK_N], P_SL)
    return q_smem, qr_smem, k_smem, r_smem, kc_smem, rc_smem, p_smem


@gluon.jit
def _part_record(sched_ptr, part, kv_scale_ptr, kv_scale_val, scale_log2,
                 SCALE_FROM_PTR: gl.constexpr):
    """A part's record from the schedule kernel (its tiles ``[lo, hi)``, its first sequence
    ``b`` and that sequence's first tile ``start``, a part's ``share`` of tiles) and the
    latent's scale: ``(lo, hi, b, start, share, kv_scale, qk_scale)``."""
    lo = gl.load(sched_ptr + part * 8)
    hi = gl.load(sched_ptr + part * 8 + 1)
    b = gl.load(sched_ptr + part * 8 + 2)
    start = gl.load(sched_ptr + part * 8 + 3)
    share = gl.load(sched_ptr + part * 8 + 4)
    if SCALE_FROM_PTR:
        kv_scale = gl.load(kv_scale_ptr).to(gl.float32)
    else:
        kv_scale = kv_scale_val
    return lo, hi, b, start, share, kv_scale, scale_log2 * kv_scale


@gluon.jit
def _sequence_tiles(context_lens_ptr, b, stride_ctx, capacity, lo, hi, start,
                    BLOCK_N: gl.constexpr):
    """Sequence ``b`` of a part's walk: its length clamped to the table, its tiles, and the
    part's tiles of it, ``[t_lo, t_hi)``: ``(seq_len, tiles, t_lo, t_hi)``."""
    raw_len = gl.load(context_lens_ptr + b * stride_ctx)
    seq_len = gl.minimum(gl.maximum(raw_len, 0), capacity).to(gl.int32)
    tiles = gl.cdiv(seq_len, BLOCK_N)
    return seq_len, tiles, gl.maximum(lo - start, 0), gl.minimum(hi - start, tiles)


@gluon.jit(do_not_specialize=["batch", "num_pages"])
def _mla_decode_gluon_kernel(
    q_ptr, qpe_ptr, ckv_ptr, kpe_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
    part_o_ptr, part_lse_ptr, pieces_ptr, sched_ptr, errors_ptr,
    kv_scale_ptr, kv_scale_val, scale_log2, sinks_ptr, softcap,
    batch, num_pages, capacity, num_q_heads,
    stride_q_b, stride_q_t, stride_q_h, stride_q_d,
    stride_qr_b, stride_qr_t, stride_qr_h, stride_qr_d,
    stride_c_page, stride_c_tok, stride_r_page, stride_r_tok,
    stride_bt_b, stride_bt_p, stride_ctx,
    stride_o_b, stride_o_t, stride_o_h, stride_o_d,
    LATENT_DIM: gl.constexpr, BLOCK_D: gl.constexpr, ROPE_DIM: gl.constexpr,
    BLOCK_DR: gl.constexpr, Q_LEN: gl.constexpr, HEADS: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    OVERHEAD: gl.constexpr, DTYPE: gl.constexpr, KV_DTYPE: gl.constexpr,
    SCALE_FROM_PTR: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 8, "two warpgroups")
    gl.static_assert(BLOCK_H == 64, "one wgmma M a warpgroup")
    part = gl.program_id(0)
    hb = gl.program_id(1)
    # layouts: the gathers (16-byte vectors), the score ([4, 2]: each warpgroup half the
    # tokens), the output ([4, 2]: each warpgroup half the latent's columns)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    LD_R: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
    # the latent tiles' copies: the same, or 16 fp8 elements (16 bytes) a vector
    LD_K: gl.constexpr = LD if KV_DTYPE == DTYPE else gl.BlockedLayout(
        [1, 16], [4, 8], [num_warps, 1], [1, 0])
    LD_KR: gl.constexpr = LD_R if KV_DTYPE == DTYPE else gl.BlockedLayout(
        [1, 16], [8, 4], [num_warps, 1], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_D // 2, 16])
    q_smem, qr_smem, k_smem, r_smem, kc_smem, rc_smem, p_smem = _latent_buffers(
        DTYPE, KV_DTYPE, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DR)
    lo, hi, b, start, share, kv_scale, qk_scale = _part_record(
        sched_ptr, part, kv_scale_ptr, kv_scale_val, scale_log2, SCALE_FROM_PTR)

    rows = Q_LEN * num_q_heads
    # the query rows in the gather layout, the score's rows, the output's rows
    m_ld = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    m_ldr = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD_R))
    m_s = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
    m_o = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    d_ld = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, LD))
    d_ldr = gl.arange(0, BLOCK_DR, layout=gl.SliceLayout(0, LD_R))
    d_o = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, O_L))
    n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    bad_row = -1
    while (b < batch) & (start < hi):
        seq_len, tiles, t_lo, t_hi = _sequence_tiles(context_lens_ptr, b, stride_ctx, capacity,
                                                     lo, hi, start, BLOCK_N)
        whole = (t_lo == 0) & (t_hi == tiles)
        if (start >= lo) & (hb == 0):  # this part owns the sequence's start: its pieces
            gl.store(pieces_ptr + 2 * b, part * 2 + (start > lo).to(gl.int32))
            gl.store(pieces_ptr + 2 * b + 1,
                     gl.where(tiles > 0, (start + tiles - 1) // share - part + 1, 0))
        if t_lo < t_hi:
            b64 = b.to(gl.int64)
            bt_row = block_tables_ptr + b64 * stride_bt_b
            # the query: rows token x head of this block, into shared memory with tile 0
            _issue_query(q_smem, qr_smem, q_ptr, qpe_ptr, b64, hb, m_ld, m_ldr, d_ld, d_ldr,
                         stride_q_b, stride_q_t, stride_q_h, stride_q_d, stride_qr_b,
                         stride_qr_t, stride_qr_h, stride_qr_d, LATENT_DIM, BLOCK_D, ROPE_DIM,
                         BLOCK_DR, Q_LEN, HEADS)
            page_bad = _issue_tile(k_smem.index(0), r_smem.index(0), ckv_ptr, kpe_ptr, bt_row,
                                   stride_bt_p, t_lo * BLOCK_N, seq_len, num_pages,
                                   stride_c_page, stride_c_tok, stride_r_page, stride_r_tok,
                                   LD_K, LD_KR, PAGE_SIZE, BLOCK_N, BLOCK_D, BLOCK_DR, LATENT_DIM,
                                   ROPE_DIM)
            commit_group()
            if t_lo + 1 < t_hi:
                page_bad |= _issue_tile(k_smem.index(1), r_smem.index(1), ckv_ptr, kpe_ptr,
                                        bt_row, stride_bt_p, (t_lo + 1) * BLOCK_N, seq_len,
                                        num_pages, stride_c_page, stride_c_tok, stride_r_page,
                                        stride_r_tok, LD_K, LD_KR, PAGE_SIZE, BLOCK_N, BLOCK_D,
                                        BLOCK_DR, LATENT_DIM, ROPE_DIM)
            commit_group()

            pos = seq_len - Q_LEN + m_s // HEADS  # each score row's last visible token
            acc = gl.zeros([BLOCK_H, BLOCK_D], gl.float32, layout=O_L)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
            l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
            for i in range(t_lo, t_hi):
                stage = (i - t_lo) % 2
                k_buf = k_smem.index(stage)
                r_buf = r_smem.index(stage)
                wait_group(1)  # tile i has landed (tile i + 1 may be in flight)
                if KV_DTYPE != DTYPE:  # every thread's copies seen, then the conversion
                    thread_barrier()
                    _convert_tile(k_buf, r_buf, kc_smem, rc_smem, DTYPE, BLOCK_D, num_warps)
                    k_buf = kc_smem
                    r_buf = rc_smem
                fence_async_shared()  # cp.async wrote it through the generic proxy; wgmma
                thread_barrier()  # reads through the async proxy, after every thread's copies
                acc, m_i, l_i = _tile_step(q_smem, qr_smem, k_buf, r_buf, p_smem, acc, m_i, l_i,
                                           i, pos, seq_len, n_s, qk_scale, softcap, BLOCK_H,
                                           BLOCK_N, DTYPE, HAS_SOFTCAP, S_L, O_L)
                if i + 2 < t_hi:
                    page_bad |= _issue_tile(k_smem.index(stage), r_smem.index(stage), ckv_ptr,
                                            kpe_ptr, bt_row,
                                            stride_bt_p, (i + 2) * BLOCK_N, seq_len,
                                            num_pages, stride_c_page, stride_c_tok,
                                            stride_r_page, stride_r_tok, LD_K, LD_KR, PAGE_SIZE,
                                            BLOCK_N, BLOCK_D, BLOCK_DR, LATENT_DIM, ROPE_DIM)
                commit_group()  # one group an iteration, empty or not
            wait_group(0)
            bad_row = gl.where(page_bad & (bad_row < 0), b, bad_row)

            _store_sequence(acc, m_i, l_i, whole, b64, part, start > lo, hb, kv_scale, out_ptr,
                            lse_ptr, part_o_ptr, part_lse_ptr, sinks_ptr, num_q_heads, rows,
                            stride_o_b, stride_o_t, stride_o_h, stride_o_d, m_s, m_o, d_o,
                            LATENT_DIM, BLOCK_D, HEADS, Q_LEN, HAS_SINKS, HAS_LSE, O_L)
        elif (tiles == 0) & (start >= lo):  # an empty sequence, owned by the part at its start
            _store_empty(b, hb, out_ptr, lse_ptr, sinks_ptr, num_q_heads, rows, stride_o_b,
                         stride_o_t, stride_o_h, stride_o_d, m_s, m_o, d_o, LATENT_DIM,
                         BLOCK_D, BLOCK_H, HEADS, Q_LEN, HAS_SINKS, HAS_LSE, S_L, O_L)
        start += tiles + OVERHEAD
        b += 1
    if bad_row >= 0:
        report_block_tables(errors_ptr, bad_row)


# --- the warp-specialized form (the Hopper default: MLAKernelConfig.ws; perf-notes step 55) -----


@gluon.jit
def _ws_producer(q_smem, qr_smem, k_smem, r_smem, q_ready, q_empty, kv_ready, kv_empty,
                 q_ptr, qpe_ptr, ckv_ptr, kpe_ptr, block_tables_ptr, context_lens_ptr,
                 errors_ptr, lo, hi, b, start, hb, batch, num_pages, capacity,
                 stride_q_b, stride_q_t, stride_q_h, stride_q_d,
                 stride_qr_b, stride_qr_t, stride_qr_h, stride_qr_d,
                 stride_c_page, stride_c_tok, stride_r_page, stride_r_tok,
                 stride_bt_b, stride_bt_p, stride_ctx,
                 LATENT_DIM: gl.constexpr, BLOCK_D: gl.constexpr, ROPE_DIM: gl.constexpr,
                 BLOCK_DR: gl.constexpr, Q_LEN: gl.constexpr, HEADS: gl.constexpr,
                 BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
                 OVERHEAD: gl.constexpr, DTYPE: gl.constexpr, KV_DTYPE: gl.constexpr,
                 LAND: gl.constexpr = False):
    """The producer warpgroup: the part's sequences in the consumers' order; for each, the
    query once the consumers are done with the last one (``q_empty``), then each latent tile
    into stage ``g % 2`` (``g``: tiles so far) once released (``kv_empty``), signalled as it
    lands; reports a clamped page id. ``LAND`` (perf-notes step 60): the producer does not
    wait for a tile's copies; each of its threads arrives on the stage's ``kv_ready`` when
    its own copies land (``cp.async.mbarrier.arrive.noinc``: the barrier expects the
    warpgroup's 128 arrivals), so the next tile's copies are issued as soon as its stage is
    free, as step 56 does for prefill; the consumers fence the landed stage."""
    NW: gl.constexpr = gl.num_warps()
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
    LD_R: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])
    LD_K: gl.constexpr = LD if KV_DTYPE == DTYPE else gl.BlockedLayout(
        [1, 16], [4, 8], [NW, 1], [1, 0])
    LD_KR: gl.constexpr = LD_R if KV_DTYPE == DTYPE else gl.BlockedLayout(
        [1, 16], [8, 4], [NW, 1], [1, 0])
    m_ld = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    m_ldr = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD_R))
    d_ld = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, LD))
    d_ldr = gl.arange(0, BLOCK_DR, layout=gl.SliceLayout(0, LD_R))
    bad_row = -1
    g = 0  # tiles issued so far: the stage and its phase
    nq = 0  # queries loaded so far
    while (b < batch) & (start < hi):
        seq_len, tiles, t_lo, t_hi = _sequence_tiles(context_lens_ptr, b, stride_ctx, capacity,
                                                     lo, hi, start, BLOCK_N)
        if t_lo < t_hi:
            b64 = b.to(gl.int64)
            bt_row = block_tables_ptr + b64 * stride_bt_b
            mbarrier.wait(q_empty, (nq + 1) % 2, pred=nq > 0)
            _issue_query(q_smem, qr_smem, q_ptr, qpe_ptr, b64, hb, m_ld, m_ldr, d_ld, d_ldr,
                         stride_q_b, stride_q_t, stride_q_h, stride_q_d, stride_qr_b,
                         stride_qr_t, stride_qr_h, stride_qr_d, LATENT_DIM, BLOCK_D, ROPE_DIM,
                         BLOCK_DR, Q_LEN, HEADS)
            commit_group()
            wait_group(0)
            landed(q_ready)
            nq += 1
            page_bad = False
            for i in range(t_lo, t_hi):
                s = g % 2
                mbarrier.wait(kv_empty.index(s), ((g // 2) + 1) % 2, pred=g >= 2)
                page_bad |= _issue_tile(k_smem.index(s), r_smem.index(s), ckv_ptr, kpe_ptr,
                                        bt_row, stride_bt_p, i * BLOCK_N, seq_len, num_pages,
                                        stride_c_page, stride_c_tok, stride_r_page,
                                        stride_r_tok, LD_K, LD_KR, PAGE_SIZE, BLOCK_N,
                                        BLOCK_D, BLOCK_DR, LATENT_DIM, ROPE_DIM)
                if LAND:
                    mbarrier_arrive(kv_ready.index(s), increment_count=False)
                else:
                    commit_group()
                    wait_group(0)
                    landed(kv_ready.index(s))
                g += 1
            bad_row = gl.where(page_bad & (bad_row < 0), b, bad_row)
        start += tiles + OVERHEAD
        b += 1
    if LAND:  # the warpgroup's last copies have landed before it exits
        commit_group()
        wait_group(0)
    if bad_row >= 0:
        report_block_tables(errors_ptr, bad_row)


@gluon.jit
def _ws_consumer(q_smem, qr_smem, k_smem, r_smem, kc_smem, rc_smem, p_smem, q_ready, q_empty,
                 kv_ready, kv_empty, context_lens_ptr, out_ptr, lse_ptr, part_o_ptr,
                 part_lse_ptr, pieces_ptr, sinks_ptr, softcap, kv_scale, qk_scale,
                 part, lo, hi, b, start, share, hb, batch, capacity, num_q_heads, stride_ctx,
                 stride_o_b, stride_o_t, stride_o_h, stride_o_d,
                 LATENT_DIM: gl.constexpr, BLOCK_D: gl.constexpr, ROPE_DIM: gl.constexpr,
                 BLOCK_DR: gl.constexpr, Q_LEN: gl.constexpr, HEADS: gl.constexpr,
                 BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, OVERHEAD: gl.constexpr,
                 DTYPE: gl.constexpr, KV_DTYPE: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                 HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr, LAND: gl.constexpr = False):
    """The two consumer warpgroups: the kernel's per-tile math and epilogue
    (:func:`_mla_decode_gluon_kernel`) with the copies left to the producer; an fp8 stage is
    released as soon as it is converted (the dots read the converted tile)."""
    NW: gl.constexpr = gl.num_warps()
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_D // 2, 16])
    rows = Q_LEN * num_q_heads
    m_s = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
    m_o = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    d_o = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, O_L))
    n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    g = 0
    nq = 0
    while (b < batch) & (start < hi):
        seq_len, tiles, t_lo, t_hi = _sequence_tiles(context_lens_ptr, b, stride_ctx, capacity,
                                                     lo, hi, start, BLOCK_N)
        whole = (t_lo == 0) & (t_hi == tiles)
        if (start >= lo) & (hb == 0):  # this part owns the sequence's start: its pieces
            gl.store(pieces_ptr + 2 * b, part * 2 + (start > lo).to(gl.int32))
            gl.store(pieces_ptr + 2 * b + 1,
                     gl.where(tiles > 0, (start + tiles - 1) // share - part + 1, 0))
        if t_lo < t_hi:
            mbarrier.wait(q_ready, nq % 2)
            pos = seq_len - Q_LEN + m_s // HEADS  # each score row's last visible token
            acc = gl.zeros([BLOCK_H, BLOCK_D], gl.float32, layout=O_L)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
            l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
            for i in range(t_lo, t_hi):
                s = g % 2
                mbarrier.wait(kv_ready.index(s), (g // 2) % 2)
                if LAND:  # cp.async wrote through the generic proxy; wgmma reads the async one
                    fence_async_shared()
                k_buf = k_smem.index(s)
                r_buf = r_smem.index(s)
                if KV_DTYPE != DTYPE:  # convert, then the stage is free for the next copy
                    _convert_tile(k_buf, r_buf, kc_smem, rc_smem, DTYPE, BLOCK_D, NW)
                    fence_async_shared()
                    thread_barrier()
                    mbarrier.arrive(kv_empty.index(s), count=1)
                    k_buf = kc_smem
                    r_buf = rc_smem
                acc, m_i, l_i = _tile_step(q_smem, qr_smem, k_buf, r_buf, p_smem, acc, m_i, l_i,
                                           i, pos, seq_len, n_s, qk_scale, softcap, BLOCK_H,
                                           BLOCK_N, DTYPE, HAS_SOFTCAP, S_L, O_L)
                if KV_DTYPE == DTYPE:
                    mbarrier.arrive(kv_empty.index(s), count=1)
                g += 1
            mbarrier.arrive(q_empty, count=1)  # the query is read (the barrier above)
            nq += 1
            _store_sequence(acc, m_i, l_i, whole, b.to(gl.int64), part, start > lo, hb,
                            kv_scale, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sinks_ptr,
                            num_q_heads, rows, stride_o_b, stride_o_t, stride_o_h, stride_o_d,
                            m_s, m_o, d_o, LATENT_DIM, BLOCK_D, HEADS, Q_LEN, HAS_SINKS,
                            HAS_LSE, O_L)
        elif (tiles == 0) & (start >= lo):  # an empty sequence, owned by the part at its start
            _store_empty(b, hb, out_ptr, lse_ptr, sinks_ptr, num_q_heads, rows, stride_o_b,
                         stride_o_t, stride_o_h, stride_o_d, m_s, m_o, d_o, LATENT_DIM,
                         BLOCK_D, BLOCK_H, HEADS, Q_LEN, HAS_SINKS, HAS_LSE, S_L, O_L)
        start += tiles + OVERHEAD
        b += 1


@gluon.jit(do_not_specialize=["batch", "num_pages"])
def _mla_decode_gluon_ws_kernel(
    q_ptr, qpe_ptr, ckv_ptr, kpe_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
    part_o_ptr, part_lse_ptr, pieces_ptr, sched_ptr, errors_ptr,
    kv_scale_ptr, kv_scale_val, scale_log2, sinks_ptr, softcap,
    batch, num_pages, capacity, num_q_heads,
    stride_q_b, stride_q_t, stride_q_h, stride_q_d,
    stride_qr_b, stride_qr_t, stride_qr_h, stride_qr_d,
    stride_c_page, stride_c_tok, stride_r_page, stride_r_tok,
    stride_bt_b, stride_bt_p, stride_ctx,
    stride_o_b, stride_o_t, stride_o_h, stride_o_d,
    LATENT_DIM: gl.constexpr, BLOCK_D: gl.constexpr, ROPE_DIM: gl.constexpr,
    BLOCK_DR: gl.constexpr, Q_LEN: gl.constexpr, HEADS: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    OVERHEAD: gl.constexpr, DTYPE: gl.constexpr, KV_DTYPE: gl.constexpr,
    SCALE_FROM_PTR: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    LAND: gl.constexpr = False,
):
    """:func:`_mla_decode_gluon_kernel`'s parts, schedule, workspace and math, warp-specialized:
    a producer warpgroup (``PRODUCER_REGS`` registers a thread) issues every copy, the two
    consumer warpgroups (the registers it gives up) only convert and compute; two latent
    stages and the query hand over through mbarriers (``q_ready``/``q_empty``,
    ``kv_ready``/``kv_empty``). ``LAND``: the producer never waits for its own tile copies
    (``_ws_producer``; opt-in, perf-notes step 60)."""
    gl.static_assert(num_warps == 8, "two consumer warpgroups")
    gl.static_assert(BLOCK_H == 64, "one wgmma M a warpgroup")
    part = gl.program_id(0)
    hb = gl.program_id(1)
    q_smem, qr_smem, k_smem, r_smem, kc_smem, rc_smem, p_smem = _latent_buffers(
        DTYPE, KV_DTYPE, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DR)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=1)
    for s in gl.static_range(2):
        # LAND: every producer thread arrives as its copies land; else one, after them all
        mbarrier.init(kv_ready.index(s), count=_PRODUCER_THREADS if LAND else 1)
        mbarrier.init(kv_empty.index(s), count=1)

    lo, hi, b, start, share, kv_scale, qk_scale = _part_record(
        sched_ptr, part, kv_scale_ptr, kv_scale_val, scale_log2, SCALE_FROM_PTR)
    gl.warp_specialize([
        (_ws_consumer, (q_smem, qr_smem, k_smem, r_smem, kc_smem, rc_smem, p_smem, q_ready,
                        q_empty, kv_ready, kv_empty, context_lens_ptr, out_ptr, lse_ptr,
                        part_o_ptr, part_lse_ptr, pieces_ptr, sinks_ptr, softcap, kv_scale,
                        qk_scale, part, lo, hi, b, start, share, hb, batch, capacity,
                        num_q_heads, stride_ctx, stride_o_b, stride_o_t, stride_o_h,
                        stride_o_d, LATENT_DIM, BLOCK_D, ROPE_DIM, BLOCK_DR, Q_LEN, HEADS,
                        BLOCK_H, BLOCK_N, OVERHEAD, DTYPE, KV_DTYPE, HAS_SOFTCAP, HAS_SINKS,
                        HAS_LSE, LAND)),
        (_ws_producer, (q_smem, qr_smem, k_smem, r_smem, q_ready, q_empty, kv_ready, kv_empty,
                        q_ptr, qpe_ptr, ckv_ptr, kpe_ptr, block_tables_ptr, context_lens_ptr,
                        errors_ptr, lo, hi, b, start, hb, batch, num_pages, capacity,
                        stride_q_b, stride_q_t, stride_q_h, stride_q_d,
                        stride_qr_b, stride_qr_t, stride_qr_h, stride_qr_d,
                        stride_c_page, stride_c_tok, stride_r_page, stride_r_tok,
                        stride_bt_b, stride_bt_p, stride_ctx, LATENT_DIM, BLOCK_D, ROPE_DIM,
                        BLOCK_DR, Q_LEN, HEADS, BLOCK_H, BLOCK_N, PAGE_SIZE, OVERHEAD, DTYPE,
                        KV_DTYPE, LAND)),
    ], [4], [PRODUCER_REGS])
