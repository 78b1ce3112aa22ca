"""Paged prefill or MLA decode, ours beside the peer, one call each between
``cudaProfilerStart`` and ``cudaProfilerStop``, for Nsight Compute.

Every runner is built and called twice first (compiles, FlashInfer's JIT, plans), so the
profiled range holds one call of each and nothing else: run it under ``ncu
--profile-from-start off`` with no kernel filter, and the CSV lists ours and the peer's
kernels in the order given::

    ncu --clock-control none --section SpeedOfLight --section LaunchStats \\
        --section Occupancy --section WarpStateStats --profile-from-start off --csv \\
        --page details python3 scripts/ncu_prefill_mla.py prefill --row prompt-8k \\
        --variants "gluon-split:gluon=1,split=1,block_n=64,num_stages=3" --fa3 .peers/fa3_peer.py

    ncu ... python3 scripts/ncu_prefill_mla.py mla --rows ds-tp1-b64-c4k,ds-tp8-b64-c4k

``prefill``: a row of ``scripts/bench_prefill.py`` (Llama-3-8B heads, bf16), our default
plan, each ``--variants`` entry (that script's ``label:field=value,...`` form), FlashInfer's
paged prefill (when ``import flashinfer`` works) and FA3's paged varlen call (``--fa3``):
``bench_prefill.makers``, the bench's own runners.
``mla``: rows of ``pagedattn.bench.mla`` (DeepSeek-V3's latent), each ``--ours`` variant
(``default``, ``gluon``, ``gluon-ws``, ``plain``) and FlashInfer's MLA wrapper where it takes
the row. Prints each call's label as it is profiled. Exits 2 without a CUDA GPU or for an
unknown row.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def _prefill_runs(args) -> list[tuple[str, Callable]]:
    import bench_prefill as bp  # noqa: PLC0415 (a sibling script: its rows and runners)

    row = next(r for r in bp.ROWS if r.name == args.row)
    inputs, query, qsl, _ = bp.build(row, "cuda", torch.bfloat16)
    return [(name, make(inputs, query, qsl, row))
            for name, make in bp.makers(args.variants, args.fa3).items()]


def _mla_runs(args) -> list[tuple[str, Callable]]:
    from pagedattn.bench import mla as bm  # noqa: PLC0415
    from pagedattn.bench.peers import PeerUnsupported  # noqa: PLC0415

    shapes = {s.name: s for s in bm.MLA_SHAPES}
    runs = []
    for name in args.rows.split(","):
        shape = shapes[name]
        inputs, sinks = bm.build_inputs(shape, "cuda")
        for variant in args.ours.split(","):
            runs.append((f"{name}/pagedattn:{variant}", bm.ours(shape, inputs, sinks, variant)))
        try:
            runs.append((f"{name}/flashinfer-mla", bm.flashinfer_mla(shape, inputs, sinks)))
        except PeerUnsupported as e:
            print(f"{name}: {e}", flush=True)
    return runs


def _unknown_rows(args) -> str:
    """Why the rows asked for are not rows of the lab ("" if they are)."""
    if args.what == "prefill":
        import bench_prefill as bp  # noqa: PLC0415

        names = [r.name for r in bp.ROWS]
        asked = [args.row]
    else:
        from pagedattn.bench import mla as bm  # noqa: PLC0415

        names = [s.name for s in bm.MLA_SHAPES]
        asked = args.rows.split(",")
    bad = [n for n in asked if n not in names]
    return f"unknown {args.what} row {bad[0]!r} (one of {', '.join(names)})" if bad else ""


def _refuse(message: str) -> int:
    print(f"ncu_prefill_mla: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("prefill", "mla"))
    ap.add_argument("--row", default="prompt-8k", help="prefill: a bench_prefill.py row")
    ap.add_argument("--variants", default="", help="prefill: label:field=value,...;...")
    ap.add_argument("--fa3", help="prefill: fa3_peer.py beside its fa3.tar")
    ap.add_argument("--rows", default="ds-tp1-b64-c4k,ds-tp8-b64-c4k",
                    help="mla: comma list of pagedattn.bench.mla rows")
    ap.add_argument("--ours", default="default", help="mla: comma list of our variants")
    args = ap.parse_args(argv)
    bad = _unknown_rows(args)
    if bad:
        return _refuse(bad)
    if not torch.cuda.is_available():
        return _refuse("needs a CUDA GPU (run it under ncu --profile-from-start off)")
    runs = _prefill_runs(args) if args.what == "prefill" else _mla_runs(args)
    for _, fn in runs:  # compile, JIT, plan: outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in runs:
        print(f"profiling {label}", flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
