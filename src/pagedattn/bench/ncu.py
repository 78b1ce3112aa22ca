"""Nsight Compute (``ncu``): the metric table, the command lines, and the CSV parser.

The optimization study reads four ncu sections per kernel: SpeedOfLight, LaunchStats,
Occupancy and MemoryWorkloadAnalysis. :data:`METRICS` is the one table that names, for every row
of our profile table, the metric in both of ncu's CSV exports:

- ``ncu --import R.ncu-rep --csv --page raw --print-units base``: wide. A header row of metric
  names (``gpu__time_duration.sum``, ...), a row of units, then one row per profiled launch.
- ``ncu --import R.ncu-rep --csv --page details``: long. Columns ``"ID","Process ID",
  "Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",
  "Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"`` (newer versions
  append rule columns), one row per (launch, section, metric), with display names such as
  ``"DRAM Throughput"``.

:func:`parse_ncu_csv` reads either (it tells them apart by the header), converts every value to
the row's canonical unit (µs, %, bytes) and merges repeated launches of one kernel by the median.
A value ncu did not report stays ``None``: nothing here invents a counter.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Metric:
    """One row of the profile table and where ncu reports it."""

    key: str
    label: str
    unit: str  # canonical unit of the parsed value: "us", "%", "bytes" or "" (a count)
    raw: tuple[str, ...]  # --page raw metric names, preferred first
    details: tuple[str, ...]  # --page details display names, preferred first
    sections: tuple[str, ...] = ()  # preferred --page details sections (display names)


_SOL = ("GPU Speed Of Light Throughput",)
_LAUNCH = ("Launch Statistics",)
_OCC = ("Occupancy",)

#: The study's rows, in table order. Names differ across ncu versions: aliases come after.
METRICS: tuple[Metric, ...] = (
    Metric("duration_us", "Duration", "us", ("gpu__time_duration.sum",), ("Duration",), _SOL),
    Metric("dram_pct", "DRAM throughput", "%",
           ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed"), ("DRAM Throughput",), _SOL),
    Metric("l1_pct", "L1/TEX throughput", "%",
           ("l1tex__throughput.avg.pct_of_peak_sustained_active",
            "l1tex__throughput.avg.pct_of_peak_sustained_elapsed"),
           ("L1/TEX Cache Throughput",), _SOL),
    Metric("l2_pct", "L2 throughput", "%", ("lts__throughput.avg.pct_of_peak_sustained_elapsed",),
           ("L2 Cache Throughput",), _SOL),
    Metric("sm_pct", "Compute (SM) throughput", "%",
           ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
           ("Compute (SM) Throughput",), _SOL),
    Metric("regs", "Registers/thread", "", ("launch__registers_per_thread",),
           ("Registers Per Thread",), _LAUNCH),
    Metric("smem_static", "Static shared memory/block", "bytes",
           ("launch__shared_mem_per_block_static",), ("Static Shared Memory Per Block",), _LAUNCH),
    Metric("smem_dynamic", "Dynamic shared memory/block", "bytes",
           ("launch__shared_mem_per_block_dynamic",), ("Dynamic Shared Memory Per Block",),
           _LAUNCH),
    Metric("occ_theoretical", "Theoretical occupancy", "%",
           ("sm__maximum_warps_per_active_cycle_pct", "launch__occupancy_theoretical_pct"),
           ("Theoretical Occupancy",), _OCC),
    Metric("occ_achieved", "Achieved occupancy", "%",
           ("sm__warps_active.avg.pct_of_peak_sustained_active",), ("Achieved Occupancy",), _OCC),
    Metric("waves", "Waves per SM", "", ("launch__waves_per_multiprocessor",), ("Waves Per SM",),
           _LAUNCH),
    Metric("grid", "Grid size (blocks)", "", ("launch__grid_size",), ("Grid Size",), _LAUNCH),
    Metric("block", "Block size (threads)", "", ("launch__block_size",), ("Block Size",), _LAUNCH),
)
METRIC_KEYS = tuple(m.key for m in METRICS)

#: ncu section identifiers collected by ``pagedattn profile`` (``--section NAME``).
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "MemoryWorkloadAnalysis")

_TIME_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
               "msecond": 1e3, "s": 1e6, "second": 1e6}
_BYTES = {"byte": 1.0, "b": 1.0, "kbyte": 1e3, "kb": 1e3, "kibyte": 1024.0, "kib": 1024.0,
          "mbyte": 1e6, "mb": 1e6, "mibyte": 2.0**20, "mib": 2.0**20}


class NcuError(RuntimeError):
    """ncu is missing, failed, refused the counters, or profiled no kernel."""


@dataclass
class KernelCounters:
    """The parsed counters of one kernel (repeated launches merged by the median)."""

    name: str
    values: dict[str, float | None] = field(default_factory=dict)  # METRICS key -> value
    grid: str = ""  # "(x, y, z)" as ncu prints it, "" when unknown
    block: str = ""
    launches: int = 1


def to_canonical(value: float, unit: str, canonical: str) -> float | None:
    """``value`` in ``unit`` converted to ``canonical`` ("us", "bytes", "%" or "")."""
    u = unit.strip().split("/")[0].strip().lower()  # "Kbyte/block" -> "kbyte"
    if canonical == "us":
        factor = _TIME_TO_US.get(u)
        return None if factor is None else value * factor
    if canonical == "bytes":
        factor = _BYTES.get(u, 1.0 if u == "" else None)
        return None if factor is None else value * factor
    return value


def _number(text: str) -> float | None:
    """ncu's value text as a float; ``None`` for "n/a", "" or a non-number."""
    t = text.strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return None


def _csv_rows(text: str) -> list[list[str]]:
    """The CSV table of an ncu export, with ``==PROF==``-style log lines ahead of it dropped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("not an ncu CSV export: no header row starting with \"ID\"")
    return [r for r in csv.reader(io.StringIO("\n".join(lines[start:]))) if r]


# one profiled launch: (ID, kernel name, METRICS key -> value, grid text, block text)
_Launch = tuple[str, str, dict[str, "float | None"], str, str]


def _cell(row: list[str], head: dict[str, int], column: str) -> str:
    i = head.get(column)
    return row[i] if i is not None and i < len(row) else ""


def _pick_details(m: Metric, cells: dict[str, list[tuple[str, str, str]]]) -> float | None:
    """``m``'s value among one launch's (section, unit, value) cells by display name; a cell
    in one of ``m.sections`` wins over the same name in another section."""
    for name in m.details:
        for _, unit, text in sorted(cells.get(name, []), key=lambda c: c[0] not in m.sections):
            num = _number(text)
            if num is not None:
                return to_canonical(num, unit, m.unit)
    return None


def _parse_details(rows: list[list[str]]) -> list[_Launch]:
    head = {name: i for i, name in enumerate(rows[0])}
    need = max(head[k] for k in ("ID", "Kernel Name", "Section Name", "Metric Name",
                                 "Metric Unit", "Metric Value")) + 1
    launches: dict[str, tuple[list[str], dict[str, list[tuple[str, str, str]]]]] = {}
    for r in rows[1:]:
        if len(r) < need:
            continue
        _, cells = launches.setdefault(r[head["ID"]], (r, {}))
        cells.setdefault(r[head["Metric Name"]], []).append(
            (r[head["Section Name"]], r[head["Metric Unit"]], r[head["Metric Value"]]))
    return [(lid, first[head["Kernel Name"]], {m.key: _pick_details(m, cells) for m in METRICS},
             _cell(first, head, "Grid Size"), _cell(first, head, "Block Size"))
            for lid, (first, cells) in launches.items()]


def _pick_raw(m: Metric, row: list[str], head: dict[str, int], units: list[str]) -> float | None:
    """``m``'s value in one row of the raw page, by metric name (first alias present)."""
    for name in m.raw:
        num = _number(_cell(row, head, name))
        if num is not None:
            return to_canonical(num, _cell(units, head, name), m.unit)
    return None


def _parse_raw(rows: list[list[str]]) -> list[_Launch]:
    head = {name: i for i, name in enumerate(rows[0])}
    has_units = len(rows) > 1 and rows[1][0].strip() == ""  # the units row has no ID
    units = rows[1] if has_units else [""] * len(rows[0])
    return [(_cell(r, head, "ID"), _cell(r, head, "Kernel Name"),
             {m.key: _pick_raw(m, r, head, units) for m in METRICS},
             _cell(r, head, "Grid Size"), _cell(r, head, "Block Size"))
            for r in rows[2 if has_units else 1:]]


def parse_ncu_csv(text: str) -> list[KernelCounters]:
    """Kernels of an ncu CSV export (``--page raw`` or ``--page details``), in launch order.

    Launches of the same kernel name are merged: each value is the median over them, and
    ``launches`` counts them. Raises ``ValueError`` on text that is not an ncu CSV export.
    """
    rows = _csv_rows(text)
    header = rows[0]
    long_format = "Metric Name" in header and "Metric Value" in header
    launches = _parse_details(rows) if long_format else _parse_raw(rows)
    merged: dict[str, list] = {}
    for _, name, values, grid, block in launches:
        merged.setdefault(name, []).append((values, grid, block))
    kernels = []
    for name, items in merged.items():
        values = {}
        for key in METRIC_KEYS:
            nums = [v[key] for v, _, _ in items if v[key] is not None]
            values[key] = statistics.median(nums) if nums else None
        kernels.append(KernelCounters(name, values, items[0][1], items[0][2], len(items)))
    return kernels


def parse_ncu_exports(raw: str, details: str) -> list[KernelCounters]:
    """The kernels of a report from its raw export, with any value the raw page lacks (a
    metric renamed in another ncu version) filled from the details export, by kernel name."""
    kernels = parse_ncu_csv(raw)
    backup = {k.name: k for k in parse_ncu_csv(details)}
    for k in kernels:
        other = backup.get(k.name)
        for key, v in (other.values.items() if other else ()):
            if k.values.get(key) is None:
                k.values[key] = v
    return kernels


def read_ncu_csv(path: str | os.PathLike) -> list[KernelCounters]:
    """:func:`parse_ncu_csv` of a file."""
    return parse_ncu_csv(Path(path).read_text(encoding="utf-8", errors="replace"))


def find_ncu() -> str | None:
    """The ncu executable: ``$NCU``, then ``ncu`` on ``PATH``, then the CUDA toolkit's."""
    for candidate in (os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def profile_command(ncu: str, report: Path, target: list[str]) -> list[str]:
    """ncu command line that profiles every kernel between cudaProfilerStart/Stop in ``target``
    into ``report`` (``.ncu-rep``; ncu appends that extension itself, so it is passed without).

    ``--clock-control none`` leaves the GPU clocks alone (required on the H200 machine);
    ``--profile-from-start off`` keeps warm-up and compilation outside the profiled range.
    Caches are flushed between replay passes (ncu's default ``--cache-control all``).
    """
    export = str(report).removesuffix(".ncu-rep")
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off",
           "--target-processes", "all", "--force-overwrite", "--export", export]
    for section in SECTIONS:
        cmd += ["--section", section]
    return cmd + target


def export_command(ncu: str, report: Path, page: str = "raw") -> list[str]:
    """ncu command line that prints a report as CSV (``page`` "raw" or "details")."""
    cmd = [ncu, "--import", str(report), "--csv", "--page", page]
    return cmd + (["--print-units", "base"] if page == "raw" else [])


def _failure(proc: subprocess.CompletedProcess) -> str | None:
    text = (proc.stdout or "") + (proc.stderr or "")
    errors = [ln for ln in text.splitlines() if ln.startswith("==ERROR==")]
    if errors:
        return "; ".join(errors[:3])
    if "No kernels were profiled" in text:
        return "ncu profiled no kernel"
    if proc.returncode != 0:
        return f"exit status {proc.returncode}: {text.strip()[-400:]}"
    return None


def run_profile(ncu: str, report: Path, target: list[str], *, timeout: float = 600.0,
                env: dict[str, str] | None = None) -> tuple[str, str]:
    """Profile ``target`` into ``report`` (a ``.ncu-rep`` path); returns its (raw CSV,
    details CSV) exports.

    Raises :class:`NcuError` when ncu fails, refuses the counters (``ERR_NVGPUCTRPERM``) or
    profiles no kernel, with ncu's own message.
    """
    report = Path(report)
    try:
        proc = subprocess.run(profile_command(ncu, report, target), capture_output=True,
                              text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NcuError(f"ncu did not run: {exc}") from exc
    reason = _failure(proc)
    if reason is None and not report.exists():
        reason = f"no report written at {report}"
    if reason is not None:
        raise NcuError(reason)
    out = []
    for page in ("raw", "details"):
        exp = subprocess.run(export_command(ncu, report, page), capture_output=True, text=True,
                             timeout=timeout)
        if exp.returncode != 0:
            raise NcuError(f"ncu --import failed: {exp.stderr.strip()[-400:]}")
        out.append(exp.stdout)
    return out[0], out[1]
