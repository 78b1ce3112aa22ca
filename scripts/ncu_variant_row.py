"""Run one variant row of ``scripts/bench_variants.py`` through ``auto`` and FlashInfer (the
same variant), twice each, for Nsight Compute: the profile then holds both sides' kernels on
the same batch. Usage (repo root, GPU machine, FlashInfer importable)::

    ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \\
        -k regex:'paged_decode|merge|Merge|Prefill|Decode' --csv --page details \\
        python3 scripts/ncu_variant_row.py --row window1024-b64-c2k
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_variants as bv  # noqa: E402  (a sibling script)

from pagedattn.bench.shapes import build_batch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", required=True, choices=sorted({**bv.ROWS, **bv.TUNE_ROWS}))
    args = ap.parse_args()
    shape_name, plan_kw, per_layer = {**bv.ROWS, **bv.TUNE_ROWS}[args.row]
    shape = bv._shape(shape_name, False)
    b = build_batch(shape, "cuda")
    query, layer = bv._inputs(shape, b, plan_kw, per_layer)
    runs = [bv.ours(shape, b, query, plan_kw, layer)]
    fi = bv.flashinfer(shape, b, query, plan_kw, layer)
    if callable(fi):
        runs.append(fi)
    else:
        print("flashinfer:", fi)
    for run in runs:
        for _ in range(2):
            run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
