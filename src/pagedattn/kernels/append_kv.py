"""KV append (vLLM's ``reshape_and_cache``): scatter one step's new keys and values into the
paged cache.

**Algorithm.** Token ``t`` of the step owns slot ``s = slot_mapping[t]``, i.e. page
``s // page_size`` and in-page offset ``s % page_size``. Its key row ``key[t, :, :]``
(``[num_kv_heads, head_dim]``) goes to ``key_cache[s // page_size, s % page_size, :, :]`` and
likewise for the value. A negative slot (vLLM's padding for CUDA-graph batches) and a slot at
or past the cache's capacity are skipped, so the kernel never writes out of bounds; a slot
past the capacity is also reported in the device's error word (``pagedattn._errors``). With
``QUANTIZE`` (fp8 caches) the stored value is ``clamp(x / scale, -FP8_MAX, FP8_MAX)`` rounded
to the cache's fp8 dtype (the decode kernel dequantizes with ``stored * scale``); ``scale`` is
one float or one per kv head. The rounding to the fp8 grid (nearest, ties to even, as torch's
``.to(float8)``) is done in fp32 integer arithmetic by ``_round_to_fp8_grid`` before the cast,
so the cast itself is exact: the same bits on the GPU and under Triton's interpreter (whose own
fp32->fp8 cast rounds wrongly across binades).

**Grid.** ``(cdiv(num_tokens, BLOCK_T), cdiv(num_kv_heads * head_dim, BLOCK_C))``. One program
owns ``BLOCK_T`` tokens × ``BLOCK_C`` flattened ``(kv head, dim)`` columns: column ``c`` is head
``c // HEAD_DIM``, dim ``c % HEAD_DIM``. Every offset is computed in int64 (caches past 2^31
elements are normal at serving sizes). Any strides on every tensor: NHD and HND caches are the
same kernel with permuted strides.

Stage: serving integration (not one of the study's decode stages).
"""

import triton
import triton.language as tl

from pagedattn.kernels.errors import SLOT_MAPPING, _report


@triton.jit
def _round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                       SUBNORMAL_MAGIC: tl.constexpr):
    """Round fp32 ``x`` (already saturated) to the nearest fp8 value, ties to even; fp32 out.

    Normal range: the classic bit trick (add half an fp8 ulp minus one, plus the kept lsb,
    then clear the dropped bits; a carry moves into the exponent as it should). Subnormal
    range (``|x| < MIN_NORMAL``): the grid is uniform, step ``MIN_NORMAL / 2^MANTISSA_BITS``;
    adding and subtracting ``SUBNORMAL_MAGIC = step * 2^23`` rounds to it in fp32.
    """
    SHIFT: tl.constexpr = 23 - MANTISSA_BITS
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> SHIFT) & 1
    bits = (bits + ((1 << (SHIFT - 1)) - 1) + lsb) & ~((1 << SHIFT) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    mag = tl.abs(x)
    sub = (mag + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(mag < MIN_NORMAL, sub, normal)


@triton.jit
def _append_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    errors_ptr,  # [1] int64: the device's error word (pagedattn._errors)
    k_scale_ptr, v_scale_ptr, stride_ks, stride_vs, k_scale_val, v_scale_val,
    num_tokens, num_slots, page_size,
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_kc_page, stride_kc_slot, stride_kc_head, stride_kc_d,
    stride_vc_page, stride_vc_slot, stride_vc_head, stride_vc_d,
    stride_slot,
    NUM_COLS: tl.constexpr,  # num_kv_heads * head_dim
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    QUANTIZE: tl.constexpr,  # fp8 cache: divide by the scale and saturate
    SCALE_FROM_PTR: tl.constexpr,  # scales are tensors (per head or 0-d) rather than floats
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMAL_MAGIC: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    tok = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # [BLOCK_T]
    col = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    head = (col // HEAD_DIM).to(tl.int64)
    dim = (col % HEAD_DIM).to(tl.int64)
    tok_ok = tok < num_tokens
    col_ok = col < NUM_COLS

    slot = tl.load(slot_mapping_ptr + tok * stride_slot, mask=tok_ok, other=-1).to(tl.int64)
    write_tok = tok_ok & (slot >= 0) & (slot < num_slots)  # [BLOCK_T]
    past = tok_ok & (slot >= num_slots)  # dropped, and reported (by the first column block)
    first_past = tl.min(tl.where(past, tok, num_tokens))
    _report(errors_ptr, (pid_c == 0) & (first_past < num_tokens), SLOT_MAPPING, first_past,
            tl.max(tl.where(tok == first_past, slot, 0)))
    slot = tl.where(write_tok, slot, 0)
    page = slot // page_size
    offset = slot % page_size
    mask = write_tok[:, None] & col_ok[None, :]  # [BLOCK_T, BLOCK_C]

    src_k = tok[:, None] * stride_key_t + head[None, :] * stride_key_h + dim[None, :] * stride_key_d
    src_v = (tok[:, None] * stride_value_t + head[None, :] * stride_value_h
             + dim[None, :] * stride_value_d)
    k = tl.load(key_ptr + src_k, mask=mask, other=0.0)  # [BLOCK_T, BLOCK_C]
    v = tl.load(value_ptr + src_v, mask=mask, other=0.0)
    if QUANTIZE:
        if SCALE_FROM_PTR:
            ks = tl.load(k_scale_ptr + head * stride_ks, mask=col_ok, other=1.0)  # [BLOCK_C]
            vs = tl.load(v_scale_ptr + head * stride_vs, mask=col_ok, other=1.0)
            k = k.to(tl.float32) / ks[None, :]
            v = v.to(tl.float32) / vs[None, :]
        else:
            k = k.to(tl.float32) / k_scale_val
            v = v.to(tl.float32) / v_scale_val
        k = tl.clamp(k, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        v = tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        k = _round_to_fp8_grid(k, FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)
        v = _round_to_fp8_grid(v, FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)

    dst_k = (page[:, None] * stride_kc_page + offset[:, None] * stride_kc_slot
             + head[None, :] * stride_kc_head + dim[None, :] * stride_kc_d)
    dst_v = (page[:, None] * stride_vc_page + offset[:, None] * stride_vc_slot
             + head[None, :] * stride_vc_head + dim[None, :] * stride_vc_d)
    tl.store(key_cache_ptr + dst_k, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst_v, v.to(value_cache_ptr.dtype.element_ty), mask=mask)
