"""Run ``auto`` and a peer's kernel twice each on one batch, for Nsight Compute.

Meant to run under ``ncu`` with a kernel-name filter, so the profile holds our kernels and the
peer's on the same batch, side by side. Two forms:

* ``--shape NAME --peer-file [NAME=]PATH[:FUNC] ...``: a benchmark shape, ``auto`` beside one
  or more measuring peer files in ``pagedattn bench --peer-file``'s form (the plain floor's
  ``floor_runner`` with its default config, FA3's ``make_runner``), in the order given::

    ncu --clock-control none --section SpeedOfLight --section LaunchStats \\
        --section Occupancy -k regex:'paged_decode|merge|_floor_|device_kernel' --csv \\
        --page details python3 scripts/ncu_side_by_side.py --shape llama8b-b64-c2k \\
        --peer-file .peers/plain_floor.py:floor_runner --peer-file fa3=.peers/fa3_peer.py

  (FA3's kernels are CUTLASS ``device_kernel`` instances.)

  ``--peer NAME`` adds a built-in peer of ``pagedattn bench --peers`` (FlashInfer's TC
  decode is ``flashinfer-tc``: its kernels match ``Prefill|Decode``).

* ``--row NAME``: a row of ``scripts/bench_variants.py`` (a variant such as a sliding window),
  ``auto`` beside FlashInfer's same variant (when ``import flashinfer`` works)::

    ncu ... -k regex:'paged_decode|merge|Merge|Prefill|Decode' --csv --page details \\
        python3 scripts/ncu_side_by_side.py --row window1024-b64-c2k
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import pagedattn
from pagedattn.bench.shapes import build_batch, get_shape

sys.path.insert(0, str(Path(__file__).parent))
import bench_variants as bv  # noqa: E402  (a sibling script: its rows and runners)


def _shape_runs(shape_name: str, peer_files: list[str], peers: list[str] = ()) -> list:
    """``plan.run`` of ``auto``, each peer file's runner, then each built-in peer's
    (``pagedattn bench --peers`` names: ``flashinfer-tc``, ``flashinfer-xqa``, ...) on a
    benchmark shape."""
    from pagedattn.bench.peers import PEERS, load_peer_file

    shape = get_shape(shape_name)
    m = shape.model
    b = build_batch(shape, "cuda")
    plan = pagedattn.plan_decode(b.block_tables, b.context_lens, num_q_heads=m.num_q_heads,
                                 num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                 page_size=shape.page_size, q_dtype=shape.dtype,
                                 kv_dtype=shape.cache_dtype,
                                 host_context_lens=list(shape.context_lens))
    # planned with the host copy of the lengths, as `pagedattn bench` plans `auto`
    return [lambda: plan.run(*b.tensors[:3], **b.scales)] + [
        load_peer_file(p).factory(shape, b) for p in peer_files] + [
        PEERS[p](shape, b) for p in peers]


def _row_runs(row: str) -> list:
    """``auto`` and FlashInfer (if it runs the variant) on a variant row."""
    shape_name, plan_kw, per_layer = bv.ALL_ROWS[row]
    shape = bv._shape(shape_name, False)
    b = build_batch(shape, "cuda")
    query, layer = bv._inputs(shape, b, plan_kw, per_layer)
    fi = bv.flashinfer(shape, b, query, plan_kw, layer)
    if not callable(fi):
        print("flashinfer:", fi)
    return [bv.ours(shape, b, query, plan_kw, layer)] + ([fi] if callable(fi) else [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", help="a benchmark shape (with --peer-file)")
    ap.add_argument("--peer-file", action="append", default=[],
                    help="[NAME=]PATH[:FUNC] of a measuring peer (with --shape; repeatable)")
    ap.add_argument("--peer", action="append", default=[],
                    help="a built-in peer of `pagedattn bench --peers` (with --shape; "
                         "repeatable), e.g. flashinfer-tc")
    ap.add_argument("--row", choices=sorted(bv.ALL_ROWS),
                    help="a variant row, beside FlashInfer")
    args = ap.parse_args()
    from pagedattn.bench.peers import PEERS  # noqa: PLC0415

    if (args.row is None) == (args.shape is None) or (args.shape is None) != (
            not (args.peer_file or args.peer)):
        ap.error("give either --shape and --peer-file or --peer, or --row")
    unknown = [p for p in args.peer if p not in PEERS]
    if unknown:
        ap.error(f"--peer: unknown {unknown[0]!r} (one of {', '.join(PEERS)})")
    runs = _row_runs(args.row) if args.row else _shape_runs(args.shape, args.peer_file,
                                                            args.peer)
    for run in runs:
        for _ in range(2):
            run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
