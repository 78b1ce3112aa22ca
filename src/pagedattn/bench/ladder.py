"""``pagedattn ladder``: the study's five stages and ``auto``, profiled, charted and discussed.

    pagedattn ladder                      # H200: ncu on both shapes -> docs/ladder-h200.md
    pagedattn ladder --small --out /tmp/ladder.md   # CPU: interpreter fallback, < 1 minute

Two shapes: the study's workload (``seed-fp32-b64-c2048``: fp32, batch 64, 32/8 heads,
head_dim 128, page_size 16, context 2048, pages in shuffled order) and a real bf16 Llama-3-8B
batch (``azure-conv-b64-llama8b``: 64 requests of the Azure conversation trace, seed 0). Each
impl is profiled by :func:`pagedattn.bench.profiling.profile_impls` (ncu when present, else the
labelled fallback). The markdown report holds the read roofline measured in the same run, the
profile table per shape, a study-versus-measured table, three PNG charts beside the report and
a commentary generated from the measured numbers (:mod:`pagedattn.bench.ladder_text`). On the
CPU (or with ``--small``) every shape is shrunk for the Triton interpreter and the report says
so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

DEFAULT_OUT = "docs/ladder-h200.md"
SMALL_OUT = "out/ladder-small.md"  # never overwrite the committed H200 report with a CPU run
SHAPES = ("seed-fp32-b64-c2048", "azure-conv-b64-llama8b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedattn ladder``."""
    parser.add_argument("--out", default=None,
                        help=f"markdown report [{DEFAULT_OUT}; {SMALL_OUT} with shrunken "
                             "shapes]; charts and the tidy CSV go beside it")
    parser.add_argument("--out-dir", default="out/ladder",
                        help="ncu reports and their CSV exports [out/ladder]")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma list of shapes [{','.join(SHAPES)}]")
    parser.add_argument("--small", action="store_true",
                        help="shrunken shapes for the CPU interpreter (implied without a GPU)")
    parser.add_argument("--no-ncu", action="store_true", help="use the fallback even with ncu")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled calls first [3]")


def write_report(out: Path, by_shape: dict, descriptions: dict[str, str],
                 roofline_gbps: float | None, env: dict[str, str], small: bool) -> Path:
    """The markdown report, its three charts (``<stem>-*.png``) and tidy CSV (``<stem>.csv``)."""
    from pagedattn.bench import ladder_plots as P
    from pagedattn.bench import ladder_text as T
    from pagedattn.bench import profile_report as R
    from pagedattn.bench.profiling import SOURCE_INTERPRETER

    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")
    charts = {
        "Duration per stage (log scale)": P.plot_durations(by_shape, f"{stem}-duration.png"),
        "Achieved bandwidth vs the read roofline": P.plot_bandwidth(
            by_shape, roofline_gbps, f"{stem}-bandwidth.png"),
        "Occupancy vs registers": P.plot_occupancy(by_shape, f"{stem}-occupancy.png"),
    }
    all_profiles = [p for ps in by_shape.values() for p in ps]
    R.write_csv(f"{stem}.csv", all_profiles, env)
    ncu_used = any(p.is_ncu for p in all_profiles)
    md = ["# The study's ladder, profiled", ""]
    interpreter = any(p.source == SOURCE_INTERPRETER for p in all_profiles)
    if interpreter:
        md += ["> **Shrunken shapes on the Triton interpreter (CPU).** Nothing here is "
               "performance: no time was measured and no hardware counter read. This page shows "
               "the report's structure; the figures come from the H200 run.", ""]
    elif small:
        md += ["> **Shrunken shapes (--small)**: not the study's sizes; the figures are not "
               "comparable with its own.", ""]
    if not ncu_used and not interpreter:
        md += ["> **Fallback: Nsight Compute did not run.** Durations are CUDA-event medians; "
               "throughput and occupancy rows are n/a (never estimated).", ""]
    md += [T.H200_NOTE, "", *R.header_lines(env, roofline_gbps), ""]
    for name, profiles in by_shape.items():
        md.append(R.shape_section(profiles, descriptions[name], roofline_gbps))
    study = next((ps for n, ps in by_shape.items() if n.startswith(T.STUDY_SHAPE)), None)
    if study:
        md += ["## Study vs measured (the study's workload)", "",
               f"The study's figures come from {T.STUDY_GPU}; a step is the speed-up over the "
               "stage before (split_kv_v4: over gqa_reuse_v3, as the study compares).", "",
               T.study_table(study), ""]
    md += ["## Charts", ""]
    md += [f"![{title}]({Path(path).name})\n" for title, path in charts.items()]
    md += ["## Commentary (generated from the measured numbers)", ""]
    for name, profiles in by_shape.items():
        md += [f"### {name}", "", *T.shape_commentary(profiles, roofline_gbps), ""]
    trace = next((ps for n, ps in by_shape.items() if not n.startswith(T.STUDY_SHAPE)), None)
    cross = T.cross_shape_sentence(study or [], trace or [])
    if cross:
        md += ["### Across the two shapes", "", cross, ""]
    out.write_text("\n".join(md), encoding="utf-8")
    return out


def main(args: argparse.Namespace) -> int:
    """Run ``pagedattn ladder``; returns the exit status."""
    from pagedattn.api import STAGES
    from pagedattn.bench.profile import measure_roofline
    from pagedattn.bench.profiling import profile_impls, resolve_shape
    from pagedattn.bench.report import environment_meta

    on_gpu = torch.cuda.is_available()
    small = args.small or not on_gpu
    if small:
        print("[ladder] shrunken shapes" + ("" if on_gpu else " on the CPU interpreter: "
                                            "nothing is timed"))
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    try:
        shapes = {name: resolve_shape(name, small) for name in names}
    except ValueError as exc:
        print(f"pagedattn ladder: {exc}")
        return 2
    impls = [*STAGES, "auto"]
    roofline = measure_roofline()
    by_shape, descriptions = {}, {}
    for name, shape in shapes.items():
        print(f"[ladder] {shape.describe()}")
        by_shape[shape.name] = profile_impls(impls, name, args.out_dir, small=small,
                                             use_ncu=not args.no_ncu, warmup=args.warmup)
        descriptions[shape.name] = shape.describe()
    env = environment_meta("cuda" if on_gpu else None)
    out_path = Path(args.out or (SMALL_OUT if small else DEFAULT_OUT))
    out = write_report(out_path, by_shape, descriptions, roofline, env, small)
    print(f"[ladder] wrote {out}")
    return 0
