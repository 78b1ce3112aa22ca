"""Run ``auto`` and a measuring peer's kernel twice each on one shape, for Nsight Compute.

Meant to run under ``ncu`` with a kernel-name filter, so the profile holds our main kernel
and the peer's split kernel on the same batch, side by side::

    ncu --clock-control none --section SpeedOfLight --section LaunchStats \\
        --section Occupancy -k regex:'_paged_decode_kernel|_floor_split_kernel' --csv \\
        --page details python3 scripts/ncu_side_by_side.py --shape llama8b-b64-c2k \\
        --peer-file .peers/plain_floor.py

The peer file must expose ``floor_runner(query, key_cache, value_cache, block_tables,
context_lens, scale, **config)``; it runs with its default config.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

import pagedattn
from pagedattn.bench.shapes import build_batch, get_shape


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--peer-file", required=True)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location(Path(args.peer_file).stem, args.peer_file)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    shape = get_shape(args.shape)
    m = shape.model
    b = build_batch(shape, "cuda")
    plan = pagedattn.plan_decode(b.block_tables, b.context_lens, num_q_heads=m.num_q_heads,
                                 num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                 page_size=shape.page_size, q_dtype=shape.dtype,
                                 kv_dtype=shape.cache_dtype)
    for _ in range(2):
        plan.run(*b.tensors[:3], **b.scales)
    run = peer.floor_runner(*b.tensors, m.head_dim ** -0.5)
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
