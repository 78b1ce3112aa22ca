"""The study's own figures, and the ladder's commentary generated from the measured numbers.

:data:`STUDY` holds the Nsight Compute figures that ``shared/seed`` reports for its five stages
on its workload (fp32, batch 64, 32/8 heads, head_dim 128, page_size 16, about 2k tokens) on a
36-SM consumer GPU. :func:`commentary` writes templated sentences: each step's measured
speed-up next to the study's, the counters the study singles out next to ours, and where the
two agree or differ in direction. Every number in the text comes from the profiles passed in or
from :data:`STUDY`; a value that was not measured is said to be so. The lead edits the final
prose after the H200 run.
"""

from __future__ import annotations

from pagedattn.bench.profile_report import fmt_bytes, fmt_count, fmt_pct, fmt_time, smem_bytes
from pagedattn.bench.profiling import ImplProfile

STUDY_GPU = "a 36-SM consumer GPU"
H200_NOTE = ("The study ran on a 36-SM consumer GPU; the H200 has 132 SMs and about 4.8 TB/s of "
             "HBM3e, so absolute times and waves per SM are not comparable, while the speed-up "
             "of each step and where the counters point are.")
STUDY_SHAPE = "seed-fp32-b64-c2048"
LADDER = ("baseline", "fused_v1", "vectorized_v2", "gqa_reuse_v3", "split_kv_v4")

#: the study's ncu figures per stage (time in µs, throughputs and occupancy in %, smem bytes)
STUDY: dict[str, dict[str, float]] = {
    "baseline": {"duration_us": 119_980.0, "dram_pct": 2.40, "l1_pct": 91.72, "l2_pct": 2.23,
                 "sm_pct": 89.78},
    "fused_v1": {"duration_us": 7_500.0, "dram_pct": 37.92, "l1_pct": 61.40, "l2_pct": 28.18,
                 "sm_pct": 60.59, "waves": 4.74, "regs": 31, "occ_achieved": 89.36},
    "vectorized_v2": {"duration_us": 4_950.0, "dram_pct": 57.42, "l1_pct": 34.10,
                      "l2_pct": 42.14, "sm_pct": 17.02, "regs": 64, "occ_theoretical": 50.0,
                      "occ_achieved": 37.58, "waves": 2.37, "grid": 2048, "block": 32},
    "gqa_reuse_v3": {"duration_us": 3_350.0, "dram_pct": 84.86, "l1_pct": 30.32,
                     "l2_pct": 31.54, "sm_pct": 28.46, "regs": 39, "smem": 16_384,
                     "occ_theoretical": 41.67, "occ_achieved": 36.79, "waves": 2.84,
                     "grid": 512, "block": 128},
    "split_kv_v4": {"duration_us": 3_920.0 + 22.56, "split_us": 3_920.0, "merge_us": 22.56,
                    "dram_pct": 73.41, "merge_dram_pct": 85.68, "l1_pct": 42.05,
                    "l2_pct": 52.91, "sm_pct": 21.58, "waves": 18.96},
}


def _first(p: ImplProfile | None, key: str) -> float | None:
    """The value of ``key`` for the impl's main (longest) kernel."""
    k = p.main_kernel if p else None
    return k.values.get(key) if k else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _times(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x"


def _direction(measured: float, study: float) -> str:
    if (measured > 1) == (study > 1):
        return "the same direction as the study"
    return "the opposite direction to the study"


def _speed(r: float) -> str:
    """A speed-up ratio (old time / new time) in words: "16.0x faster", "1.18x slower"."""
    return f"{_times(r)} faster" if r >= 1 else f"{_times(1 / r)} slower"


#: per stage, the counters the study discusses for it (plus DRAM everywhere)
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


def step_sentence(prev: ImplProfile | None, cur: ImplProfile | None, *, study: bool) -> str:
    """``cur`` against the stage before it: measured speed-up, and the study's when asked."""
    if cur is None or prev is None:
        return ""
    r = _ratio(prev.total_us, cur.total_us)
    s = _ratio(STUDY[prev.impl]["duration_us"], STUDY[cur.impl]["duration_us"]) \
        if study and prev.impl in STUDY and cur.impl in STUDY else None
    head = f"- **{cur.impl}** vs {prev.impl}: "
    study_text = (f"the study measured {_speed(s)} ({fmt_time(STUDY[prev.impl]['duration_us'])}"
                  f" -> {fmt_time(STUDY[cur.impl]['duration_us'])})") if s else ""
    if r is None:
        return head + "not timed here" + (f"; {study_text}." if s else ".")
    text = f"{head}{_speed(r)} ({fmt_time(prev.total_us)} -> {fmt_time(cur.total_us)})"
    if s:
        text += f"; {study_text}: {_direction(r, s)}"
    return text + "."


def counter_sentence(p: ImplProfile | None, *, study: bool) -> str:
    """The counters the study reads for this stage, ours next to its own."""
    if p is None or not p.is_ncu:
        return ""
    ref = STUDY.get(p.impl, {}) if study else {}
    parts = []
    for key in STAGE_COUNTERS.get(p.impl, ("dram_pct",)):
        label, fmt = _LABELS[key]
        main = p.main_kernel
        v = (smem_bytes(main) if main else None) if key == "smem" else _first(p, key)
        parts.append(f"{label} {fmt(v)}" + (f" (study {fmt(ref[key])})" if key in ref else ""))
    text = "  ncu: " + "; ".join(parts) + "."
    for other in (k for k in p.kernels if k is not p.main_kernel):
        ref_merge = (f" (study's merge {fmt_time(ref['merge_us'])}, DRAM "
                     f"{fmt_pct(ref['merge_dram_pct'])})") if "merge" in other.name \
            and "merge_us" in ref else ""
        d = other.values.get("duration_us")
        share = _ratio(d, p.total_us)
        text += (f" Kernel {other.name} takes {fmt_time(d)}{ref_merge}, DRAM "
                 f"{fmt_pct(other.values.get('dram_pct'))}, "
                 f"{fmt_pct(None if share is None else 100 * share)} of the call.")
    return text + _reading(p, study)


def _reading(p: ImplProfile, study: bool) -> str:
    """One templated reading of a stage's counters against the study's account of it."""
    dram, sm, l1 = _first(p, "dram_pct"), _first(p, "sm_pct"), _first(p, "l1_pct")
    if p.impl == "baseline" and dram is not None and sm is not None and l1 is not None:
        busy = min(sm, l1) > 5 * dram
        return (" SM and L1 are far busier than DRAM: the redundant-work signature the study "
                "describes." if busy else " Unlike the study, SM and L1 are not far busier "
                "than DRAM here.")
    if p.impl == "gqa_reuse_v3" and dram is not None:  # 80 %: our line for "DRAM-bound"
        bound = "DRAM-bound (at least 80 %" if dram >= 80 else "Not DRAM-bound (below 80 %"
        return f" {bound} DRAM throughput" + ("; the study reached 84.86 %)." if study else ").")
    return ""


def shape_commentary(profiles: list[ImplProfile], roofline_gbps: float | None) -> list[str]:
    """Sentences for one shape's ladder (the study's figures only on the study's shape)."""
    by = {p.impl: p for p in profiles}
    study = bool(profiles) and profiles[0].shape.startswith(STUDY_SHAPE)
    lines = []
    if by.get("baseline"):
        lines.append(f"- **baseline**: {fmt_time(by['baseline'].total_us)} per call"
                     + (f" (study {fmt_time(STUDY['baseline']['duration_us'])})." if study
                        else "."))
        lines.append(counter_sentence(by["baseline"], study=study))
    for prev, cur in zip(LADDER, LADDER[1:], strict=False):
        if cur == "split_kv_v4":  # the study compares the split pair with gqa_reuse_v3
            prev = "gqa_reuse_v3"
        lines.append(step_sentence(by.get(prev), by.get(cur), study=study))
        lines.append(counter_sentence(by.get(cur), study=study))
    timed = [(p.total_us, p) for p in profiles if p.total_us and p.impl in LADDER]
    if timed:
        best_us, best = min(timed, key=lambda tp: tp[0])
        best_gbps = best.gbps or 0.0  # timed, so set
        text = f"- Fastest stage: **{best.impl}**, {fmt_time(best_us)}, {best_gbps:,.0f} GB/s"
        if roofline_gbps:
            text += (f" = {100 * best_gbps / roofline_gbps:.1f} % of the read roofline measured "
                     f"in this run ({roofline_gbps:,.0f} GB/s)")
        if study:
            also = " also" if best.impl == "gqa_reuse_v3" else ""
            text += (f"; the study's fastest was{also} gqa_reuse_v3 (84.86 % DRAM throughput "
                     "on its GPU)")
        lines.append(text + ".")
        auto = by.get("auto")
        if auto and auto.total_us and auto.gbps:
            r = best_us / auto.total_us
            lines.append(f"- **auto** (the production kernel): {fmt_time(auto.total_us)}, "
                         f"{_speed(r)} than {best.impl}"
                         + (f", {100 * auto.gbps / roofline_gbps:.1f} % of the roofline."
                            if roofline_gbps else "."))
            lines.append(counter_sentence(auto, study=False))
    else:
        lines.append("- Nothing was timed on this machine (CPU interpreter): run "
                     "`pagedattn ladder` on the H200 for the figures.")
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
    study = STUDY["gqa_reuse_v3"]["duration_us"] / STUDY["split_kv_v4"]["duration_us"]
    return (f"- Split-KV against GQA reuse: split_kv_v4 is {_speed(r_study)} than gqa_reuse_v3 "
            f"on the uniform study shape and {_speed(r_trace)} on the ragged trace batch "
            f"(study: {_speed(study)} on its uniform shape).")


def study_table(profiles: list[ImplProfile]) -> str:
    """Markdown: per stage, the study's duration, DRAM % and step speed-up next to ours."""
    by = {p.impl: p for p in profiles}
    rows = ["| stage | study duration | measured | study DRAM | measured DRAM "
            "| study step | measured step |", "|---|---|---|---|---|---|---|"]
    prev = None
    for impl in LADDER:
        p, ref = by.get(impl), STUDY[impl]
        base = "gqa_reuse_v3" if impl == "split_kv_v4" else prev
        s = _ratio(STUDY[base]["duration_us"], ref["duration_us"]) if base else None
        m = _ratio(by[base].total_us if base in by else None, p.total_us if p else None) \
            if base else None
        rows.append(f"| {impl} | {fmt_time(ref['duration_us'])} | "
                    f"{fmt_time(p.total_us if p else None)} | {fmt_pct(ref['dram_pct'])} | "
                    f"{fmt_pct(_first(p, 'dram_pct'))} | {_times(s) if s else '-'} | "
                    f"{_times(m) if m else ('-' if not base else 'n/a')} |")
        prev = impl
    return "\n".join(rows)
