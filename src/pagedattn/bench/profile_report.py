"""The profile table (text and markdown, one column per impl) and its tidy CSV.

Rows follow the study's ncu reading: duration; DRAM, L1/TEX, L2 and compute (SM) throughput;
registers/thread and shared memory per block (static + dynamic); theoretical and achieved
occupancy; waves per SM; grid and block size. An impl that launches two kernels (split + merge)
shows each cell as ``split / merge`` and gets a total duration. A value nobody measured prints
``n/a``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

from pagedattn.bench.ncu import METRICS, KernelCounters
from pagedattn.bench.profiling import (
    META_KEYS,
    SOURCE_EVENTS,
    SOURCE_INTERPRETER,
    SOURCE_NCU,
    ImplProfile,
)

NA = "n/a"
SHORT_SOURCE = {SOURCE_NCU: "ncu", SOURCE_EVENTS: "fallback (events)",
                SOURCE_INTERPRETER: "fallback (interpreter)"}
UNITS = {m.key: m.unit for m in METRICS} | {k: "" for k in META_KEYS}


def fmt_time(us: float | None) -> str:
    if us is None:
        return NA
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.2f} us"


def fmt_pct(v: float | None) -> str:
    return NA if v is None else f"{v:.2f} %"


def fmt_count(v: float | None) -> str:
    if v is None:
        return NA
    return f"{int(v)}" if float(v).is_integer() else f"{v:.2f}"


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return NA
    return f"{v / 1024:.1f} KiB" if v >= 1024 else f"{int(v)} B"


def smem_bytes(k: KernelCounters) -> float | None:
    """Shared memory per block, static + dynamic (None when neither is known)."""
    parts = [k.values.get("smem_static"), k.values.get("smem_dynamic")]
    return None if all(p is None for p in parts) else sum(p or 0 for p in parts)


def _grid(k: KernelCounters) -> str:
    n = fmt_count(k.values.get("grid"))
    return f"{k.grid} = {n}" if k.grid and n != NA else (k.grid or n)


def _block(k: KernelCounters) -> str:
    return k.block or fmt_count(k.values.get("block"))


def _per_kernel(get: Callable[[KernelCounters], str]) -> Callable[[ImplProfile], str]:
    return lambda p: " / ".join(get(k) for k in p.kernels) if p.kernels else NA


def _value(key: str, fmt: Callable[[float | None], str]) -> Callable[[ImplProfile], str]:
    return _per_kernel(lambda k: fmt(k.values.get(key)))


def _roofline_pct(roofline_gbps: float | None) -> Callable[[ImplProfile], str]:
    def cell(p: ImplProfile) -> str:
        if p.gbps is None or not roofline_gbps:
            return NA
        return f"{100 * p.gbps / roofline_gbps:.1f} %"
    return cell


def table(profiles: list[ImplProfile], roofline_gbps: float | None = None) -> list[list[str]]:
    """The profile table: a header row, then one row per quantity; one column per impl."""
    rows: list[tuple[str, Callable[[ImplProfile], str]]] = [
        ("Source", lambda p: SHORT_SOURCE.get(p.source, p.source)),
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
        ("Block size", _per_kernel(_block)),
        ("Spills (Triton)", _value("spills", fmt_count)),
        ("num_warps (Triton)", _value("num_warps", fmt_count)),
        ("num_stages (Triton)", _value("num_stages", fmt_count)),
        ("Achieved bandwidth", lambda p: NA if p.gbps is None else f"{p.gbps:.0f} GB/s"),
        ("% of read roofline", _roofline_pct(roofline_gbps)),
    ]
    out = [["", *(p.impl for p in profiles)]]
    out += [[label, *(cell(p) for p in profiles)] for label, cell in rows]
    return out


def to_text(rows: list[list[str]]) -> str:
    """A fixed-width text table (header row first)."""
    from tabulate import tabulate

    return tabulate(rows[1:], headers=rows[0], tablefmt="simple", disable_numparse=True)


def to_markdown(rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table (header row first)."""
    from tabulate import tabulate

    return tabulate(rows[1:], headers=rows[0], tablefmt="github", disable_numparse=True)


def write_csv(path: str | Path, profiles: list[ImplProfile], env: dict[str, str]) -> None:
    """Tidy rows: one per (shape, impl, kernel, metric), with unit, source and environment.
    Kernel ``TOTAL`` carries the per-call duration and achieved bandwidth."""
    fields = ["shape", "impl", "kernel", "metric", "value", "unit", "source", *env]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for p in profiles:
            base = [p.source, *env.values()]
            for k in p.kernels:
                for key, v in k.values.items():
                    w.writerow([p.shape, p.impl, k.name, key, "" if v is None else v,
                                UNITS.get(key, ""), *base])
            w.writerow([p.shape, p.impl, "TOTAL", "duration_us",
                        "" if p.total_us is None else p.total_us, "us", *base])
            w.writerow([p.shape, p.impl, "TOTAL", "achieved_gbps",
                        "" if p.gbps is None else p.gbps, "GB/s", *base])


def notes(profiles: list[ImplProfile]) -> list[str]:
    """One line per distinct source and per fallback reason, for under the table."""
    lines = []
    for source in dict.fromkeys(p.source for p in profiles):
        lines.append(f"- {SHORT_SOURCE.get(source, source)}: {source}")
    by_note: dict[str, list[str]] = {}
    for p in profiles:
        if p.note:
            by_note.setdefault(p.note, []).append(p.impl)
    for note, impls in by_note.items():
        who = "all impls" if len(impls) == len(profiles) > 1 else ", ".join(impls)
        lines.append(f"- {who}: {note}")
    if any(not p.is_ncu for p in profiles):
        lines.append("- Fallback columns hold no hardware counters: throughput and occupancy "
                     "rows are n/a, never estimated.")
    return lines


def shape_section(profiles: list[ImplProfile], shape_text: str,
                  roofline_gbps: float | None, level: str = "##") -> str:
    """Markdown for one shape: a heading, its description, the table and the notes."""
    name = profiles[0].shape if profiles else "?"
    lines = [f"{level} {name}", "", shape_text, "", to_markdown(table(profiles, roofline_gbps)),
             "", *notes(profiles)]
    return "\n".join(lines) + "\n"


def header_lines(env: dict[str, str], roofline_gbps: float | None) -> list[str]:
    """Markdown bullet lines: the environment and the roofline of this run."""
    lines = [f"- {k}: {v}" for k, v in env.items()]
    lines.append(f"- read roofline (streaming-read kernel, this run): {roofline_gbps:,.0f} GB/s"
                 if roofline_gbps else "- read roofline: not measured (no CUDA GPU)")
    lines.append("- durations: ncu's gpu__time_duration (caches flushed between replay passes, "
                 "clocks not locked: --clock-control none), or the fallback's median of "
                 "cold-L2 CUDA-event timings; GB/s counts the minimal bytes (valid K/V, q, out, "
                 "used block-table entries), GB = 1e9 bytes")
    return lines
