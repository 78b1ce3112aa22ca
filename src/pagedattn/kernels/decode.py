"""The production decode kernel behind ``impl="auto"``: GQA-packed, multi-page tiles,
token-balanced split-KV planned on the device, and a log-sum-exp merge.

**Work units.** A unit is (split row ``r``, kv head): tokens ``[s·chunk_b, min((s+1)·chunk_b,
len_b))`` of sequence ``b`` for the whole query group of one kv head. Sequence ``b`` owns rows
``[start_b, start_b + n_b)``, ``n_b = ceil(len_b / chunk_b)``; an empty sequence owns none.

**Splits decided on the device.** Every program reads ``context_lens`` (no host sync: a CUDA
graph replayed with new lengths re-plans by itself) and sizes one chunk for the batch so that
its token-work spreads over about ``target_units`` units: ``chunk = roundup(max(min_chunk,
ceil(total_tokens · num_kv_heads / target_units)), BLOCK_N)``, and sequence ``b`` is cut
into ``ceil(len_b / chunk)`` near-equal pieces. Long sequences get many splits and short ones
one, so the longest no longer sets the time. ``Σ ceil(len_b / chunk) ≤ total / chunk +
batch``, so the rows fit the workspace the host sized from shapes alone. A forced
``num_splits`` gives ``chunk_b = roundup(ceil(len_b / num_splits), BLOCK_N)``.

**Grid.** One program per unit ``u``: ``r = u // num_kv_heads``, kv head ``u % num_kv_heads``;
``r → b`` by a vector scan of ``context_lens`` (``BLOCK_B`` a step; the batch size is a
runtime value, never a constexpr). Programs past the real rows exit after the scan.

**One unit.** The query group, padded to ``BLOCK_H ≥ 16`` rows, is one tile; the token loop
(:func:`~pagedattn.kernels.steps._attend_tiles`) walks ``BLOCK_N``-token tiles that may span
pages, loads K and V once for the group, and runs the online softmax in the exp2 domain, the
scale applied to the fp32 scores (never folded into a 16-bit ``q``: case B16). fp8 caches dot
in fp16, the query scaled per row by a power of two into fp16's range first (``Q_POW2_SCALE``,
exact: case N07); fp32 caches dot in split bf16 (``bf16x3``; ``tf32x3`` in the interpreter).

**The merge.** A sequence with one row writes its result (and LSE) directly; otherwise each
unit writes its unnormalized partial ``(m, l, acc)`` to its workspace row, and the rows are
combined with log-sum-exp rescaling in one of three places, which the launcher chooses:

* ``FOLD_MERGE``: the last unit of a (sequence, kv head) to arrive (one ``acq_rel`` atomic
  on a counter that it resets) merges the pair's rows here, and no merge kernel runs;
* ``_merge_per_group_kernel``: one program per (sequence, kv head), the same
  ``_merge_group_rows`` (so a folded merge's bits are its), launched as a programmatic
  dependent on sm_90+ (``PDL``);
* ``_merge_per_head_kernel``: one program per (sequence, query head), when the per-group
  programs would not fill the SMs.

**Variants** are the fields of one constexpr, ``VARIANTS`` (:data:`pagedattn.options.
Variants`: one flag per option); with every flag off the compiled code is the plain
kernel's, instruction for instruction. The window (``HAS_WINDOW``) also bounds the plan: only
the tiles that hold visible keys are split, so no page before the window is read. The sink
(``HAS_SINKS``) joins the denominator once, where the result is written (the unit, or the
merge). ``BATCH_INVARIANT`` fixes the chunk at ``min_chunk``. Multi-token queries (``Q_LEN >
1``) make the tile's rows ``Q_LEN × group`` (K/V read once for every token), each row causal
and bottom-right aligned.

**Schedules and fast forms**, set by the launcher where they are exact: ``ONE_UNIT`` (no
sequence splits: program ``(b, kv head)`` takes the whole sequence, no scan, no merge),
``LEAN_SOFTMAX`` (every row sees a key in every tile: exactly rounded products, no clamp, no
select), ``SLOT_OFFSETS_I32``
(in-page offsets in int32 where both caches allow), ``FP8_V_PAIRS`` (fp8 values read as
16-bit pairs of dims). Lengths are clamped to the table's capacity; block-table entries past
``ceil(len / page_size)`` are never read.

**Structure.** The kernels are their steps in order, each a ``@triton.jit`` helper that Triton
inlines: ``_plan_unit`` and ``_unit_tokens`` (:mod:`pagedattn.kernels.paging`), the query and
the token loop, ``_store_result`` or ``_store_partial`` (:mod:`pagedattn.kernels.steps`),
and the merges (:mod:`pagedattn.kernels.merge`). ``DESIGN.md`` draws the path; the
measurements behind each choice are in ``docs/perf-notes.md``.
"""

import triton
import triton.language as tl

from pagedattn.kernels.errors import CONTEXT_LENS, _report
from pagedattn.kernels.merge import (
    _arrive,
    _empty_seq_result,
    _empty_seq_rows,
    _merge_group_rows,
    _pdl_launch_dependents,
    _pdl_wait,
    _seq_rows,
    _store_empty,
    _store_merged,
)
from pagedattn.kernels.paging import (
    _clamped_context_len,
    _dim_mask,
    _plan_unit,
    _program_sequence,
    _unit_tokens,
)
from pagedattn.kernels.softmax import LOG2E, _fold_sink, _natural_lse, _rescale
from pagedattn.kernels.steps import (
    _attend_tiles,
    _kv_scales,
    _load_query,
    _lse_ptrs,
    _store_partial,
    _store_result,
    _tile_ptrs,
    _tile_rows,
)

# runtime values that change from call to call: never specialized (no recompiles for a new
# batch size, table width or split policy)
_RUNTIME_ARGS = ["batch", "max_pages", "num_pages", "forced_splits", "min_chunk", "target_units",
                 "target_units_ragged", "stride_q_b", "stride_bt_b", "stride_o_b",
                 "window_left", "stride_q_t", "stride_o_t"]

@triton.jit(do_not_specialize=_RUNTIME_ARGS)
def _paged_decode_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, lse_ptr,
    errors_ptr,  # [1] int64: the device's error word (pagedattn._errors)
    part_ml_ptr,  # [rows_max, num_q_heads, 2] fp32 (m, l), exp2 domain
    part_acc_ptr,  # [rows_max, num_q_heads, BLOCK_D] fp32, unnormalized
    # [batch, 2] int32 (start_b, n_b): the unit (b, s=0, kv head 0), or (0, 0); FOLD_MERGE:
    # the [batch, num_kv_heads] int32 arrival counters instead, zero between launches
    seq_rows_ptr,
    k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale,  # [num_kv_heads] or 0-d
    k_scale_val, v_scale_val,  # Python-float scales (used when not SCALE_FROM_PTR)
    scale_log2,
    sinks_ptr, alibi_ptr,  # [num_q_heads] fp32 each (read under HAS_SINKS / HAS_ALIBI only)
    window_left, softcap,  # read under HAS_WINDOW / HAS_SOFTCAP only
    stride_q_t, stride_o_t,  # the query token's stride in a 4-D query / out (Q_LEN > 1 only)
    batch, num_kv_heads, group, max_pages, forced_splits,
    min_chunk, target_units, target_units_ragged,  # split sizing (runtime: never recompiles)
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_b, stride_bt_p, stride_ctx,
    stride_o_b, stride_o_h, stride_o_d,
    num_pages,  # the caches' pages: a page id outside [0, num_pages) reads page 0, reported
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,  # lengths per vector load of the split planner
    PAGE_SIZE: tl.constexpr,  # a model constant: token -> (page, slot) by shifts/multiplies
    DOT_DTYPE: tl.constexpr,  # operand dtype of the dots
    DOT_PRECISION: tl.constexpr,  # "bf16x3" / "tf32x3" for fp32 operands, else default
    Q_POW2_SCALE: tl.constexpr,  # rescale each query row by a power of two into DOT_DTYPE's range
    SCALE_FROM_PTR: tl.constexpr,  # scales come as tensors (graph-safe), not floats
    HAS_LSE: tl.constexpr,
    # the options' flags (pagedattn.options.Variants): HAS_WINDOW (a sliding window of
    # window_left keys), HAS_SOFTCAP (softcap * tanh(s / softcap)), HAS_SINKS (one sink logit
    # per query head), HAS_ALIBI (+ slope_h * (p - i)), BATCH_INVARIANT (chunk = min_chunk,
    # whatever the batch)
    VARIANTS: tl.constexpr,
    Q_LEN: tl.constexpr = 1,  # query tokens per sequence; rows = Q_LEN x group (token-major)
    ONE_UNIT: tl.constexpr = False,  # one unit per sequence (row r = sequence b): no merge
    FP8_V_PAIRS: tl.constexpr = 0,  # fp8 V read as 16-bit dim pairs: 1 e4m3, 2 e5m2 (0: off)
    ASM: tl.constexpr = False,  # inline PTX (GPU only): FP8_V_PAIRS' cvt, the exact products
    PDL: tl.constexpr = False,  # the merge is launched as a programmatic dependent (sm_90+)
    FOLD_MERGE: tl.constexpr = False,  # the last unit of a (sequence, kv head) merges its rows
    LEAN_SOFTMAX: tl.constexpr = False,  # every row sees a key in every tile: no clamp, no select
    SLOT_OFFSETS_I32: tl.constexpr = False,  # a token's offset within its page in int32
):
    tl.static_assert(BLOCK_H >= 16, "tl.dot needs at least 16 rows (the group is padded)")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D pads HEAD_DIM")
    HAS_WINDOW: tl.constexpr = VARIANTS.HAS_WINDOW
    HAS_SINKS: tl.constexpr = VARIANTS.HAS_SINKS
    HAS_ALIBI: tl.constexpr = VARIANTS.HAS_ALIBI
    BATCH_INVARIANT: tl.constexpr = VARIANTS.BATCH_INVARIANT
    _pdl_launch_dependents(PDL)  # the merge's programs may launch once all of ours run
    # every length is read clamped to the table's capacity; program p reports those of
    # sequences p, p + programs, ... that were not (a split grid has a program a sequence)
    for b_chk in range(tl.program_id(0), batch, tl.num_programs(0)):
        raw_len = tl.load(context_lens_ptr + b_chk * stride_ctx)
        _report(errors_ptr, (raw_len < 0) | (raw_len > max_pages * PAGE_SIZE * (num_pages > 0)),
                CONTEXT_LENS, b_chk, raw_len)
    u = tl.program_id(0)  # one split unit per program: (row r, kv head)
    r = u // num_kv_heads
    kv_head = u % num_kv_heads
    num_q_heads = num_kv_heads * group
    capacity = max_pages * PAGE_SIZE * (num_pages > 0)  # no page: every length clamps to 0
    b, start_b, chunk = _plan_unit(context_lens_ptr, r, batch, stride_ctx, capacity,
                                   num_kv_heads, min_chunk, target_units, target_units_ragged,
                                   forced_splits, window_left, BLOCK_B, BLOCK_N, Q_LEN,
                                   HAS_WINDOW, BATCH_INVARIANT, ONE_UNIT)
    if FOLD_MERGE:  # no merge kernel: an empty sequence's result comes from program (b, kv)
        _empty_seq_result(out_ptr, lse_ptr, sinks_ptr, context_lens_ptr, u, batch,
                          num_kv_heads, group, num_q_heads, stride_ctx, capacity, stride_o_b,
                          stride_o_t, stride_o_h, stride_o_d, HEAD_DIM, BLOCK_H, BLOCK_D,
                          Q_LEN, HAS_SINKS, HAS_LSE)
    elif not ONE_UNIT:  # no unit writes an empty sequence's merge entry: program b does
        _empty_seq_rows(seq_rows_ptr, context_lens_ptr, u, batch, stride_ctx, capacity)
    if b >= batch:  # past the last real row: the grid is sized from shapes, not lengths
        return
    ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity)
    tok_start, tok_end, n_rows, win_first = _unit_tokens(ctx, r, start_b, chunk, forced_splits,
                                                         window_left, Q_LEN, BLOCK_N,
                                                         HAS_WINDOW, ONE_UNIT)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    # Q_LEN x group rows: K/V are read once for every query token
    q_tok, heads, mask_h, q_pos = _tile_rows(offs_h, kv_head, group, ctx, Q_LEN)
    q_ptrs = _tile_ptrs(query_ptr, b, q_tok, heads, offs_d, stride_q_b, stride_q_t,
                        stride_q_h, stride_q_d, Q_LEN)
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_hd = mask_h[:, None] & mask_d[None, :]
    k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale,
                                  k_scale_val, v_scale_val, kv_head, SCALE_FROM_PTR)
    q_dot, qk_scale = _load_query(q_ptrs, mask_hd, scale_log2, k_scale, BLOCK_H, DOT_DTYPE,
                                  Q_POW2_SCALE)
    # 64-bit: a head-major cache view can put heads more than 2^31 elements apart
    k_head = kv_head.to(tl.int64) * stride_k_head
    v_head = kv_head.to(tl.int64) * stride_v_head
    alibi2 = 0.0
    if HAS_ALIBI:  # slopes in the exp2 domain, per row
        alibi2 = tl.load(alibi_ptr + heads, mask=mask_h, other=0.0) * LOG2E

    m, l, acc = _attend_tiles(q_dot, qk_scale, alibi2, key_cache_ptr, value_cache_ptr,
                              block_tables_ptr, b, kv_head, k_head, v_head, tok_start, tok_end,
                              ctx, q_pos, win_first, window_left, softcap, offs_n, offs_d,
                              mask_d, stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
                              stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
                              stride_bt_b, stride_bt_p, num_pages, HEAD_DIM, BLOCK_H,
                              BLOCK_D, BLOCK_N, PAGE_SIZE, DOT_DTYPE, DOT_PRECISION, Q_LEN,
                              VARIANTS, FP8_V_PAIRS, ASM, LEAN_SOFTMAX, SLOT_OFFSETS_I32)

    if ONE_UNIT:  # the sequence's only unit (an empty one too: out 0)
        _store_result(out_ptr, lse_ptr, sinks_ptr, b, q_tok, heads, mask_h, offs_d, mask_hd,
                      m, l, acc, v_scale, num_q_heads, stride_o_b, stride_o_t, stride_o_h,
                      stride_o_d, Q_LEN, HAS_SINKS, HAS_LSE, ONE_UNIT)
    else:
        if n_rows == 1:  # the sequence's only unit: the result (and the sink, once) here
            _store_result(out_ptr, lse_ptr, sinks_ptr, b, q_tok, heads, mask_h, offs_d,
                          mask_hd, m, l, acc, v_scale, num_q_heads, stride_o_b, stride_o_t,
                          stride_o_h, stride_o_d, Q_LEN, HAS_SINKS, HAS_LSE, ONE_UNIT)
        else:
            _store_partial(part_ml_ptr, part_acc_ptr, r, q_tok, heads, mask_h, offs_d, m, l,
                           acc, v_scale, num_q_heads, BLOCK_D, Q_LEN)
            if FOLD_MERGE:  # noqa: SIM102 (the pair's last unit to arrive merges its rows,
                # in the merge kernel's order)
                if _arrive(seq_rows_ptr, b, kv_head, num_kv_heads, n_rows):
                    m, l, acc = _merge_group_rows(part_ml_ptr, part_acc_ptr, start_b, n_rows,
                                                  q_tok, heads, mask_h, offs_d, num_q_heads,
                                                  BLOCK_H, BLOCK_D, Q_LEN, ".cg")
                    _store_merged(_tile_ptrs(out_ptr, b, q_tok, heads, offs_d, stride_o_b,
                                             stride_o_t, stride_o_h, stride_o_d, Q_LEN),
                                  _lse_ptrs(lse_ptr, b, q_tok, heads, num_q_heads, Q_LEN),
                                  sinks_ptr, heads, mask_h, mask_hd, m, l, acc, Q_LEN,
                                  HAS_SINKS, HAS_LSE)
        if not FOLD_MERGE:  # noqa: SIM102 (constexpr)
            if (r == start_b) & (kv_head == 0):  # the merge's rows of b (an empty b's: above)
                tl.store(seq_rows_ptr + b * 2, start_b)
                tl.store(seq_rows_ptr + b * 2 + 1, n_rows)


@triton.jit(do_not_specialize=["max_pages", "stride_o_b", "stride_o_t"])
def _merge_per_group_kernel(
    context_lens_ptr, part_ml_ptr, part_acc_ptr, seq_rows_ptr, out_ptr, lse_ptr,
    sinks_ptr,  # [num_q_heads] fp32 (HAS_SINKS only)
    num_q_heads, group, page_size, max_pages,
    stride_ctx, stride_o_b, stride_o_h, stride_o_d, stride_o_t,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_LSE: tl.constexpr,
    Q_LEN: tl.constexpr = 1,  # rows are Q_LEN x group, as in the main kernel
    HAS_SINKS: tl.constexpr = False,  # the sink is folded in here once, after the rows
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the main kernel
):
    """Grid ``(batch, num_kv_heads)``: merge the split rows of one sequence for the query
    heads of one kv head (the group, ``BLOCK_H`` rows as in the main kernel).

    Length 0: writes zeros (and LSE -inf). One row: the main kernel already wrote the result,
    and the program exits after one load round (``context_lens`` and ``seq_rows`` are loaded
    together). Several rows: ``out = Σ acc_r·2^(m_r−M) / Σ l_r·2^(m_r−M)`` with ``M = max m_r``,
    one ``[group, head_dim]`` tile per row, rows in order (their loads do not depend on each
    other, so they pipeline). The row range comes from ``seq_rows``, which the main kernel
    writes for every sequence ((0, 0) for an empty one); every row in it held tokens, so every
    ``m_r`` is finite. One program per (sequence, kv head) rather than per query head: a batch of 64
    with 32 query heads launched 2,048 programs that mostly exit at once, a launch cost that
    ncu showed (``docs/perf-notes.md``). Used when ``batch ·
    num_kv_heads`` fills the SMs; else :func:`_merge_per_head_kernel`."""
    b, kv_head, ctx = _program_sequence(context_lens_ptr, stride_ctx, max_pages, page_size)
    _pdl_wait(PDL)  # seq_rows and the partials are the main kernel's
    start, n_rows = _seq_rows(seq_rows_ptr, b)  # loaded beside the length (one round)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    q_tok, heads, mask_h, _ = _tile_rows(offs_h, kv_head, group, ctx, Q_LEN)  # as the units'
    out_ptrs = _tile_ptrs(out_ptr, b, q_tok, heads, offs_d, stride_o_b, stride_o_t, stride_o_h,
                          stride_o_d, Q_LEN)
    lse_ptrs = _lse_ptrs(lse_ptr, b, q_tok, heads, num_q_heads, Q_LEN)
    mask_hd = mask_h[:, None] & _dim_mask(offs_d, HEAD_DIM, BLOCK_D)[None, :]
    if ctx == 0:  # no key: zeros (seq_rows holds (0, 0) here)
        _store_empty(out_ptrs, lse_ptrs, sinks_ptr, heads, mask_h, mask_hd, BLOCK_H, BLOCK_D,
                     HAS_SINKS, HAS_LSE)
    elif n_rows > 1:
        m, l, acc = _merge_group_rows(part_ml_ptr, part_acc_ptr, start, n_rows, q_tok, heads,
                                      mask_h, offs_d, num_q_heads, BLOCK_H, BLOCK_D, Q_LEN, "")
        _store_merged(out_ptrs, lse_ptrs, sinks_ptr, heads, mask_h, mask_hd, m, l, acc, Q_LEN,
                      HAS_SINKS, HAS_LSE)


@triton.jit(do_not_specialize=["max_pages", "stride_o_b", "stride_o_t"])
def _merge_per_head_kernel(
    context_lens_ptr, part_ml_ptr, part_acc_ptr, seq_rows_ptr, out_ptr, lse_ptr,
    sinks_ptr,  # [num_q_heads] fp32 (HAS_SINKS only)
    num_q_heads, group, page_size, max_pages,  # group: unused (the per-group kernel's args)
    stride_ctx, stride_o_b, stride_o_h, stride_o_d,
    stride_o_t,  # unused: multi-token queries merge per group
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,  # the sink is folded in here once, after the rows
):
    """Grid ``(batch, num_q_heads)``: merge one head's split rows of one sequence. Used when
    ``batch · num_kv_heads`` is below the SM count (few sequences, many splits each: batch 1
    with 64 rows per kv head merged slower through the per-group kernel's row loop).

    Length 0: writes zeros (and LSE -inf). One row: the main kernel already wrote the result.
    Several rows: ``out = Σ acc_r·2^(m_r−M) / Σ l_r·2^(m_r−M)`` with ``M = max m_r``, taking
    ``BLOCK_R`` rows per step as one vector load (no serial chain of dependent loads). The row
    range comes from ``seq_rows``, which the main kernel writes for every sequence ((0, 0) for
    an empty one); every row in it held tokens, so every ``m_r`` is finite."""
    b, h, ctx = _program_sequence(context_lens_ptr, stride_ctx, max_pages, page_size)
    # the rows loaded beside the length, not after it (one round of loads fewer before the
    # rows: the per-head merge runs at low occupancy, where each round is latency)
    start, n_rows = _seq_rows(seq_rows_ptr, b)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    out_ptrs = out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h + offs_d * stride_o_d
    lse_out = lse_ptr + b.to(tl.int64) * num_q_heads + h
    if ctx == 0:
        tl.store(out_ptrs, tl.zeros([BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                 mask=mask_d)
        if HAS_LSE:
            if HAS_SINKS:  # no key at all: the denominator is the sink alone
                tl.store(lse_out, tl.load(sinks_ptr + h))
            else:
                tl.store(lse_out, float("-inf"))
    else:
        if n_rows > 1:
            m = float("-inf")
            l = 0.0
            acc = tl.zeros([BLOCK_D], tl.float32)
            for r0 in range(0, n_rows, BLOCK_R):
                mask_r = r0 + offs_r < n_rows
                row = (start + r0 + offs_r).to(tl.int64) * num_q_heads + h  # [BLOCK_R]
                m_r = tl.load(part_ml_ptr + row * 2, mask=mask_r, other=float("-inf"))
                l_r = tl.load(part_ml_ptr + row * 2 + 1, mask=mask_r, other=0.0)
                acc_r = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :],
                                mask=mask_r[:, None], other=0.0)  # [BLOCK_R, BLOCK_D]
                m_new = tl.maximum(m, tl.max(m_r, axis=0))  # finite: row r0 is real
                alpha = _rescale(m, m_new)
                w = tl.where(mask_r, tl.exp2(m_r - m_new), 0.0)  # [BLOCK_R]
                l = l * alpha + tl.sum(l_r * w, axis=0)
                acc = acc * alpha + tl.sum(acc_r * w[:, None], axis=0)
                m = m_new
            if HAS_SINKS:  # the sequence's rows are merged: the sink is added here, once
                m, l, alpha = _fold_sink(m, l, tl.load(sinks_ptr + h) * LOG2E)
                acc = acc * alpha
            tl.store(out_ptrs, (acc / l).to(out_ptr.dtype.element_ty), mask=mask_d)
            if HAS_LSE:
                tl.store(lse_out, _natural_lse(m, l))
