"""The paged prefill kernel's Hopper path in Gluon (``triton.experimental.gluon``): the same
rows, keys and loops as :mod:`pagedattn.kernels.prefill`, with FlashAttention-3's structure,
which plain Triton cannot express.

* **Warp specialization.** A producer warpgroup (four warps, 80 registers a thread) gathers
  the query once and every K and V tile through the block table with ``cp.async`` into
  shared memory; the two consumer warpgroups (eight warps, the registers the producer gave
  up) only compute. They hand the stages over through mbarriers, as FA3's paged path
  without TMA does: the producer loads a tile's page ids once (a tile ahead), issues its K
  and its V as one copy each, and each of its threads arrives on the stage's ``kv_ready``
  when its own copies land (``cp.async.mbarrier.arrive.noinc``), so it never waits for a
  copy, only for a stage the consumers have released (``kv_empty``). The consumers fence a
  landed stage for the tensor cores' proxy before their dots read it. Nothing else
  synchronizes the two sides, so later tiles' copies run under tile ``j``'s dots
  (docs/perf-notes.md steps 54 and 56). ``SPLIT`` makes each consumer warpgroup a partition
  of its own (64 rows, four warps): each releases a stage itself (``kv_empty`` expects two
  arrivals), so the two drift apart and one's softmax can run under the other's dots
  (step 58); ``PING_PONG`` orders them so it does: they take turns issuing their scores'
  dots (FA3's ping-pong, through two mbarriers; step 59).
* **P stays in registers.** The probabilities are the second dot's A operand straight from
  the score's registers (wgmma's register-A form), not a trip through shared memory.

**Rows.** A program owns 128 query rows of one sequence and one query head (``G_PACK = 1``:
long chunks; short chunks that pack the GQA group stay on the plain kernel). Block row ``r``'s
sequence, first row, row count and first token's position come from
:func:`pagedattn.kernels.prefill._prefill_schedule_kernel` (plain Triton, one launch before:
Gluon 3.6 has no ``cumsum`` for the scan of ``query_start_loc``), which also reports clamped
metadata. **Keys**: tiles ``[0, kv_end)``; those below the block's first token (rounded down
to a tile) unmasked, the diagonal ones masked per row; a key past ``kv_end`` reads row
``kv_end - 1`` (never a page past the sequence's); page ids clamped to ``[0, num_pages)``
and reported. No variant (window, soft-cap, sinks, ALiBi): those plans run the plain kernel.

Shared memory: the query (128 × D) and ``STAGES`` stages of K and V (``BLOCK_N`` × D each):
160 KB at D = 128 with 128-key tiles two deep.

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
    mbarrier,
    mbarrier_arrive,
    report_block_tables,
    thread_barrier,
    wait_group,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_LN2 = gl.constexpr(0.6931471805599453)
_ROWS_A_COPY = gl.constexpr(32)  # the producer copies the query 32 rows at a time
_PRODUCER_THREADS = gl.constexpr(128)  # one warpgroup
_SPLIT_CONSUMER_REGS = gl.constexpr(208)  # SPLIT: the second consumer partition's registers


@gluon.jit
def _tile_page_ids(bt_row_ptr, stride_bt_p, n0, kv_end, live, PAGE_SIZE: gl.constexpr,
                   BLOCK_N: gl.constexpr, LD: gl.constexpr):
    """Tokens ``n0 .. n0 + BLOCK_N`` of a tile (one a row of ``LD``), a token at or past
    ``kv_end`` as token ``kv_end - 1`` (never a page past the sequence's), and their raw page
    ids: ``(tokens, ids)``; nothing is loaded unless ``live`` (ids 0)."""
    toks = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD)), kv_end - 1)
    ids = gl.load(bt_row_ptr + (toks // PAGE_SIZE) * stride_bt_p, mask=live & (toks >= 0),
                  other=0)
    return toks, ids


@gluon.jit
def _producer(q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty,
              query_ptr, key_cache_ptr, value_cache_ptr, bt_row_ptr, errors_ptr,
              row0, rows_here, head, kv_head, kv_end, n_tiles, b, report_pages, num_pages,
              stride_q_t, stride_q_h, stride_k_page, stride_k_tok, stride_k_head,
              stride_v_page, stride_v_tok, stride_v_head, stride_bt_p,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):
    """The producer warpgroup: the query, then each tile's keys and values into the stage
    ``j % STAGES`` once the consumers have released it, one ``cp.async`` for the tile's K and
    one for its V; each thread then arrives on the stage's ``kv_ready`` when its copies have
    landed (``cp.async.mbarrier.arrive.noinc``: the barrier expects the warpgroup's 128
    arrivals), so the producer never waits for its own copies, only for a free stage. A
    tile's page ids are loaded once, for K and V, a tile ahead. Reports a clamped page id."""
    # 16-byte vectors along the head dim: HEAD_DIM // 8 threads a row
    TPR: gl.constexpr = HEAD_DIM // 8
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [gl.num_warps(), 1], [1, 0])
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    every_col = gl.full([1, HEAD_DIM], 1, gl.int1, layout=LD)
    for r0 in gl.static_range(0, BLOCK_M, _ROWS_A_COPY):
        i = r0 + gl.arange(0, _ROWS_A_COPY, layout=gl.SliceLayout(1, LD))
        rows = row0.to(gl.int64) + gl.minimum(i, gl.maximum(rows_here - 1, 0))
        ptrs = query_ptr + rows[:, None] * stride_q_t + head * stride_q_h + cols[None, :]
        async_copy_global_to_shared(q_smem.slice(r0, _ROWS_A_COPY, dim=0), ptrs,
                                    mask=(i < rows_here)[:, None] & every_col)
    mbarrier_arrive(q_ready, increment_count=False)
    k_off = kv_head.to(gl.int64) * stride_k_head
    v_off = kv_head.to(gl.int64) * stride_v_head
    bad = gl.zeros([BLOCK_N], gl.int1, layout=gl.SliceLayout(1, LD))
    toks_next, ids_next = _tile_page_ids(bt_row_ptr, stride_bt_p, 0, kv_end, n_tiles > 0,
                                         PAGE_SIZE, BLOCK_N, LD)
    for j in range(n_tiles):
        s = j % STAGES
        toks, ids = toks_next, ids_next
        # tile j + 1's page ids: their load flies while this stage is awaited and filled
        toks_next, ids_next = _tile_page_ids(bt_row_ptr, stride_bt_p, (j + 1) * BLOCK_N,
                                             kv_end, j + 1 < n_tiles, PAGE_SIZE, BLOCK_N, LD)
        out = (ids < 0) | (ids >= num_pages)
        bad = bad | out
        page = gl.where(out, 0, ids).to(gl.int64)
        slot = (toks % PAGE_SIZE).to(gl.int64)
        # the consumers released this stage's previous tile (the first round: nothing to wait)
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) + 1) % 2, pred=j >= STAGES)
        k_rows = page * stride_k_page + slot * stride_k_tok + k_off
        async_copy_global_to_shared(k_smem.index(s),
                                    key_cache_ptr + k_rows[:, None] + cols[None, :])
        v_rows = page * stride_v_page + slot * stride_v_tok + v_off
        async_copy_global_to_shared(v_smem.index(s),
                                    value_cache_ptr + v_rows[:, None] + cols[None, :])
        mbarrier_arrive(kv_ready.index(s), increment_count=False)
    commit_group()
    wait_group(0)  # the warpgroup's last copies have landed before it exits
    if (gl.max(bad.to(gl.int32), axis=0) > 0) & report_pages:
        report_block_tables(errors_ptr, b)


@gluon.jit
def _softmax_tile(sc, m_i, l_i, j, full_tiles, pos, tok0, kv_end, qk_scale):
    """One tile's online-softmax step in the exp2 domain: ``(p, alpha, m, l)``. Tiles below
    ``full_tiles`` are seen whole by every row (finite scores, no mask); the diagonal ones
    keep each row's keys ``<= pos`` below ``kv_end`` (``tok0``: the tile's token offsets).
    ``qk_scale >= 0`` (the launcher sends a negative scale to the plain kernel), so a whole
    tile's row max is taken before the scale, as the plain kernel's ``_unmasked_probs`` does,
    and clamped at 0: a product fused into the subtraction may exceed its rounded max."""
    if j < full_tiles:
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(gl.minimum(sc * qk_scale - m_new[:, None], 0.0))
    else:
        sc = sc * qk_scale
        tok = j * tok0.shape[0] + tok0
        seen = (tok[None, :] <= pos[:, None]) & (tok < kv_end)[None, :]
        sc = gl.where(seen, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        alpha = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - m_new))
        p = gl.where(sc == float("-inf"), 0.0, gl.exp2(gl.minimum(sc - m_new[:, None], 0.0)))
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, turn,
              out_ptr, lse_ptr, row0, rows_here, head, p0, kv_end, n_tiles,
              qk_scale, v_scale, num_q_heads, stride_o_t, stride_o_h,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, DTYPE: gl.constexpr, HAS_LSE: gl.constexpr,
              OVERLAP: gl.constexpr, NW: gl.constexpr, PING_PONG: gl.constexpr = False,
              ME: gl.constexpr = 0):
    """``BLOCK_M`` query rows from ``row0`` (positions from ``p0``) on ``NW`` warps: the two
    consumer warpgroups together (128 rows, eight warps, one release a stage), or one of
    them as a partition of its own (64 rows, four warps: ``SPLIT``, each releases the stage
    itself). ``S = Q·Kᵀ``, the online softmax in the exp2 domain (unmasked below the
    diagonal: the tiles wholly at or below the first row's position), ``O += P·V`` with
    ``P`` from registers; the normalized output and the LSE. ``OVERLAP`` (FA3's
    intra-warpgroup overlap): tile ``j + 1``'s ``Q·Kᵀ`` is issued before tile ``j``'s
    softmax, so the tensor cores work while the softmax runs (one score tile more in
    registers; the last iteration recomputes its own tile's scores rather than branch).
    ``PING_PONG`` (``SPLIT`` without the overlap; FA3's ordering of its two consumer
    warpgroups): consumer ``ME`` issues tile ``j``'s ``Q·Kᵀ`` only in its turn and then hands
    the turn to the other (``turn``: two mbarriers, one arrival a phase), so the two
    alternate on the tensor cores and one's softmax runs under the other's dots: consumer 0
    goes first, and waits before tile ``j > 0`` for consumer 1 to have issued tile ``j - 1``;
    consumer 1 waits before tile ``j`` for consumer 0 to have issued it."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                  instr_shape=[16, HEAD_DIM, 16])
    full_tiles = gl.maximum(p0 + 1, 0) // BLOCK_N  # tiles wholly at or below p0: unmasked
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    m_s = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    pos = p0 + m_s  # each row's position: it sees keys <= pos
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=O_L)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_L))
    zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
    mbarrier.wait(q_ready, 0)
    fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads the async one
    if OVERLAP:
        sc = zeros_s
        if n_tiles > 0:  # tile 0's scores before the loop
            mbarrier.wait(kv_ready.index(0), 0)
            fence_async_shared()
            sc = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zeros_s,
                               use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc,))
        last = gl.maximum(n_tiles - 1, 0)
        for j in range(n_tiles):
            s = j % STAGES
            nxt = gl.minimum(j + 1, last)  # the last iteration: its own tile again
            mbarrier.wait(kv_ready.index(nxt % STAGES), (nxt // STAGES) % 2)
            fence_async_shared()
            sn = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), zeros_s,
                               use_acc=False, is_async=True)
            p, alpha, m_i, l_i = _softmax_tile(sc, m_i, l_i, j, full_tiles, pos, n_s, kv_end,
                                               qk_scale)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p_op = gl.convert_layout(p.to(DTYPE), P_L)
            acc = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
            sn, acc = warpgroup_mma_wait(0, deps=(sn, acc))
            thread_barrier()  # this partition's warps' dots have read the stage
            mbarrier.arrive(kv_empty.index(s), count=1)
            sc = sn
    else:
        for j in range(n_tiles):
            s = j % STAGES
            mbarrier.wait(kv_ready.index(s), (j // STAGES) % 2)
            fence_async_shared()
            if PING_PONG:  # consumer ME's turn: phase j - 1 + ME of its barrier complete
                if ME == 1:  # consumer 0 has issued tile j
                    mbarrier.wait(turn.index(1), j % 2)
                elif j > 0:  # consumer 1 has issued tile j - 1 (consumer 0 goes first)
                    mbarrier.wait(turn.index(0), (j + 1) % 2)
            sc = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), zeros_s,
                               use_acc=False, is_async=True)
            if PING_PONG:  # every warp of the partition has issued: the other's turn
                thread_barrier()
                mbarrier.arrive(turn.index(1 - ME), count=1)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            p, alpha, m_i, l_i = _softmax_tile(sc, m_i, l_i, j, full_tiles, pos, n_s, kv_end,
                                               qk_scale)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p_op = gl.convert_layout(p.to(DTYPE), P_L)
            acc = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            thread_barrier()  # this partition's warps' dots have read the stage
            mbarrier.arrive(kv_empty.index(s), count=1)

    m_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
    inv = gl.where(l_i > 0, v_scale / gl.where(l_i > 0, l_i, 1.0), 0.0)
    o = acc * gl.convert_layout(inv, gl.SliceLayout(1, O_L))[:, None]
    rows_o = row0.to(gl.int64) + m_o
    o_ptrs = out_ptr + rows_o[:, None] * stride_o_t + head * stride_o_h + d_o[None, :]
    gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(m_o < rows_here)[:, None])
    if HAS_LSE:
        lse = gl.where(l_i > 0, (m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0))) * _LN2,
                       float("-inf"))
        rows_s = row0.to(gl.int64) + m_s
        gl.store(lse_ptr + rows_s * num_q_heads + head, lse, mask=m_s < rows_here)


@gluon.jit(do_not_specialize=["num_pages", "stride_bt_b"])
def _paged_prefill_gluon_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, out_ptr, lse_ptr, sched_ptr,
    errors_ptr, k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale,
    k_scale_val, v_scale_val, scale_log2, num_pages, group,
    stride_q_t, stride_q_h,
    stride_k_page, stride_k_tok, stride_k_head,
    stride_v_page, stride_v_tok, stride_v_head,
    stride_bt_b, stride_bt_p, stride_o_t, stride_o_h,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, DTYPE: gl.constexpr,
    SCALE_FROM_PTR: gl.constexpr, HAS_LSE: gl.constexpr, OVERLAP: gl.constexpr,
    SPLIT: gl.constexpr, num_warps: gl.constexpr, PING_PONG: gl.constexpr = False,
):
    gl.static_assert(num_warps == (4 if SPLIT else 8),
                     "two consumer warpgroups: the default partition's eight warps, or four "
                     "and a partition of four more (SPLIT)")
    gl.static_assert(OVERLAP < STAGES, "producer and consumers would wait on each other")
    gl.static_assert(not PING_PONG or (SPLIT and not OVERLAP),
                     "the ping-pong orders two consumer partitions (SPLIT), without the overlap")
    gl.static_assert(BLOCK_M == 128, "64 rows a consumer warpgroup")
    r = gl.program_id(0)
    head = gl.program_id(1)
    num_q_heads = gl.num_programs(1)
    kv_head = head // group
    # the block row's schedule (_prefill_schedule_kernel): b (-1: none), first row, rows,
    # first token's position, kv_end, whether its length was not clamped
    b = gl.load(sched_ptr + r * 8)
    row0 = gl.load(sched_ptr + r * 8 + 1)
    rows_here = gl.load(sched_ptr + r * 8 + 2)
    p0 = gl.load(sched_ptr + r * 8 + 3)
    kv_end = gl.load(sched_ptr + r * 8 + 4)
    report_pages = gl.load(sched_ptr + r * 8 + 5) != 0
    valid = b >= 0
    n_tiles = gl.where(valid, gl.cdiv(kv_end, BLOCK_N), 0)
    rows_here = gl.where(valid, rows_here, 0)
    if SCALE_FROM_PTR:
        k_scale = gl.load(k_scale_ptr + kv_head * stride_k_scale).to(gl.float32)
        v_scale = gl.load(v_scale_ptr + kv_head * stride_v_scale).to(gl.float32)
    else:
        k_scale = k_scale_val
        v_scale = v_scale_val
    qk_scale = scale_log2 * k_scale
    bt_row = block_tables_ptr + gl.maximum(b, 0).to(gl.int64) * stride_bt_b

    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], DTYPE)
    KV_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], DTYPE)
    q_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_M, HEAD_DIM], Q_SL)
    k_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_DIM], KV_SL)
    v_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_DIM], KV_SL)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = kv_empty  # PING_PONG: consumer c's turn, one arrival (the other consumer's) a phase
    if PING_PONG:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(turn.index(c), count=1)
    # the producer's every thread arrives when its copies land (_PRODUCER_THREADS arrivals);
    # a consumer partition's release is one arrival, its first thread after its barrier
    mbarrier.init(q_ready, count=_PRODUCER_THREADS)
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(s), count=_PRODUCER_THREADS)
        mbarrier.init(kv_empty.index(s), count=2 if SPLIT else 1)

    # the producer's entry is written out in both calls: Gluon 3.6 neither binds a tuple that
    # holds a JIT function to a name nor keeps constexprs constant through a tuple of arguments
    if SPLIT:  # a partition a warpgroup: they drift apart, one's softmax under the other's dots
        HALF: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_consumer, (q_smem.slice(0, HALF, dim=0), k_smem, v_smem, q_ready, kv_ready,
                         kv_empty, turn, out_ptr, lse_ptr, row0, gl.minimum(rows_here, HALF),
                         head, p0, kv_end, n_tiles, qk_scale, v_scale, num_q_heads,
                         stride_o_t, stride_o_h, HEAD_DIM, HALF, BLOCK_N, STAGES, DTYPE,
                         HAS_LSE, OVERLAP, 4, PING_PONG, 0)),
            (_consumer, (q_smem.slice(HALF, HALF, dim=0), k_smem, v_smem, q_ready, kv_ready,
                         kv_empty, turn, out_ptr, lse_ptr, row0 + HALF,
                         gl.maximum(rows_here - HALF, 0), head, p0 + HALF, kv_end, n_tiles,
                         qk_scale, v_scale, num_q_heads, stride_o_t, stride_o_h, HEAD_DIM,
                         HALF, BLOCK_N, STAGES, DTYPE, HAS_LSE, OVERLAP, 4, PING_PONG, 1)),
            (_producer, (q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, query_ptr,
                         key_cache_ptr, value_cache_ptr, bt_row, errors_ptr, row0, rows_here,
                         head, kv_head, kv_end, n_tiles, b, report_pages, num_pages,
                         stride_q_t, stride_q_h, stride_k_page, stride_k_tok, stride_k_head,
                         stride_v_page, stride_v_tok, stride_v_head, stride_bt_p, HEAD_DIM,
                         BLOCK_M, BLOCK_N, PAGE_SIZE, STAGES)),
        ], [4, _PRODUCER_THREADS // 32], [_SPLIT_CONSUMER_REGS, 80])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, turn,
                         out_ptr, lse_ptr, row0, rows_here, head, p0, kv_end, n_tiles,
                         qk_scale, v_scale, num_q_heads, stride_o_t, stride_o_h,
                         HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DTYPE, HAS_LSE, OVERLAP, 8)),
            (_producer, (q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, query_ptr,
                         key_cache_ptr, value_cache_ptr, bt_row, errors_ptr, row0, rows_here,
                         head, kv_head, kv_end, n_tiles, b, report_pages, num_pages,
                         stride_q_t, stride_q_h, stride_k_page, stride_k_tok, stride_k_head,
                         stride_v_page, stride_v_tok, stride_v_head, stride_bt_p, HEAD_DIM,
                         BLOCK_M, BLOCK_N, PAGE_SIZE, STAGES)),
        ], [_PRODUCER_THREADS // 32], [80])
