"""The production kernel's steps for one unit (:mod:`pagedattn.kernels.decode`), in the
order a unit runs them.

The tile's rows and pointers (``_tile_rows`` with ``_token_rows``, ``_tile_ptrs``,
``_lse_ptrs``), the scales and the query (``_kv_scales``, ``_load_query``,
``_load_latent_query``), how the values are read (``_v_tile_view``, ``_fp8_dim_pairs``), the
token loop ``_attend_tiles`` with its ``_score_and_mask`` and ``_online_softmax_step(_pairs)``,
and a unit's epilogues: ``_store_result`` (with the sink, ``_add_sink``) or ``_store_partial``.
The merges of several units' partials are in :mod:`pagedattn.kernels.merge`.

Each keeps the kernel's flags as constexpr arguments, so a flag that is off leaves no code,
and Triton inlines each: the kernels compile to the instructions and registers they had as one
body (``docs/perf-notes.md``, which also says why the K/V loads stay in the token loop's own
body). The math is :mod:`pagedattn.kernels.softmax`'s and the addressing
:mod:`pagedattn.kernels.paging`'s; neither imports this module.
"""

import triton
import triton.language as tl

from pagedattn.kernels.errors import _clamped_page_ids
from pagedattn.kernels.paging import _dim_mask, _page_ids
from pagedattn.kernels.softmax import (
    LOG2E,
    _exact_mul,
    _fold_sink,
    _natural_lse,
    _normalize,
    _soft_cap,
    _softmax_block_step,
)


@triton.jit
def _token_rows(offs_h, kv_head, group, Q_LEN: tl.constexpr):
    """Multi-token tiles (``Q_LEN > 1``): row ``i`` is query token ``i // group`` of query
    head ``kv_head * group + i % group``. Returns ``(q_tok, heads, mask_h)`` ``[BLOCK_H]``."""
    return offs_h // group, kv_head * group + offs_h % group, offs_h < Q_LEN * group


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
    """MLA's query tile (:mod:`pagedattn.kernels.mla`): its latent part ``q_nope`` ``[BLOCK_H,
    BLOCK_D]`` and rope part ``q_pe`` ``[BLOCK_H, BLOCK_DR]`` as the dots' operands, and the
    per-row score scale ``(q_dot, qpe_dot, qk_scale)``, as :func:`_load_query`. A row's score
    is the sum of both parts' dots, so ``Q_POW2_SCALE`` scales the two parts of a row by one
    power of two, from the row's largest ``|q|`` over both."""
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
def _fp8_dim_pairs(w, FP8: tl.constexpr, ASM: tl.constexpr):
    """fp8 V tile read as 16-bit words ``w`` (``[BLOCK_N, BLOCK_D // 2]``: dims ``2j`` in the
    low byte, ``2j + 1`` in the high byte) -> ``(even, odd)`` fp16 tiles, each exact. A tile of
    bytes whose reduction dim (tokens) is strided cannot go through ``ldmatrix.trans`` (16-bit
    only): the byte tile was read from shared memory one byte per instruction
    (docs/perf-notes.md). Words transpose like fp16, and each pair of words becomes two fp16
    pairs by one ``prmt`` and two packed ``cvt`` (``ASM``: inline PTX, sm_89+; else plain
    Triton casts, which the interpreter runs). ``FP8``: 1 e4m3, 2 e5m2."""
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


@triton.jit
def _score_and_mask(q_dot, k, qk_scale, tok, mask_n, ctx, q_pos, alibi2, win_first,
                    window_left, softcap, DOT_DTYPE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, Q_LEN: tl.constexpr, VARIANTS: tl.constexpr,
                    LEAN: tl.constexpr = False, ASM: tl.constexpr = False):
    """A tile's exp2-domain scores ``[BLOCK_H, BLOCK_N]``: ``q·kᵀ · qk_scale``, then the
    soft-cap (Gemma 2, on the natural-domain logit, before any bias), ALiBi's ``+ slope·(p -
    i)`` (``alibi2``: slopes times log2 e, per row), and -inf where a key is not seen: past
    the unit's range, after the row's own position (``Q_LEN > 1``: causal, bottom-right
    aligned) or before its window (each row's with several tokens; one token: the first
    tile's keys before ``win_first``). ``LEAN``: the product is exactly rounded
    (:func:`_exact_mul`, inline PTX with ``ASM``), as :func:`_softmax_block_step`'s
    ``LEAN`` form needs. ``VARIANTS``: the options' flags (:data:`pagedattn.options.
    Variants`), read here by name; a variant of the scores goes here, under its flag."""
    dot = tl.dot(q_dot, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    s = _exact_mul(dot, qk_scale[:, None], ASM) if LEAN else dot * qk_scale[:, None]
    if VARIANTS.HAS_SOFTCAP:
        s = _soft_cap(s, softcap)
    if VARIANTS.HAS_ALIBI:
        if Q_LEN > 1:
            s += alibi2[:, None] * (tok[None, :] - q_pos[:, None]).to(tl.float32)
        else:
            s += alibi2[:, None] * (tok - (ctx - 1)).to(tl.float32)[None, :]
    if Q_LEN > 1:  # per row: causal, and the row's own window ([first, ctx) is the union)
        seen = mask_n[None, :] & (tok[None, :] <= q_pos[:, None])
        if VARIANTS.HAS_WINDOW:
            seen = seen & (tok[None, :] >= q_pos[:, None] - window_left)
        s = tl.where(seen, s, float("-inf"))
    elif VARIANTS.HAS_WINDOW:
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
def _attend_tiles(q_dot, qk_scale, alibi2, key_cache_ptr, value_cache_ptr,
                  block_tables_ptr, b, kv_head, k_head, v_head, tok_start, tok_end, ctx, q_pos,
                  win_first,
                  window_left, softcap, offs_n, offs_d, mask_d,
                  stride_k_page, stride_k_tok, stride_k_head, stride_k_d,
                  stride_v_page, stride_v_tok, stride_v_head, stride_v_d,
                  stride_bt_b, stride_bt_p, num_pages, HEAD_DIM: tl.constexpr,
                  BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_LEN: tl.constexpr,
                  VARIANTS: tl.constexpr, FP8_V_PAIRS: tl.constexpr, ASM: tl.constexpr,
                  LEAN_SOFTMAX: tl.constexpr, SLOT_OFFSETS_I32: tl.constexpr):
    """The token loop: the online softmax of the tile's rows (``q_dot``, ``qk_scale``,
    ``alibi2``: :func:`_load_query` and the ALiBi slopes) over tokens ``[tok_start,
    tok_end)`` of sequence ``b``, kv head ``kv_head`` (``k_head``/``v_head``: its 64-bit
    offsets in the caches), ``BLOCK_N`` tokens a tile that may span pages. Returns the
    unnormalized state ``(m, l, acc)``: ``[BLOCK_H]``, ``[BLOCK_H]``, ``[BLOCK_H, BLOCK_D]``
    (``-inf``, 0, 0 for an empty range). The next tile's page ids are loaded one iteration
    ahead, so the K/V loads never wait on a block-table load of their own iteration and the
    pipeliner keeps several tiles in flight. ``VARIANTS``: the options' flags
    (:data:`pagedattn.options.Variants`), passed on to :func:`_score_and_mask`.

    Page ids outside ``[0, num_pages)`` read page 0 instead: whatever its block table holds,
    the loop reads inside the caches (a report would keep a flag live across the loop, which
    cost the register-capped kernels a spill: the prefill kernel and ``PAGEDATTN_VALIDATE``
    report such ids)."""
    HAS_WINDOW: tl.constexpr = VARIANTS.HAS_WINDOW
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
    page_id = _clamped_page_ids(
        _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p, tok // PAGE_SIZE, tok < tok_end),
        num_pages)
    if SLOT_OFFSETS_I32:  # int32 instead (the launcher checked that every in-page offset fits)
        k_head = kv_head * stride_k_head
        v_head = kv_head * stride_v_head
    for n0 in range(tok_start, tok_end, BLOCK_N):
        tok = n0 + offs_n
        mask_n = tok < tok_end
        # the K/V loads stand here, in the loop's own body, not in a helper of their own: an
        # inlined helper's debug-scope labels split ptxas's blocks, and inside the loop that
        # cost the ALiBi kernel 162 registers against 128, the soft-cap one 12 spilled bytes
        # (docs/perf-notes.md). A token's offset is page_id · stride_page (64-bit: pages pass
        # 2^31 elements on large caches) plus its slot's and head's offsets, in int32 where
        # they fit (SLOT_OFFSETS_I32: one 64-bit product a row, not three; docs/perf-notes.md).
        # With a window, keys before it read win_first's row (see above)
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
        if FP8_V_PAIRS:  # [BLOCK_N, BLOCK_D // 2] 16-bit words, two fp8 dims each
            w_row = tl.multiple_of(v_off // 2, 8)  # the launcher's strides: 16-byte multiples
            v = tl.load(v_base + w_row[:, None] + offs_v[None, :],
                        mask=mask_n[:, None] & v_mask_d[None, :], other=0)
        else:
            v = tl.load(value_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_v_d,
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        tok_next = tok + BLOCK_N  # entries past the unit's end are masked, never read
        page_id = _clamped_page_ids(
            _page_ids(block_tables_ptr, b, stride_bt_b, stride_bt_p, tok_next // PAGE_SIZE,
                      tok_next < tok_end), num_pages)
        s = _score_and_mask(q_dot, k, qk_scale, tok, mask_n, ctx, q_pos, alibi2, win_first,
                            window_left, softcap, DOT_DTYPE, DOT_PRECISION, Q_LEN, VARIANTS,
                            LEAN_SOFTMAX, ASM)
        if FP8_V_PAIRS:
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
