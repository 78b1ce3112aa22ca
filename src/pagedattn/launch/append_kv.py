"""Launcher of the KV-append kernel (vLLM's ``reshape_and_cache``): validation, tiles, grid.

Everything is decided from shapes and dtypes, never from slot values, so the launch needs no
host sync and can be captured in a CUDA graph (value checks run only on CPU tensors or with
``validate=True``, as for :func:`pagedattn.paged_decode`).
"""

from __future__ import annotations

import torch

from pagedattn import _errors
from pagedattn import _validation as V
from pagedattn._env import is_interpreter
from pagedattn.kernels.append_kv import _append_kv_kernel
from pagedattn.launch._common import cdiv, named_strides, next_power_of_2, on_tensor_device

# a whole token row ([num_kv_heads * head_dim]) per program up to this many columns
_MAX_BLOCK_C = 1024
# elements per program on the GPU: 2-4K keeps the scatter wide without register spills
_GPU_TILE_ELEMENTS = 2048
# the interpreter runs programs one by one: one program takes a whole decode step's tokens
_INTERPRET_BLOCK_T = 64


# the argument checks live with the API's (one error format); re-exported for existing callers
check_append_kv_args = V.check_append_kv_args
check_slot_values = V.check_slot_values


def _fp8_constants(dtype: torch.dtype) -> tuple[float, int, float, float]:
    """``(max, mantissa bits, smallest normal, 2^23 * smallest subnormal)`` of an fp8 dtype
    (zeros for other dtypes: the kernel does not quantize then)."""
    if dtype not in V.FP8_DTYPES:
        return 0.0, 0, 0.0, 0.0
    fi = torch.finfo(dtype)
    mantissa_bits = 3 if dtype == torch.float8_e4m3fn else 2
    return float(fi.max), mantissa_bits, float(fi.smallest_normal), \
        float(fi.smallest_normal) * 2.0 ** (23 - mantissa_bits)


def _scale_args(s):
    """``(pointer tensor or None, stride, float value)`` for one scale."""
    if isinstance(s, torch.Tensor):
        t = s if s.dtype == torch.float32 else s.float()
        return t, (t.stride(0) if t.dim() == 1 else 0), 1.0
    return None, 0, 1.0 if s is None else float(s)


@on_tensor_device
def append_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    validate: bool | None = None,
) -> dict[str, object]:
    """Write one step's new keys/values into their cache slots, in place, on the tensors' device
    (whatever the current CUDA device).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` float32/float16/bfloat16, any
            strides; the cache's dtype, or any of the three for an fp8 cache.
        key_cache, value_cache: ``[num_pages, page_size, num_kv_heads, head_dim]`` ("NHD") or
            ``[num_pages, num_kv_heads, page_size, head_dim]`` ("HND"); float32/float16/
            bfloat16 or float8_e4m3fn/float8_e5m2; any strides. Mutated.
        slot_mapping: ``[num_tokens]`` int32/int64; token ``t`` goes to page
            ``slot // page_size``, offset ``slot % page_size``. Negative slots are skipped
            (padding). Duplicate slots in one call leave either token's row.
        kv_layout: ``"NHD"`` or ``"HND"``.
        k_scale, v_scale: fp8 caches only: a float, 0-d tensor or ``[num_kv_heads]`` tensor;
            stored values are ``saturate(x / scale)`` (default scale 1.0).
        validate: ``None`` checks slot values only for CPU tensors, ``True`` always (one host
            sync), ``False`` never. Unchecked slots past the capacity are skipped by the kernel.

    Returns:
        ``{"append_kv": what the launch returned}`` (the compiled kernel on a GPU, ``None``
        under the interpreter); ``{}`` when there is no token.

    Raises:
        TypeError: a non-tensor or a wrong dtype (key/value differing from a float cache's
        dtype or from each other). ValueError: a wrong rank/shape, mixed
        devices (naming the argument off the key's device), CPU tensors without
        ``TRITON_INTERPRET=1``, head counts or head_dim differing between key and caches, a
        scale with a non-fp8 cache or of a bad shape, or (when value checks run) a slot
        ``>= num_pages * page_size``. Messages name the argument.
    """
    check_append_kv_args(key, value, key_cache, value_cache, slot_mapping, kv_layout=kv_layout,
                         k_scale=k_scale, v_scale=v_scale)
    _errors.raise_pending(key.device)
    num_pages, page_size, num_kv_heads, head_dim = V.cache_dims(key_cache, kv_layout)
    num_slots = num_pages * page_size
    on_cpu = key.device.type == "cpu"
    if V.value_checks_due(validate, key.device):
        if validate and not on_cpu and torch.cuda.is_current_stream_capturing():
            raise ValueError("validate: True needs a device-to-host sync, which CUDA-graph "
                             "capture forbids; pass validate=None")
        check_slot_values(slot_mapping, num_slots)
        V.check_scalar_values((("k_scale", k_scale), ("v_scale", v_scale)))
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return {}
    if kv_layout == "HND":  # the kernel sees NHD-shaped views; strides carry the layout
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)

    fp8 = key_cache.dtype in V.FP8_DTYPES
    kp, ks, kval = _scale_args(k_scale)
    vp, vs, vval = _scale_args(v_scale)
    from_ptr = kp is not None or vp is not None
    if from_ptr:  # one tensor scale forces both through pointers (one compiled variant)
        if kp is None:
            kp = torch.full((), kval, dtype=torch.float32, device=key.device)
        if vp is None:
            vp = torch.full((), vval, dtype=torch.float32, device=key.device)
    num_cols = num_kv_heads * head_dim
    block_c = min(next_power_of_2(num_cols), _MAX_BLOCK_C)
    if is_interpreter():
        block_c = next_power_of_2(num_cols)
        block_t = _INTERPRET_BLOCK_T
    else:
        block_t = max(1, _GPU_TILE_ELEMENTS // block_c)
    grid = (cdiv(num_tokens, block_t), cdiv(num_cols, block_c))
    fp8_max, mantissa_bits, min_normal, magic = _fp8_constants(key_cache.dtype)
    compiled = _append_kv_kernel[grid](
        key_ptr=key, value_ptr=value, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping, errors_ptr=_errors.error_word(key.device),
        # without tensor scales the pointers are unused: any tensor of the call stands in
        k_scale_ptr=kp if from_ptr else slot_mapping, v_scale_ptr=vp if from_ptr else slot_mapping,
        stride_ks=ks, stride_vs=vs, k_scale_val=kval, v_scale_val=vval,
        num_tokens=num_tokens, num_slots=num_slots, page_size=page_size,
        **named_strides("key", key, "t h d"), **named_strides("value", value, "t h d"),
        **named_strides("kc", key_cache, "page slot head d"),
        **named_strides("vc", value_cache, "page slot head d"),
        stride_slot=slot_mapping.stride(0),
        NUM_COLS=num_cols, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_C=block_c,
        QUANTIZE=fp8, SCALE_FROM_PTR=from_ptr, FP8_MAX=fp8_max,
        FP8_MANTISSA_BITS=mantissa_bits, FP8_MIN_NORMAL=min_normal, FP8_SUBNORMAL_MAGIC=magic,
        num_warps=4,
    )
    return {"append_kv": compiled}
