"""The ladder's three PNG charts (matplotlib, Agg backend).

- :func:`plot_durations`: duration of one call per impl, one bar series per shape, log scale;
  the study's figures as markers on the study's shape.
- :func:`plot_bandwidth`: achieved bandwidth (minimal bytes) per impl and shape against the
  read roofline measured in the same run.
- :func:`plot_occupancy`: achieved (filled) and theoretical (hollow) occupancy against
  registers/thread, one point per kernel.

A chart without data (the CPU interpreter times nothing and reads no counter) still gets
written, with a line saying why it is empty.
"""

from __future__ import annotations

from pathlib import Path

from pagedattn.bench.ladder_text import STUDY, STUDY_SHAPE
from pagedattn.bench.profiling import ImplProfile


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, path: str | Path, empty_reason: str | None) -> Path:
    if empty_reason:
        ax.text(0.5, 0.5, empty_reason, ha="center", va="center", transform=ax.transAxes,
                fontsize=10, wrap=True)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _impls(by_shape: dict[str, list[ImplProfile]]) -> list[str]:
    return list(dict.fromkeys(p.impl for ps in by_shape.values() for p in ps))


def _bars(ax, by_shape, impls, value):
    """Grouped bars of ``value(profile)`` (None: no bar); returns whether any bar was drawn."""
    width = 0.8 / max(len(by_shape), 1)
    drawn = False
    for i, (shape, profiles) in enumerate(by_shape.items()):
        lookup = {p.impl: p for p in profiles}
        xs, ys = [], []
        for j, impl in enumerate(impls):
            v = value(lookup[impl]) if impl in lookup else None
            if v is not None:
                xs.append(j + (i - (len(by_shape) - 1) / 2) * width)
                ys.append(v)
        if xs:
            ax.bar(xs, ys, width, label=shape)
            drawn = True
    ax.set_xticks(range(len(impls)), impls, rotation=25, ha="right")
    return drawn


def plot_durations(by_shape: dict[str, list[ImplProfile]], path: str | Path) -> Path:
    """Duration per stage (log scale), per shape; the study's durations as markers."""
    plt = _pyplot()
    impls = _impls(by_shape)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = _bars(ax, by_shape, impls, lambda p: p.total_us)
    if drawn:
        ax.set_yscale("log")
        if any(s.startswith(STUDY_SHAPE) for s in by_shape):
            pts = [(j, STUDY[i]["duration_us"]) for j, i in enumerate(impls) if i in STUDY]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], marker="D", color="black",
                       zorder=3, label="study (36-SM GPU, its workload)")
        ax.legend(fontsize=8)
    ax.set_ylabel("duration of one call (µs, log scale)")
    ax.set_title("paged decode: duration per stage")
    return _save(fig, ax, path, None if drawn else "not timed: CPU interpreter (no GPU)")


def plot_bandwidth(by_shape: dict[str, list[ImplProfile]], roofline_gbps: float | None,
                   path: str | Path) -> Path:
    """Achieved GB/s (minimal bytes) per impl and shape; the read roofline as a line."""
    plt = _pyplot()
    impls = _impls(by_shape)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = _bars(ax, by_shape, impls, lambda p: p.gbps)
    if roofline_gbps:
        ax.axhline(roofline_gbps, color="black", linestyle="--", linewidth=1,
                   label=f"read roofline, this run ({roofline_gbps:,.0f} GB/s)")
    if drawn or roofline_gbps:
        ax.legend(fontsize=8)
    ax.set_ylabel("achieved bandwidth (GB/s, minimal bytes)")
    ax.set_title("paged decode: achieved bandwidth vs the read roofline")
    return _save(fig, ax, path, None if drawn else "not timed: CPU interpreter (no GPU)")


def plot_occupancy(by_shape: dict[str, list[ImplProfile]], path: str | Path) -> Path:
    """Occupancy (achieved filled, theoretical hollow) against registers/thread, per kernel:
    colour by impl, marker by shape; kernels other than the impl's main one are labelled."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(8, 4.8))
    impls = _impls(by_shape)
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}
    markers = {shape: "osD^v<>"[i % 7] for i, shape in enumerate(by_shape)}
    used_impls, used_shapes = set(), set()
    for shape, profiles in by_shape.items():
        for p in profiles:
            for k in p.kernels:
                regs = k.values.get("regs")
                ach, theo = k.values.get("occ_achieved"), k.values.get("occ_theoretical")
                if regs is None or (ach is None and theo is None):
                    continue
                c, m = colors[p.impl], markers[shape]
                if ach is not None:
                    ax.scatter([regs], [ach], marker=m, color=c, zorder=3)
                if theo is not None:
                    ax.scatter([regs], [theo], marker=m, facecolors="none", edgecolors=c)
                if k is not p.main_kernel:
                    ax.annotate(k.name.strip("_"), (regs, ach if ach is not None else theo),
                                fontsize=6, xytext=(4, -8), textcoords="offset points")
                used_impls.add(p.impl)
                used_shapes.add(shape)
    handles = [Line2D([], [], marker="s", linestyle="", color=colors[i], label=i)
               for i in impls if i in used_impls]
    handles += [Line2D([], [], marker=markers[s], linestyle="", color="black",
                       markerfacecolor="none", label=s) for s in by_shape if s in used_shapes]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xlabel("registers/thread")
    ax.set_ylabel("occupancy (%): achieved filled, theoretical hollow")
    ax.set_ylim(0, 105)
    ax.set_title("occupancy vs registers (one point per kernel)")
    reason = None if handles else "no occupancy counters: ncu did not run (fallback)"
    return _save(fig, ax, path, reason)
