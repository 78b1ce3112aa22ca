"""The split and persistent schedules side by side on a GPU, each row beside its size-matched
limit: one process, one GPU, every figure from the same run.

For each row (a ``pagedattn.bench.shapes`` name) it times, as CUDA-graph replays of one call
after a flush that only *reads* 2x the L2 (so the timed call starts on a clean L2; a zeroing
flush leaves dirty lines whose write-back the next kernel pays), the median over ``--reps``:

* ``limit``: a contiguous streaming read of exactly the row's minimal bytes (``kernels/readbw``,
  the fastest of its tile shapes), the size-matched limit;
* ``split``: ``plan.run`` of ``schedule="split"`` (today's plan);
* ``persistent``: ``plan.run`` of ``schedule="persistent"`` as the policy plans it, and one
  row per ``--variants`` entry ``label:key=value,...``: the policy's config with those
  :class:`~pagedattn.launch.policy.DecodeConfig` fields replaced (``persistent_ctas_per_sm``
  sets the program count and the register cap that keeps them resident);
* ``floor``: with ``--floor PATH`` (``plain_floor.py``'s ``best_floor_runner``), the floor peer.

Each output is compared with the split schedule's (relative L2) and, for rows under
``--oracle-mb`` of KV, with the float64 oracle. ``--stress N`` replays the persistent plan of a
ragged row ``N`` times and checks that every replay's output is bitwise the first (the
last-arriving program merges in a fixed order, so any difference is a race). Usage (repo
root, GPU machine)::

    PYTHONPATH=src python3 scripts/ab_schedule.py [--rows a,b] [--variants ...] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

import pagedattn
from pagedattn.bench.shapes import build_batch, get_shape
from pagedattn.bench.timing import READ_CONFIGS, l2_cache_bytes, stream_read
from pagedattn.launch import policy
from pagedattn.testing import rel_l2_error

ROWS = ("llama8b-b1-c32k,llama8b-b8-c8k,azure-conv-b64-llama8b,ragged-b64-llama8b,"
        "hd64-smollm-b64-c2k,mooncake-b16-llama8b,llama8b-b64-c2k,llama8b-b64-c8k,"
        "llama8b-b256-c1k,tp8-70b-b128-c8k,qwen7b-b64-c4k,hd256-b32-c4k,"
        "fp8-llama8b-b64-c8k,fp8-llama8b-b1-c32k")


class CleanFlush:
    """Reads a buffer of twice the L2 (at least 256 MB) into a one-element sink: the L2 then
    holds clean lines only."""

    def __init__(self, device):
        n = max(2 * l2_cache_bytes(device), 256 << 20) // 8
        self.buf = torch.ones(n, dtype=torch.int64, device=device)
        self.sink = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self):
        torch.sum(self.buf, dim=0, out=self.sink)


def graph_of(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def timed(launch, flush, reps):
    """Median µs of ``launch`` after ``flush``, warmed for 0.2 s (the clock ramp)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        flush()
        launch()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        flush()
        s.record()
        launch()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))


def limit_us(nbytes, flush, reps, device):
    """The size-matched limit: the fastest contiguous read of ``nbytes`` (graph, clean)."""
    x = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16, device=device)
    best = None
    for chunk, block, warps in READ_CONFIGS:
        part = stream_read(x, chunk=chunk, block=block, num_warps=warps)
        g = graph_of(lambda p=part, c=chunk, b=block, w=warps: stream_read(
            x, p, chunk=c, block=b, num_warps=w))
        t = timed(g.replay, flush, reps)
        best = t if best is None else min(best, t)
    return best


VARIANTS = ("k2:persistent_ctas_per_sm=2;k4:persistent_ctas_per_sm=4;"
            "32x4:block_n=32,num_stages=4;k2-64x3:persistent_ctas_per_sm=2,num_stages=3")


@contextlib.contextmanager
def patched_config(fields: dict):
    """The policy's configs with ``fields`` replaced, while the block runs; a field named
    ``_NAME`` sets the policy's module constant ``_NAME`` instead (``_PERSISTENT_MERGE_*``)."""
    consts = {k: v for k, v in fields.items() if k.startswith("_")}
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    saved = {k: getattr(policy, k) for k in consts}  # AttributeError: a misspelled name
    base = policy.choose_config
    if fields:
        policy.choose_config = lambda *a, **k: replace(base(*a, **k), **fields)
    for k, v in consts.items():
        setattr(policy, k, v)
    try:
        yield
    finally:
        policy.choose_config = base
        for k, v in saved.items():
            setattr(policy, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--variants", default=VARIANTS,
                    help="persistent variants, label:field=value,...;label:...")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--eager", action="store_true", help="also time eager plan.run")
    ap.add_argument("--floor", help="plain_floor.py (best_floor_runner)")
    ap.add_argument("--oracle-mb", type=float, default=150.0)
    ap.add_argument("--stress", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true",
                    help="only run each plan twice, eagerly after the flush (under ncu: "
                         "-k regex:paged_decode)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = CleanFlush(dev)
    floor = None
    if args.floor:
        import importlib.util
        spec = importlib.util.spec_from_file_location("plain_floor", args.floor)
        floor = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(floor)
    variants = {"persistent": {}}
    for spec in filter(None, args.variants.split(";")):
        label, _, fields = spec.partition(":")
        variants[label] = {k: int(v) for k, v in (f.split("=") for f in fields.split(",") if f)}
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, variants {variants}", flush=True)
    results = []
    for name in args.rows.split(","):
        shape = get_shape(name)
        b = build_batch(shape, dev)
        m = shape.model
        row = {"row": name, "mb": shape.minimal_bytes / 1e6}
        row["limit"] = 0.0 if args.profile else limit_us(shape.minimal_bytes, flush, args.reps,
                                                         dev)
        common = dict(num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
                      head_dim=m.head_dim, page_size=shape.page_size, q_dtype=shape.dtype,
                      kv_dtype=shape.cache_dtype)
        outs = {}
        plans = {"split": (pagedattn.plan_decode(b.block_tables, b.context_lens,
                                                 schedule="split", **common), {})}
        for label, fields in variants.items():
            plans[label] = (pagedattn.plan_decode(b.block_tables, b.context_lens,
                                                  schedule="persistent", **common), fields)
        for label, (plan, fields) in plans.items():
            out = torch.empty_like(b.query)

            def call(plan=plan, out=out, b=b):
                return plan.run(*b.tensors[:3], out=out, **b.scales)

            if args.profile:
                with patched_config(fields):
                    for _ in range(2):
                        flush()
                        call()
                torch.cuda.synchronize()
                continue
            try:
                with patched_config(fields):  # the plan's launcher is built at its first run
                    g = graph_of(call)
                row[label] = timed(g.replay, flush, args.reps)
                if args.eager:
                    row[label + " eager"] = timed(call, flush, args.reps)
                outs[label] = out.clone()
            except Exception as e:  # noqa: BLE001 (a row that fails is reported, not fatal)
                row[label] = f"error: {e!r}"[:200]
        if args.profile:
            continue
        if floor is not None:
            try:
                run, cfg = floor.best_floor_runner(*b.tensors, m.head_dim ** -0.5)
                g = graph_of(run)
                row["floor"] = timed(g.replay, flush, args.reps)
            except Exception as e:  # noqa: BLE001
                row["floor"] = f"error: {e!r}"[:200]
        ref = outs.get("split")
        for label, out in outs.items():
            if label != "split" and ref is not None:
                row[label + " vs split"] = rel_l2_error(out, ref)
        if shape.kv_bytes / 1e6 <= args.oracle_mb:
            oracle = pagedattn.paged_decode_reference(*b.tensors, **b.scales).out
            for label, out in outs.items():
                row[label + " err"] = rel_l2_error(out, oracle)
        line = f"{name:24s} {row['mb']:7.1f} MB limit {row['limit']:7.1f}"
        for label in plans:
            v = row.get(label)
            line += (f" | {label} {v:7.1f} ({100 * row['limit'] / v:5.1f}%)"
                     if isinstance(v, float) else f" | {label} {v}")
        if isinstance(row.get("floor"), float):
            line += f" | floor {row['floor']:7.1f} ({100 * row['limit'] / row['floor']:5.1f}%)"
        print(line, flush=True)
        errs = {k: f"{v:.1e}" for k, v in row.items() if k.endswith(("err", " split"))
                and isinstance(v, float)}
        print("    " + " ".join(f"{k}={v}" for k, v in errs.items()), flush=True)
        results.append(row)
        del b, plans, outs
        torch.cuda.empty_cache()
    bad = 0
    if args.stress:
        shape = get_shape("ragged-b64-llama8b")
        b = build_batch(shape, dev)
        m = shape.model
        plan = pagedattn.plan_decode(b.block_tables, b.context_lens, schedule="persistent",
                                     num_programs=3 * sms, num_q_heads=m.num_q_heads,
                                     num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                     page_size=16, q_dtype=shape.dtype)
        out = torch.empty_like(b.query)
        g = graph_of(lambda: plan.run(*b.tensors[:3], out=out))
        g.replay()
        first = out.clone()
        for _ in range(args.stress):
            g.replay()
            bad += not torch.equal(out, first)
        torch.cuda.synchronize()
        print(f"stress: {args.stress} replays of ragged, {bad} differ from the first", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "stress_differ": bad, "sms": sms}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
