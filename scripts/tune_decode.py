"""Sweep the production kernel's tile/launch table on the GPU (a tuning aid, not a benchmark).

For each shape: stage 1 sweeps the tile (block_n, num_warps, num_stages) at the default launch
choices; stage 2 sweeps the launch (ctas_per_sm, units_per_program, min_chunk) at the best
tile. Times are cold-L2 medians (eager); every variant's output is compared with the default
config's output (relative L2). Writes one CSV row per variant. Usage (repo root, GPU machine):

    PYTHONPATH=src python3 scripts/tune_decode.py --shapes peers --out tune.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import sys
import time

import torch

import pagedattn
from pagedattn.bench.shapes import build_batch, select_shapes
from pagedattn.bench.timing import gb_per_s, time_cold
from pagedattn.launch import decode as launch_decode


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="peers")
    p.add_argument("--out", default="tune.csv")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    base_choose = launch_decode.choose_config
    rows = []
    for shape in select_shapes(args.shapes):
        batch = build_batch(shape, "cuda")
        kv = batch.tensors
        out = torch.empty_like(batch.query)
        base = base_choose(shape.model.head_dim, shape.model.num_q_heads // shape.model.num_kv_heads,
                           shape.cache_dtype, shape.page_size, False)
        ref = pagedattn.paged_decode(*kv, **batch.scales).float()

        def trial(cfg, stage):
            launch_decode.choose_config = lambda *a, **k: cfg
            try:
                t0 = time.perf_counter()
                got = pagedattn.paged_decode(*kv, out=out, **batch.scales)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                err = ((got.float() - ref).norm() / ref.norm()).item()
                t = time_cold(lambda: pagedattn.paged_decode(*kv, out=out, **batch.scales),
                              reps=args.reps, warmup=3)
            except Exception as e:  # a variant that does not compile is skipped, not fatal
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                return None
            finally:
                launch_decode.choose_config = base_choose
            row = {"shape": shape.name, "stage": stage, **dataclasses.asdict(cfg),
                   "median_us": round(t.median_us, 2),
                   "gbps": round(gb_per_s(shape.minimal_bytes, t.median_us), 1),
                   "rel_err_vs_default": f"{err:.2e}", "first_call_s": round(compile_s, 2)}
            rows.append(row)
            print(row, flush=True)
            return row

        tiles = ([(bn, w, s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
                 if base.use_dot else
                 [(bn, w, s) for bn, w, s in itertools.product((16, 32), (4, 8), (1, 2, 3))])
        best = None
        for bn, w, s in tiles:
            cfg = dataclasses.replace(base, block_n=bn, num_warps=w, num_stages=s, min_chunk=4 * bn)
            r = trial(cfg, "tile")
            if r and (best is None or r["median_us"] < best[1]["median_us"]):
                best = (cfg, r)
        if best is None:
            continue
        for ctas, upp, mc in itertools.product((1, 2, 3, 4), (1, 2, 4), (2, 4, 8)):
            cfg = dataclasses.replace(best[0], ctas_per_sm=ctas, units_per_program=upp,
                                      min_chunk=mc * best[0].block_n)
            trial(cfg, "launch")
        del batch, kv, out, ref
        torch.cuda.empty_cache()
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
