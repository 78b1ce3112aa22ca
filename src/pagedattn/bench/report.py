"""Benchmark reporting: tidy rows to CSV/JSON/markdown/terminal tables, a roofline plot, the
run's environment (with the commit measured), Triton compile metadata, and the number formats
every page of the bench package uses.

A row is a flat dict (one per shape and impl) whose keys carry their units: ``*_us``
microseconds, ``*_bytes`` bytes, ``*_gbps`` GB/s (1e9 bytes/s), ``*pct_roofline`` percent of the
read rate (2 GiB) measured in the same run, ``*pct_limit`` percent of the shape's size-matched
limit (``100 * limit_us / median_us``). ``median_us``, ``graph_median_us`` and every % are
timed after the run's ``flush`` (``clean``: a read); ``dirty_median_us`` after the zeroing
flush of ``triton.testing.do_bench`` (every run before the ``flush`` key). ``step_us_per_layer``
is one decode step of ``step_layers`` layers over ``step_caches`` distinct caches, one CUDA
graph, per layer. Every CSV/JSON row also carries the run's environment (GPU, torch/triton
versions, git commit and whether ``src/`` had uncommitted changes, date) and the roofline, so
rows from different files can be concatenated. Keys starting with ``_`` are
in-memory only (never written).
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

from pagedattn._env import git_state

#: column order of the CSV/JSON rows (a row may leave any of them empty)
COLUMNS = (
    "shape", "impl", "kind", "batch", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
    "cache_dtype", "num_tokens", "kv_bytes", "minimal_bytes",
    "median_us", "p20_us", "p80_us", "graph_median_us", "graph_p20_us", "graph_p80_us",
    "dirty_median_us", "dirty_p20_us", "dirty_p80_us", "limit_us", "step_us_per_layer",
    "step_layers", "step_caches", "gbps", "graph_gbps", "dirty_gbps", "limit_gbps",
    "pct_roofline", "graph_pct_roofline", "pct_limit", "graph_pct_limit", "roofline_gbps",
    "host_us",
    "to_beat_us", "to_beat_peer", "beats", "graph_to_beat_us", "graph_to_beat_peer",
    "graph_beats", "rel_l2_error", "tolerance", "status", "error", "kernels", "peer_info",
    "gpu", "torch", "triton", "git_commit", "src_dirty", "date", "flush",
)
META_KEYS = ("gpu", "torch", "triton", "git_commit", "src_dirty", "date")
#: the run's keys every row carries: the environment and the flush of its timings
RUN_KEYS = (*META_KEYS, "flush")
NA = "n/a"
#: the contract's "at least as fast": an impl beats a peer at <= 1.02 x its median
TO_BEAT_SLACK = 1.02


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


def format_row(row: dict[str, Any]) -> str:
    """One lab row on one line: ``key value | key value``, floats to 4 significant digits
    (the MLA lab's and the scripts' progress lines)."""
    return " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in row.items())


def dump_rows(rows: list[dict[str, Any]], path: str | None) -> None:
    """Write ``rows`` (the lab's and the scripts' progress rows, as printed) to ``path`` as a
    JSON list, one-space indented, when a path is given (``--json``); nothing otherwise. Unlike
    :func:`write_json`: no meta, no units, the rows as they are (a non-finite float is written
    as JSON's ``NaN``/``Infinity``)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def compile_metadata(compiled_kernel: Any) -> dict[str, Any]:
    """Registers, spills, shared memory (bytes), warps and stages of a compiled Triton kernel,
    as returned by a launch (``kernel = _kern[grid](...)``). Missing facts are ``None``; the
    interpreter returns no kernel, which gives ``{}``."""
    if compiled_kernel is None:
        return {}
    md = getattr(compiled_kernel, "metadata", None)

    def meta(key: str):
        return md.get(key) if isinstance(md, dict) else getattr(md, key, None)

    def attr(key: str):
        try:
            return getattr(compiled_kernel, key, None)  # n_regs/n_spills load lazily
        except Exception:  # noqa: BLE001 - a failed lazy load only loses the fact
            return None

    return {"name": attr("name") or meta("name"), "n_regs": attr("n_regs"),
            "n_spills": attr("n_spills"), "shared_bytes": meta("shared"),
            "num_warps": meta("num_warps"), "num_stages": meta("num_stages")}


def format_kernels(kernels: dict[str, dict[str, Any]]) -> str:
    """``{name: compile_metadata}`` -> one line: ``name: regs=.. spills=.. smem=..B ...``."""
    parts = []
    for name, m in kernels.items():
        parts.append(f"{name}: regs={m.get('n_regs')} spills={m.get('n_spills')} "
                     f"smem={m.get('shared_bytes')}B warps={m.get('num_warps')} "
                     f"stages={m.get('num_stages')}")
    return "; ".join(parts)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment_meta(device=None) -> dict[str, str]:
    """GPU name (or the CPU), torch and triton versions, git commit (and whether ``src/`` was
    dirty), the UTC date/time and the Python version."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        gpu = torch.cuda.get_device_name(torch.device(device))
    else:
        gpu = f"cpu ({platform.processor() or platform.machine()})"
    return {"gpu": gpu, "torch": torch.__version__, "triton": _version("triton"), **git_state(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": sys.version.split()[0]}


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Rows to CSV with the :data:`COLUMNS` header (extra keys are appended)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = sorted({k for r in rows for k in r if not k.startswith("_")} - set(COLUMNS))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *extra], restval="",
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(rows: list[dict[str, Any]], meta: dict[str, Any], path: str | Path) -> Path:
    """``{"meta": ..., "units": ..., "rows": [...]}``; non-finite floats become ``null``."""
    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    units = {"*_us": "microseconds", "*_bytes": "bytes", "*gbps": "GB/s (1e9 bytes/s)",
             "*pct_roofline": "percent of roofline_gbps, the read bandwidth (2 GiB) measured in "
                              "this run",
             "*pct_limit": "percent of the size-matched limit: 100 * limit_us / the row's time",
             "flush": "the L2 flush before each timed call: clean (a read); dirty_* after the "
                      "zeroing flush"}
    doc = {"meta": meta, "units": units,
           "rows": [{k: clean(v) for k, v in r.items() if not k.startswith("_")} for r in rows]}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def _fmt(v, spec: str) -> str:
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, spec)


#: the widest status cell of a table; a longer status and error text goes to a numbered note
STATUS_WIDTH = 72


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def status_cells(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Per row, its status cell (``status: error`` when that fits in :data:`STATUS_WIDTH`,
    else ``status [n]``), and the numbered notes holding each longer error whole
    (``[n] shape / impl: error``, whitespace folded to one line). The CSV and JSON keep the
    error exactly as raised."""
    cells, notes = [], []
    for r in rows:
        status, error = r.get("status", ""), _one_line(r.get("error") or "")
        cell = status + (f": {error}" if error else "")
        if len(cell) > STATUS_WIDTH:
            notes.append(f"[{len(notes) + 1}] {r['shape']} / {r['impl']}: {error}")
            cell = f"{status} [{len(notes)}]"
        cells.append(cell)
    return cells, notes


def _fmt_na(v, spec: str) -> str:
    """:func:`_fmt`, but ``n/a`` for a value not measured: the yardstick's columns stay in
    every table, a dry run's included (:func:`_drop_empty_columns` drops only ``—``)."""
    cell = _fmt(v, spec)
    return NA if cell == "—" else cell


def display_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The columns people read: shape, impl, KV MB, clean µs, graph µs, dirty µs, the
    size-matched limit µs, % of it, GB/s, % of the 2 GiB read rate, µs per layer of the decode
    step (32 layers by default), status (see :func:`status_cells` for a long error)."""
    out = []
    for r, status in zip(rows, status_cells(rows)[0], strict=True):
        out.append({
            "shape": r["shape"], "impl": r["impl"],
            "KV MB": _fmt(r.get("kv_bytes") and r["kv_bytes"] / 1e6, ",.1f"),
            "clean µs": _fmt_na(r.get("median_us"), ".1f"),
            "graph µs": _fmt(r.get("graph_median_us"), ".1f"),
            "dirty µs": _fmt_na(r.get("dirty_median_us"), ".1f"),
            "limit µs": _fmt_na(r.get("limit_us"), ".1f"),
            "% limit": _fmt_na(r.get("pct_limit"), ".1f"),
            "graph % limit": _fmt(r.get("graph_pct_limit"), ".1f"),
            "GB/s": _fmt(r.get("gbps"), ",.0f"),
            "% 2 GiB rate": _fmt_na(r.get("pct_roofline"), ".1f"),
            "graph % 2 GiB rate": _fmt(r.get("graph_pct_roofline"), ".1f"),
            "step µs/layer": _fmt_na(r.get("step_us_per_layer"), ".1f"),
            "host µs": _fmt(r.get("host_us"), ".1f"),
            "to beat µs": _fmt(r.get("to_beat_us"), ".1f"),
            "≤ to beat": r.get("beats") or "—",
            "graph ≤ to beat": r.get("graph_beats") or "—",
            "rel L2 err": _fmt(r.get("rel_l2_error"), ".2e"),
            "status": status,
            "peer info": (r.get("peer_info") or "—")[:40],
        })
    return out


def _drop_empty_columns(table: list[dict[str, str]]) -> list[dict[str, str]]:
    keep = [k for k in (table[0] if table else {}) if any(t[k] != "—" for t in table)]
    return [{k: t[k] for k in keep} for t in table]


def _md_cell(text: Any) -> str:
    """``text`` for a markdown table cell: a ``|`` in it (a peer's error) would end the cell."""
    return str(text).replace("|", "\\|")


def terminal_table(rows: list[dict[str, Any]], width: int = 100) -> str:
    """The table, then its notes (each long error whole, wrapped at ``width`` columns)."""
    import textwrap

    from tabulate import tabulate

    text = tabulate(_drop_empty_columns(display_rows(rows)), headers="keys", tablefmt="simple",
                    disable_numparse=True)
    notes = status_cells(rows)[1]
    wrapped = [textwrap.fill(n, width, subsequent_indent="    ", break_long_words=False,
                             break_on_hyphens=False) for n in notes]
    return "\n".join([text, *(["", "notes:", *wrapped] if notes else [])])


def roofline_line(roofline_gbps: float | None) -> str:
    """The read roofline of this run, in words (or that it was not measured)."""
    if not roofline_gbps:
        return "read roofline: not measured in this run (no CUDA GPU)"
    return f"read roofline (streaming-read kernel, this run): {roofline_gbps:,.0f} GB/s"


def header_lines(meta: dict[str, Any], roofline_gbps: float | None) -> list[str]:
    """Markdown bullets that open every results page: the environment, the commit measured
    (with a warning when ``src/`` was dirty) and the roofline of this run."""
    lines = [f"- {k}: {v}" for k, v in meta.items() if k != "src_dirty"]
    if meta.get("src_dirty") == "yes":
        lines.append("- **src/ had uncommitted changes**: the figures are not those of "
                     f"commit {meta.get('git_commit', '?')}")
    elif meta.get("src_dirty") == "no":
        lines.append("- src/: as committed (no uncommitted changes)")
    lines.append(f"- {roofline_line(roofline_gbps)}")
    return lines


def write_markdown(rows: list[dict[str, Any]], meta: dict[str, Any],
                   roofline_gbps: float | None, path: str | Path) -> Path:
    """A markdown page: the run's environment and roofline, the results table (with the host
    time and the to-beat columns), and the Triton compile metadata of our kernels."""
    from tabulate import tabulate

    lines = ["# pagedattn benchmark", "", *header_lines(meta, roofline_gbps)]
    if any(r.get("median_us") is not None for r in rows):
        lines.append("- times: median over cold-L2 repetitions after the clean flush (a read "
                     "of twice the L2: no dirty line left); dirty µs: after do_bench's zeroing "
                     "flush (the runs before the clean flush); GB/s counts the minimal bytes "
                     "(valid K/V, used block-table entries, q); limit µs: a contiguous streaming "
                     "read of exactly those bytes, same flush, same run; % limit: limit µs / "
                     "µs; % 2 GiB rate: GB/s over the read rate of 2 GiB; step µs/layer: one "
                     "decode step of `step_layers` layers (32 unless --layers), each on a cache "
                     "of its own of the row's shape, one CUDA graph, per layer; host "
                     "µs: one eager call's submission time (n/a under the interpreter); to "
                     "beat: the fastest peer that passed its check in this run, beaten at <= "
                     f"{TO_BEAT_SLACK}x")
        fewer = sorted({(r["step_caches"], r["step_layers"]) for r in rows
                        if r.get("step_caches") and r["step_caches"] < r["step_layers"]})
        if fewer:
            lines.append("- **the decode step shared caches** on some rows (the device's "
                         "memory held fewer): " + ", ".join(f"{c} distinct caches for {n} "
                                                            "layers" for c, n in fewer))
    else:
        lines.append("- **nothing was timed** (dry run or no GPU): outputs were checked against "
                     "the float64 oracle only")
    lines.append("")
    table = [{k: _md_cell(v) for k, v in t.items()}
             for t in _drop_empty_columns(display_rows(rows))]
    lines.append(tabulate(table, headers="keys", tablefmt="github", disable_numparse=True))
    notes = status_cells(rows)[1]
    if notes:
        lines += ["", "## Notes (errors in full)", ""]
        lines += [f"- {n}" for n in notes]
    compiled = [tuple(map(_md_cell, (r["shape"], r["impl"], r["kernels"]))) for r in rows
                if r.get("kernels")]
    if compiled:
        lines += ["", "## Triton compile metadata", ""]
        lines.append(tabulate(compiled, headers=["shape", "impl", "kernels"], tablefmt="github"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def plot_roofline(rows: list[dict[str, Any]], path: str | Path,
                  roofline_gbps: float | None, title: str = "") -> Path | None:
    """Grouped bars of % of roofline per shape and impl (eager); graph-replay results as
    markers; a line at 100 % (the read bandwidth measured in the same run). Agg backend.
    Nothing is written (``None``) when no row holds a % of roofline: no chart without data."""
    if not any(r.get(k) is not None for r in rows for k in ("pct_roofline",
                                                            "graph_pct_roofline")):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lookup = {(r["shape"], r["impl"]): r for r in rows}
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(min(24.0, max(8.0, 0.25 * len(shapes) * len(impls) + 3)), 6))
    for i, impl in enumerate(impls):
        xs = [s + (i - (len(impls) - 1) / 2) * width for s in range(len(shapes))]
        eager = [lookup.get((s, impl), {}).get("pct_roofline") for s in shapes]
        graph = [lookup.get((s, impl), {}).get("graph_pct_roofline") for s in shapes]
        bars = ax.bar(xs, [v if v is not None else 0.0 for v in eager], width, label=impl)
        gx = [x for x, v in zip(xs, graph, strict=True) if v is not None]
        if gx:
            ax.scatter(gx, [v for v in graph if v is not None], marker="o", s=28, zorder=3,
                       color=bars.patches[0].get_facecolor(), edgecolors="black")
    label = "roofline" + (f" ({roofline_gbps:,.0f} GB/s, this run)" if roofline_gbps else "")
    ax.axhline(100.0, color="black", linestyle="--", linewidth=1, label=label)
    ax.set_xticks(range(len(shapes)), shapes, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("% of read roofline (bars: eager, dots: CUDA-graph replay)")
    top = max([100.0, *(r.get(k) or 0.0 for r in rows
                        for k in ("pct_roofline", "graph_pct_roofline"))])
    ax.set_ylim(0, top * 1.1)
    ax.set_title(title or "paged decode: achieved bandwidth (minimal bytes) / read roofline")
    ax.legend(fontsize=8, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
