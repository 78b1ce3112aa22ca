"""``pagedattn bench``: time our impls and the peers on the registry's shapes, on one GPU.

For every shape (interleaved: all impls for shape 1, then all for shape 2, ...), every impl
and every peer: check the output against the float64 oracle (computed on the GPU), time the
call on cold L2 (median, µs), optionally time CUDA-graph replays (``--graph``), and report GB/s
(minimal bytes, decimal) and % of the read roofline measured by a streaming-read kernel in the
same run (at the start and the end; the higher is used). Outputs in ``--out-dir``: ``bench.csv``,
``bench.json``, ``bench.md`` and ``bench_roofline.png``, rewritten after every shape, so an
interrupted run keeps what it measured.

Example (H200): ``PYTHONPATH=src python3 -m pagedattn.cli bench --shapes peers --graph
--out-dir $OUT/bench``. Needs CUDA; ``--list`` works anywhere.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedattn.bench import report
from pagedattn.bench.peers import DEFAULT_PEERS, PEERS, PeerUnsupported
from pagedattn.bench.shapes import SHAPES, BenchBatch, BenchShape, build_batch, select_shapes
from pagedattn.bench.timing import Timing, gb_per_s

DEFAULT_IMPLS = ("auto", "split_kv_v4", "gqa_reuse_v3")
Timer = Callable[[Callable[[], object]], Timing]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="peers",
                        help="'peers' (the peers table, default), 'all', or a comma list")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                        help="comma list of pagedattn impls (default: %(default)s)")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help=f"comma list of {', '.join(PEERS)}, or 'none' "
                             "(default: %(default)s; absent packages are skipped)")
    parser.add_argument("--graph", action="store_true",
                        help="also time CUDA-graph replays (FlashInfer with use_cuda_graph)")
    parser.add_argument("--reps", type=int, default=100, help="timed repetitions (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the float64 oracle (faster; the error column stays empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the K/V/q draws")
    parser.add_argument("--out-dir", default="out/bench", help="where the reports go")
    parser.add_argument("--list", action="store_true", help="list the shapes and exit")


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip() and s.strip() != "none"]


def base_row(shape: BenchShape, impl: str, kind: str) -> dict[str, Any]:
    m = shape.model
    return {"shape": shape.name, "impl": impl, "kind": kind, "batch": shape.batch,
            "num_q_heads": m.num_q_heads, "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "dtype": str(shape.dtype).removeprefix("torch."),
            "cache_dtype": str(shape.cache_dtype).removeprefix("torch."),
            "num_tokens": shape.num_tokens, "kv_bytes": shape.kv_bytes,
            "minimal_bytes": shape.minimal_bytes, "status": "", "error": ""}


def impl_factory(impl: str) -> Callable[..., Callable[[], torch.Tensor]]:
    """A factory like the peers' for one of our impls: ``paged_decode(..., impl=impl)``."""
    import pagedattn.api as api

    def make(shape: BenchShape, b: BenchBatch, for_graph: bool = False):
        if impl in api.STAGES and shape.cache_dtype != shape.dtype:
            raise PeerUnsupported(f"{impl}: the study's stages take no fp8 cache")
        return lambda: api.paged_decode(*b.tensors, impl=impl, **b.scales)

    return make


def _record_timing(row: dict[str, Any], prefix: str, t: Timing, nbytes: int) -> None:
    row[f"{prefix}median_us"], row[f"{prefix}p20_us"], row[f"{prefix}p80_us"] = t[:3]
    row[f"{prefix}gbps"] = gb_per_s(nbytes, t.median_us)


def measure(shape: BenchShape, b: BenchBatch, name: str, kind: str, make, ref,
            timer: Timer | None, graph_timer: Timer | None) -> dict[str, Any]:
    """One row: build the callable, check it against ``ref`` (float64 or None), time it."""
    from pagedattn.testing import rel_l2_error, tolerance_for

    row = base_row(shape, name, kind)
    compiled = report.last_compiled() if kind == "ours" else {}
    compiled.clear()  # so what is left after the call is this impl's kernels
    try:
        fn = make(shape, b, False)
        out = fn()
        if b.query.is_cuda:
            torch.cuda.synchronize()
    except PeerUnsupported as e:
        return {**row, "status": "unsupported", "error": str(e)}
    except Exception as e:  # noqa: BLE001 - a failing impl or peer is a row, not a crash
        return {**row, "status": "error", "error": f"{type(e).__name__}: {e}"[:300]}
    kernels = {k: report.compile_metadata(v) for k, v in compiled.items()}
    row["kernels"] = report.format_kernels({k: v for k, v in kernels.items() if v})
    row["tolerance"] = tolerance_for(shape.cache_dtype)
    if ref is not None:
        row["rel_l2_error"] = rel_l2_error(out, ref)
        row["status"] = "ok" if row["rel_l2_error"] <= row["tolerance"] else "FAIL"
    else:
        row["status"] = "unchecked"
    del out
    for prefix, time_it, for_graph in (("", timer, False), ("graph_", graph_timer, True)):
        if time_it is None:
            continue
        try:
            call = make(shape, b, True) if for_graph else fn
            _record_timing(row, prefix, time_it(call), shape.minimal_bytes)
        except Exception as e:  # noqa: BLE001 - e.g. a peer that cannot be captured
            row["error"] += f"{prefix or 'eager_'}timing: {type(e).__name__}: {e}"[:300]
    return row


def bench_shape(shape: BenchShape, impls: list[str], peers: list[str], device, *,
                timer: Timer | None, graph_timer: Timer | None = None, check: bool = True,
                seed: int = 0, progress=None) -> list[dict[str, Any]]:
    """All impls, then all peers, on one shape. Caches are not poisoned here (the naive peer
    would read NaN tails); the test suite covers poisoning."""
    from pagedattn.reference import paged_decode_reference

    b = build_batch(shape, device, seed, poison=False)
    ref = paged_decode_reference(*b.tensors, **b.scales).out if check else None
    rows = []
    entries = [(i, "ours", impl_factory(i)) for i in impls]
    entries += [(p, "peer", PEERS[p]) for p in peers]
    for name, kind, make in entries:
        if progress is not None:
            progress.set_description(f"{shape.name} / {name}")
        rows.append(measure(shape, b, name, kind, make, ref, timer, graph_timer))
        if progress is not None:
            progress.update(1)
    return rows


def finalize(rows: list[dict[str, Any]], meta: dict[str, Any], roofline: float | None) -> None:
    """Add % of roofline and the run's environment to every row (in place)."""
    for r in rows:
        r.update({k: meta[k] for k in report.META_KEYS if k in meta})
        if roofline:
            r["roofline_gbps"] = roofline
            for p in ("", "graph_"):
                if r.get(f"{p}gbps") is not None:
                    r[f"{p}pct_roofline"] = 100.0 * r[f"{p}gbps"] / roofline


def write_reports(rows, meta, roofline, out_dir: str | Path) -> dict[str, Path]:
    """CSV, JSON, markdown and PNG under ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    finalize(rows, meta, roofline)
    md = out_dir / "bench.md"
    md.write_text(report.markdown_report(rows, meta, roofline))
    return {"csv": report.write_csv(rows, out_dir / "bench.csv"),
            "json": report.write_json(rows, {**meta, "roofline_gbps": roofline},
                                      out_dir / "bench.json"),
            "md": md,
            "png": report.plot_roofline(rows, out_dir / "bench_roofline.png", roofline,
                                        title=f"paged decode on {meta.get('gpu', '?')}")}


def _list_shapes() -> int:
    from tabulate import tabulate

    from pagedattn.bench.shapes import PEER_SHAPES, get_shape

    table = [(n, "peers" if n in PEER_SHAPES else "extra",
              get_shape(n).describe().split(": ", 1)[1]) for n in SHAPES]
    print(tabulate(table, headers=["shape", "set", "description"]))
    return 0


def main(args: argparse.Namespace) -> int:
    if args.list:
        return _list_shapes()
    if not torch.cuda.is_available():
        print("pagedattn bench needs a CUDA GPU (timing under the CPU interpreter is not "
              "performance). Use `pagedattn run` for a correctness run on the CPU.")
        return 2
    from tqdm import tqdm

    from pagedattn.bench.timing import measure_read_bandwidth, time_cold, time_graph

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        shapes = select_shapes(args.shapes)
    except ValueError as e:
        raise SystemExit(f"--shapes: {e}") from None
    impls, peers = _split(args.impls), _split(args.peers)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; known: {', '.join(PEERS)}")
    meta: dict[str, Any] = report.environment_meta(device)
    roof_start = measure_read_bandwidth(device)
    print(f"{meta['gpu']}: read roofline {roof_start:,.0f} GB/s (streaming read, 2 GiB bf16)")
    timer = functools.partial(time_cold, reps=args.reps, warmup=args.warmup, device=device)
    graph_timer = (functools.partial(time_graph, reps=args.reps, warmup=args.warmup,
                                     device=device) if args.graph else None)
    rows: list[dict[str, Any]] = []
    progress = tqdm(total=len(shapes) * (len(impls) + len(peers)), unit="run", mininterval=5)
    for shape in shapes:
        t0 = time.perf_counter()
        rows += bench_shape(shape, impls, peers, device, timer=timer, graph_timer=graph_timer,
                            check=not args.no_check, seed=args.seed, progress=progress)
        write_reports(rows, meta, roof_start, args.out_dir)
        tqdm.write(f"{shape.describe()}  [{time.perf_counter() - t0:.0f} s]")
        gc.collect()
        torch.cuda.empty_cache()
    progress.close()
    roof_end = measure_read_bandwidth(device)
    roofline = max(roof_start, roof_end)
    meta["roofline_start_gbps"], meta["roofline_end_gbps"] = roof_start, roof_end
    paths = write_reports(rows, meta, roofline, args.out_dir)
    print(report.terminal_table(rows))
    print(f"roofline {roofline:,.0f} GB/s (start {roof_start:,.0f}, end {roof_end:,.0f}); "
          + ", ".join(f"{k}: {v}" for k, v in paths.items()))
    failed = [r for r in rows if r["kind"] == "ours" and r["status"] in ("FAIL", "error")]
    for r in failed:
        print(f"FAILED {r['shape']} / {r['impl']}: {r['status']} {r.get('error', '')}")
    return 1 if failed else 0
