"""Host time the compat layer adds over a direct ``plan.run``: a CPU exploration.

On a GPU machine (CUDA tensors, the real kernels) each call is timed as in
``scripts/host_time.py``: back-to-back calls of a tiny batch, one synchronize, medians of
``--repeats`` timings. Without a GPU (``--cpu``) the launch itself is stubbed (the plan's
``launch`` returns a preallocated output, and the CPU-only value checks are skipped as they
are for CUDA tensors) so that only the Python of the call runs: the difference from the
direct ``plan.run`` is the compat layer's own Python. CPU figures are an exploration of that Python
cost, not GPU host time. Usage (repo root)::

    PYTHONPATH=src python3 scripts/compat_host_time.py [--cpu] [--calls 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

import pagedattn
from pagedattn.compat import BatchDecodeWithPagedKVCacheWrapper, flash_attn_with_kvcache
from pagedattn.testing import make_paged_inputs


def _inputs(device: str):
    inp = make_paged_inputs([16] * 4, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            page_size=16, dtype=torch.bfloat16, poison=False, device=device)
    lens = inp.context_lens.tolist()
    pages = [(n + 15) // 16 for n in lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([inp.block_tables[b, :p].cpu() for b, p in enumerate(pages)])
    last = torch.tensor([(n - 1) % 16 + 1 for n in lens], dtype=torch.int32)
    return inp, (indptr.to(device), indices.to(device), last.to(device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="stub the launch, time Python only")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    inp, csr = _inputs(device)
    q, kc, vc = inp.query, inp.key_cache, inp.value_cache
    plan = pagedattn.plan_decode(inp.block_tables, inp.context_lens, num_q_heads=32,
                                 num_kv_heads=8, head_dim=128, page_size=16,
                                 q_dtype=torch.bfloat16)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8,
                                                             device=device))
    wrapper.plan(*csr, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    cache5 = torch.stack([kc, vc], dim=1)
    q4 = q.unsqueeze(1)
    if device == "cpu":  # Python only: every plan's launch returns a ready output
        ready = torch.empty_like(q)
        def stub(p):  # as on CUDA with validate=None: no value checks, then the launch
            p.launch, p.on_cpu = (lambda *a, **k: ready), False
        for p in (plan, wrapper._plan):
            stub(p)
        flash_attn_with_kvcache(q4, kc, vc, cache_seqlens=inp.context_lens,
                                page_table=inp.block_tables, causal=True)
        from pagedattn.compat import flash_attn as fa
        for p in fa._plans.values():
            stub(p)
    calls = {
        "plan.run (direct)": lambda: plan.run(q, kc, vc),
        "FlashInfer run, (k, v) tuple": lambda: wrapper.run(q, (kc, vc)),
        "FlashInfer run, one [pages, 2, ...] tensor": lambda: wrapper.run(q, cache5),
        "flash_attn_with_kvcache (cached plan)": lambda: flash_attn_with_kvcache(
            q4, kc, vc, cache_seqlens=inp.context_lens, page_table=inp.block_tables,
            causal=True),
    }
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = {}
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        sync()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            timeit.Timer(fn).timeit(args.calls)
            sync()
            times.append((time.perf_counter() - t) / args.calls * 1e6)
        results[name] = statistics.median(times)
    base = results["plan.run (direct)"]
    print(f"device: {device}{' (launch stubbed: Python only)' if device == 'cpu' else ''}")
    for name, us in results.items():
        print(f"{name:48s} {us:8.2f} µs/call   +{us - base:6.2f} µs")


if __name__ == "__main__":
    main()
