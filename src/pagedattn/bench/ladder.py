"""``pagedattn ladder``: the study's five stages and ``auto``, profiled, charted and discussed.

    pagedattn ladder                      # a GPU with ncu: both shapes -> out/ladder/ladder.md
    pagedattn ladder --dry-run            # anywhere: the pipeline on shrunken shapes, unmeasured
    pagedattn ladder --out docs/ladder-h200.md   # refresh the committed page (asked for by name)

Everything goes under ``--out-dir`` (``out/ladder``) unless ``--out`` names the page: a run never
overwrites a committed page by default. Every path is checked before the first profile.

Two shapes: the study's workload (``seed-fp32-b64-c2048``: fp32, batch 64, 32/8 heads,
head_dim 128, page_size 16, context 2048) and a real bf16 Llama-3-8B batch
(``azure-conv-b64-llama8b``). Each impl is profiled by
:func:`pagedattn.bench.profile.profile_impls` (ncu, else the labelled fallback). The page holds
the environment and the read roofline of the same run, the profile table per shape, a
study-versus-measured table, up to three PNG charts, and a commentary rendered from
:data:`TEMPLATES` over the measured values: no figure in the prose is typed in by hand. The
study's own figures come from ``pagedattn/data/study_ladder.csv`` and are always labelled as
the study's. Without a GPU nothing is measured: the command says so and exits 2, unless
``--dry-run``; a page then says it holds no measurement, and a chart is drawn only where there is
data to draw.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import sys
from importlib import resources
from pathlib import Path

import torch

from pagedattn._cli_types import checked_output, name_list, output_dir, output_file
from pagedattn.bench.profile import ImplProfile, add_profiling_arguments, smem_bytes
from pagedattn.bench.report import fmt_bytes, fmt_count, fmt_pct, fmt_time
from pagedattn.bench.shapes import SHAPES

DEFAULT_OUT_DIR = "out/ladder"
#: the page's name in ``--out-dir`` (without ``--out``): a measured run, a shrunken one
PAGE_NAME, SMALL_PAGE_NAME = "ladder.md", "ladder-small.md"
CHARTS = ("duration", "bandwidth", "occupancy")  # <stem>-<chart>.png beside the page
LADDER_SHAPES = ("seed-fp32-b64-c2048", "azure-conv-b64-llama8b")
STUDY_SHAPE = "seed-fp32-b64-c2048"
STUDY_GPU = "a 36-SM consumer GPU"
LADDER = ("baseline", "fused_v1", "vectorized_v2", "gqa_reuse_v3", "split_kv_v4")
DRAM_BOUND_PCT = 80.0  # our line for "DRAM-bound"

#: every sentence of the commentary; ``{...}`` fields are filled from measured values (or the
#: study's, labelled so). A sentence whose values were not measured is not written.
TEMPLATES = {
    "gpu_note": "The study ran on {study_gpu}; this run's GPU, {gpu}, has {sms} SMs and a read "
                "roofline of {roofline} measured in this run, so absolute times and waves per SM "
                "are not comparable, while the speed-up of each step and where the counters "
                "point are.",
    "baseline": "- **baseline**: {time} per call{study}.",
    "baseline_study": " (study {time})",
    "step": "- **{cur}** vs {prev}: {speed} ({prev_time} -> {cur_time}){study}.",
    "step_untimed": "- **{cur}** vs {prev}: not timed here{study}.",
    "step_study": "the study measured {speed} ({prev_time} -> {cur_time})",
    "direction": ": the {same} direction {as_} the study",
    "counters": "  ncu: {parts}.",
    "other_kernel": " Kernel {name} takes {time}{study}, DRAM {dram}, {share} of the call.",
    "other_kernel_study": " (study's merge {time}, DRAM {dram})",
    "busy": " SM ({sm}) and L1 ({l1}) are far busier than DRAM ({dram}): the redundant-work "
            "signature the study describes.",
    "not_busy": " Unlike the study, SM ({sm}) and L1 ({l1}) are not far busier than DRAM "
                "({dram}) here.",
    "dram_bound": " {bound} ({dram} DRAM throughput against our {line} line{study}).",
    "fastest": "- Fastest stage: **{impl}**, {time}, {gbps} GB/s{roof}{study}.",
    "fastest_roof": " = {pct} of the read roofline measured in this run ({roofline})",
    "fastest_study": "; the study's fastest was{also} gqa_reuse_v3 ({dram} DRAM throughput on "
                     "its GPU)",
    "auto": "- **auto** (the production kernel): {time}, {speed} than {best}{roof}.",
    "auto_roof": ", {pct} of the roofline",
    "nothing": "- Nothing was measured for this shape: no figure of ours is stated.",
    "cross": "- Split-KV against GQA reuse: split_kv_v4 is {study_speed} than gqa_reuse_v3 on the "
             "uniform study shape and {trace_speed} on the ragged trace batch (study: "
             "{ref_speed} on its uniform shape).",
}
#: per stage, the counters the study discusses for it
STAGE_COUNTERS: dict[str, tuple[str, ...]] = {
    "baseline": ("dram_pct", "l1_pct", "sm_pct"),
    "fused_v1": ("dram_pct", "l1_pct", "sm_pct", "occ_achieved"),
    "vectorized_v2": ("dram_pct", "sm_pct", "regs", "occ_theoretical", "occ_achieved", "waves"),
    "gqa_reuse_v3": ("dram_pct", "regs", "smem", "occ_theoretical", "occ_achieved", "waves"),
    "split_kv_v4": ("dram_pct", "regs", "occ_achieved", "waves"),
    "auto": ("dram_pct", "regs", "smem", "occ_achieved", "waves"),
}
_LABELS = {"dram_pct": ("DRAM", fmt_pct), "l1_pct": ("L1/TEX", fmt_pct),
           "sm_pct": ("SM", fmt_pct), "regs": ("registers/thread", fmt_count),
           "smem": ("shared memory/block", fmt_bytes),
           "occ_theoretical": ("theoretical occupancy", fmt_pct),
           "occ_achieved": ("achieved occupancy", fmt_pct), "waves": ("waves per SM", fmt_count)}


@functools.cache
def study() -> dict[str, dict[str, float]]:
    """The study's figures per stage (``data/study_ladder.csv``), read once."""
    text = (resources.files("pagedattn") / "data" / "study_ladder.csv").read_text("utf-8")
    figures: dict[str, dict[str, float]] = {}
    for r in csv.DictReader(io.StringIO(text)):
        figures.setdefault(r["stage"], {})[r["metric"]] = float(r["value"])
    return figures


# --- the commentary --------------------------------------------------------------------------

def _main_value(p: ImplProfile | None, key: str) -> float | None:
    k = p.main_kernel if p else None
    return k.values.get(key) if k else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _times(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x"


def _speed(r: float) -> str:
    """A speed-up ratio (old time / new time) in words: "16.0x faster", "1.18x slower"."""
    return f"{_times(r)} faster" if r >= 1 else f"{_times(1 / r)} slower"


def step_sentence(prev: ImplProfile | None, cur: ImplProfile | None, *, with_study: bool) -> str:
    """``cur`` against the stage before it: measured speed-up, and the study's when asked."""
    if cur is None or prev is None:
        return ""
    ref = study()
    s_prev, s_cur = ref.get(prev.impl, {}), ref.get(cur.impl, {})
    s = _ratio(s_prev.get("duration_us"), s_cur.get("duration_us")) if with_study else None
    study_text = TEMPLATES["step_study"].format(
        speed=_speed(s), prev_time=fmt_time(s_prev["duration_us"]),
        cur_time=fmt_time(s_cur["duration_us"])) if s else ""
    r = _ratio(prev.total_us, cur.total_us)
    if r is None:
        return TEMPLATES["step_untimed"].format(cur=cur.impl, prev=prev.impl,
                                                study=f"; {study_text}" if s else "")
    tail = ""
    if s:
        same = (r > 1) == (s > 1)
        tail = f"; {study_text}" + TEMPLATES["direction"].format(
            same="same" if same else "opposite", as_="as" if same else "to")
    return TEMPLATES["step"].format(cur=cur.impl, prev=prev.impl, speed=_speed(r),
                                    prev_time=fmt_time(prev.total_us),
                                    cur_time=fmt_time(cur.total_us), study=tail)


def _reading(p: ImplProfile, with_study: bool) -> str:
    """One templated reading of a stage's counters against the study's account of it."""
    dram, sm, l1 = (_main_value(p, k) for k in ("dram_pct", "sm_pct", "l1_pct"))
    if p.impl == "baseline" and None not in (dram, sm, l1):
        busy = min(sm, l1) > 5 * dram  # type: ignore[type-var, operator]
        return TEMPLATES["busy" if busy else "not_busy"].format(
            sm=fmt_pct(sm), l1=fmt_pct(l1), dram=fmt_pct(dram))
    if p.impl == "gqa_reuse_v3" and dram is not None:
        ref = study()["gqa_reuse_v3"]["dram_pct"]
        return TEMPLATES["dram_bound"].format(
            bound="DRAM-bound" if dram >= DRAM_BOUND_PCT else "Not DRAM-bound",
            dram=fmt_pct(dram), line=fmt_pct(DRAM_BOUND_PCT),
            study=f"; the study reached {fmt_pct(ref)}" if with_study else "")
    return ""


def counter_sentence(p: ImplProfile | None, *, with_study: bool) -> str:
    """The counters the study reads for this stage, ours next to its own."""
    if p is None or not p.is_ncu:
        return ""
    ref = study().get(p.impl, {}) if with_study else {}
    parts = []
    for key in STAGE_COUNTERS.get(p.impl, ("dram_pct",)):
        label, fmt = _LABELS[key]
        main = p.main_kernel
        v = (smem_bytes(main) if main else None) if key == "smem" else _main_value(p, key)
        parts.append(f"{label} {fmt(v)}" + (f" (study {fmt(ref[key])})" if key in ref else ""))
    text = TEMPLATES["counters"].format(parts="; ".join(parts))
    for other in (k for k in p.kernels if k is not p.main_kernel):
        merge_ref = TEMPLATES["other_kernel_study"].format(
            time=fmt_time(ref["merge_us"]), dram=fmt_pct(ref["merge_dram_pct"])) \
            if "merge" in other.name and "merge_us" in ref else ""
        d = other.values.get("duration_us")
        share = _ratio(d, p.total_us)
        text += TEMPLATES["other_kernel"].format(
            name=other.name, time=fmt_time(d), study=merge_ref,
            dram=fmt_pct(other.values.get("dram_pct")),
            share=fmt_pct(None if share is None else 100 * share))
    return text + _reading(p, with_study)


def shape_commentary(profiles: list[ImplProfile], roofline_gbps: float | None) -> list[str]:
    """Sentences for one shape's ladder (the study's figures only on the study's shape)."""
    by = {p.impl: p for p in profiles}
    ref = study()
    with_study = bool(profiles) and profiles[0].shape.startswith(STUDY_SHAPE)
    timed = [p for p in profiles if p.total_us and p.impl in LADDER]
    if not timed:
        return [TEMPLATES["nothing"]]
    lines = []
    if by.get("baseline") and by["baseline"].total_us:
        lines.append(TEMPLATES["baseline"].format(
            time=fmt_time(by["baseline"].total_us),
            study=TEMPLATES["baseline_study"].format(time=fmt_time(
                ref["baseline"]["duration_us"])) if with_study else ""))
        lines.append(counter_sentence(by["baseline"], with_study=with_study))
    for prev, cur in zip(LADDER, LADDER[1:], strict=False):
        if cur == "split_kv_v4":  # the study compares the split pair with gqa_reuse_v3
            prev = "gqa_reuse_v3"
        lines.append(step_sentence(by.get(prev), by.get(cur), with_study=with_study))
        lines.append(counter_sentence(by.get(cur), with_study=with_study))
    best = min(timed, key=lambda p: p.total_us or 0.0)
    roof = TEMPLATES["fastest_roof"].format(
        pct=fmt_pct(100 * (best.gbps or 0.0) / roofline_gbps),
        roofline=f"{roofline_gbps:,.0f} GB/s") if roofline_gbps else ""
    lines.append(TEMPLATES["fastest"].format(
        impl=best.impl, time=fmt_time(best.total_us), gbps=f"{best.gbps or 0.0:,.0f}", roof=roof,
        study=TEMPLATES["fastest_study"].format(
            also=" also" if best.impl == "gqa_reuse_v3" else "",
            dram=fmt_pct(ref["gqa_reuse_v3"]["dram_pct"])) if with_study else ""))
    auto = by.get("auto")
    if auto and auto.total_us and auto.gbps:
        lines.append(TEMPLATES["auto"].format(
            time=fmt_time(auto.total_us), speed=_speed((best.total_us or 0.0) / auto.total_us),
            best=best.impl, roof=TEMPLATES["auto_roof"].format(
                pct=fmt_pct(100 * auto.gbps / roofline_gbps)) if roofline_gbps else ""))
        lines.append(counter_sentence(auto, with_study=False))
    return [ln for ln in lines if ln]


def cross_shape_sentence(study_profiles: list[ImplProfile],
                         trace_profiles: list[ImplProfile]) -> str:
    """split_kv_v4 against gqa_reuse_v3 on the uniform study shape and on the trace batch."""
    def ratio(profiles):
        by = {p.impl: p for p in profiles}
        a, b = by.get("gqa_reuse_v3"), by.get("split_kv_v4")
        return _ratio(a.total_us if a else None, b.total_us if b else None)

    r_study, r_trace = ratio(study_profiles), ratio(trace_profiles)
    if r_study is None or r_trace is None:
        return ""
    ref = study()
    r_ref = ref["gqa_reuse_v3"]["duration_us"] / ref["split_kv_v4"]["duration_us"]
    return TEMPLATES["cross"].format(study_speed=_speed(r_study), trace_speed=_speed(r_trace),
                                     ref_speed=_speed(r_ref))


def study_table(profiles: list[ImplProfile]) -> str:
    """Markdown: per stage, the study's duration, DRAM % and step speed-up next to ours."""
    by, ref = {p.impl: p for p in profiles}, study()
    rows = ["| stage | study duration | measured | study DRAM | measured DRAM "
            "| study step | measured step |", "|---|---|---|---|---|---|---|"]
    prev = None
    for impl in LADDER:
        p, r = by.get(impl), ref[impl]
        base = "gqa_reuse_v3" if impl == "split_kv_v4" else prev
        s = _ratio(ref[base]["duration_us"], r["duration_us"]) if base else None
        m = _ratio(by[base].total_us if base in by else None, p.total_us if p else None) \
            if base else None
        rows.append(f"| {impl} | {fmt_time(r['duration_us'])} | "
                    f"{fmt_time(p.total_us if p else None)} | {fmt_pct(r['dram_pct'])} | "
                    f"{fmt_pct(_main_value(p, 'dram_pct'))} | {_times(s) if s else '-'} | "
                    f"{_times(m) if m else ('-' if not base else 'n/a')} |")
        prev = impl
    return "\n".join(rows)


def gpu_note(env: dict[str, str], roofline_gbps: float | None) -> str:
    """How this run's GPU compares with the study's, from the device and the roofline."""
    if not torch.cuda.is_available() or not roofline_gbps:
        return ""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return TEMPLATES["gpu_note"].format(study_gpu=STUDY_GPU, gpu=env.get("gpu", "?"), sms=sms,
                                        roofline=f"{roofline_gbps:,.0f} GB/s")


# --- the charts ------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _ylabel(ax, text: str) -> None:
    """The y label, saying "log scale" exactly when the axis is logarithmic."""
    ax.set_ylabel(f"{text}, log scale" if ax.get_yscale() == "log" else text)


def _impls(by_shape: dict[str, list[ImplProfile]]) -> list[str]:
    return list(dict.fromkeys(p.impl for ps in by_shape.values() for p in ps))


def _bars(ax, by_shape, impls, value) -> None:
    """Grouped bars of ``value(profile)`` (None: no bar)."""
    width = 0.8 / max(len(by_shape), 1)
    for i, (shape, profiles) in enumerate(by_shape.items()):
        lookup = {p.impl: p for p in profiles}
        pts = [(j + (i - (len(by_shape) - 1) / 2) * width, v) for j, impl in enumerate(impls)
               if impl in lookup and (v := value(lookup[impl])) is not None]
        if pts:
            ax.bar([x for x, _ in pts], [y for _, y in pts], width, label=shape)
    ax.set_xticks(range(len(impls)), impls, rotation=25, ha="right")


def plot_durations(by_shape: dict[str, list[ImplProfile]], path: str | Path) -> Path | None:
    """Duration per stage and shape on a log axis; the study's durations as markers on the
    study's shape. ``None`` (no file) when nothing was timed."""
    if not any(p.total_us for ps in by_shape.values() for p in ps):
        return None
    plt = _pyplot()
    impls = _impls(by_shape)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    _bars(ax, by_shape, impls, lambda p: p.total_us)
    ax.set_yscale("log")
    if any(s.startswith(STUDY_SHAPE) for s in by_shape):
        ref = study()
        pts = [(j, ref[i]["duration_us"]) for j, i in enumerate(impls) if i in ref]
        ax.scatter([x for x, _ in pts], [y for _, y in pts], marker="D", color="black",
                   zorder=3, label=f"study ({STUDY_GPU}, its workload)")
    ax.legend(fontsize=8)
    _ylabel(ax, "duration of one call (µs)")
    ax.set_title("paged decode: duration per stage")
    return _save(fig, path)


def plot_bandwidth(by_shape: dict[str, list[ImplProfile]], roofline_gbps: float | None,
                   path: str | Path) -> Path | None:
    """Achieved GB/s (minimal bytes) per impl and shape on a linear axis; the read roofline of
    this run as a line. ``None`` when nothing was timed."""
    if not any(p.gbps for ps in by_shape.values() for p in ps):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    _bars(ax, by_shape, _impls(by_shape), lambda p: p.gbps)
    if roofline_gbps:
        ax.axhline(roofline_gbps, color="black", linestyle="--", linewidth=1,
                   label=f"read roofline, this run ({roofline_gbps:,.0f} GB/s)")
    ax.legend(fontsize=8)
    _ylabel(ax, "achieved bandwidth (GB/s, minimal bytes)")
    ax.set_title("paged decode: achieved bandwidth vs the read roofline")
    return _save(fig, path)


def plot_occupancy(by_shape: dict[str, list[ImplProfile]], path: str | Path) -> Path | None:
    """Occupancy (achieved filled, theoretical hollow) against registers/thread, per kernel:
    colour by impl, marker by shape. ``None`` when no kernel has occupancy counters."""
    points = [(shape, p, k) for shape, ps in by_shape.items() for p in ps for k in p.kernels
              if k.values.get("regs") is not None
              and (k.values.get("occ_achieved") is not None
                   or k.values.get("occ_theoretical") is not None)]
    if not points:
        return None
    plt = _pyplot()
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(8, 4.8))
    impls = _impls(by_shape)
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}
    markers = {shape: "osD^v<>"[i % 7] for i, shape in enumerate(by_shape)}
    for shape, p, k in points:
        regs = k.values["regs"]
        ach, theo = k.values.get("occ_achieved"), k.values.get("occ_theoretical")
        c, m = colors[p.impl], markers[shape]
        if ach is not None:
            ax.scatter([regs], [ach], marker=m, color=c, zorder=3)
        if theo is not None:
            ax.scatter([regs], [theo], marker=m, facecolors="none", edgecolors=c)
        if k is not p.main_kernel:
            ax.annotate(k.name.strip("_"), (regs, ach if ach is not None else theo),
                        fontsize=6, xytext=(4, -8), textcoords="offset points")
    used_impls = {p.impl for _, p, _ in points}
    used_shapes = {s for s, _, _ in points}
    handles = [Line2D([], [], marker="s", linestyle="", color=colors[i], label=i)
               for i in impls if i in used_impls]
    handles += [Line2D([], [], marker=markers[s], linestyle="", color="black",
                       markerfacecolor="none", label=s) for s in by_shape if s in used_shapes]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xlabel("registers/thread")
    _ylabel(ax, "occupancy (%): achieved filled, theoretical hollow")
    ax.set_ylim(0, 105)
    ax.set_title("occupancy vs registers (one point per kernel)")
    return _save(fig, path)


# --- the page and the command ------------------------------------------------------------------

def report_files(out: Path) -> dict[str, Path]:
    """The files :func:`write_report` writes for the page ``out``: ``md`` (``out``), ``csv``
    and one PNG per chart (``<stem>-<chart>.png``), so that all are checked before the work."""
    stem = out.with_suffix("")
    return {"md": out, "csv": stem.with_name(f"{stem.name}.csv"),
            **{c: stem.with_name(f"{stem.name}-{c}.png") for c in CHARTS}}


def write_report(out: Path, by_shape: dict[str, list[ImplProfile]], descriptions: dict[str, str],
                 roofline_gbps: float | None, env: dict[str, str], small: bool) -> Path:
    """The markdown page, its charts (``<stem>-*.png``, only those with data) and tidy CSV."""
    from pagedattn.bench.profile import banner, shape_section, write_csv
    from pagedattn.bench.report import header_lines

    out.parent.mkdir(parents=True, exist_ok=True)
    files = report_files(out)
    charts = {
        "Duration per stage (log scale)": plot_durations(by_shape, files["duration"]),
        "Achieved bandwidth vs the read roofline": plot_bandwidth(
            by_shape, roofline_gbps, files["bandwidth"]),
        "Occupancy vs registers": plot_occupancy(by_shape, files["occupancy"]),
    }
    all_profiles = [p for ps in by_shape.values() for p in ps]
    write_csv(files["csv"], all_profiles, env, roofline_gbps)
    md = ["# The study's ladder, profiled", "", *banner(all_profiles)]
    if small and any(p.total_us is not None for p in all_profiles):
        md += ["> **Shrunken shapes (--small)**: not the study's sizes; the figures are not "
               "comparable with its own.", ""]
    note = gpu_note(env, roofline_gbps)
    md += [*([note, ""] if note else []), *header_lines(env, roofline_gbps), ""]
    for name, profiles in by_shape.items():
        md.append(shape_section(profiles, descriptions[name], roofline_gbps))
    study_profiles = next((ps for n, ps in by_shape.items() if n.startswith(STUDY_SHAPE)), None)
    if study_profiles:
        md += ["## Study vs measured (the study's workload)", "",
               f"The study's figures come from {STUDY_GPU}; a step is the speed-up over the "
               "stage before (split_kv_v4: over gqa_reuse_v3, as the study compares).", "",
               study_table(study_profiles), ""]
    drawn = {title: path for title, path in charts.items() if path is not None}
    md += ["## Charts", ""]
    md += [f"![{title}]({Path(path).name})\n" for title, path in drawn.items()] or [
        "No chart: nothing was measured.", ""]
    md += ["## Commentary (rendered from the measured numbers)", ""]
    for name, profiles in by_shape.items():
        md += [f"### {name}", "", *shape_commentary(profiles, roofline_gbps), ""]
    trace = next((ps for n, ps in by_shape.items() if not n.startswith(STUDY_SHAPE)), None)
    cross = cross_shape_sentence(study_profiles or [], trace or [])
    if cross:
        md += ["### Across the two shapes", "", cross, ""]
    out.write_text("\n".join(md), encoding="utf-8")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedattn ladder``."""
    parser.add_argument("--out", default=None, type=output_file,
                        help=f"markdown report [OUT_DIR/{PAGE_NAME}; OUT_DIR/{SMALL_PAGE_NAME} "
                             "with shrunken shapes]; charts and the tidy CSV go beside it "
                             "(--out docs/ladder-h200.md refreshes the committed page)")
    parser.add_argument("--out-dir", default=Path(DEFAULT_OUT_DIR), type=output_dir,
                        help=f"the page (without --out), ncu reports and their CSV exports "
                             f"[{DEFAULT_OUT_DIR}]")
    parser.add_argument("--shapes", default=list(LADDER_SHAPES),
                        type=name_list(SHAPES, what="shape"),
                        help=f"comma list of shapes [{','.join(LADDER_SHAPES)}]")
    add_profiling_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Run ``pagedattn ladder``; returns the exit status."""
    from pagedattn.api import STAGES
    from pagedattn.bench.profile import (
        check_output_files,
        measure_roofline,
        nothing_measurable,
        profile_impls,
        verdict,
    )
    from pagedattn.bench.report import environment_meta
    from pagedattn.bench.shapes import resolve_shape

    if nothing_measurable("ladder", args):
        return 2
    on_gpu = torch.cuda.is_available()
    small = args.small or not on_gpu
    impls = [*STAGES, "auto"]
    out_dir = check_output_files(args.out_dir, [resolve_shape(n, small).name
                                                for n in args.shapes], impls)
    page = Path(args.out) if args.out else out_dir / (SMALL_PAGE_NAME if small else PAGE_NAME)
    for path in report_files(page).values():  # before the first profile, not after the last
        checked_output(path, "--out" if args.out else "--out-dir")
    roofline = measure_roofline()
    by_shape, descriptions = {}, {}
    for name in args.shapes:
        shape = resolve_shape(name, small)
        print(f"[ladder] {shape.describe()}")
        by_shape[shape.name] = profile_impls(impls, name, out_dir, small=small,
                                             use_ncu=not args.no_ncu, warmup=args.warmup)
        descriptions[shape.name] = shape.describe()
    env = environment_meta("cuda" if on_gpu else None)
    out = write_report(page, by_shape, descriptions, roofline, env, small)
    print(f"[ladder] wrote {out}")
    why = verdict([p for ps in by_shape.values() for p in ps], dry_run=args.dry_run,
                  no_ncu=args.no_ncu)
    if why:
        print(f"pagedattn ladder: {why}.", file=sys.stderr)
        return 1
    return 0
