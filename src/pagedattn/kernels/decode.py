"""The production decode kernel behind ``impl="auto"``: GQA-packed, multi-page tiles,
token-balanced split-KV planned on the device, and a log-sum-exp merge.

**Work units.** A unit is (split row ``r``, kv head): tokens ``[s·chunk_b, min((s+1)·chunk_b,
len_b))`` of sequence ``b`` for the whole query group of one kv head. Rows are numbered
sequence-major: sequence ``b`` owns rows ``[start_b, start_b + n_b)`` with
``n_b = ceil(len_b / chunk_b)``, so an empty sequence owns none.

**Token-balanced splits, decided on the device.** Every program reads ``context_lens`` (no host
sync; CUDA-graph replays with new lengths re-plan by themselves) and sizes one chunk for the
whole batch so that the batch's token-work spreads over about ``target_units`` units:
``chunk = roundup(max(min_chunk, ceil(total_tokens · num_kv_heads / target_units)), BLOCK_N)``;
sequence ``b`` is cut into ``ceil(len_b / chunk)`` near-equal pieces of ``chunk_b =
roundup(ceil(len_b / ceil(len_b / chunk)), BLOCK_N)`` tokens. Long sequences get many splits
and short ones one, so the longest sequence no longer sets the time (FlashInfer's weakness on
real traces). Because ``Σ ceil(len_b / chunk) ≤ total / chunk + batch``, the rows fit the
workspace the host sized from shapes alone (``batch + target_units / num_kv_heads`` rows). A
forced ``num_splits`` gives ``chunk_b = roundup(ceil(len_b / num_splits), BLOCK_N)`` instead.

**Grid.** One program per unit ``u``: ``u → (r = u // num_kv_heads, kv head = u %
num_kv_heads)``; ``r → b`` by counting the sequences whose rows end at or before ``r`` (a
vector scan of ``context_lens`` in ``BLOCK_B`` slices; batch size is a runtime value, never a
constexpr). The launcher sizes the grid from shapes (``batch + target / num_kv_heads`` rows,
and no more than ``batch · ceil(capacity / min_chunk)``); programs past the real rows exit
after the scan. A ragged batch (mean length under half the longest) targets more units.

**One unit.** The query group, padded to ``BLOCK_H`` rows, is one tile; the program walks
``BLOCK_N``-token tiles that may span several pages (the next tile's block-table entries are
loaded one iteration ahead, so K/V loads never wait on a load of their own iteration), loads K
and V once for the whole group, and runs the online softmax in the exp2 domain with
``scale · log2(e)`` applied to the fp32 scores (fp32 accumulation; folding it into a 16-bit
``q`` would round the scores by the query's precision and cost the LSE its accuracy at large
logits, case B16). The dots are ``tl.dot`` with the group padded to ≥ 16 rows: tensor cores
for 16-bit and fp8 caches, split-TF32 (``DOT_PRECISION="tf32x3"``: fp32-level accuracy, never
plain tf32) for fp32 caches. fp8 caches are converted to fp16 in registers; the query is first
scaled per row by a power of two into fp16's range (``Q_POW2_SCALE``: exact, and the scores
divide it back out, so no cast narrows the caller's range, case N07); ``k_scale`` applies to
the scores and ``v_scale`` to the output. Where the layout allows (``FP8_V_PAIRS``), the fp8
value tile is read as 16-bit pairs of dims, which transpose through shared memory like fp16
(a byte tile was read one byte per instruction), and its even and odd dims accumulate in two
half-width P·V dots (:func:`_fp8_dim_pairs`). Token tiles are software-pipelined by Triton
(``num_stages``).

A sequence with one row writes its normalized output (and LSE) directly; otherwise each unit
writes its unnormalized partial ``(m, l, acc)`` to the workspace row, and a merge kernel
combines the rows with log-sum-exp rescaling: ``_merge_per_group_kernel`` (one program per
sequence and kv head) when those programs fill the SMs, else ``_merge_per_head_kernel`` (one
per sequence and query head, split rows vectorized; the launcher decides from shapes); on
sm_90+ the per-group merge is a programmatic dependent launch (``PDL``:
``_pdl_launch_dependents`` at the main kernel's start, ``_pdl_wait`` before the merge's first
read of the workspace). A merge fused into the main kernel's last unit (an arrival counter
per sequence and kv head) was tried and measured slower (``docs/perf-notes.md``, step 5); a
per-group merge of several split rows per load round did not pay either (step 32). Rows are
exactly the non-empty splits, so no empty split is ever formed or read. Lengths are clamped
to the table's capacity; block-table entries past ``ceil(len / page_size)`` are never read.

**Variants** are ``constexpr`` flags of this one kernel; with every flag off the compiled code
is the plain kernel's, instruction for instruction (the new runtime arguments are read under
their flag only):

* ``HAS_WINDOW`` (``window_left``): the ``Q_LEN`` query tokens together see keys ``[first,
  len)`` with ``first = max(0, len - Q_LEN - window_left)``. The planner splits only the
  tiles that hold them, from ``first`` rounded down to a multiple of ``BLOCK_N``
  (``_visible_tokens`` in both scans), so tiles stay aligned as without a window; the first
  tile's keys before ``first`` read ``first``'s own row and are masked from the scores, so
  no byte and no block-table entry before the window is read, and bytes and time scale with
  the window. With several query tokens each row also masks ``p < i - window_left``.
* ``HAS_SOFTCAP`` (``softcap``): ``cap·tanh(s / cap)`` on the natural-domain logit
  (``_soft_cap`` converts from and back to the exp2 domain), before any bias.
* ``HAS_ALIBI`` (``alibi_ptr``): ``+ slope_h·(p - i)`` (times ``log2 e``) after the soft-cap.
* ``HAS_SINKS`` (``sinks_ptr``): the sink joins the denominator exactly once, in the final
  normalization: by the unit itself when the sequence has one split row (it writes the
  result), else by the merge kernel after it has combined the rows (and by the merge for an
  empty sequence: out 0, LSE = sink). Partials in the workspace never hold it.
* ``Q_LEN`` > 1 (multi-token queries): the tile's rows are ``Q_LEN × group`` (token-major,
  ``BLOCK_H = next_pow2(Q_LEN·group)``), so K/V are read once for every query token; row
  ``(j, h)`` sits at position ``len - Q_LEN + j`` and masks keys after it (causal,
  bottom-right aligned). Partials are indexed by (split row, query token, query head); such
  a row may see no key of a split (``m = -inf``), so the merge weighs rows with
  ``_rescale`` and a token that saw no key at all gets 0 (LSE ``-inf``, or the sink).
  Multi-token plans always merge per group.
* ``BATCH_INVARIANT``: ``chunk`` is the launcher's fixed ``min_chunk`` (a multiple of
  ``BLOCK_N``) instead of a batch-wide target, so a sequence's splits, tiles and merge order
  depend on its own length only; the launcher also fixes the merge kernel (per group).
* ``ONE_UNIT``: the launcher knows from shapes that no sequence splits (the table's capacity
  is at most the smallest chunk, or ``num_splits=1``), or plans none (a sliding window whose
  (sequence, kv head) pairs fill the GPU: ``window_one_unit``): program ``(b, kv head)`` takes the
  whole sequence, without the two scans of ``context_lens``, writes the result (an empty
  sequence: 0, LSE ``-inf`` or the sink) and no merge is launched. The arithmetic of a
  non-empty sequence is the one-row path's, bit for bit.
"""

import triton
import triton.language as tl

from pagedattn.kernels.common import (
    LOG2E,
    _clamped_context_len,
    _dim_mask,
    _fold_sink,
    _natural_lse,
    _normalize,
    _page_ids,
    _pdl_launch_dependents,
    _pdl_wait,
    _rescale,
    _soft_cap,
    _softmax_block_step,
)


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


# runtime values that change from call to call: never specialized (no recompiles for a new
# batch size, table width or split policy)
_RUNTIME_ARGS = ["batch", "max_pages", "forced_splits", "min_chunk", "target_units",
                 "target_units_ragged", "stride_q_b", "stride_bt_b", "stride_o_b",
                 "window_left", "stride_q_t", "stride_o_t"]

@triton.jit(do_not_specialize=_RUNTIME_ARGS)
def _paged_decode_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, lse_ptr,
    part_ml_ptr,  # [rows_max, num_q_heads, 2] fp32 (m, l), exp2 domain
    part_acc_ptr,  # [rows_max, num_q_heads, BLOCK_D] fp32, unnormalized
    seq_rows_ptr,  # [batch, 2] int32 (start_b, n_b), written by the unit (b, s=0, kv head 0)
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
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,  # lengths per vector load of the split planner
    PAGE_SIZE: tl.constexpr,  # a model constant: token -> (page, slot) by shifts/multiplies
    DOT_DTYPE: tl.constexpr,  # operand dtype of the dots
    DOT_PRECISION: tl.constexpr,  # "tf32x3" for fp32 operands (fp32 accuracy), else default
    Q_POW2_SCALE: tl.constexpr,  # rescale each query row by a power of two into DOT_DTYPE's range
    SCALE_FROM_PTR: tl.constexpr,  # scales come as tensors (graph-safe), not floats
    HAS_LSE: tl.constexpr,
    Q_LEN: tl.constexpr = 1,  # query tokens per sequence; rows = Q_LEN x group (token-major)
    HAS_WINDOW: tl.constexpr = False,  # sliding window of window_left keys
    HAS_SOFTCAP: tl.constexpr = False,  # softcap * tanh(s / softcap)
    HAS_SINKS: tl.constexpr = False,  # one sink logit per query head
    HAS_ALIBI: tl.constexpr = False,  # + slope_h * (p - i)
    BATCH_INVARIANT: tl.constexpr = False,  # chunk = min_chunk, whatever the batch
    ONE_UNIT: tl.constexpr = False,  # one unit per sequence (row r = sequence b): no merge
    FP8_V_PAIRS: tl.constexpr = 0,  # fp8 V read as 16-bit dim pairs: 1 e4m3, 2 e5m2 (0: off)
    FP8_ASM: tl.constexpr = False,  # FP8_V_PAIRS: the packed cvt in inline PTX (GPU only)
    PDL: tl.constexpr = False,  # the merge is launched as a programmatic dependent (sm_90+)
):
    tl.static_assert(BLOCK_H >= 16, "tl.dot needs at least 16 rows (the group is padded)")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D pads HEAD_DIM")
    _pdl_launch_dependents(PDL)  # the merge's programs may launch once all of ours run
    u = tl.program_id(0)  # one split unit per program: (row r, kv head)
    r = u // num_kv_heads
    kv_head = u % num_kv_heads
    num_q_heads = num_kv_heads * group
    capacity = max_pages * PAGE_SIZE
    # ONE_UNIT: the launcher knows no sequence splits: row r is sequence b, and there is no
    # chunk to size and no scan of the lengths
    if BATCH_INVARIANT:
        # a fixed split size in tokens (the launcher passes a multiple of BLOCK_N): a
        # sequence's splits, and so its arithmetic, never depend on the rest of the batch
        chunk = min_chunk.to(tl.int32)
    elif not ONE_UNIT:
        total, longest = _total_and_max_tokens(context_lens_ptr, batch, stride_ctx, capacity,
                                               window_left, BLOCK_B, BLOCK_N, Q_LEN,
                                               HAS_WINDOW)
        work = total * num_kv_heads  # int64
        # a ragged batch (mean length under half the longest) is cut finer: whole-sequence
        # units of unequal lengths leave a tail that smaller units fill
        ragged = total * 2 < longest.to(tl.int64) * batch
        target = tl.where(ragged, target_units_ragged, target_units)
        # a multiple of BLOCK_N, so the near-equal pieces of _chunk_of are never more than
        # ceil(len / chunk) per sequence (the workspace bound of the launcher)
        chunk = tl.cdiv(tl.maximum(tl.cdiv(work, target), min_chunk), BLOCK_N) * BLOCK_N
        chunk = tl.minimum(chunk, capacity + BLOCK_N).to(tl.int32)  # no sequence is longer
    if ONE_UNIT:
        b = r
        start_b = r
    else:
        b, start_b = _locate_row(context_lens_ptr, r, batch, stride_ctx, capacity, chunk,
                                 forced_splits, window_left, BLOCK_B, BLOCK_N, Q_LEN,
                                 HAS_WINDOW)
    if b >= batch:  # past the last real row: the grid is sized from shapes, not lengths
        return
    ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity)
    n_vis = ctx
    if HAS_WINDOW:  # the window's tiles only: splits cut [start, ctx), no page before is read
        win_first = _window_first(ctx, window_left, Q_LEN)
        first, n_vis = _visible_tokens(ctx, window_left, Q_LEN, BLOCK_N)
    if ONE_UNIT:  # the whole visible range; an empty sequence writes 0 (and -inf or the sink)
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

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    if Q_LEN > 1:  # Q_LEN x group rows: K/V are read once for every query token
        q_tok, heads, mask_h = _token_rows(offs_h, kv_head, group, Q_LEN)
        q_pos = ctx - Q_LEN + q_tok  # [BLOCK_H] each row's position (< 0: sees no key)
        q_ptrs = query_ptr + (b.to(tl.int64) * stride_q_b + q_tok * stride_q_t
                              + heads * stride_q_h)[:, None] + offs_d[None, :] * stride_q_d
    else:
        mask_h = offs_h < group
        heads = kv_head * group + offs_h  # [BLOCK_H]
        q_ptrs = (query_ptr + b.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h
                  + offs_d[None, :] * stride_q_d)
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_hd = mask_h[:, None] & mask_d[None, :]

    if SCALE_FROM_PTR:
        k_scale = tl.load(k_scale_ptr + kv_head * stride_k_scale).to(tl.float32)
        v_scale = tl.load(v_scale_ptr + kv_head * stride_v_scale).to(tl.float32)
    else:
        k_scale = k_scale_val
        v_scale = v_scale_val
    q = tl.load(q_ptrs, mask=mask_hd, other=0.0).to(tl.float32)
    qk_scale = tl.zeros([BLOCK_H], tl.float32) + scale_log2 * k_scale  # per query row
    if Q_POW2_SCALE:
        # fp8 caches dot in fp16: a bf16/fp32 query may exceed fp16's range (65,504), so each
        # row is scaled by 2^e into [2^13, 2^14) first; a power of two is exact, and the
        # scores divide it back out (no cast narrows the caller's range); the exponent is
        # at most 126, so 2^e and 2^-e stay finite (a row with max |q| below 2^-114, about
        # 5e-35, made 2^e inf and the row NaN): such a row's largest element lands below 2^12,
        # still exact, and its scores are ~0 whatever fp16 rounds away
        amax = tl.max(tl.abs(q), axis=1)
        e = tl.minimum(tl.where(amax > 0, 14.0 - tl.ceil(tl.log2(amax)), 0.0), 126.0)
        q = q * tl.exp2(e)[:, None]
        qk_scale = qk_scale * tl.exp2(-e)
    q_dot = q.to(DOT_DTYPE)  # unscaled: exact for fp16/bf16 queries
    # 64-bit: a head-major cache view can put heads more than 2^31 elements apart
    k_head = kv_head.to(tl.int64) * stride_k_head
    v_head = kv_head.to(tl.int64) * stride_v_head
    if HAS_ALIBI:  # slopes in the exp2 domain, per row
        alibi2 = tl.load(alibi_ptr + heads, mask=mask_h, other=0.0) * LOG2E

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if FP8_V_PAIRS:  # even and odd dims accumulate apart (see _fp8_dim_pairs)
        acc_even = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
        offs_w = tl.arange(0, BLOCK_D // 2)
        v_words = value_cache_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        # the launcher sets FP8_V_PAIRS only for 16-byte strides and a unit dim stride
        w_mask_d = _dim_mask(offs_w, HEAD_DIM // 2, BLOCK_D // 2)  # a splat: 16-byte loads
    # page ids of the first tile; inside the loop the next tile's ids are fetched one
    # iteration ahead, so the K/V loads never wait on a block-table load of their own
    # iteration and the pipeliner can keep several tiles in flight
    tok = tok_start + offs_n
    if HAS_WINDOW:
        # a window's first tile may start before the window (tiles are whole, from a
        # multiple of BLOCK_N): its keys before ``win_first`` take the address of
        # ``win_first`` itself (a row already read, so no byte outside the window is fetched
        # and no block-table entry before it is read) and are masked out of the scores;
        # clamping addresses rather than masking loads keeps the kernel in 128 registers
        # (a load mask cost 156: perf-notes step 23). Later tiles start past ``win_first``.
        tok = tl.maximum(tok, win_first)
    page_id = _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p, tok // PAGE_SIZE,
                        tok < tok_end)
    for n0 in range(tok_start, tok_end, BLOCK_N):
        tok = n0 + offs_n
        mask_n = tok < tok_end
        if HAS_WINDOW:  # keys before the window read win_first's row (see above)
            slot = (tl.maximum(tok, win_first) % PAGE_SIZE).to(tl.int64)
        else:
            slot = (tok % PAGE_SIZE).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(key_cache_ptr + (page_id * stride_k_page + slot * stride_k_tok
                                     + k_head)[:, None] + offs_d[None, :] * stride_k_d,
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if FP8_V_PAIRS:  # [BLOCK_N, BLOCK_D // 2] 16-bit words, two fp8 dims each
            w_row = tl.multiple_of((page_id * stride_v_page + slot * stride_v_tok + v_head) // 2,
                                   8)  # the launcher's strides are multiples of 16 bytes
            v = tl.load(v_words + w_row[:, None] + offs_w[None, :],
                        mask=mask_n[:, None] & w_mask_d[None, :], other=0)
        else:
            v = tl.load(value_cache_ptr + (page_id * stride_v_page + slot * stride_v_tok
                                           + v_head)[:, None] + offs_d[None, :] * stride_v_d,
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        tok_next = tok + BLOCK_N  # entries past the unit's end are masked, never read
        page_id = _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p,
                            tok_next // PAGE_SIZE, tok_next < tok_end)
        s = tl.dot(q_dot, tl.trans(k.to(DOT_DTYPE)),
                   input_precision=DOT_PRECISION) * qk_scale[:, None]  # [BLOCK_H, BLOCK_N]
        if HAS_SOFTCAP:  # Gemma 2, on scale·q·k (natural domain) before any bias
            s = _soft_cap(s, softcap)
        if HAS_ALIBI:  # + slope_h · (p - i), after the soft-cap
            if Q_LEN > 1:
                s += alibi2[:, None] * (tok[None, :] - q_pos[:, None]).to(tl.float32)
            else:
                s += alibi2[:, None] * (tok - (ctx - 1)).to(tl.float32)[None, :]
        if Q_LEN > 1:  # per row: causal, and the row's own window ([first, ctx) is the union)
            seen = mask_n[None, :] & (tok[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                seen = seen & (tok[None, :] >= q_pos[:, None] - window_left)
            s = tl.where(seen, s, float("-inf"))
        elif HAS_WINDOW:  # one token: the unit's range, less the first tile's keys before
            s = tl.where((mask_n & (tok >= win_first))[None, :], s, float("-inf"))
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))
        m, alpha, p, l = _softmax_block_step(m, l, s)
        if FP8_V_PAIRS:
            v_even, v_odd = _fp8_dim_pairs(v, FP8_V_PAIRS, FP8_ASM)
            p16 = p.to(tl.float16)
            acc_even = acc_even * alpha[:, None] + tl.dot(p16, v_even)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                                input_precision=DOT_PRECISION)
    if FP8_V_PAIRS:  # dims 2j, 2j + 1 back in place: [BLOCK_H, BLOCK_D]
        acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_H, BLOCK_D])

    if n_rows == 1:
        if HAS_SINKS:  # the sequence's only unit: the sink is added here, once
            sink2 = tl.load(sinks_ptr + heads, mask=mask_h, other=0.0) * LOG2E
            m, l, alpha = _fold_sink(m, l, sink2)
            acc = acc * alpha[:, None]
        if Q_LEN > 1:  # a token before the sequence's start saw no key: out 0
            out = acc * _normalize(v_scale, l)[:, None]
            o_row = b.to(tl.int64) * stride_o_b + q_tok * stride_o_t + heads * stride_o_h
            o_ptrs = out_ptr + o_row[:, None] + offs_d[None, :] * stride_o_d
            lse_ptrs = lse_ptr + (b.to(tl.int64) * Q_LEN + q_tok) * num_q_heads + heads
        else:
            if ONE_UNIT:  # an empty sequence (l = 0): out 0, never 0 / 0
                out = acc * _normalize(v_scale, l)[:, None]
            else:
                out = acc * (v_scale / l)[:, None]
            o_ptrs = (out_ptr + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h
                      + offs_d[None, :] * stride_o_d)
            lse_ptrs = lse_ptr + b.to(tl.int64) * num_q_heads + heads
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_hd)
        if HAS_LSE:
            tl.store(lse_ptrs, _natural_lse(m, l), mask=mask_h)
    else:
        if Q_LEN > 1:  # partials per (row, query token, head)
            row = (r.to(tl.int64) * Q_LEN + q_tok) * num_q_heads + heads
        else:
            row = r * num_q_heads + heads.to(tl.int64)  # [BLOCK_H]
        tl.store(part_ml_ptr + row * 2, m, mask=mask_h)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=mask_h)
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc * v_scale,
                 mask=mask_h[:, None])
    if not ONE_UNIT:  # noqa: SIM102 (a constexpr branch: no code when on)
        if (r == start_b) & (kv_head == 0):  # the merge reads this for every non-empty b
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
    fills for every non-empty sequence; every row in it held tokens, so every ``m_r`` is
    finite. One program per (sequence, kv head) rather than per query head: a batch of 64
    with 32 query heads launched 2,048 programs that mostly exit at once, a launch cost that
    ncu showed on llama8b-b64-c2k (``docs/perf-notes.md``, step 7). Used when ``batch ·
    num_kv_heads`` fills the SMs; else :func:`_merge_per_head_kernel`."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, max_pages * page_size)
    _pdl_wait(PDL)  # seq_rows and the partials are the main kernel's
    start = tl.load(seq_rows_ptr + b * 2)
    n_rows = tl.load(seq_rows_ptr + b * 2 + 1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    if Q_LEN > 1:
        q_tok, heads, mask_h = _token_rows(offs_h, kv_head, group, Q_LEN)
        out_ptrs = (out_ptr + (b.to(tl.int64) * stride_o_b + q_tok * stride_o_t
                               + heads * stride_o_h)[:, None] + offs_d[None, :] * stride_o_d)
        lse_ptrs = lse_ptr + (b.to(tl.int64) * Q_LEN + q_tok) * num_q_heads + heads
    else:
        mask_h = offs_h < group
        heads = kv_head * group + offs_h  # [BLOCK_H]
        out_ptrs = (out_ptr + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h
                    + offs_d[None, :] * stride_o_d)
        lse_ptrs = lse_ptr + b.to(tl.int64) * num_q_heads + heads
    mask_hd = mask_h[:, None] & _dim_mask(offs_d, HEAD_DIM, BLOCK_D)[None, :]
    if ctx == 0:  # seq_rows is stale for an empty sequence: never read past here
        tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                 mask=mask_hd)
        if HAS_LSE:
            if HAS_SINKS:  # no key at all: the denominator is the sink alone
                tl.store(lse_ptrs, tl.load(sinks_ptr + heads, mask=mask_h, other=0.0),
                         mask=mask_h)
            else:
                tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=mask_h)
    elif n_rows > 1:
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for r in range(start, start + n_rows):
            if Q_LEN > 1:
                row = (q_tok + r * Q_LEN).to(tl.int64) * num_q_heads + heads
            else:
                row = r * num_q_heads + heads.to(tl.int64)  # [BLOCK_H], 64-bit
            m_r = tl.load(part_ml_ptr + row * 2, mask=mask_h, other=0.0)
            l_r = tl.load(part_ml_ptr + row * 2 + 1, mask=mask_h, other=0.0)
            acc_r = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :],
                            mask=mask_h[:, None], other=0.0)  # [BLOCK_H, BLOCK_D]
            m_new = tl.maximum(m, m_r)  # finite from the first row on (one query token)
            alpha = _rescale(m, m_new)
            # several tokens: a row may have seen no key of this split (m_r = -inf)
            w = _rescale(m_r, m_new) if Q_LEN > 1 else tl.exp2(m_r - m_new)
            l = l * alpha + l_r * w
            acc = acc * alpha[:, None] + acc_r * w[:, None]
            m = m_new
        if HAS_SINKS:  # the sequence's rows are merged: the sink is added here, once
            m, l, alpha = _fold_sink(m, l, tl.load(sinks_ptr + heads, mask=mask_h, other=0.0)
                                     * LOG2E)
            acc = acc * alpha[:, None]
        # padding rows of the tile stay finite (never stored); a token that saw no key: 0
        l = tl.where(mask_h & (l > 0), l, 1.0) if Q_LEN > 1 else tl.where(mask_h, l, 1.0)
        tl.store(out_ptrs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=mask_hd)
        if HAS_LSE:
            tl.store(lse_ptrs, _natural_lse(m, l), mask=mask_h)


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
    range comes from ``seq_rows``, which the main kernel fills for every non-empty sequence;
    every row in it held tokens, so every ``m_r`` is finite."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = _clamped_context_len(context_lens_ptr, b, stride_ctx, max_pages * page_size)
    # loaded beside the length, not after it (one round of loads fewer before the rows: the
    # per-head merge runs at low occupancy, where each round is latency); an empty
    # sequence's entry is stale (or the launcher's zeros) and is never used
    start = tl.load(seq_rows_ptr + b * 2)
    n_rows = tl.load(seq_rows_ptr + b * 2 + 1)
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
