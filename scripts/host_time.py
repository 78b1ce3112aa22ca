"""Host time of one decode call: 2,000 back-to-back calls of a tiny batch, one synchronize.

With a tiny batch the GPU finishes each call long before the host issues the next, so the
wall time per call is the host path: validation, allocation and the launches. Measures
``plan.run`` (the plan built once; without and with ``out``), ``paged_decode`` (one-shot) and,
where ``import flashinfer`` works, FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper.run()``
(planned once, as the bench peer ``flashinfer-tc``) on the three batches of the peers'
host-time table, all in the same process, and (``empty_out``) the allocation of an output
alone, what ``plan.run`` adds without ``out``. The host's CPU clock drifts from run to
run (on the H200 machine the same tree measured 116 and 224 µs per one-shot call a few seconds
apart), so each figure is the median of ``--repeats`` timings of ``--calls`` calls, with their
minimum beside it (``*_min``), the rows of a batch timed round-robin. Usage (repo root, GPU
machine)::

    PYTHONPATH=src python3 scripts/host_time.py [--calls 2000] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

import pagedattn
from pagedattn.bench import peers
from pagedattn.bench.report import dump_rows
from pagedattn.bench.shapes import BenchBatch, BenchShape, ModelShape
from pagedattn.testing import make_paged_inputs

#: (name, lens, num_q_heads, num_kv_heads, head_dim, dtype)
BATCHES = [
    ("b1-32/8-hd128-ctx16", [16], 32, 8, 128, torch.bfloat16),
    ("b64-9/3-hd64-ctx32", [32] * 64, 9, 3, 64, torch.bfloat16),
    ("b8-32/8-hd128-ctx300-fp16", [300] * 8, 32, 8, 128, torch.float16),
]


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):  # compile, bind, warm the allocator
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timings of --calls calls per figure (median reported, min beside)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also print where plan.run and paged_decode spend host time (cProfile)")
    args = ap.parse_args()
    results = []
    for name, lens, hq, hkv, hd, dtype in BATCHES:
        x = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=hd,
                              page_size=16, dtype=dtype, device="cuda", poison=False)
        plan = pagedattn.plan_decode(x.block_tables, x.context_lens, num_q_heads=hq,
                                     num_kv_heads=hkv, head_dim=hd, page_size=16, q_dtype=dtype)
        out = torch.empty_like(x.query)
        run = functools.partial(plan.run, *x[:3])
        run_out = functools.partial(plan.run, *x[:3], out=out)
        one_shot = functools.partial(pagedattn.paged_decode, *x)
        # what plan.run adds without ``out``: the output's allocation and free, alone
        alloc = functools.partial(torch.empty_like, x.query)
        timed = [("plan_run", run), ("plan_run_out", run_out), ("paged_decode", one_shot),
                 ("empty_out", alloc)]
        shape = BenchShape(name, ModelShape(name, hq, hkv, hd, dtype), tuple(lens), dtype, dtype)
        try:
            timed.append(("flashinfer_run", peers.flashinfer_tc(
                shape, BenchBatch(*x, k_scale=None, v_scale=None))))
        except peers.PeerUnsupported as e:
            print(f"batch={name} flashinfer_run: {e}", flush=True)
        r = dict(batch=name)
        times = {label: [] for label, _ in timed}
        for _ in range(args.repeats):  # round-robin: a drifting clock spreads over every row
            for label, fn in timed:
                times[label].append(per_call_us(fn, args.calls))
        for label, t in times.items():
            r[f"{label}_us"] = statistics.median(t)
            r[f"{label}_us_min"] = min(t)
        results.append(r)
        if args.profile and name == BATCHES[0][0]:
            import cProfile
            import pstats
            for label, fn in (("plan.run", run), ("paged_decode", one_shot)):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(500):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                for order in ("tottime", "cumulative"):
                    print(f"--- {label}: 500 calls, by {order}")
                    pstats.Stats(prof).sort_stats(order).print_stats(25)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in r.items()), flush=True)
    dump_rows(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
