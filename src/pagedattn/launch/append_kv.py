"""Launcher of the KV-append kernel (vLLM's ``reshape_and_cache``): validation, tiles, grid.

Everything is decided from shapes and dtypes, never from slot values, so the launch needs no
host sync and can be captured in a CUDA graph (value checks run only on CPU tensors or with
``validate=True``, as for :func:`pagedattn.paged_decode`).
"""

from __future__ import annotations

import torch
import triton

from pagedattn import _validation as V
from pagedattn._env import is_interpreter
from pagedattn.kernels.append_kv import _append_kv_kernel

# a whole token row ([num_kv_heads * head_dim]) per program up to this many columns
_MAX_BLOCK_C = 1024
# elements per program on the GPU: 2-4K keeps the scatter wide without register spills
_GPU_TILE_ELEMENTS = 2048
# the interpreter runs programs one by one: one program takes a whole decode step's tokens
_INTERPRET_BLOCK_T = 64


_fail = V._fail  # one error format for every argument check
_check_rank_dtype = V._check_tensor


def check_append_kv_args(key, value, key_cache, value_cache, slot_mapping, *, kv_layout,
                         k_scale, v_scale) -> None:
    """Metadata checks (no data read). Raises TypeError/ValueError naming the argument."""
    floats = "float32, float16 or bfloat16"
    caches = floats + ", float8_e4m3fn or float8_e5m2"
    table = (
        ("key", key, 3, V.FLOAT_DTYPES, floats),
        ("value", value, 3, V.FLOAT_DTYPES, floats),
        ("key_cache", key_cache, 4, V.FLOAT_DTYPES + V.FP8_DTYPES, caches),
        ("value_cache", value_cache, 4, V.FLOAT_DTYPES + V.FP8_DTYPES, caches),
        ("slot_mapping", slot_mapping, 1, V.INDEX_DTYPES, "int32 or int64"),
    )
    for name, t, rank, dtypes, words in table:
        _check_rank_dtype(name, t, rank, dtypes, words)
    if kv_layout not in V.KV_LAYOUTS:
        _fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    if value.shape != key.shape:
        _fail(ValueError, "value", f"the shape of key {tuple(key.shape)}", tuple(value.shape))
    V.check_cache_pair(key_cache, value_cache)
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            _fail(ValueError, name, f"a tensor on the key's device {key.device}", t.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    _, page_size, cache_heads, cache_dim = V.cache_dims(key_cache, kv_layout)
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        _fail(ValueError, "key_cache",
              f"{kv_layout} dims (num_kv_heads={num_kv_heads}, head_dim={head_dim}) as in key",
              f"(num_kv_heads={cache_heads}, head_dim={cache_dim})")
    if page_size < 1:
        _fail(ValueError, "page_size", "at least 1 (key_cache dim)", page_size)
    if slot_mapping.shape[0] != num_tokens:
        _fail(ValueError, "slot_mapping", f"{num_tokens} entries (key's num_tokens)",
              slot_mapping.shape[0])
    fp8 = key_cache.dtype in V.FP8_DTYPES
    if not fp8 and key.dtype != key_cache.dtype:
        _fail(TypeError, "key", f"the cache dtype {key_cache.dtype} (or an fp8 cache)", key.dtype)
    if value.dtype != key.dtype:
        _fail(TypeError, "value", f"the key's dtype {key.dtype}", value.dtype)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and not fp8:
            _fail(ValueError, name, f"None for a {key_cache.dtype} cache (scales are for fp8)",
                  "a scale")
        V.check_scale_arg(name, s, num_kv_heads, key.device)


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Slots must be < ``num_pages * page_size`` (negative = skip). Reads the data."""
    if slot_mapping.numel() == 0:
        return
    bad = slot_mapping.long() >= num_slots
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        _fail(ValueError, "slot_mapping",
              f"slots < num_pages * page_size = {num_slots} or negative (entry {i})",
              int(slot_mapping[i]))


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
) -> None:
    """Write one step's new keys/values into their cache slots, in place.

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

    Raises:
        TypeError: a non-tensor or a wrong dtype (key/value differing from a float cache's
        dtype or from each other). ValueError: a wrong rank/shape, mixed
        devices, head counts or head_dim differing between key and caches, a scale with a
        non-fp8 cache or of a bad shape, or (when value checks run) a slot
        ``>= num_pages * page_size``. Messages name the argument.
    """
    check_append_kv_args(key, value, key_cache, value_cache, slot_mapping, kv_layout=kv_layout,
                         k_scale=k_scale, v_scale=v_scale)
    num_pages, page_size, num_kv_heads, head_dim = V.cache_dims(key_cache, kv_layout)
    num_slots = num_pages * page_size
    on_cpu = key.device.type == "cpu"
    if validate or (validate is None and on_cpu):
        if validate and not on_cpu and torch.cuda.is_current_stream_capturing():
            raise ValueError("validate: True needs a device-to-host sync, which CUDA-graph "
                             "capture forbids; pass validate=None")
        check_slot_values(slot_mapping, num_slots)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
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
    block_c = min(triton.next_power_of_2(num_cols), _MAX_BLOCK_C)
    if is_interpreter():
        block_c = triton.next_power_of_2(num_cols)
        block_t = _INTERPRET_BLOCK_T
    else:
        block_t = max(1, _GPU_TILE_ELEMENTS // block_c)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_cols, block_c))
    fp8_max, mantissa_bits, min_normal, magic = _fp8_constants(key_cache.dtype)
    _append_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        kp if from_ptr else slot_mapping, vp if from_ptr else slot_mapping, ks, vs, kval, vval,
        num_tokens, num_slots, page_size,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        slot_mapping.stride(0),
        NUM_COLS=num_cols, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_C=block_c,
        QUANTIZE=fp8, SCALE_FROM_PTR=from_ptr, FP8_MAX=fp8_max,
        FP8_MANTISSA_BITS=mantissa_bits, FP8_MIN_NORMAL=min_normal, FP8_SUBNORMAL_MAGIC=magic,
        num_warps=4,
    )
