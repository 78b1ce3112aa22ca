"""The FlashAttention drop-in (``pagedattn.compat.flash_attn_with_kvcache``) per call beside
FA3's own ``flash_attn_with_kvcache``, eager, in three calling patterns, in one process.

Patterns (what an engine hands the call each decode step):

* ``same``: the same query, ``page_table`` and ``cache_seqlens`` tensors every call;
* ``views``: fresh views of them every call (``q[:]``, ``table[:, :]``, ``lens[:]``);
* ``fresh``: tensors built every call: the lengths converted from an int64 copy and the table
  cloned (a dtype conversion and a copy per call, as an engine that rebuilds its metadata).

Rows: ``llama8b-b8-c8k``, ``azure-conv-b64-llama8b`` and ``llama8b-b1-c32k`` (the harness's
shapes; eager µs per call on a cold L2 after a read-only flush,
:func:`pagedattn.bench.timing.time_cold`, median of ``--reps``), and ``host-b8-c300`` (eight
300-token fp16 sequences: host µs per call, back-to-back calls, :func:`timing.host_us`).
Both sides run ``causal=True`` with the same scale; every output is checked against FA3's
(rel. L2) and, on the CPU, against the float64 oracle.

    PYTHONPATH=src python3 scripts/fa_dropin_per_call.py --fa3 .peers/fa3_peer.py [--json F]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/fa_dropin_per_call.py --dry-run   # CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

import pagedattn
from pagedattn.bench.report import dump_rows, format_row
from pagedattn.bench.shapes import build_batch, get_shape, make_shape
from pagedattn.compat import flash_attn_with_kvcache
from pagedattn.testing import rel_l2_error, tolerance_for

ROWS = ("llama8b-b8-c8k", "azure-conv-b64-llama8b", "llama8b-b1-c32k", "host-b8-c300")
PATTERNS = ("same", "views", "fresh")


def _shape(name: str, dry: bool):
    if name == "host-b8-c300":
        shape = make_shape(name, "llama-3-8b", [300] * 8, dtype=torch.float16)
    else:
        shape = get_shape(name)
    if dry:
        from pagedattn.bench.shapes import shrink  # noqa: PLC0415 (CPU only)
        shape = shrink(shape)
    return shape


def callers(fa, batch, scale: float) -> dict[str, object]:
    """``{pattern: zero-argument call}`` of ``fa`` (a ``flash_attn_with_kvcache``) on ``batch``."""
    q = batch.query.unsqueeze(1)  # [batch, 1, heads, dim]
    k, v = batch.key_cache, batch.value_cache
    table = batch.block_tables.to(torch.int32)
    lens = batch.context_lens.to(torch.int32)
    lens64 = lens.to(torch.int64)
    kw = dict(softmax_scale=scale, causal=True)
    return {
        "same": lambda: fa(q, k, v, cache_seqlens=lens, page_table=table, **kw),
        "views": lambda: fa(q[:], k, v, cache_seqlens=lens[:], page_table=table[:, :], **kw),
        "fresh": lambda: fa(q, k, v, cache_seqlens=lens64.to(torch.int32),
                            page_table=table.clone(), **kw),
    }


def load_fa3(path: str):
    """FA3's ``flash_attn_with_kvcache``, unpacked by the peers' ``fa3_peer.py`` loader."""
    spec = importlib.util.spec_from_file_location("fa3_peer", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer._load()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls of a host row")
    ap.add_argument("--fa3", help="fa3_peer.py beside its fa3.tar")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: interpreter-sized rows, checked against the oracle, untimed")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    names = args.rows.split(",")
    if any(n not in ROWS for n in names):
        print(f"fa_dropin_per_call: --rows: unknown row in {args.rows!r}", file=sys.stderr)
        return 2
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("fa_dropin_per_call: needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    sides = {"pagedattn": flash_attn_with_kvcache}
    if args.fa3 and not dry:
        sides["fa3"] = load_fa3(args.fa3)
    if not dry:
        from pagedattn.bench import timing  # noqa: PLC0415 (CUDA only)
    results, failures = [], 0
    for name in names:
        shape = _shape(name, dry)
        batch = build_batch(shape, "cpu" if dry else "cuda", poison=True)
        scale = shape.model.head_dim ** -0.5
        ref = None
        if dry:
            ref = pagedattn.paged_decode_reference(*batch.tensors, scale=scale).out
        for pattern in PATTERNS:
            res = {"row": name, "pattern": pattern}
            outs = {}
            for side, fa in sides.items():
                fn = callers(fa, batch, scale)[pattern]
                outs[side] = fn().squeeze(1)
                if not dry:
                    if name.startswith("host-"):
                        res[side + " host us"] = timing.host_us(fn, calls=args.calls)
                    else:
                        res[side + " us"] = timing.time_cold(fn, reps=args.reps).median_us
            if ref is not None:
                res["err"] = rel_l2_error(outs["pagedattn"], ref)
                if not res["err"] <= tolerance_for(batch.query.dtype):
                    failures += 1
            if "fa3" in outs:
                res["vs fa3"] = rel_l2_error(outs["pagedattn"], outs["fa3"])
                if not res["vs fa3"] <= tolerance_for(batch.query.dtype):
                    failures += 1
            key = "us" if not name.startswith("host-") else "host us"
            if f"fa3 {key}" in res:
                res["ours / fa3"] = res[f"pagedattn {key}"] / res[f"fa3 {key}"]
            print(format_row(res), flush=True)
            results.append(res)
    dump_rows(results, args.json)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
