"""``pagedattn profile``: Nsight Compute for impls on one shape, its table, and its target.

    pagedattn profile --impls gqa_reuse_v3,split_kv_v4 --shape seed-fp32-b64-c2048

With a GPU and ``ncu``, one ncu process per impl profiles a child Python process (this module
run as ``python -m pagedattn.bench.profile --impl .. --shape ..``: :func:`target_main`) that
builds the batch, warms the impl up outside the profiled range, then runs it ``--reps`` times
between cudaProfilerStart/Stop. Every kernel in that range is profiled, the split-KV merge
included (sections SpeedOfLight, LaunchStats, Occupancy, MemoryWorkloadAnalysis;
``--clock-control none``). The ``.ncu-rep`` and its CSV exports stay in ``--out-dir``.

Without ncu, or when ncu fails or is refused the counters for an impl, the **fallback** runs
the impl through the harness's one pipeline (:func:`pagedattn.bench.harness.measure`: checked
against the oracle, cold-L2 CUDA-event median) and adds Triton's compile metadata; no hardware
counter is ever estimated. Without a GPU nothing can be measured: the command says so and exits
2 (as ``pagedattn bench`` does), unless ``--dry-run`` runs the impls on a shrunken shape in the
Triton interpreter (checked, nothing measured) to exercise the pipeline. With a GPU but no
counters read, it exits 1 unless ``--no-ncu`` or ``--dry-run`` asked for that.

The table follows the study's ncu reading: duration; DRAM, L1/TEX, L2 and compute (SM)
throughput; registers/thread and shared memory per block; theoretical and achieved occupancy;
waves per SM; grid and block size. An impl that launches two kernels (split + merge) shows each
cell as ``split / merge`` and gets a total duration. A value nobody measured prints ``n/a``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedattn._cli_types import checked_output, name_list, nonneg_int, output_dir, positive_int
from pagedattn.bench import ncu
from pagedattn.bench.ncu import METRIC_KEYS, METRICS, KernelCounters
from pagedattn.bench.report import (
    NA,
    compile_metadata,
    fmt_bytes,
    fmt_count,
    fmt_pct,
    fmt_time,
    header_lines,
)
from pagedattn.bench.shapes import SHAPES, BenchBatch, BenchShape, build_batch, resolve_shape

SOURCE_NCU = "ncu"
SOURCE_EVENTS = "fallback: CUDA events + Triton compile metadata (no hardware counters)"
SOURCE_DRY_RUN = ("dry run: Triton interpreter on the CPU, shrunken shape; nothing measured "
                  "(no time, no hardware counter, no compile metadata)")
SHORT_SOURCE = {SOURCE_NCU: "ncu", SOURCE_EVENTS: "fallback (events)",
                SOURCE_DRY_RUN: "dry run (interpreter)"}
#: per-kernel keys beyond ncu's METRICS, from Triton's compile metadata
META_KEYS = ("spills", "num_warps", "num_stages")
#: our key -> the key of :func:`pagedattn.bench.report.compile_metadata` (Triton's shared
#: memory is all dynamic)
_META_FIELDS = {"regs": "n_regs", "spills": "n_spills", "smem_dynamic": "shared_bytes",
                "num_warps": "num_warps", "num_stages": "num_stages"}
UNITS = {m.key: m.unit for m in METRICS} | {k: "" for k in META_KEYS}
WARP_SIZE = 32
DEFAULT_OUT_DIR = "out/profile"


def compiled_kernels(impl: str, inputs: BenchBatch, **kwargs) -> tuple[torch.Tensor, dict]:
    """Run ``paged_decode(*inputs.tensors, impl=impl, **kwargs)`` once; return its output and
    ``{kernel name: compiled kernel}`` of every kernel that call launched.

    The API returns the compile records on request (``pagedattn.compiled_kernels``).
    """
    import pagedattn

    return pagedattn.compiled_kernels(*inputs.tensors, impl=impl, **inputs.scales, **kwargs)


def _as_counters(name: str, md: dict) -> KernelCounters:
    """Triton's compile metadata of one launched kernel as table values (None when absent)."""
    values: dict[str, float | None] = {k: None for k in (*METRIC_KEYS, *META_KEYS)}
    for ours, theirs in _META_FIELDS.items():
        v = md.get(theirs)
        values[ours] = float(v) if isinstance(v, (int, float)) else None
    if values["num_warps"] is not None:  # Triton launches num_warps * 32 threads per block
        values["block"] = values["num_warps"] * WARP_SIZE
    return KernelCounters(str(md.get("name") or name), values)


@dataclass
class ImplProfile:
    """The profile of one impl on one shape."""

    impl: str
    shape: str
    source: str  # SOURCE_NCU, SOURCE_EVENTS or SOURCE_DRY_RUN
    kernels: list[KernelCounters] = field(default_factory=list)
    total_us: float | None = None  # one call: sum of kernel durations (ncu) or event median
    minimal_bytes: int = 0
    note: str = ""  # e.g. why ncu was not used
    files: list[str] = field(default_factory=list)
    status: str = ""  # the oracle check of the fallback ("ok", "FAIL", "error"); "" unchecked

    @property
    def gbps(self) -> float | None:
        """Achieved bandwidth over the minimal bytes, in GB/s (1e9 bytes/s), if timed."""
        from pagedattn.bench.timing import gb_per_s

        return gb_per_s(self.minimal_bytes, self.total_us)

    @property
    def is_ncu(self) -> bool:
        return self.source == SOURCE_NCU

    @property
    def main_kernel(self) -> KernelCounters | None:
        """The longest kernel (the first one when durations are unknown): an impl's call may
        also launch small helpers (a merge, a torch fill), which ncu profiles too."""
        if not self.kernels:
            return None
        return max(self.kernels, key=lambda k: k.values.get("duration_us") or 0.0)


# --- measuring -----------------------------------------------------------------------------------

def _child_env() -> dict[str, str]:
    """The child's environment, with this ``pagedattn`` importable (its ``src`` first)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def target_command(impl: str, shape_name: str, small: bool, *, warmup: int = 3,
                   repeat: int = 1, meta_out: Path | None = None) -> list[str]:
    """The child command that ncu profiles (:func:`target_main`)."""
    cmd = [sys.executable, "-m", "pagedattn.bench.profile", "--impl", impl,
           "--shape", shape_name, "--warmup", str(warmup), "--reps", str(repeat)]
    return cmd + (["--small"] if small else []) + (["--meta-out", str(meta_out)] if meta_out
                                                   else [])


def ncu_files(out_dir: str | os.PathLike, shape: str, impl: str) -> dict[str, Path]:
    """Extension -> the file ncu's run of ``impl`` on the (resolved) ``shape`` writes."""
    return {ext: Path(out_dir) / f"{shape}_{impl}{ext}"
            for ext in (".ncu-rep", ".raw.csv", ".details.csv", ".meta.json")}


def check_output_files(out_dir: str | os.PathLike, shapes: list[str], impls: list[str],
                       option: str = "--out-dir") -> Path:
    """Before any work: ``out_dir`` and every ncu file of ``impls`` x ``shapes`` (resolved
    names) can be written (:func:`pagedattn._cli_types.checked_output`); returns ``out_dir``
    as a Path. Raises ArgumentError naming ``option``."""
    out = checked_output(out_dir, option, directory=True)
    for shape in shapes:
        for impl in impls:
            for path in ncu_files(out, shape, impl).values():
                checked_output(path, option)
    return out


def profile_with_ncu(ncu_path: str, impl: str, shape_name: str, out_dir: Path, *,
                     small: bool = False, warmup: int = 3, repeat: int = 1,
                     timeout: float = 600.0) -> ImplProfile:
    """One ncu process for ``impl`` on a registered shape; raises :class:`ncu.NcuError`."""
    shape = resolve_shape(shape_name, small)
    paths = ncu_files(out_dir, shape.name, impl)
    target = target_command(impl, shape_name, small, warmup=warmup, repeat=repeat,
                            meta_out=paths[".meta.json"])
    raw, details = ncu.run_profile(ncu_path, paths[".ncu-rep"], target, timeout=timeout,
                                   env=_child_env())
    paths[".raw.csv"].write_text(raw, encoding="utf-8")
    paths[".details.csv"].write_text(details, encoding="utf-8")
    kernels = ncu.parse_ncu_exports(raw, details)
    if not kernels or any(k.values.get("duration_us") is None for k in kernels):
        raise ncu.NcuError(f"{paths['.ncu-rep']} lacks a kernel duration (counters refused?)")
    meta = paths[".meta.json"]
    by_name = {m["name"]: m["values"] for m in json.loads(meta.read_text())} \
        if meta.exists() else {}
    for k in kernels:  # Triton's spills/num_warps/num_stages, which ncu does not report
        for key in META_KEYS:
            k.values.setdefault(key, by_name.get(k.name, {}).get(key))
    total = sum(k.values["duration_us"] or 0.0 for k in kernels)  # each checked above
    files = [str(paths[ext]) for ext in (".ncu-rep", ".raw.csv", ".details.csv")]
    return ImplProfile(impl, shape.name, SOURCE_NCU, kernels, total, shape.minimal_bytes,
                       files=files)


def profile_fallback(impl: str, shape: BenchShape, note: str = "") -> ImplProfile:
    """The harness's pipeline on one impl (checked; cold-L2 event median on a GPU only) plus
    the compile metadata of the kernels it launched."""
    import functools

    from pagedattn.bench.entries import impl_entry
    from pagedattn.bench.harness import UNTIMED, Timers, measure
    from pagedattn.reference import paged_decode_reference

    on_gpu = torch.cuda.is_available()
    b = build_batch(shape, "cuda" if on_gpu else "cpu")
    ref = paged_decode_reference(*b.tensors, **b.scales).out
    timers = UNTIMED
    if on_gpu:
        from pagedattn.bench.timing import time_cold

        timers = Timers(eager=functools.partial(time_cold, reps=30, warmup=3))
    row = measure(impl_entry(impl), shape, b, ref, timers)
    kernels = [_as_counters(k, md) for k, md in row.get("_compiled", {}).items()]
    if row["status"] in ("error", "unsupported"):
        note = "; ".join(x for x in (note, f"{row['status']}: {row['error']}") if x)
    return ImplProfile(impl, shape.name, SOURCE_EVENTS if on_gpu else SOURCE_DRY_RUN, kernels,
                       row.get("median_us"), shape.minimal_bytes, note=note,
                       status=row["status"])


def profile_impls(impls: list[str], shape_name: str, out_dir: str | os.PathLike, *,
                  small: bool = False, use_ncu: bool = True, warmup: int = 3, repeat: int = 1,
                  log=print) -> list[ImplProfile]:
    """Profile each impl on a registered shape (shrunk with ``small``): ncu when found and
    ``use_ncu``; otherwise, or when ncu fails for an impl, the fallback, with the reason in
    ``note``. Reports and CSV exports go to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    ncu_path = ncu.find_ncu() if use_ncu and on_gpu else None
    why = ("ncu not requested (--no-ncu)" if not use_ncu else "no CUDA GPU" if not on_gpu
           else "ncu not found" if ncu_path is None else "")
    shape = resolve_shape(shape_name, small)
    results = []
    for impl in impls:
        note = why
        if ncu_path is not None:
            log(f"[profile] ncu: {impl} on {shape.name}")
            try:
                results.append(profile_with_ncu(ncu_path, impl, shape_name, out, small=small,
                                                warmup=warmup, repeat=repeat))
                continue
            except ncu.NcuError as exc:
                note = f"ncu failed: {exc}"
                log(f"[profile] {note}; falling back for {impl}")
        log(f"[profile] fallback: {impl} on {shape.name}")
        results.append(profile_fallback(impl, shape, note=note))
    return results


def measure_roofline(log=print) -> float | None:
    """The read roofline (GB/s) measured now on the GPU, or ``None`` without one."""
    if not torch.cuda.is_available():
        return None
    from pagedattn.bench.timing import measure_read_bandwidth

    gbps = measure_read_bandwidth()
    torch.cuda.empty_cache()
    log(f"[profile] read roofline (this run): {gbps:,.0f} GB/s")
    return gbps


def verdict(profiles: list[ImplProfile], *, dry_run: bool, no_ncu: bool) -> str | None:
    """Why this run must exit non-zero (``None`` when it measured what was asked): nothing
    measured at all, or no hardware counter read when ncu was wanted."""
    if dry_run:
        return None
    if not any(p.total_us is not None for p in profiles):
        return "nothing was measured"
    if not no_ncu and not any(p.is_ncu for p in profiles):
        reasons = sorted({p.note for p in profiles if p.note}) or ["ncu did not run"]
        return ("no hardware counter was read (" + "; ".join(reasons) + "); durations are "
                "CUDA-event medians. Pass --no-ncu to accept that")
    return None


# --- the table --------------------------------------------------------------------------------

def smem_bytes(k: KernelCounters) -> float | None:
    """Shared memory per block, static + dynamic (None when neither is known)."""
    parts = [k.values.get("smem_static"), k.values.get("smem_dynamic")]
    return None if all(p is None for p in parts) else sum(p or 0 for p in parts)


def _grid(k: KernelCounters) -> str:
    n = fmt_count(k.values.get("grid"))
    return f"{k.grid} = {n}" if k.grid and n != NA else (k.grid or n)


def _per_kernel(get: Callable[[KernelCounters], str]) -> Callable[[ImplProfile], str]:
    return lambda p: " / ".join(get(k) for k in p.kernels) if p.kernels else NA


def _value(key: str, fmt: Callable[[float | None], str]) -> Callable[[ImplProfile], str]:
    return _per_kernel(lambda k: fmt(k.values.get(key)))


def table(profiles: list[ImplProfile], roofline_gbps: float | None = None) -> list[list[str]]:
    """The profile table: a header row, then one row per quantity; one column per impl."""
    from pagedattn.bench.timing import pct_of

    rows: list[tuple[str, Callable[[ImplProfile], str]]] = [
        ("Source", lambda p: SHORT_SOURCE.get(p.source, p.source)),
        ("Check vs oracle", lambda p: p.status or "not checked"),
        ("Kernels", _per_kernel(lambda k: k.name)),
        ("Duration (per kernel)", _value("duration_us", fmt_time)),
        ("Duration (total, one call)", lambda p: fmt_time(p.total_us)),
        ("DRAM throughput", _value("dram_pct", fmt_pct)),
        ("L1/TEX throughput", _value("l1_pct", fmt_pct)),
        ("L2 throughput", _value("l2_pct", fmt_pct)),
        ("Compute (SM) throughput", _value("sm_pct", fmt_pct)),
        ("Registers/thread", _value("regs", fmt_count)),
        ("Shared memory/block (static+dynamic)", _per_kernel(lambda k: fmt_bytes(smem_bytes(k)))),
        ("Theoretical occupancy", _value("occ_theoretical", fmt_pct)),
        ("Achieved occupancy", _value("occ_achieved", fmt_pct)),
        ("Waves per SM", _value("waves", fmt_count)),
        ("Grid size", _per_kernel(_grid)),
        ("Block size", _per_kernel(lambda k: k.block or fmt_count(k.values.get("block")))),
        ("Spills (Triton)", _value("spills", fmt_count)),
        ("num_warps (Triton)", _value("num_warps", fmt_count)),
        ("num_stages (Triton)", _value("num_stages", fmt_count)),
        ("Achieved bandwidth", lambda p: NA if p.gbps is None else f"{p.gbps:.0f} GB/s"),
        ("% of read roofline", lambda p: fmt_pct(pct_of(p.gbps, roofline_gbps))),
    ]
    out = [["", *(p.impl for p in profiles)]]
    out += [[label, *(cell(p) for p in profiles)] for label, cell in rows]
    return out


def to_text(rows: list[list[str]], fmt: str = "simple") -> str:
    """The table as text (``fmt`` "simple") or GitHub markdown (``fmt`` "github")."""
    from tabulate import tabulate

    return tabulate(rows[1:], headers=rows[0], tablefmt=fmt, disable_numparse=True)


def write_csv(path: str | Path, profiles: list[ImplProfile], env: dict[str, str],
              roofline_gbps: float | None = None) -> None:
    """Tidy rows: one per (shape, impl, kernel, metric), with unit, source, the environment and
    the roofline of this run. Kernel ``TOTAL`` carries the per-call duration and bandwidth."""
    env = {**env, "roofline_gbps": "" if roofline_gbps is None else str(roofline_gbps)}
    fields = ["shape", "impl", "kernel", "metric", "value", "unit", "source", "status", *env]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for p in profiles:
            base = [p.source, p.status, *env.values()]
            for k in p.kernels:
                for key, v in k.values.items():
                    w.writerow([p.shape, p.impl, k.name, key, "" if v is None else v,
                                UNITS.get(key, ""), *base])
            for key, v, unit in (("duration_us", p.total_us, "us"),
                                 ("achieved_gbps", p.gbps, "GB/s")):
                w.writerow([p.shape, p.impl, "TOTAL", key, "" if v is None else v, unit, *base])


def notes(profiles: list[ImplProfile]) -> list[str]:
    """One line per distinct source and per fallback reason, for under the table."""
    lines = [f"- {SHORT_SOURCE.get(s, s)}: {s}" for s in dict.fromkeys(p.source for p in profiles)]
    by_note: dict[str, list[str]] = {}
    for p in profiles:
        if p.note:
            by_note.setdefault(p.note, []).append(p.impl)
    for note, impls in by_note.items():
        who = "all impls" if len(impls) == len(profiles) > 1 else ", ".join(impls)
        lines.append(f"- {who}: {note}")
    if any(not p.is_ncu for p in profiles):
        lines.append("- Columns not from ncu hold no hardware counters: throughput and "
                     "occupancy rows are n/a, never estimated.")
    return lines


def shape_section(profiles: list[ImplProfile], shape_text: str,
                  roofline_gbps: float | None, level: str = "##") -> str:
    """Markdown for one shape: a heading, its description, the table and the notes."""
    name = profiles[0].shape if profiles else "?"
    lines = [f"{level} {name}", "", shape_text, "",
             to_text(table(profiles, roofline_gbps), "github"), "", *notes(profiles)]
    return "\n".join(lines) + "\n"


def banner(profiles: list[ImplProfile]) -> list[str]:
    """The warning that opens a page when it holds less than a full ncu profile."""
    if not any(p.total_us is not None for p in profiles):
        return ["> **Dry run: nothing was measured.** The impls ran on shrunken shapes in the "
                "Triton interpreter (CPU) and were checked against the oracle; every time, "
                "counter and bandwidth on this page is n/a. Run on a GPU with ncu for "
                "figures.", ""]
    if not any(p.is_ncu for p in profiles):
        return ["> **Nsight Compute did not run.** Durations are CUDA-event medians; "
                "throughput and occupancy rows are n/a (never estimated).", ""]
    return []


# --- the command and the ncu target -------------------------------------------------------------

def _impls_type():
    from pagedattn.api import IMPLS

    return name_list(IMPLS, what="impl", presets={"all": tuple(IMPLS)})


def add_profiling_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``profile`` and ``ladder`` share."""
    parser.add_argument("--small", action="store_true", help="shrunken shapes")
    parser.add_argument("--no-ncu", action="store_true",
                        help="use the fallback (CUDA events) even with ncu, and accept it")
    parser.add_argument("--dry-run", action="store_true",
                        help="without a GPU: run the pipeline on shrunken shapes in the "
                             "interpreter; nothing is measured, exit 0")
    parser.add_argument("--warmup", type=nonneg_int, default=3, help="unprofiled calls first [3]")


def nothing_measurable(command: str, args: argparse.Namespace) -> bool:
    """Without a GPU and without ``--dry-run``: say plainly, in one line on stderr, that nothing
    can be measured (the caller exits 2, as ``pagedattn bench`` does, and writes nothing)."""
    if torch.cuda.is_available() or args.dry_run:
        return False
    print(f"pagedattn {command}: nothing was measured: no CUDA GPU, so neither Nsight Compute "
          "nor timing can run. --dry-run runs the pipeline on shrunken shapes in the Triton "
          "interpreter (checked, not measured).", file=sys.stderr)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedattn profile``."""
    parser.add_argument("--impls", default=["auto"], type=_impls_type(),
                        help="comma list of impls (pagedattn.api.IMPLS) or 'all' [auto]")
    parser.add_argument("--impl", dest="impls", type=_impls_type(), default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)  # the old spelling (sessions <= 12), hidden
    parser.add_argument("--shape", default="seed-fp32-b64-c2048", choices=SHAPES,
                        metavar="SHAPE", help="a shape of pagedattn.bench.shapes "
                                              "[seed-fp32-b64-c2048]")
    parser.add_argument("--out-dir", default=Path(DEFAULT_OUT_DIR), type=output_dir,
                        help=f"reports, CSV and markdown go here [{DEFAULT_OUT_DIR}]")
    add_profiling_arguments(parser)
    parser.add_argument("--reps", type=positive_int, default=1,
                        help="profiled calls per impl; repeated launches are merged by the "
                             "median [1]")
    parser.add_argument("--repeat", dest="reps", type=positive_int, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)  # the old spelling (sessions <= 12), hidden


def main(args: argparse.Namespace) -> int:
    """Run ``pagedattn profile``; returns the exit status."""
    from pagedattn.bench.report import environment_meta

    if nothing_measurable("profile", args):
        return 2
    on_gpu = torch.cuda.is_available()
    small = args.small or not on_gpu
    shape = resolve_shape(args.shape, small)
    out = check_output_files(args.out_dir, [shape.name], args.impls)
    csv_path = out / f"profile_{shape.name}.csv"
    md_path = out / f"profile_{shape.name}.md"
    for path in (csv_path, md_path):  # before the first profile, not after the last
        checked_output(path, "--out-dir")
    profiles = profile_impls(args.impls, args.shape, out, small=small, use_ncu=not args.no_ncu,
                             warmup=args.warmup, repeat=args.reps)
    roofline = measure_roofline()
    env = environment_meta("cuda" if on_gpu else None)
    print(shape.describe())
    print(to_text(table(profiles, roofline)))
    print("\n".join(notes(profiles)))
    write_csv(csv_path, profiles, env, roofline)
    md = ["# pagedattn profile", "", *banner(profiles), *header_lines(env, roofline), "",
          shape_section(profiles, shape.describe(), roofline)]
    files = [f for p in profiles for f in p.files]
    if files:
        md += ["Files: " + ", ".join(f"`{Path(f).name}`" for f in files), ""]
    md_path.write_text("\n".join(md), encoding="utf-8")
    print(f"[profile] wrote {md_path} and {csv_path}")
    why = verdict(profiles, dry_run=args.dry_run, no_ncu=args.no_ncu)
    if why:
        print(f"pagedattn profile: {why}.", file=sys.stderr)
        return 1
    return 0


def target_parser() -> argparse.ArgumentParser:
    """Options of the process ncu profiles (:func:`target_main`; built by
    :func:`target_command`)."""
    parser = argparse.ArgumentParser(prog="python -m pagedattn.bench.profile")
    parser.add_argument("--impl", required=True, help="the one impl to run")
    parser.add_argument("--shape", required=True, choices=SHAPES, metavar="SHAPE",
                        help="a shape of pagedattn.bench.shapes")
    parser.add_argument("--small", action="store_true", help="the shrunken shape")
    parser.add_argument("--warmup", type=nonneg_int, default=3,
                        help="calls before the profiled range (the first compiles) [3]")
    parser.add_argument("--reps", type=positive_int, default=1,
                        help="calls inside the profiled range [1]")
    parser.add_argument("--num-splits", type=positive_int, default=None,
                        help="split-KV splits (default: the impl's own choice)")
    parser.add_argument("--meta-out", default=None, help="write compile metadata JSON here")
    return parser


def target_main(argv: list[str] | None = None) -> int:
    """The process ncu profiles: warm-up (Triton compiles; not profiled, since ncu runs with
    ``--profile-from-start off``), then ``--reps`` calls between cudaProfilerStart/Stop.
    With ``--meta-out`` it also writes the compile metadata of the kernels it launched."""
    args = target_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("profile target: needs a CUDA GPU", file=sys.stderr)
        return 2
    batch = build_batch(resolve_shape(args.shape, args.small), "cuda")
    out = torch.empty_like(batch.query)
    _, handles = compiled_kernels(args.impl, batch, num_splits=args.num_splits, out=out)
    for _ in range(max(args.warmup - 1, 0)):  # the call above was warm-up 1 (it compiled)
        compiled_kernels(args.impl, batch, num_splits=args.num_splits, out=out)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.reps):
        compiled_kernels(args.impl, batch, num_splits=args.num_splits, out=out)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    if args.meta_out:
        kernels = [_as_counters(k, compile_metadata(h)) for k, h in handles.items()]
        with open(args.meta_out, "w", encoding="utf-8") as f:
            json.dump([{"name": k.name, "values": k.values} for k in kernels], f)
    return 0


if __name__ == "__main__":
    sys.exit(target_main())
