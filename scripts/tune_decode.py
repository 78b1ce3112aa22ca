"""Tune the production kernel's table on the GPU: writes ``tuned_h200.json`` entries.

Shapes are grouped by the table key (head_dim, group, cache dtype, page_size), since one key
gets one config. For each key, stage 1 times every tile (block_n, num_warps, num_stages) on
all the key's shapes and keeps the tile with the best geometric-mean slowdown against each
shape's fastest (fp32 also tries the CUDA-core path); stage 2 does the same for the launch
(persistent or one program per unit, ctas_per_sm cap, units_per_program, min_chunk) on that
tile. Times are cold-L2 eager medians; each variant's output is compared with the untuned
config's (relative L2) so a broken variant shows. This is a tuning aid: the
benchmark harness makes the published numbers. Usage (repo root, GPU machine):

    PYTHONPATH=src python3 scripts/tune_decode.py --shapes peers --out tune.csv \\
        --table src/pagedattn/launch/tuned_h200.json
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import math
import sys

import torch

import pagedattn
from pagedattn.bench import timing
from pagedattn.bench.shapes import build_batch, select_shapes
from pagedattn.bench.timing import gb_per_s, time_cold
from pagedattn.launch import decode as launch_decode
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import tolerance_for

# block_n, warps, stages, use_dot
TILES = [(32, 4, 3, True), (32, 4, 4, True), (64, 4, 2, True), (64, 4, 3, True),
         (64, 4, 4, True), (64, 8, 3, True), (128, 4, 2, True), (128, 8, 3, True)]
TILES_FP32 = [(32, 4, 2, True), (32, 4, 3, True), (64, 4, 2, True), (32, 8, 2, True),
              (16, 4, 2, False), (16, 4, 3, False), (32, 4, 2, False), (16, 8, 2, False)]
# persistent, ctas cap, units per resident program, min_chunk in tiles
LAUNCHES = ([(False, 4, u, mc) for u in (1, 2, 4, 8) for mc in (2, 8)]
            + [(True, c, u, 2) for c in (2, 4) for u in (1, 4)])


def _geomean_best(rows, shapes, fields):
    """The config (tuple of ``fields``) with the lowest geometric-mean slowdown over shapes."""
    best_us = {s: min(r["median_us"] for r in rows if r["shape"] == s) for s in shapes}
    by_cfg = collections.defaultdict(dict)
    for r in rows:
        by_cfg[tuple(r[f] for f in fields)][r["shape"]] = r["median_us"] / best_us[r["shape"]]
    scored = [(math.exp(sum(map(math.log, v.values())) / len(v)), k)
              for k, v in by_cfg.items() if len(v) == len(shapes)]
    return min(scored)[1] if scored else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="peers")
    p.add_argument("--out", default="tune.csv")
    p.add_argument("--table", default="tuned_h200.json")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    # trials run back to back (the GPU stays at its boost clock): a short warm-up suffices
    timing.WARMUP_S = 0.05
    base_choose = launch_decode.choose_config
    groups = collections.defaultdict(list)
    for shape in select_shapes(args.shapes):
        m = shape.model
        key = launch_decode.config_key(m.head_dim, m.num_q_heads // m.num_kv_heads,
                                       shape.cache_dtype, shape.page_size)
        groups[key].append(shape)
    all_rows, table = [], {}
    # most-used keys first: a timeout then leaves only rarer keys on the heuristic
    for key, shapes in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        m = shapes[0].model
        base = launch_decode.heuristic_config(m.head_dim, m.num_q_heads // m.num_kv_heads,
                                              shapes[0].cache_dtype)
        batches = {s.name: build_batch(s, "cuda", poison=False) for s in shapes}
        refs = {n: pagedattn.paged_decode(*b.tensors, **b.scales).float()
                for n, b in batches.items()}
        for n, b in batches.items():  # the untuned kernel itself against the float64 oracle
            oracle = paged_decode_reference(*b.tensors, **b.scales).out
            err = ((refs[n].double() - oracle).norm() / oracle.norm()).item()
            print(f"oracle check {n}: rel L2 {err:.2e}", flush=True)
            if not err <= tolerance_for(shapes[0].cache_dtype):
                raise SystemExit(f"{n}: the untuned kernel fails the oracle ({err:.2e})")
        rows = []

        def trial(cfg, stage):
            launch_decode.choose_config = lambda *a, **k: cfg
            try:
                for s in shapes:
                    b = batches[s.name]
                    out = torch.empty_like(b.query)
                    got = pagedattn.paged_decode(*b.tensors, out=out, **b.scales).float()
                    err = ((got - refs[s.name]).norm() / refs[s.name].norm()).item()
                    t = time_cold(lambda b=b, out=out: pagedattn.paged_decode(
                        *b.tensors, out=out, **b.scales), reps=args.reps, warmup=3)
                    row = {"key": key, "shape": s.name, "stage": stage,
                           **dataclasses.asdict(cfg), "median_us": round(t.median_us, 2),
                           "gbps": round(gb_per_s(s.minimal_bytes, t.median_us), 1),
                           "rel_err_vs_untuned": f"{err:.2e}"}
                    rows.append(row)
                    print(row, flush=True)
            except Exception as e:  # a variant that fails to compile or fit is skipped
                print(f"  {key} {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            finally:
                launch_decode.choose_config = base_choose

        names = [s.name for s in shapes]
        tiles = TILES_FP32 if shapes[0].cache_dtype == torch.float32 else TILES
        for bn, w, st, dot in tiles:
            trial(dataclasses.replace(base, block_n=bn, num_warps=w, num_stages=st, use_dot=dot,
                                      min_chunk=4 * bn), "tile")
        tile_fields = ("block_n", "num_warps", "num_stages", "use_dot")
        tile = _geomean_best([r for r in rows if r["stage"] == "tile"], names, tile_fields)
        if tile is None:
            continue
        tiled = dataclasses.replace(base, **dict(zip(tile_fields, tile, strict=True)))
        for pers, ctas, upp, mc in LAUNCHES:
            trial(dataclasses.replace(tiled, persistent=pers, ctas_per_sm=ctas,
                                      units_per_program=upp, min_chunk=mc * tiled.block_n),
                  "launch")
        launch_fields = ("persistent", "ctas_per_sm", "units_per_program", "min_chunk")
        launch = _geomean_best([r for r in rows if r["stage"] == "launch"], names, launch_fields)
        if launch is not None:
            chosen = dataclasses.replace(tiled, **dict(zip(launch_fields, launch, strict=True)))
            table[key] = dataclasses.asdict(chosen)
            print("chosen", key, table[key], flush=True)
            _write_table(args.table, table, args.shapes)  # after each key: a timeout keeps it
        all_rows += rows
        del batches, refs
        torch.cuda.empty_cache()
    if not all_rows:
        return 1
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(all_rows[0]))
        w.writeheader()
        w.writerows(all_rows)
    return 0


def _write_table(path: str, table: dict, shapes: str) -> None:
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "source": "scripts/tune_decode.py", "shapes": shapes}
    with open(path, "w") as f:
        json.dump({"meta": meta, "configs": table}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
