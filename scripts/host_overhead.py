"""Where one eager ``paged_decode`` call spends its host time (CUDA only).

For each shape: the host time per call (no sync between calls, so the figure is the time to
submit, not to run), the same for the validation alone and the launcher alone, a cProfile of
the calls (top functions by own time), and the cold-L2 eager and CUDA-graph medians from the
benchmark's timer (``docs/perf-notes.md``, step 6).

    PYTHONPATH=src python3 scripts/host_overhead.py --shapes llama8b-b64-c2k,llama8b-b1-c32k
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

import torch

from pagedattn import _validation as V
from pagedattn._cli_types import positive_int
from pagedattn.api import paged_decode
from pagedattn.bench.shapes import build_batch, get_shape
from pagedattn.bench.timing import host_us, time_cold, time_graph
from pagedattn.launch.decode import paged_decode_auto


def measure_shape(name: str, reps: int) -> tuple[dict, str]:
    """The figures of one shape (a JSON row) and the cProfile text."""
    shape = get_shape(name)
    b = build_batch(shape, "cuda")
    q, kc, vc, bt, cl = b.tensors
    out = torch.empty_like(q)

    def full():
        return paged_decode(q, kc, vc, bt, cl, **b.scales)

    def check_only():
        V.check_metadata(q, kc, vc, bt, cl, scale=None, impl="auto", impls=("auto",),
                         num_splits=None, out=None, kv_layout="NHD", k_scale=b.k_scale,
                         v_scale=b.v_scale, return_lse=False, validate=None)

    def launcher_only():
        paged_decode_auto(q, kc, vc, bt, cl, out, None, scale=q.shape[-1] ** -0.5,
                          k_scale=b.k_scale, v_scale=b.v_scale)

    row = {"shape": name, **{f"host_{what}_us": host_us(fn, calls=300, warmup=10) for what, fn
                             in (("full", full), ("validation", check_only),
                                 ("launcher", launcher_only))}}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        full()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    row["eager_median_us"] = time_cold(full, reps=reps).median_us
    row["graph_median_us"] = time_graph(full, reps=reps).median_us
    return row, text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama8b-b64-c2k,llama8b-b1-c32k")
    ap.add_argument("--reps", type=positive_int, default=50)
    args = ap.parse_args()
    for name in args.shapes.split(","):
        row, profile = measure_shape(name, args.reps)
        print(json.dumps(row))
        print(profile)


if __name__ == "__main__":
    main()
