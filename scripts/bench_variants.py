"""Timings of the attention variants of ``impl="auto"`` (issue 11), with FlashInfer's same
variant in the same run where it has one.

Every row is one decode step of one layer through ``plan_decode`` + ``DecodePlan.run``: the
cold-L2 median (µs, eager: host path included) and the CUDA-graph replay median, checked
once against the float64 oracle first. FlashInfer (``BatchDecodeWithPagedKVCacheWrapper``,
tensor cores; ``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask for ``q_len > 1``)
is timed on the same batch when ``import flashinfer`` works and it takes the variant; a row
it cannot run says why. Usage (repo root, GPU machine)::

    PYTHONPATH=src python3 scripts/bench_variants.py [--rows NAME,...] [--json out.json]

``--dry-run`` (CPU, ``TRITON_INTERPRET=1``): every row on a tiny batch, oracle check only.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import pagedattn
from pagedattn.bench.peers import flashinfer_page_table
from pagedattn.bench.report import dump_rows
from pagedattn.bench.shapes import BenchBatch, build_batch, get_shape, make_shape
from pagedattn.testing import rel_l2_error, tolerance_for

#: name -> (shape, plan-time options, per-layer options ("sinks"/"alibi_slopes" drawn))
ROWS: dict[str, tuple[str, dict, tuple[str, ...]]] = {
    "plain-b1-c4k": ("llama8b-b1-c4k", {}, ()),
    "plain-b1-c32k": ("llama8b-b1-c32k", {}, ()),
    "window4096-b1-c32k": ("llama8b-b1-c32k", dict(window_left=4096), ()),
    "plain-b64-c2k": ("llama8b-b64-c2k", {}, ()),
    "window1024-b64-c2k": ("llama8b-b64-c2k", dict(window_left=1024), ()),
    "softcap50-b64-c2k": ("llama8b-b64-c2k", dict(logits_soft_cap=50.0), ()),
    "sinks-b64-c2k": ("llama8b-b64-c2k", {}, ("sinks",)),
    "alibi-b64-c2k": ("llama8b-b64-c2k", {}, ("alibi_slopes",)),
    "qlen4-b64-c2k": ("llama8b-b64-c2k", dict(q_len=4), ()),
    "invariant-b64-c2k": ("llama8b-b64-c2k", dict(batch_invariant=True), ()),
    "plain-azure": ("azure-conv-b64-llama8b", {}, ()),
    "window1024-azure": ("azure-conv-b64-llama8b", dict(window_left=1024), ()),
    "softcap50-azure": ("azure-conv-b64-llama8b", dict(logits_soft_cap=50.0), ()),
    "invariant-azure": ("azure-conv-b64-llama8b", dict(batch_invariant=True), ()),
    "invariant-b1-c32k": ("llama8b-b1-c32k", dict(batch_invariant=True), ()),
}


#: plain rows for tuning only (``--rows``; not in the default set): the benchmark's rows
#: where ``auto`` trails the plain floor
TUNE_ROWS: dict[str, tuple[str, dict, tuple[str, ...]]] = {
    f"plain-{s}": (s, {}, ()) for s in (
        "llama8b-b8-c8k", "llama8b-b256-c1k", "qwen7b-b64-c4k", "tp8-70b-b128-c8k",
        "hd256-b32-c4k", "hd64-smollm-b64-c2k", "mooncake-b16-llama8b",
        "fp8-llama8b-b64-c8k", "fp8-llama8b-b1-c32k")
} | {  # the work of a 1,024-token window (1,025 keys) without one: is the gap the window's?
    "plain-b64-c1025": ("llama8b-b64-c1025", {}, ()),
} | {  # windows on smaller batches and a wider window, for the unsplit rows below
    "window1024-b32-c2k": ("llama8b-b32-c2k", dict(window_left=1024), ()),
    "window1024-b16-c2k": ("llama8b-b16-c2k", dict(window_left=1024), ()),
    "window4096-b64-c8k": ("llama8b-b64-c8k", dict(window_left=4096), ()),
}
TUNE_ROWS |= {  # a window bounds every sequence's keys: one unit per sequence and kv head?
    f"{w}-nosplit": (shape, dict(kw, num_splits=1), ())
    for w, (shape, kw, _) in {**ROWS, **TUNE_ROWS}.items()
    if w in ("window1024-b64-c2k", "window1024-azure", "window1024-b32-c2k",
             "window1024-b16-c2k", "window4096-b64-c8k")
}
#: every row by name, the default set and the tuning rows
ALL_ROWS = {**ROWS, **TUNE_ROWS}

#: the rows' llama-3-8b batches that the benchmark's shape table does not hold (lengths)
_EXTRA_SHAPES = {"llama8b-b1-c4k": [4096], "llama8b-b64-c1025": [1025] * 64,
                 "llama8b-b32-c2k": [2048] * 32, "llama8b-b16-c2k": [2048] * 16}


def _shape(name: str, dry: bool):
    if dry:  # a tiny stand-in: the rows' options on an interpreter-sized batch
        return make_shape(name, "smollm2-135m", [37, 0, 150], dtype=torch.float32,
                          page_size=4)
    if name in _EXTRA_SHAPES:
        return make_shape(name, "llama-3-8b", _EXTRA_SHAPES[name])
    return get_shape(name)


def _inputs(shape, b: BenchBatch, plan_kw: dict, per_layer: tuple[str, ...], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    heads, dim = shape.model.num_q_heads, shape.model.head_dim
    q_len = plan_kw.get("q_len", 1)
    query = b.query if q_len == 1 else torch.randn(
        shape.batch, q_len, heads, dim, generator=g).to(b.query)
    layer = {"sinks": torch.randn(heads, generator=g),
             "alibi_slopes": torch.rand(heads, generator=g) * 0.1}
    return query, {k: layer[k].to(b.query.device) for k in per_layer}


def ours(shape, b: BenchBatch, query, plan_kw: dict, layer: dict, config: str = "default"):
    """``plan.run`` of the row; ``config``: ``"default"`` or overrides of the default
    :class:`~pagedattn.launch.policy.DecodeConfig` such as ``"maxnreg=128,num_stages=3"``
    (a tuning aid: the plan's launcher is rebuilt with that config)."""
    m = shape.model
    # planned with the host copy of the lengths, as `pagedattn bench` plans `auto` and as
    # FlashInfer's plan() takes its host index pointers (a ragged batch pipelines deeper)
    plan = pagedattn.plan_decode(b.block_tables, b.context_lens, num_q_heads=m.num_q_heads,
                                 num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                 page_size=shape.page_size, q_dtype=shape.dtype,
                                 kv_dtype=shape.cache_dtype,
                                 host_context_lens=list(shape.context_lens), **plan_kw)
    if config != "default":
        from dataclasses import replace

        from pagedattn.launch.decode import AutoLauncher

        base = plan._engine().config
        over = {k: int(v) for k, v in (kv.split("=") for kv in config.split(","))}
        plan._launchers[None] = AutoLauncher(plan.spec, config=replace(base, **over))
    out = torch.empty_like(query)
    return lambda: plan.run(query, b.key_cache, b.value_cache, out=out, **layer)


def flashinfer(shape, b: BenchBatch, query, plan_kw: dict, layer: dict):
    """FlashInfer's wrapper for the same variant, or a string saying why not."""
    try:
        import flashinfer as fi
    except Exception as e:  # noqa: BLE001 - absent or unusable: the row says so
        return f"import flashinfer failed ({type(e).__name__})"
    if plan_kw.get("batch_invariant") or "alibi_slopes" in layer:
        return "no such variant in its paged decode"
    m, ps, dev = shape.model, shape.page_size, query.device
    indptr, indices, last = flashinfer_page_table(b, ps)
    ws = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)
    q_len = plan_kw.get("q_len", 1)
    common = dict(window_left=plan_kw.get("window_left", -1),
                  logits_soft_cap=plan_kw.get("logits_soft_cap"), q_data_type=shape.dtype,
                  kv_data_type=shape.cache_dtype, sm_scale=m.head_dim**-0.5)
    run_kw = {"sinks": layer["sinks"]} if "sinks" in layer else {}
    try:
        if q_len == 1:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            w.plan(indptr, indices, last, m.num_q_heads, m.num_kv_heads, m.head_dim, ps,
                   **common)
            q = query
        else:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            qo = torch.arange(0, (shape.batch + 1) * q_len, q_len, dtype=torch.int32,
                              device=dev)
            w.plan(qo, indptr, indices, last, m.num_q_heads, m.num_kv_heads, m.head_dim, ps,
                   causal=True, **common)
            q = query.reshape(-1, m.num_q_heads, m.head_dim)
        w.run(q, (b.key_cache, b.value_cache), **run_kw)  # raises if it lacks the variant
    except Exception as e:  # noqa: BLE001 - an unsupported variant: the row says so
        return f"{type(e).__name__}: {str(e)[:80]}"
    return lambda: w.run(q, (b.key_cache, b.value_cache), **run_kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma list (default: all)")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--dry-run", action="store_true", help="CPU: oracle checks only")
    p.add_argument("--configs", default="default",
                   help="';'-separated DecodeConfig overrides to time beside each other, e.g. "
                        "'default;maxnreg=128' (tuning; eager medians only, no FlashInfer)")
    args = p.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run:
        from pagedattn.bench.timing import time_cold, time_graph
    results = []
    for name in args.rows.split(","):
        shape_name, plan_kw, per_layer = ALL_ROWS[name]
        shape = _shape(shape_name, args.dry_run)
        b = build_batch(shape, device)
        query, layer = _inputs(shape, b, plan_kw, per_layer)
        fn = ours(shape, b, query, plan_kw, layer)
        ref_kw = {k: v for k, v in plan_kw.items()
                  if k not in ("q_len", "batch_invariant", "num_splits")}
        ref = pagedattn.paged_decode_reference(query, *b.tensors[1:], **ref_kw, **layer)
        err = rel_l2_error(fn(), ref.out)
        row = dict(row=name, shape=shape.name, rel_l2=err,
                   ok=err <= tolerance_for(shape.cache_dtype))
        if args.configs != "default":  # tuning: each config's eager median, checked first
            for cfg in args.configs.split(";"):
                try:  # a config may not fit the GPU (shared memory): the row says so
                    cfn = ours(shape, b, query, plan_kw, layer, cfg)
                    cerr = rel_l2_error(cfn(), ref.out)
                except Exception as e:  # noqa: BLE001 - tuning: record it, time the rest
                    row[f"us[{cfg}]"] = f"{type(e).__name__}: {str(e)[:80]}"
                    continue
                row["ok"] = row["ok"] and cerr <= tolerance_for(shape.cache_dtype)
                row[f"rel_l2[{cfg}]"] = cerr
                row[f"us[{cfg}]"] = (time_cold(cfn, reps=args.reps).median_us
                                     if not args.dry_run else cerr)
            results.append(row)
            print(json.dumps(row), flush=True)
            continue
        if not args.dry_run:
            row.update(auto_us=time_cold(fn, reps=args.reps).median_us,
                       auto_graph_us=time_graph(fn, reps=args.reps).median_us)
            fi = flashinfer(shape, b, query, plan_kw, layer)
            if callable(fi):
                row["flashinfer_us"] = time_cold(fi, reps=args.reps).median_us
                try:  # the wrapper is planned without its CUDA-graph buffers
                    row["flashinfer_graph_us"] = time_graph(fi, reps=args.reps).median_us
                except Exception as e:  # noqa: BLE001 - the row says why
                    row["flashinfer_graph"] = f"{type(e).__name__}: {str(e)[:80]}"
            else:
                row["flashinfer"] = fi
        results.append(row)
        print(json.dumps(row), flush=True)
    dump_rows(results, args.json)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
