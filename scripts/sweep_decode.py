"""Sweep the production kernel's tiles and split target on the GPU, beside the plain floor.

For each shape: the float64 oracle, the default config (``choose_config``) eager and graph,
every config of the grid below (eager, cold L2), and optionally a measuring peer file such as
the plain-Triton floor (its own best-of-sweep config, then timed by our timer), all in the
same run with the read roofline. Writes ``sweep.csv`` and prints, per shape, the best config
and where the default stands. A tuning aid: the harness (``pagedattn bench``) makes the
published numbers. ``--write-table`` also writes this GPU's tuned table (see
:func:`table_from_rows`); it belongs at ``src/pagedattn/launch/tuned/<GPU name>.json``
(:func:`pagedattn.launch.policy.tuned_table_path`), where ``choose_config`` reads it for that
GPU model only. Usage (repo root, GPU machine)::

    PYTHONPATH=src python3 scripts/sweep_decode.py --shapes peers --out $OUT \\
        --peer-file .peers/plain_floor.py [--write-table $OUT/tuned.json]
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

import pagedattn
from pagedattn.bench.shapes import build_batch, select_shapes
from pagedattn.bench.timing import gb_per_s, measure_read_bandwidth, time_cold, time_graph
from pagedattn.launch.decode import AutoLauncher
from pagedattn.launch.policy import DecodeConfig, choose_config, config_key, tuned_table_path
from pagedattn.reference import paged_decode_reference
from pagedattn.spec import LaunchSpec
from pagedattn.testing import rel_l2_error

BLOCK_N = {"fp32": (16, 32, 64), "other": (32, 64, 128)}
STAGES = (2, 3)
CTAS = (2, 4, 8)


def _grid(cache_dtype: torch.dtype, grid: str):
    """``full``: tiles x stages x split targets; ``none``: the default config only."""
    key = "fp32" if cache_dtype == torch.float32 else "other"
    if grid == "full":
        for bn, st, ctas in itertools.product(BLOCK_N[key], STAGES, CTAS):
            yield DecodeConfig(block_n=bn, num_warps=4, num_stages=st, ctas_per_sm=ctas,
                               min_chunk=256)


#: the fields of a swept config that a tuned table records (the rest keep the heuristic's)
TABLE_FIELDS = ("block_n", "num_stages", "ctas_per_sm")


def table_from_rows(rows: list[dict], min_gain: float = 0.02) -> dict[str, dict]:
    """A tuned table from a sweep's rows: for each config key (head_dim, group, cache dtype,
    page size), the swept config with the lowest geometric mean of its time over the default's
    time across that key's shapes, among the configs timed on every one of them; kept only
    where it beats the default by at least ``min_gain`` (elsewhere the heuristic stays, as it
    does on every GPU without a table).

    ``rows``: dicts with ``key``, ``shape``, ``kind`` (``"default"`` or ``"sweep"``),
    ``eager_us`` and, for swept rows, the :data:`TABLE_FIELDS`. Returns ``{key: {field: value}}``.
    """
    table = {}
    for key in sorted({r["key"] for r in rows}):
        default = {r["shape"]: r["eager_us"] for r in rows
                   if r["key"] == key and r["kind"] == "default"}
        ratios: dict[tuple, dict[str, float]] = {}
        for r in rows:
            if r["key"] == key and r["kind"] == "sweep" and r["shape"] in default:
                cfg = tuple(r[f] for f in TABLE_FIELDS)
                ratios.setdefault(cfg, {})[r["shape"]] = r["eager_us"] / default[r["shape"]]
        scored = [(math.exp(sum(math.log(x) for x in by.values()) / len(by)), cfg)
                  for cfg, by in ratios.items() if by.keys() == default.keys()]
        if scored:
            score, cfg = min(scored)
            if score <= 1.0 - min_gain:
                table[key] = dict(zip(TABLE_FIELDS, cfg, strict=True))
    return table


def _load_peer(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).parent))
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="peers")
    ap.add_argument("--out", default="out")
    ap.add_argument("--peer-file", default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop sweeping after this")
    ap.add_argument("--grid", choices=("full", "none"), default="full")
    ap.add_argument("--write-table", default=None, metavar="PATH",
                    help="also write this GPU's tuned table (JSON) here")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    roof = measure_read_bandwidth()
    print(f"roofline {roof:.0f} GB/s  commit {pagedattn.__file__}", flush=True)
    peer = _load_peer(args.peer_file) if args.peer_file else None
    rows = []
    for shape in select_shapes(args.shapes):
        m = shape.model
        b = build_batch(shape, "cuda")
        ref = paged_decode_reference(*b.tensors, **b.scales).out
        plan = pagedattn.plan_decode(b.block_tables, b.context_lens, num_q_heads=m.num_q_heads,
                                     num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                     page_size=shape.page_size, q_dtype=shape.dtype,
                                     kv_dtype=shape.cache_dtype)
        run = functools.partial(plan.run, *b.tensors[:3], **b.scales)
        err = rel_l2_error(run(), ref)
        eager = time_cold(run, reps=args.reps).median_us
        graph = time_graph(run, reps=args.reps).median_us
        group = m.num_q_heads // m.num_kv_heads
        default = choose_config(m.head_dim, group, shape.cache_dtype, shape.page_size, False,
                                torch.cuda.get_device_name())
        key = config_key(m.head_dim, group, shape.cache_dtype, shape.page_size)
        pct = 100 * gb_per_s(shape.minimal_bytes, eager) / roof
        rows.append(dict(shape=shape.name, key=key, kind="default",
                         config="default " + str(default), eager_us=eager, graph_us=graph,
                         err=err, pct=pct))
        line = (f"{shape.name}: default eager {eager:.1f} graph {graph:.1f} ({pct:.1f} %) "
                f"err {err:.2e}")
        if peer is not None:
            try:
                q, k, v, bt, cl = b.tensors
                prun, pcfg = peer.best_floor_runner(q, k, v, bt, cl, m.head_dim ** -0.5)
                same = shape.cache_dtype == shape.dtype  # the floor reads fp8 without scales
                perr = rel_l2_error(prun(), ref) if same else float("nan")
                pt = time_cold(prun, reps=args.reps).median_us
                rows.append(dict(shape=shape.name, key=key, kind="floor",
                                 config=f"floor {pcfg}", eager_us=pt,
                                 graph_us=float("nan"), err=perr,
                                 pct=100 * gb_per_s(shape.minimal_bytes, pt) / roof))
                line += f" | floor {pt:.1f} ({pt / eager:.3f}x ours) {pcfg}"
            except Exception as e:  # a peer that cannot run this shape
                line += f" | floor error {type(e).__name__}: {e}"
        print(line, flush=True)
        best = (float("inf"), None)
        for cfg in _grid(shape.cache_dtype, args.grid):
            if time.time() - t0 > args.budget_s:
                print("  budget reached: sweep cut short", flush=True)
                break
            lau = AutoLauncher(
                LaunchSpec(batch=shape.batch, max_pages=b.block_tables.shape[1],
                           num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
                           head_dim=m.head_dim, page_size=shape.page_size, q_dtype=shape.dtype,
                           kv_dtype=shape.cache_dtype, device=b.query.device),
                config=cfg)
            fn = functools.partial(lau.launch, *b.tensors, torch.empty_like(b.query), None,
                                   scale=m.head_dim ** -0.5, **b.scales)
            try:
                fn()
                e = rel_l2_error(fn.args[5], ref)
                t = time_cold(fn, reps=args.reps, warmup=3).median_us
            except Exception as ex:
                print(f"  {cfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                continue
            rows.append(dict(shape=shape.name, key=key, kind="sweep", config=str(cfg),
                             eager_us=t, graph_us=float("nan"), err=e,
                             pct=100 * gb_per_s(shape.minimal_bytes, t) / roof,
                             **{f: getattr(cfg, f) for f in TABLE_FIELDS}))
            if t < best[0]:
                best = (t, cfg)
        print(f"  best {best[0]:.1f} {best[1]}", flush=True)
        del b, ref
        torch.cuda.empty_cache()
        with open(out_dir / "sweep.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(TABLE_FIELDS), restval="")
            w.writeheader()
            w.writerows(rows)
    if args.write_table:
        name = torch.cuda.get_device_name()
        table = table_from_rows(rows)
        Path(args.write_table).write_text(json.dumps(
            {"gpu": name, "source": "scripts/sweep_decode.py", "configs": table}, indent=1))
        print(f"tuned table ({len(table)} keys beat the heuristic by >= 2 %): "
              f"{args.write_table}; it belongs at {tuned_table_path(name)}", flush=True)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
