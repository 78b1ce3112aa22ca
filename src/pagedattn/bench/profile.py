"""``pagedattn profile``: Nsight Compute (or the labelled fallback) for impls on one shape.

    pagedattn profile --impl gqa_reuse_v3,split_kv_v4 --shape seed-fp32-b64-c2048

With a GPU and ``ncu`` it profiles every kernel each impl launches (sections SpeedOfLight,
LaunchStats, Occupancy, MemoryWorkloadAnalysis; ``--clock-control none``; warm-up outside the
profiled range) and prints the study's rows, one column per impl. Without ncu (or when ncu fails
or is refused the counters) it falls back to Triton's compile metadata plus CUDA-event timing,
and on the CPU to the interpreter on a shrunken shape with nothing timed; the output says so.
``--out-dir`` receives the ``.ncu-rep`` reports, their CSV exports, a tidy CSV and a markdown
report.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

DEFAULT_OUT_DIR = "out/profile"


def parse_impls(text: str) -> list[str]:
    """``"a,b"`` or ``"all"`` -> impl names, checked against ``pagedattn.api.IMPLS``."""
    from pagedattn.api import IMPLS

    names = list(IMPLS) if text.strip() == "all" else [s.strip() for s in text.split(",")
                                                       if s.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown or not names:
        raise ValueError(f"impl: unknown {unknown or text!r}; expected a comma list of "
                         f"{', '.join(IMPLS)} or 'all'")
    return names


def measure_roofline(log=print) -> float | None:
    """The read roofline (GB/s) measured now on the GPU, or ``None`` without one."""
    if not torch.cuda.is_available():
        return None
    from pagedattn.bench.timing import measure_read_bandwidth

    gbps = measure_read_bandwidth()
    torch.cuda.empty_cache()
    log(f"[profile] read roofline (this run): {gbps:,.0f} GB/s")
    return gbps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedattn profile``."""
    parser.add_argument("--impl", default="auto",
                        help="comma list of impls (pagedattn.api.IMPLS) or 'all' [auto]")
    parser.add_argument("--shape", default="seed-fp32-b64-c2048",
                        help="a shape of pagedattn.bench.shapes [seed-fp32-b64-c2048]")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                        help=f"reports, CSV and markdown go here [{DEFAULT_OUT_DIR}]")
    parser.add_argument("--small", action="store_true",
                        help="a shrunken copy of the shape (implied without a GPU)")
    parser.add_argument("--no-ncu", action="store_true", help="use the fallback even with ncu")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled calls first [3]")
    parser.add_argument("--repeat", type=int, default=1,
                        help="profiled calls per impl; repeated launches are merged by the "
                             "median [1]")


def main(args: argparse.Namespace) -> int:
    """Run ``pagedattn profile``; returns the exit status."""
    from pagedattn.bench import profile_report as R
    from pagedattn.bench.profiling import profile_impls, resolve_shape
    from pagedattn.bench.report import environment_meta

    small = args.small or not torch.cuda.is_available()
    try:
        impls = parse_impls(args.impl)
        shape = resolve_shape(args.shape, small)
    except ValueError as exc:
        print(f"pagedattn profile: {exc}")
        return 2
    if small and not args.small:
        print("[profile] no CUDA GPU: the Triton interpreter runs a shrunken shape, untimed")
    out = Path(args.out_dir)
    profiles = profile_impls(impls, args.shape, out, small=small, use_ncu=not args.no_ncu,
                             warmup=args.warmup, repeat=args.repeat)
    roofline = measure_roofline()
    env = environment_meta("cuda" if torch.cuda.is_available() else None)
    rows = R.table(profiles, roofline)
    print(shape.describe())
    print(R.to_text(rows))
    print("\n".join(R.notes(profiles)))
    csv_path = out / f"profile_{shape.name}.csv"
    R.write_csv(csv_path, profiles, env)
    md_path = out / f"profile_{shape.name}.md"
    md = ["# pagedattn profile", "", *R.header_lines(env, roofline), "",
          R.shape_section(profiles, shape.describe(), roofline)]
    files = [f for p in profiles for f in p.files]
    if files:
        md += ["Files: " + ", ".join(f"`{Path(f).name}`" for f in files), ""]
    md_path.write_text("\n".join(md), encoding="utf-8")
    print(f"[profile] wrote {md_path} and {csv_path}")
    return 0
