"""``pagedattn run`` and ``pagedattn bench``: one measure-a-row pipeline for our impls and peers.

:func:`measure` is the pipeline every command shares (``run``, ``bench``, and the fallback of
``profile`` and ``ladder``): build the callable, run it once (for our impls through
:func:`pagedattn.bench.profile.compiled_kernels`, which also yields Triton's compile metadata),
check the output against the float64 oracle, then time it: cold-L2 median (eager, after the
clean flush of :mod:`pagedattn.bench.timing`: a read), optionally CUDA-graph replays, the
eager median after do_bench's zeroing flush (``dirty_median_us``, for continuity with the runs
before the clean flush), the host time of one eager call, and optionally one decode step of
``--layers`` layers on caches of their own as one CUDA graph (:mod:`pagedattn.bench.step`,
``step_us_per_layer``). A failing impl or peer is a row (``FAIL``, ``error`` or
``unsupported``), never a crash.

``pagedattn run`` (the main job): every impl on one real-trace batch with poisoned pages;
shrunk for the CPU interpreter, where it checks correctness only.

``pagedattn bench``: every shape x (impls + peers), interleaved by shape, with the read
roofline (the read rate of 2 GiB) measured at the start and the end of the same run (the higher
counts), each shape's size-matched limit (a contiguous streaming read of exactly the row's
minimal bytes, :func:`pagedattn.bench.shapes.minimal_bytes`, timed the same way in the same
run: ``limit_us``; every row is reported as % of it, ``pct_limit``, and as % of the read rate,
``pct_roofline``), a "to beat" column (the fastest peer that passed its check, same run) and
whether each impl is at most ``TO_BEAT_SLACK`` x that. Outputs in ``--out-dir``
(``bench.csv``, ``.json``, ``.md``, ``.png``) are rewritten after every shape and name the
commit measured; every error is kept whole (the CSV/JSON as raised, the tables in numbered
notes). Exit status
(:func:`bench_status`): 1 when one of our impls gives a wrong result, or when any impl or peer
raised an error (an ``error`` cell, or a timing that raised) unless ``--allow-errors``; an
``unsupported`` cell and a peer's own ``FAIL`` are reported only; 2 for a bad argument. Needs
CUDA, except ``--list`` and ``--dry-run`` (shrunken shapes on the interpreter: checked,
untimed)::

    pagedattn bench --shapes peers --graph --peer-file floor=PATH/plain_floor.py:best_floor_runner

Host time: mean of ``--host-calls`` back-to-back eager calls on the row's own batch
(:func:`pagedattn.bench.timing.host_us`); ``n/a`` under the CPU interpreter.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from pagedattn._cli_types import (
    CPU_LIMIT_S,
    DTYPES,
    checked_output,
    dtype_name,
    name_list,
    nonneg_int,
    output_dir,
    output_file,
    positive_int,
    refuse_unless_yes,
)
from pagedattn._env import free_memory
from pagedattn.bench import report, step
from pagedattn.bench.cpu_time import batch_bytes, interpreter_seconds, say_estimate, seconds_for
from pagedattn.bench.entries import (
    Entry,
    entries,
    impl_names,
)
from pagedattn.bench.peers import DEFAULT_PEERS, PEERS, PeerUnsupported, peer_file
from pagedattn.bench.report import TO_BEAT_SLACK
from pagedattn.bench.shapes import (
    MODELS,
    SHAPE_PRESETS,
    SHAPES,
    BenchBatch,
    BenchShape,
    build_batch,
    make_shape,
    resolve_shape,
    shrink_lengths,
)
from pagedattn.bench.timing import Timing, gb_per_s
from pagedattn.traces import TRACES, sample_context_lens

DEFAULT_IMPLS = ("auto", "split_kv_v4", "gqa_reuse_v3")
#: ``pagedattn run`` defaults: the stages loop token by token in the interpreter (about 0.1 s
#: per token for 32 heads), so the CPU default takes under a minute on 2 cores
CPU_BATCH, CPU_MAX_CONTEXT, GPU_BATCH = 6, 32, 64
RUN_PAGE_SIZE = 16  # the pages of ``pagedattn run``'s batch
Timer = Callable[[Callable[[], object]], Timing]

class Timers(NamedTuple):
    """What :func:`measure` times: each ``None`` leaves its columns empty. ``eager`` and
    ``graph`` after the clean flush, ``dirty`` eager after the zeroing one, ``limit`` a
    streaming read of a byte count (the size-matched limit), ``step`` a decode step of
    several layers (a graph timer)."""

    eager: Timer | None = None
    graph: Timer | None = None
    host: Callable[[Callable[[], object]], float] | None = None
    dirty: Timer | None = None
    limit: Callable[[int], Timing] | None = None
    step: Timer | None = None


UNTIMED = Timers()  # check only: the CPU interpreter and --dry-run


def base_row(shape: BenchShape, name: str, kind: str) -> dict[str, Any]:
    m = shape.model
    return {"shape": shape.name, "impl": name, "kind": kind, "batch": shape.batch,
            "num_q_heads": m.num_q_heads, "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "dtype": str(shape.dtype).removeprefix("torch."),
            "cache_dtype": str(shape.cache_dtype).removeprefix("torch."),
            "num_tokens": shape.num_tokens, "kv_bytes": shape.kv_bytes,
            "minimal_bytes": shape.minimal_bytes, "status": "", "error": ""}


def _first_call(entry: Entry, fn, b: BenchBatch):
    """Run the entry once; through its ``check`` (ours: ``compiled_kernels``, with compile
    metadata) when it has one."""
    if entry.check is None:
        return fn(), {}
    out, kernels = entry.check(b)
    return out, {k: report.compile_metadata(v) for k, v in kernels.items()}


def _time_step(entry: Entry, shape: BenchShape, layers: list[BenchBatch], time_it: Timer,
               row: dict[str, Any]) -> None:
    """The decode step of ``layers`` as one CUDA graph (``time_it``: a graph timer), per
    layer, into ``row``."""
    make_step = entry.make_step or functools.partial(step.per_layer_step, entry.make)
    t = time_it(make_step(shape, layers))
    row["step_us_per_layer"] = t.median_us / len(layers)


def measure(entry: Entry, shape: BenchShape, b: BenchBatch, ref: torch.Tensor | None,
            timers: Timers = UNTIMED, layers: list[BenchBatch] | None = None) -> dict[str, Any]:
    """One row: build the callable, run and check it against ``ref`` (float64, or None for
    no check), then time it with ``timers`` (the step over ``layers`` when both
    ``timers.step`` and ``layers`` are given)."""
    from pagedattn.testing import rel_l2_error, tolerance_for

    row = base_row(shape, entry.name, entry.kind)
    try:
        fn = entry.make(shape, b, False)
        out, compiled = _first_call(entry, fn, b)
        if b.query.is_cuda:
            torch.cuda.synchronize()
        if not isinstance(out, torch.Tensor) or out.shape != b.query.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"the runner returned {got}, expected a tensor of the query's "
                            f"shape {tuple(b.query.shape)}")
    except (PeerUnsupported, NotImplementedError) as e:
        return {**row, "status": "unsupported", "error": str(e) or type(e).__name__}
    except Exception as e:  # noqa: BLE001 - a failing impl or peer is a row, not a crash
        return {**row, "status": "error", "error": f"{type(e).__name__}: {e}"}  # whole
    row["_compiled"] = compiled  # every kernel launched; the interpreter leaves its facts empty
    row["kernels"] = report.format_kernels({k: v for k, v in compiled.items() if v})
    row["peer_info"] = getattr(fn, "info", "")
    row["tolerance"] = tolerance_for(shape.cache_dtype)
    if ref is None:
        row["status"] = "unchecked"
    else:
        row["rel_l2_error"] = rel_l2_error(out, ref)
        row["status"] = "ok" if row["rel_l2_error"] <= row["tolerance"] else "FAIL"
    del out
    problems: list[str] = []
    steps: list[tuple[str, Timer | None, bool | None]] = [
        ("", timers.eager, False), ("graph_", timers.graph, True), ("dirty_", timers.dirty, False)]
    if timers.step is not None and layers:
        steps.append(("step_", timers.step, None))
    for prefix, time_it, for_graph in steps:
        if time_it is None:
            continue
        try:
            if for_graph is None:
                _time_step(entry, shape, layers or [], time_it, row)
                continue
            t = time_it(entry.make(shape, b, True) if for_graph else fn)
            row[f"{prefix}median_us"], row[f"{prefix}p20_us"], row[f"{prefix}p80_us"] = t[:3]
            row[f"{prefix}gbps"] = gb_per_s(shape.minimal_bytes, t.median_us)
        except (PeerUnsupported, NotImplementedError) as e:  # e.g. no graph capture: no time
            problems.append(f"{prefix or 'eager_'}timing unsupported: {e or type(e).__name__}")
        except Exception as e:  # noqa: BLE001 - a timing that raised is an error of the row
            problems.append(f"{prefix or 'eager_'}timing: {type(e).__name__}: {e}")
            row["_timing_error"] = True
    if timers.host is not None:
        try:
            row["host_us"] = timers.host(fn)
        except Exception as e:  # noqa: BLE001
            problems.append(f"host timing: {type(e).__name__}: {e}")
            row["_timing_error"] = True
    row["error"] = "; ".join(problems)
    return row


def _limit(shape: BenchShape, timers: Timers) -> dict[str, Any]:
    """The shape's size-matched limit: a streaming read of exactly its minimal bytes, timed
    by ``timers.limit`` (nothing without it; a read that raised is the rows' error)."""
    if timers.limit is None:
        return {}
    try:
        t = timers.limit(shape.minimal_bytes)
    except Exception as e:  # noqa: BLE001 - every row of the shape says so
        return {"_limit_error": f"limit timing: {type(e).__name__}: {e}"}
    return {"limit_us": t.median_us, "limit_gbps": gb_per_s(shape.minimal_bytes, t.median_us)}


def _layers(b: BenchBatch, num_layers: int) -> list[BenchBatch]:
    """The step's layers: one cache each while the device's free memory holds them
    (:func:`pagedattn.bench.step.distinct_caches`); the CPU builds every one."""
    free = torch.cuda.mem_get_info(b.query.device)[0] if b.query.is_cuda else None
    caches = num_layers if free is None else step.distinct_caches(
        num_layers, step.cache_bytes(b), free)
    return step.layer_batches(b, num_layers, caches)


def measure_shape(shape: BenchShape, columns: list[Entry], device, *, timers: Timers = UNTIMED,
                  check: bool = True, seed: int = 0, poison: bool = False,
                  progress=None, layers: int = 0) -> list[dict[str, Any]]:
    """Every entry on one shape's batch, with the shape's size-matched limit (``timers.limit``)
    and, given ``timers.step`` and ``layers``, the decode step of that many layers. ``bench``
    leaves caches unpoisoned (the naive peer would read NaN tails); ``run`` poisons them (the
    test suite always does)."""
    from pagedattn.reference import paged_decode_reference

    b = build_batch(shape, device, seed, poison=poison)
    ref = paged_decode_reference(*b.tensors, **b.scales).out if check else None
    limit = _limit(shape, timers)
    layer_list = _layers(b, layers) if timers.step is not None and layers else None
    rows = []
    for entry in columns:
        if progress is not None:
            progress.set_description(f"{shape.name} / {entry.name}")
        row = measure(entry, shape, b, ref, timers, layer_list)
        if layer_list and row.get("step_us_per_layer") is not None:
            row["step_layers"], row["step_caches"] = layers, step.count_caches(layer_list)
        if "_limit_error" in limit:
            row["error"] = "; ".join(x for x in (row.get("error"), limit["_limit_error"]) if x)
            row["_timing_error"] = True
        rows.append({**row, **{k: v for k, v in limit.items() if not k.startswith("_")}})
        if progress is not None:
            progress.update(1)
    return rows


def _fastest(peers: list[dict[str, Any]], keys: tuple[str, ...]) -> tuple[float, str] | None:
    times = [(t, r["impl"]) for r in peers
             if (t := next((r.get(k) for k in keys if r.get(k) is not None), None)) is not None]
    return min(times, default=None)


def add_to_beat(rows: list[dict[str, Any]]) -> None:
    """Per shape, the fastest peer that passed its check (``ok`` or ``unchecked``) in this run,
    eager and graph (a peer without a graph time counts with its eager time), and on our rows
    whether the impl is at most ``TO_BEAT_SLACK`` x it (in place)."""
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        peers = [r for r in mine if r["kind"] == "peer" and r["status"] in ("ok", "unchecked")]
        for prefix, keys in (("", ("median_us",)), ("graph_", ("graph_median_us", "median_us"))):
            best = _fastest(peers, keys)
            if best is None:
                continue
            for r in mine:
                if r["kind"] != "ours":
                    continue
                r[f"{prefix}to_beat_us"], r[f"{prefix}to_beat_peer"] = best
                own = r.get(f"{prefix}median_us")
                if own is not None:
                    r[f"{prefix}beats"] = "yes" if own <= TO_BEAT_SLACK * best[0] else "no"


def finalize(rows: list[dict[str, Any]], meta: dict[str, Any], roofline: float | None) -> None:
    """The run's environment, % of roofline (the read rate), % of the size-matched limit
    (``100 * limit_us / median_us``) and the to-beat columns on every row (in place)."""
    from pagedattn.bench.timing import pct_of

    add_to_beat(rows)
    for r in rows:
        r.update({k: meta[k] for k in report.RUN_KEYS if k in meta})
        r["roofline_gbps"] = roofline
        for p in ("", "graph_"):
            r[f"{p}pct_roofline"] = pct_of(r.get(f"{p}gbps"), roofline)
            r[f"{p}pct_limit"] = pct_of(r.get("limit_us"), r.get(f"{p}median_us"))


def report_files(out_dir: str | Path, stem: str = "bench") -> dict[str, Path]:
    """The files :func:`write_reports` writes under ``out_dir``: ``csv``, ``json``, ``md``,
    ``png``."""
    out_dir = Path(out_dir)
    return {"csv": out_dir / f"{stem}.csv", "json": out_dir / f"{stem}.json",
            "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}_roofline.png"}


def check_report_files(out_dir: str | Path, option: str = "--out-dir") -> Path:
    """Before any work: ``out_dir`` and each of :func:`report_files` can be written (a
    dangling symlink, a directory named ``bench.csv``, an unwritable folder fail now, not
    after the run). Raises ArgumentError naming ``option``; returns ``out_dir`` as a Path."""
    out = checked_output(out_dir, option, directory=True)
    for path in report_files(out).values():
        checked_output(path, option)
    return out


def write_reports(rows, meta, roofline, out_dir: str | Path, *,
                  stem: str = "bench") -> dict[str, Path]:
    """CSV, JSON, markdown and PNG under ``out_dir``; returns their paths."""
    files = report_files(out_dir, stem)
    finalize(rows, meta, roofline)
    paths = {"csv": report.write_csv(rows, files["csv"]),
             "json": report.write_json(rows, {**meta, "roofline_gbps": roofline}, files["json"]),
             "md": report.write_markdown(rows, meta, roofline, files["md"]),
             "png": report.plot_roofline(rows, files["png"], roofline,
                                         title=f"paged decode on {meta.get('gpu', '?')}")}
    return {k: v for k, v in paths.items() if v is not None}


def _gpu_timers(args, device) -> tuple[Timers, float | None, dict[str, Any]]:
    """Timers, the start roofline and the environment, when a GPU is present: every time
    and % after the clean flush; the dirty eager column after the zeroing one."""
    from pagedattn.bench.timing import (
        host_us,
        measure_read_bandwidth,
        time_cold,
        time_graph,
        time_read,
    )

    meta = {**report.environment_meta(device), "flush": "clean"}
    roofline = measure_read_bandwidth(device)
    print(f"{meta['gpu']}: read roofline {roofline:,.0f} GB/s (streaming read, 2 GiB bf16, "
          "clean flush)")
    kw = dict(reps=args.reps, warmup=args.warmup, device=device)
    graph = getattr(args, "graph", False)
    timers = Timers(functools.partial(time_cold, **kw),
                    functools.partial(time_graph, **kw) if graph else None,
                    functools.partial(host_us, calls=args.host_calls),
                    dirty=functools.partial(time_cold, **kw, flush="dirty"),
                    limit=functools.partial(time_read, **kw),
                    step=functools.partial(time_graph, **kw)
                    if getattr(args, "layers", 0) else None)
    return timers, roofline, meta


def errored(row: dict[str, Any]) -> bool:
    """The row's impl or peer raised: while building or running it (status ``error``) or
    while timing it. ``unsupported`` (PeerUnsupported, NotImplementedError) is not an error."""
    return row["status"] == "error" or bool(row.get("_timing_error"))


def bench_status(rows: list[dict[str, Any]], *, allow_errors: bool = False) -> int:
    """``pagedattn bench``'s exit status: 1 when one of our impls gives a wrong result
    (``FAIL``), or when any row (ours or a peer) raised (:func:`errored`) unless
    ``allow_errors``; else 0. A peer's ``FAIL`` (its own result off the oracle) and an
    ``unsupported`` cell are reported, not failures. Prints one line per row that counts."""
    bad = [r for r in rows if (r["kind"] == "ours" and r["status"] == "FAIL")
           or (errored(r) and not allow_errors)]
    for r in bad:  # a long error is whole in the table's notes, printed just before
        error = r.get("error") or ""
        print(f"FAILED {r['shape']} / {r['impl']} ({r['kind']}): {r['status']}"
              + (f": {error}" if len(error) <= report.STATUS_WIDTH else " (see its note)"))
    if bad and any(errored(r) for r in bad):
        print("(exit status 1: a row raised an error; --allow-errors reports errors without "
              "failing the run)")
    return 1 if bad else 0


# --- pagedattn bench ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedattn bench``."""
    parser.add_argument("--shapes", default=list(SHAPE_PRESETS["peers"]),
                        type=name_list(SHAPES, what="shape", presets=SHAPE_PRESETS),
                        help="'peers' (the peers table, default), 'all', or a comma list")
    parser.add_argument("--impls", default=list(DEFAULT_IMPLS),
                        type=name_list(impl_names(), what="impl"),
                        help=f"comma list of pagedattn impls (default: {','.join(DEFAULT_IMPLS)})")
    parser.add_argument("--peers", default=list(DEFAULT_PEERS),
                        type=name_list(PEERS, what="peer", allow_none=True),
                        help=f"comma list of {', '.join(PEERS)}, or 'none' (default: "
                             f"{','.join(DEFAULT_PEERS)}; absent packages report unsupported)")
    parser.add_argument("--peer-file", action="append", default=[], type=peer_file,
                        metavar="[NAME=]PATH[:FUNC]",
                        help="a Python file whose FUNC (default make_runner) builds a runner; "
                             "repeatable (see pagedattn.bench.peers)")
    parser.add_argument("--graph", action="store_true",
                        help="also time CUDA-graph replays (FlashInfer with use_cuda_graph)")
    parser.add_argument("--layers", type=nonneg_int, default=step.STEP_LAYERS,
                        help="layers of the serving-condition step: one decode step over that "
                             "many caches as one CUDA graph, reported per layer; 0 skips it "
                             f"(default {step.STEP_LAYERS})")
    parser.add_argument("--reps", type=positive_int, default=100,
                        help="timed repetitions (default 100)")
    parser.add_argument("--warmup", type=nonneg_int, default=10,
                        help="untimed calls first (default 10)")
    parser.add_argument("--host-calls", type=positive_int, default=50,
                        help="back-to-back eager calls for the host-time column (default 50)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the float64 oracle (faster; the error column stays empty)")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="seed of the K/V/q draws")
    parser.add_argument("--out-dir", default=Path("out/bench"), type=output_dir,
                        help="where the reports go (default: out/bench)")
    parser.add_argument("--dry-run", action="store_true",
                        help="shrunken shapes, checked and untimed (the CPU interpreter)")
    parser.add_argument("--allow-errors", action="store_true",
                        help="exit 0 even when an impl or peer raised an error (its row says "
                             "so); a wrong result of ours still exits 1")
    parser.add_argument("--list", action="store_true", help="list the shapes and exit")


def _list_shapes() -> int:
    from tabulate import tabulate

    from pagedattn.bench.shapes import PEER_SHAPES, get_shape

    table = [(n, "peers" if n in PEER_SHAPES else "extra",
              get_shape(n).describe().split(": ", 1)[1]) for n in SHAPES]
    print(tabulate(table, headers=["shape", "set", "description"]))
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``pagedattn bench``; returns the exit status."""
    if args.list:
        return _list_shapes()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.dry_run:
        print("pagedattn bench: nothing was measured: no CUDA GPU (timing under the CPU "
              "interpreter is not performance). Use --dry-run to check impls and peers on "
              "shrunken shapes, or `pagedattn run` for a correctness run.", file=sys.stderr)
        return 2
    out_dir = check_report_files(args.out_dir)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    shapes = [resolve_shape(n, small=args.dry_run) for n in args.shapes]
    columns = entries(args.impls, args.peers, args.peer_file)
    if args.dry_run:
        timers, roof_start, meta = UNTIMED, None, report.environment_meta(None)
        print("pagedattn bench --dry-run: shrunken shapes, outputs checked, nothing timed")
        if not on_gpu:
            seconds = sum(interpreter_seconds(s, args.impls) for s in shapes)
            print(say_estimate("pagedattn bench --dry-run", seconds,
                               f"{len(shapes)} shapes x {len(args.impls)} impls (peers not "
                               "counted)"))
    else:
        timers, roof_start, meta = _gpu_timers(args, device)
    from tqdm import tqdm

    rows: list[dict[str, Any]] = []
    progress = tqdm(total=len(shapes) * len(columns), unit="run", mininterval=5)
    for shape in shapes:
        t0 = time.perf_counter()
        rows += measure_shape(shape, columns, device, timers=timers, check=not args.no_check,
                              seed=args.seed, progress=progress, layers=args.layers)
        write_reports(rows, meta, roof_start, out_dir)
        tqdm.write(f"{shape.describe()}  [{time.perf_counter() - t0:.0f} s]")
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    progress.close()
    roofline = roof_start
    if not args.dry_run:
        from pagedattn.bench.timing import measure_read_bandwidth

        roof_end = measure_read_bandwidth(device)
        roofline = max(roof_start or 0.0, roof_end)
        meta["roofline_start_gbps"], meta["roofline_end_gbps"] = roof_start, roof_end
    paths = write_reports(rows, meta, roofline, out_dir)
    print(report.terminal_table(rows))
    print(report.roofline_line(roofline) + "; " + ", ".join(f"{k}: {v}" for k, v in paths.items()))
    return bench_status(rows, allow_errors=args.allow_errors)


# --- pagedattn run -----------------------------------------------------------------------------

def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedattn run``."""
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS),
                        help="model shape from the registry (default: %(default)s)")
    parser.add_argument("--trace", default="azure", choices=sorted(TRACES),
                        help="request trace the lengths come from (default: %(default)s)")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help=f"sequences (default {GPU_BATCH} on a GPU, {CPU_BATCH} on the CPU)")
    parser.add_argument("--max-context", type=positive_int, default=None,
                        help="scale the lengths down so the longest is this many tokens "
                             f"(default: none on a GPU, {CPU_MAX_CONTEXT} on the CPU)")
    parser.add_argument("--impls", default=list(impl_names()),
                        type=name_list(impl_names(), what="impl",
                                       presets={"all": impl_names()}),
                        help="comma list of impls, or 'all' (default)")
    parser.add_argument("--dtype", type=dtype_name(DTYPES), default=None,
                        help="query/cache dtype: float32 (fp32), float16 (fp16) or bfloat16 "
                             "(bf16) (default: the model's)")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="trace draw and K/V/q seed")
    parser.add_argument("--reps", type=positive_int, default=50,
                        help="timed repetitions on a GPU")
    parser.add_argument("--warmup", type=nonneg_int, default=10, help="untimed calls on a GPU")
    parser.add_argument("--host-calls", type=positive_int, default=50,
                        help="back-to-back eager calls for the host-time column on a GPU")
    parser.add_argument("--csv", default=None, type=output_file,
                        help="also write the rows to this CSV file")
    parser.add_argument("--yes", action="store_true",
                        help="run even when the settings are estimated past "
                             f"{CPU_LIMIT_S // 60} minutes in Triton's interpreter (CPU) or "
                             "past the memory free (the estimate is printed first)")


def _refuse_costly(args: argparse.Namespace, model, dtype, device, *, tokens: int, seqs: int,
                   pages: int) -> None:
    """Before any allocation: refuse (ArgumentError, unless ``--yes``) settings estimated
    past :data:`CPU_LIMIT_S` of the interpreter or past the memory free, on the host (where
    the batch is drawn) and on a GPU. ``pages`` of :data:`RUN_PAGE_SIZE` tokens."""
    hint = "ask for a smaller --batch or --max-context"
    host, on_device = batch_bytes(model, dtype, pages, RUN_PAGE_SIZE)
    refuse_unless_yes(args.yes, hint, seconds=None if device.type == "cuda" else seconds_for(
        model.num_q_heads, tokens, seqs, args.impls), need_bytes=host,
        free_bytes=free_memory(torch.device("cpu")))
    if device.type == "cuda":
        refuse_unless_yes(args.yes, hint, need_bytes=on_device, free_bytes=free_memory(device))


def run_main(args: argparse.Namespace) -> int:
    """Run ``pagedattn run``; returns the exit status (1 if any impl fails). Settings
    estimated past :data:`CPU_LIMIT_S` (CPU) or the memory free are refused before any
    allocation unless ``--yes``: first the least they can cost (a token per sequence), so
    that no batch too large to run is drawn, then the drawn batch's estimate."""
    if args.csv:
        checked_output(args.csv, "--csv")
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else \
        torch.device("cpu")
    model = MODELS[args.model]
    batch = args.batch if args.batch is not None else (GPU_BATCH if on_gpu else CPU_BATCH)
    dtype = DTYPES[args.dtype] if args.dtype else model.dtype
    _refuse_costly(args, model, dtype, device, tokens=batch, seqs=batch, pages=batch)
    drawn = sample_context_lens(args.trace, batch, args.seed)
    max_context = args.max_context or (None if on_gpu else CPU_MAX_CONTEXT)
    lens = shrink_lengths(drawn, max_context) if max_context else drawn
    shape = make_shape(f"{args.trace}-b{batch}-{model.name}", model, lens, dtype=dtype,
                       page_size=RUN_PAGE_SIZE)
    _refuse_costly(args, model, dtype, device, tokens=shape.num_tokens, seqs=batch,
                   pages=sum(shape.pages_per_seq) + 2)
    print(f"{args.trace} trace, seed {args.seed}: {batch} requests, "
          f"{sum(drawn):,} KV tokens drawn (longest {max(drawn):,}).")
    if lens != drawn:
        print(f"Shrunk for {'the CPU interpreter' if not on_gpu else '--max-context'}: "
              f"lengths scaled by {max_context}/{max(drawn)} to {sum(lens):,} tokens "
              f"(longest {max(lens)}). Batch {batch}; heads {model.num_q_heads}/"
              f"{model.num_kv_heads} and head_dim {model.head_dim} are {model.name}'s. "
              "Use --batch/--max-context to change this.")
    if on_gpu:
        timers, roofline, meta = _gpu_timers(args, device)
    else:
        print("No GPU: the kernels run in Triton's interpreter on the CPU. This run checks "
              "correctness only; interpreter times are not performance.")
        timers, roofline, meta = UNTIMED, None, report.environment_meta(None)
    print(shape.describe())
    if not on_gpu:
        print(say_estimate("pagedattn run", interpreter_seconds(shape, args.impls),
                           f"{len(args.impls)} impls"))
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(total=len(args.impls), unit="impl") as progress:
        rows = measure_shape(shape, entries(args.impls, []), device, timers=timers,
                             seed=args.seed, poison=True, progress=progress)
    finalize(rows, meta, roofline)
    print(report.terminal_table(rows))
    tolerance = next((r["tolerance"] for r in rows if "tolerance" in r), "-")
    print(f"tolerance (rel L2 vs the float64 oracle): {tolerance}; "
          f"{len(rows)} impls in {time.perf_counter() - t0:.1f} s"
          + ("" if on_gpu else " (interpreter: not performance)"))
    if args.csv:
        print(f"rows written to {report.write_csv(rows, args.csv)}")
    failed = [r["impl"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


#: ``pagedattn run``, for :mod:`pagedattn.cli` (``pagedattn.bench.harness:RUN``)
RUN = SimpleNamespace(add_arguments=add_run_arguments, main=run_main)
