"""Benchmark reporting: tidy rows to CSV/JSON/markdown/terminal tables, a roofline plot, the
run's environment, and Triton compile metadata.

A row is a flat dict (one per shape and impl) whose keys carry their units: ``*_us``
microseconds, ``*_bytes`` bytes, ``*_gbps`` GB/s (1e9 bytes/s), ``pct_*`` percent of the read
roofline measured in the same run. Every CSV/JSON row also carries the run's environment (GPU,
torch/triton versions, git SHA, date) so rows from different files can be concatenated.
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

#: column order of the CSV/JSON rows (a row may leave any of them empty)
COLUMNS = (
    "shape", "impl", "kind", "batch", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
    "cache_dtype", "num_tokens", "kv_bytes", "minimal_bytes",
    "median_us", "p20_us", "p80_us", "graph_median_us", "graph_p20_us", "graph_p80_us",
    "gbps", "graph_gbps", "pct_roofline", "graph_pct_roofline", "roofline_gbps",
    "rel_l2_error", "tolerance", "status", "error", "kernels",
    "gpu", "torch", "triton", "git_sha", "date",
)
META_KEYS = ("gpu", "torch", "triton", "git_sha", "date")


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


def last_compiled() -> dict[str, Any]:
    """``pagedattn.launch.LAST_COMPILED`` (launcher name -> last compiled kernel) if the
    launchers record it, else ``{}``. The caller may ``.clear()`` it before a run."""
    import pagedattn.launch as launch

    table = getattr(launch, "LAST_COMPILED", None)
    return table if isinstance(table, dict) else {}


def format_kernels(kernels: dict[str, dict[str, Any]]) -> str:
    """``{name: compile_metadata}`` -> one line: ``name: regs=.. spills=.. smem=..B ...``."""
    parts = []
    for name, m in kernels.items():
        parts.append(f"{name}: regs={m.get('n_regs')} spills={m.get('n_spills')} "
                     f"smem={m.get('shared_bytes')}B warps={m.get('num_warps')} "
                     f"stages={m.get('num_stages')}")
    return "; ".join(parts)


def git_sha() -> str:
    """``$PAGEDATTN_GIT_SHA`` if set, else ``git rev-parse`` of this checkout (``+dirty`` when
    the tree has changes), else ``"unknown"`` (e.g. a copied tree without ``.git``)."""
    if os.environ.get("PAGEDATTN_GIT_SHA"):
        return os.environ["PAGEDATTN_GIT_SHA"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, check=True,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, check=True,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment_meta(device=None) -> dict[str, str]:
    """GPU name (or the CPU), torch and triton versions, git SHA and the UTC date/time."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        gpu = torch.cuda.get_device_name(torch.device(device))
    else:
        gpu = f"cpu ({platform.processor() or platform.machine()})"
    return {"gpu": gpu, "torch": torch.__version__, "triton": _version("triton"),
            "git_sha": git_sha(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": sys.version.split()[0]}


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Rows to CSV with the :data:`COLUMNS` header (extra keys are appended)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = sorted({k for r in rows for k in r} - set(COLUMNS))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *extra], restval="")
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
             "pct_*": "percent of roofline_gbps, the read bandwidth measured in this run"}
    doc = {"meta": meta, "units": units,
           "rows": [{k: clean(v) for k, v in r.items()} for r in rows]}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def _fmt(v, spec: str) -> str:
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, spec)


def display_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The columns people read: shape, impl, KV MB, µs, graph µs, GB/s, % of roofline, error."""
    out = []
    for r in rows:
        out.append({
            "shape": r["shape"], "impl": r["impl"],
            "KV MB": _fmt(r.get("kv_bytes") and r["kv_bytes"] / 1e6, ",.1f"),
            "µs": _fmt(r.get("median_us"), ".1f"),
            "graph µs": _fmt(r.get("graph_median_us"), ".1f"),
            "GB/s": _fmt(r.get("gbps"), ",.0f"), "% roof": _fmt(r.get("pct_roofline"), ".1f"),
            "graph % roof": _fmt(r.get("graph_pct_roofline"), ".1f"),
            "rel L2 err": _fmt(r.get("rel_l2_error"), ".2e"),
            "status": (r.get("status", "") + (f": {r['error']}" if r.get("error") else ""))[:72],
        })
    return out


def _drop_empty_columns(table: list[dict[str, str]]) -> list[dict[str, str]]:
    keep = [k for k in (table[0] if table else {}) if any(t[k] != "—" for t in table)]
    return [{k: t[k] for k in keep} for t in table]


def terminal_table(rows: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    return tabulate(_drop_empty_columns(display_rows(rows)), headers="keys", tablefmt="simple",
                    disable_numparse=True)


def markdown_report(rows: list[dict[str, Any]], meta: dict[str, Any],
                    roofline_gbps: float | None) -> str:
    """A markdown page: the run's environment and roofline, the results table, and the Triton
    compile metadata of our kernels."""
    from tabulate import tabulate

    lines = ["# pagedattn benchmark", ""]
    lines += [f"- {k}: {meta[k]}" for k in meta]
    if roofline_gbps:
        lines.append(f"- roofline (streaming read, this run): {roofline_gbps:,.0f} GB/s")
    lines += ["- times: median over cold-L2 repetitions; GB/s counts the minimal bytes "
              "(valid K/V, q, out, used block-table entries)", ""]
    lines.append(tabulate(_drop_empty_columns(display_rows(rows)), headers="keys",
                          tablefmt="github", disable_numparse=True))
    compiled = [(r["shape"], r["impl"], r["kernels"]) for r in rows if r.get("kernels")]
    if compiled:
        lines += ["", "## Triton compile metadata", ""]
        lines.append(tabulate(compiled, headers=["shape", "impl", "kernels"], tablefmt="github"))
    return "\n".join(lines) + "\n"


def plot_roofline(rows: list[dict[str, Any]], path: str | Path,
                  roofline_gbps: float | None, title: str = "") -> Path:
    """Grouped bars of % of roofline per shape and impl (eager); graph-replay results as
    markers; a line at 100 % (the read bandwidth measured in the same run). Agg backend."""
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
