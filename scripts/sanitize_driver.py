"""Small driver for compute-sanitizer (memcheck, racecheck): every impl on boundary shapes.

    PYTHONPATH=src python3 scripts/sanitize_driver.py            # warm Triton's cache first
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=src \
        compute-sanitizer --tool memcheck python3 scripts/sanitize_driver.py

Shapes (tiny, so the sanitizer finishes in a minute or two): page_size 1, 5 and 16; context
lengths 0, 1 and a last page holding one token; every page of the cache used, so the
highest page id (num_pages - 1) is read; GQA group 7; head_dim 80; table padding of -1 and
out-of-range ids; forced and automatic split counts; for ``auto`` also fp8 with per-head
scales, HND, a combined KV buffer and the LSE. With ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``
each tensor is its own allocation, so a read one element past the cache is a memcheck error
rather than a read inside PyTorch's pool.

Each call is checked against the float64 oracle; the exit status is the number of failures.
"""

from __future__ import annotations

import sys
import time

import torch

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

# (name, context_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype)
SHAPES = [
    ("page1-group7-hd80", [1, 2, 7], 7, 1, 80, 1, torch.float16),
    ("page16-onetoken-tail-group7", [0, 1, 17, 33], 14, 2, 80, 16, torch.bfloat16),
    ("page5-hd128-fp32", [0, 4, 11, 6], 4, 2, 128, 5, torch.float32),
]


def _run(impl, inputs, ref_kw=None, **kw):
    out = torch.full_like(inputs[0], float("nan"))
    result = pagedattn.paged_decode(*inputs, impl=impl, out=out, **kw)
    torch.cuda.synchronize()
    ref = paged_decode_reference(*inputs, **(ref_kw or {}))
    err = rel_l2_error(out, ref.out)
    tol = tolerance_for(inputs[1].dtype)
    ok = err <= tol
    if kw.get("return_lse"):
        lse, want = result.lse.double().cpu(), ref.lse.cpu()
        finite = torch.isfinite(want)
        ok &= bool(torch.isneginf(lse[~finite]).all())
        ok &= bool(torch.allclose(lse[finite], want[finite], rtol=1e-3, atol=1e-3))
    return ok, err


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    failures = 0
    t0 = time.time()
    for name, lens, hq, hkv, dim, page_size, dtype in SHAPES:
        inputs = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                                   page_size=page_size, dtype=dtype, extra_pages=0,
                                   max_pages=max(-(-n // page_size) for n in lens) + 2,
                                   seed=len(lens), device="cuda")
        num_pages = inputs.key_cache.shape[0]
        assert int(inputs.block_tables.max()) >= num_pages  # out-of-range padding present
        used = inputs.block_tables[inputs.block_tables < num_pages]
        assert int(used.max()) == num_pages - 1  # the highest page id is read
        runs = [(impl, {}) for impl in pagedattn.IMPLS]
        runs += [("split_kv_v4", {"num_splits": 4}), ("auto", {"num_splits": 3}),
                 ("auto", {"return_lse": True}),
                 ("auto", {})]  # a repeat: launched from the recorded plan, not by Triton
        for impl, kw in runs:
            ok, err = _run(impl, inputs, **kw)
            failures += not ok
            print(f"{name:32s} {impl:14s} {kw!s:24s} rel_l2={err:.2e} {'ok' if ok else 'FAIL'}")

        # auto only: fp8 cache with per-kv-head scales, HND layout, combined KV buffer
        k_scale = torch.linspace(0.2, 0.6, hkv, device="cuda")
        v_scale = torch.linspace(0.5, 1.5, hkv, device="cuda")
        q, k, v = inputs[:3]
        k8 = (k.float() / k_scale[None, None, :, None]).to(torch.float8_e4m3fn)
        v8 = (v.float() / v_scale[None, None, :, None]).to(torch.float8_e4m3fn)
        fp8 = (q, k8, v8, *inputs[3:])
        ok, err = _run("auto", fp8, ref_kw=dict(k_scale=k_scale, v_scale=v_scale),
                       k_scale=k_scale, v_scale=v_scale, return_lse=True)
        failures += not ok
        print(f"{name:32s} {'auto fp8':14s} {'per-head scales':24s} rel_l2={err:.2e} "
              f"{'ok' if ok else 'FAIL'}")
        kv = torch.stack([k, v], dim=1).transpose(2, 3).contiguous()  # [P, 2, H, page, D]
        hnd = (q, kv[:, 0], kv[:, 1], *inputs[3:])
        ok, err = _run("auto", hnd, ref_kw=dict(kv_layout="HND"), kv_layout="HND")
        failures += not ok
        print(f"{name:32s} {'auto HND':14s} {'combined KV':24s} rel_l2={err:.2e} "
              f"{'ok' if ok else 'FAIL'}")
    print(f"{failures} failure(s), {time.time() - t0:.1f} s")
    return failures


if __name__ == "__main__":
    sys.exit(main())
