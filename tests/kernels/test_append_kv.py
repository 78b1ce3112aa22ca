"""append_kv (reshape-and-cache) against a torch reference: every written slot equal, every
other slot bit-identical to its poison (NaN for float caches, a sentinel byte for fp8)."""

import pytest
import torch
from _hardening import assert_same_bits

from pagedattn.launch.append_kv import append_kv

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
POISON_BYTE = 0x7F  # NaN in float8_e4m3fn, NaN in float8_e5m2 too


def poisoned_cache(shape, dtype, device):
    if dtype in FP8:
        return torch.full(shape, POISON_BYTE, dtype=torch.uint8, device=device).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def quantize_ref(x, dtype, scale, num_kv_heads):
    """x [T, H, D] -> cache dtype, fp8: saturate(x / scale) rounded to nearest even."""
    if dtype not in FP8:
        return x.to(dtype)
    s = torch.as_tensor(1.0 if scale is None else scale, dtype=torch.float32).cpu()
    s = s.expand(num_kv_heads) if s.dim() == 0 else s
    fmax = torch.finfo(dtype).max
    return (x.float().cpu() / s[None, :, None]).clamp(-fmax, fmax).to(dtype)


def append_kv_ref(key, value, key_cache, value_cache, slots, kv_layout="NHD", k_scale=None,
                  v_scale=None):
    kc, vc = key_cache.clone().cpu(), value_cache.clone().cpu()
    if kv_layout == "HND":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    h = key.shape[1]
    kq = quantize_ref(key.cpu(), kc.dtype, k_scale, h)
    vq = quantize_ref(value.cpu(), vc.dtype, v_scale, h)
    page_size = kc.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        kc[s // page_size, s % page_size] = kq[t]
        vc[s // page_size, s % page_size] = vq[t]
    if kv_layout == "HND":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    return kc, vc


def run_case(device, *, num_tokens=7, num_kv_heads=2, head_dim=64, num_pages=5, page_size=4,
             dtype=torch.float16, cache_dtype=None, kv_layout="NHD", slot_dtype=torch.int32,
             k_scale=None, v_scale=None, noncontig=False, skip=(1,), seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    if noncontig:  # key/value as views into a fused qkv projection, caches in one tensor
        qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g).to(dtype)
        key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    if cache_dtype in FP8:
        key, value = key * 40, value * 3  # use the fp8 range, saturate some, hit subnormals
    shape = ((num_pages, page_size, num_kv_heads, head_dim) if kv_layout == "NHD"
             else (num_pages, num_kv_heads, page_size, head_dim))
    if noncontig:
        both = poisoned_cache((shape[0], 2, *shape[1:]), cache_dtype, "cpu")
        key_cache, value_cache = both[:, 0], both[:, 1]
    else:
        key_cache, value_cache = (poisoned_cache(shape, cache_dtype, "cpu") for _ in range(2))
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens]
    for i in skip:
        if i < num_tokens:
            slots[i] = -1
    slots = slots.to(slot_dtype)
    ref_k, ref_v = append_kv_ref(key, value, key_cache, value_cache, slots, kv_layout,
                                 k_scale, v_scale)
    dev = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t
    kc, vc = dev(key_cache), dev(value_cache)
    append_kv(dev(key), dev(value), kc, vc, dev(slots), kv_layout=kv_layout,
              k_scale=dev(k_scale), v_scale=dev(v_scale))
    assert_same_bits(kc, ref_k)
    assert_same_bits(vc, ref_v)


CASES = {
    "fp16": dict(),
    "fp32": dict(dtype=torch.float32),
    "bf16": dict(dtype=torch.bfloat16),
    "int64_slots": dict(slot_dtype=torch.int64),
    "hnd": dict(kv_layout="HND"),
    "strided_views": dict(noncontig=True, dtype=torch.float32),
    "page_size_1": dict(page_size=1, num_pages=12),
    "head_dim_80_heads_7": dict(head_dim=80, num_kv_heads=7),
    "many_tokens_two_programs": dict(num_tokens=130, num_pages=40, skip=(0, 64, 129)),
    "all_skipped": dict(num_tokens=3, skip=(0, 1, 2)),
    "no_tokens": dict(num_tokens=0),
    "fp8_e4m3_float_scale": dict(cache_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25),
    "fp8_e4m3_tensor_scale": dict(cache_dtype=torch.float8_e4m3fn,
                                  k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0)),
    "fp8_e4m3_per_head": dict(cache_dtype=torch.float8_e4m3fn, num_kv_heads=3,
                              k_scale=torch.tensor([0.5, 1.0, 0.125]),
                              v_scale=torch.tensor([1.0, 0.01, 3.0])),
    "fp8_e5m2_default_scale": dict(cache_dtype=torch.float8_e5m2, dtype=torch.float32),
    "fp8_bf16_input_hnd": dict(cache_dtype=torch.float8_e4m3fn, dtype=torch.bfloat16,
                               kv_layout="HND", k_scale=0.1, v_scale=0.1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_append_kv_matches_reference(name, device):
    run_case(device, **CASES[name])


def test_fp8_rounding_is_exact_on_every_fp8_value_and_midpoint(device):
    """Every finite fp8 value, every midpoint between neighbours (ties to even) and values
    past the range (saturation) round as torch's ``.to(float8)`` after clamping."""
    for dt in FP8:
        grid = torch.arange(256, dtype=torch.uint8).view(dt).float()
        grid = grid[torch.isfinite(grid)].sort().values
        x = torch.cat([grid, (grid[:-1] + grid[1:]) / 2, torch.tensor([1e6, -1e6, 0.0])])
        x = torch.cat([x, torch.zeros((-x.numel()) % 32)]).view(-1, 1, 32)
        kc = torch.zeros(x.shape[0], 1, 1, 32, dtype=dt)
        vc = torch.zeros_like(kc)
        slots = torch.arange(x.shape[0])
        ref_k, _ = append_kv_ref(x, x, kc, vc, slots)
        kc, vc = kc.to(device), vc.to(device)
        append_kv(x.to(device), x.to(device), kc, vc, slots.to(device))
        assert_same_bits(kc, ref_k)


def test_64bit_offsets(device):
    """A cache of more than 2^31 elements (fp8, 2.1 GB each for K and V; on the CPU only the
    touched pages are committed): a slot in the last page lands at its 64-bit offset."""
    page_size, heads, dim = 16, 1, 1024
    num_pages = 2**31 // (page_size * heads * dim) + 2
    key_cache = torch.empty(num_pages, page_size, heads, dim, dtype=torch.float8_e4m3fn,
                            device=device)
    value_cache = torch.empty_like(key_cache)
    key = torch.randn(2, heads, dim, device=device)
    slots = torch.tensor([(num_pages - 1) * page_size + 3, 5], dtype=torch.int64, device=device)
    append_kv(key, key * 2, key_cache, value_cache, slots)
    want = key.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert_same_bits(key_cache[num_pages - 1, 3], want[0])
    assert_same_bits(key_cache[0, 5], want[1])
    assert_same_bits(value_cache[num_pages - 1, 3], (key[0] * 2).to(torch.float8_e4m3fn))
    del key_cache, value_cache


def _args(**over):
    a = dict(key=torch.randn(3, 2, 64), value=torch.randn(3, 2, 64),
             key_cache=torch.zeros(4, 4, 2, 64), value_cache=torch.zeros(4, 4, 2, 64),
             slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32))
    kw = {k: over.pop(k) for k in ("kv_layout", "k_scale", "v_scale") if k in over}
    a.update(over)
    return a, kw


ERRORS = {
    "key_not_tensor": (dict(key=[1.0]), TypeError, "key"),
    "key_rank": (dict(key=torch.randn(3, 128)), ValueError, "key"),
    "key_int": (dict(key=torch.ones(3, 2, 64, dtype=torch.int32)), TypeError, "key"),
    "value_shape": (dict(value=torch.randn(3, 2, 32)), ValueError, "value"),
    "cache_heads": (dict(key_cache=torch.zeros(4, 4, 3, 64)), ValueError, "value_cache"),
    "cache_dim": (dict(key_cache=torch.zeros(4, 4, 2, 32), value_cache=torch.zeros(4, 4, 2, 32)),
                  ValueError, "key_cache"),
    "key_dtype_vs_cache": (dict(key=torch.randn(3, 2, 64).half(),
                                value=torch.randn(3, 2, 64).half()), TypeError, "key"),
    "value_dtype_vs_key": (dict(value=torch.randn(3, 2, 64).half()), TypeError, "value"),
    "cache_dtype_mix": (dict(value_cache=torch.zeros(4, 4, 2, 64, dtype=torch.float16)),
                        TypeError, "value_cache"),
    "slot_dtype": (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), TypeError, "slot_mapping"),
    "slot_len": (dict(slot_mapping=torch.tensor([0, 1], dtype=torch.int32)), ValueError,
                 "slot_mapping"),
    "slot_range": (dict(slot_mapping=torch.tensor([0, 16, 2])), ValueError, "slot_mapping"),
    "layout": (dict(kv_layout="NDH"), ValueError, "kv_layout"),
    "scale_on_float_cache": (dict(k_scale=0.5), ValueError, "k_scale"),
    "scale_shape": (dict(key_cache=torch.zeros(4, 4, 2, 64, dtype=torch.float8_e4m3fn),
                         value_cache=torch.zeros(4, 4, 2, 64, dtype=torch.float8_e4m3fn),
                         v_scale=torch.ones(3)), ValueError, "v_scale"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_append_kv_errors_name_the_argument(name):
    over, exc, word = ERRORS[name]
    a, kw = _args(**dict(over))
    before = a["key_cache"].clone() if isinstance(a["key_cache"], torch.Tensor) else None
    with pytest.raises(exc, match=word):
        append_kv(a["key"], a["value"], a["key_cache"], a["value_cache"], a["slot_mapping"],
                  **kw)
    if before is not None and before.dtype == a["key_cache"].dtype:
        assert_same_bits(a["key_cache"], before)  # nothing written before the error
