"""Small driver for compute-sanitizer (memcheck, racecheck, initcheck): every kernel of the
library on boundary shapes.

    PYTHONPATH=src python3 scripts/sanitize_driver.py            # warm Triton's cache first
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=src \
        compute-sanitizer --tool memcheck python3 scripts/sanitize_driver.py
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/sanitize_driver.py --cpu-smoke
    PYTHONPATH=src compute-sanitizer --tool memcheck python3 scripts/sanitize_driver.py \
        --graphs-only      # graph capture needs the caching allocator: its own pass
    PYTHONPATH=src compute-sanitizer --tool racecheck python3 scripts/sanitize_driver.py \
        --new-kernels      # the prefill and MLA kernels only (racecheck is slow)

What runs: every impl through the public API on each shape; the prefill kernel and a mixed
step (decodes through the decode plan); the Gluon prefill kernel, forced on (opt-in; sm_90);
``mla_decode``; metadata past the tables with the
value checks off (each run must clamp, stay in bounds and report); ``split_kv_v4`` and ``auto`` with
forced splits (so the merge kernels run: ``auto``'s per-head merge on small batches, its
per-group merge on the ``b17-hkv8`` shape, whose batch x kv heads fills the H200's 132 SMs);
``auto`` with the LSE, fp8 with per-kv-head scales and an HND view of a combined KV buffer;
``append_kv`` (bf16 and fp8 caches, NHD and HND, padding slots); and CUDA-graph replay of
``auto`` (forced splits, LSE) and ``split_kv_v4`` at new lengths (a pass of its own, with
PyTorch's caching allocator on: capture forbids ``cudaMalloc``); and ``auto``'s variant
specializations (window, soft-cap, sinks, ALiBi, multi-token queries, batch invariance);
and a plan's folded merge (arrival counters in its workspace), run twice and replayed twice
from a graph. The last line lists the
kernels launched (from the launchers' compile records).

Shapes (tiny, so the sanitizer finishes in a minute or two; all but the last fit ``auto``'s
smallest chunk, so it runs them as one unit per sequence, ``ONE_UNIT``, and the last one with
splits planned on the device): page_size 1, 5 and 16; context
lengths 0, 1 and a last page holding one token; every page of the cache used, so the
highest page id (num_pages - 1) is read; GQA group 7; head_dim 80; table padding of -1 and
out-of-range ids; forced and automatic split counts; for ``auto`` also fp8 with per-head
scales, HND, a combined KV buffer and the LSE. With ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``
each tensor is its own allocation, so a read one element past the cache is a memcheck error
rather than a read inside PyTorch's pool.

Each call is checked against the float64 oracle; the exit status is the number of failures.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

DEVICE = "cuda"

# (name, context_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype)
SHAPES = [
    ("page1-group7-hd80", [1, 2, 7], 7, 1, 80, 1, torch.float16),
    ("page16-onetoken-tail-group7", [0, 1, 17, 33], 14, 2, 80, 16, torch.bfloat16),
    ("page5-hd128-fp32", [0, 4, 11, 6], 4, 2, 128, 5, torch.float32),
    # batch 17 x 8 kv heads = 136 >= 132 SMs: auto merges per (sequence, kv head)
    ("b17-hkv8-per-group-merge", [(7 * i) % 40 for i in range(17)], 16, 8, 64, 16,
     torch.bfloat16),
    # a table of more than the smallest chunk (256 tokens): auto plans its splits on the device
    # (the shapes above hold at most 256 tokens, so auto runs them as one unit per sequence)
    ("ragged-auto-splits", [0, 300, 5, 700], 8, 2, 64, 16, torch.bfloat16),
]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _report(name, what, kw, ok, err) -> int:
    print(f"{name:32s} {what:14s} {kw!s:24s} rel_l2={err:.2e} {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


def _append_kv_runs() -> int:
    """append_kv into bf16 and fp8 (per-head scales) caches, NHD and HND, with padding slots
    (-1): each written row equals torch's own cast; unwritten slots keep their NaN."""
    from pagedattn import append_kv

    failures = 0
    g = torch.Generator().manual_seed(3)
    key = torch.randn(9, 2, 80, generator=g).to(torch.bfloat16).to(DEVICE)
    value = torch.randn(9, 2, 80, generator=g).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([0, 5, -1, 15, 16, 31, -1, 47, 8], device=DEVICE)
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for layout in ("NHD", "HND"):
            shape = (3, 16, 2, 80) if layout == "NHD" else (3, 2, 16, 80)
            kc = torch.full(shape, float("nan"), device=DEVICE).to(cache_dtype)
            vc = kc.clone()
            fp8 = cache_dtype != torch.bfloat16
            ks = torch.tensor([0.5, 2.0], device=DEVICE) if fp8 else None
            vs = torch.tensor([0.25, 1.0], device=DEVICE) if fp8 else None
            append_kv(key, value, kc, vc, slots, kv_layout=layout, k_scale=ks, v_scale=vs)
            _sync()
            nk, nv = (kc, vc) if layout == "NHD" else (kc.transpose(1, 2), vc.transpose(1, 2))
            ok = True
            for t, slot in enumerate(slots.tolist()):
                if slot < 0:
                    continue
                for cache, src, sc in ((nk, key, ks), (nv, value, vs)):
                    want = src[t].float() / (sc[:, None] if fp8 else 1.0)
                    got = cache[slot // 16, slot % 16].float()
                    ok &= bool(torch.equal(got, want.to(cache_dtype).float()))
            written = torch.zeros(3 * 16, dtype=torch.bool)
            written[[s for s in slots.tolist() if s >= 0]] = True
            ok &= bool(nk.float().isnan().reshape(48, -1)[~written.to(DEVICE)].all())
            failures += _report("append_kv", str(cache_dtype).removeprefix("torch."),
                                {"kv_layout": layout}, ok, 0.0)
    LAUNCHED.add("append_kv")
    return failures


def _graph_runs() -> int:
    """CUDA-graph capture at short lengths, replay at long ones, for auto (forced splits,
    LSE) and split_kv_v4."""
    from pagedattn.bench.timing import capture_graph

    failures = 0
    long_lens = torch.tensor([100, 1, 128], dtype=torch.int32)
    short_lens = torch.tensor([16, 3, 40], dtype=torch.int32)
    # the table holds the replay's lengths; capture runs at shorter ones
    inputs = make_paged_inputs(long_lens.tolist(), num_q_heads=8, num_kv_heads=2,
                               head_dim=128, page_size=16, dtype=torch.bfloat16, seed=5,
                               device=DEVICE)
    inputs.context_lens.copy_(short_lens)
    for impl, kw in (("auto", {"num_splits": 3, "return_lse": True}),
                     ("split_kv_v4", {"num_splits": 4})):
        out = torch.full_like(inputs.query, float("nan"))
        graph, result = capture_graph(
            lambda impl=impl, kw=kw, out=out: pagedattn.paged_decode(*inputs, impl=impl,
                                                                     out=out, **kw))
        inputs.context_lens.copy_(long_lens)
        out.fill_(float("nan"))
        graph.replay()
        _sync()
        ref = paged_decode_reference(*inputs)
        err = rel_l2_error(out, ref.out)
        ok = err <= tolerance_for(torch.bfloat16)
        if kw.get("return_lse"):
            ok &= bool(torch.allclose(result.lse.double().cpu(), ref.lse.cpu(), rtol=1e-3,
                                      atol=1e-3))
        failures += _report("graph replay", impl, kw, ok, err)
        inputs.context_lens.copy_(short_lens)
        del graph
    return failures


def _variant_runs() -> int:
    """``auto``'s variant specializations (each flag compiles its own binary): window,
    soft-cap, sinks, ALiBi, multi-token queries (alone and with window + sinks) and batch
    invariance, on a ragged batch with an empty sequence, forced splits and the LSE (so the
    merge kernels run with the sink)."""
    failures = 0
    inputs = make_paged_inputs([0, 37, 5, 130], num_q_heads=8, num_kv_heads=2, head_dim=64,
                               page_size=16, dtype=torch.bfloat16, seed=9, device=DEVICE)
    g = torch.Generator().manual_seed(9)
    sinks = torch.randn(8, generator=g).to(DEVICE)
    slopes = (torch.rand(8, generator=g) * 0.2).to(DEVICE)
    multi = torch.randn(4, 3, 8, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    runs = [({"window_left": 20}, None), ({"logits_soft_cap": 5.0}, None),
            ({"sinks": sinks}, None), ({"alibi_slopes": slopes}, None), ({}, multi),
            ({"window_left": 9, "sinks": sinks}, multi), ({"batch_invariant": True}, None)]
    for kw, query in runs:
        for splits in (None, 3):
            x = inputs if query is None else inputs._replace(query=query)
            ref_kw = {k: v for k, v in kw.items() if k != "batch_invariant"}
            ok, err = _run("auto", x, ref_kw=ref_kw, num_splits=splits, return_lse=True, **kw)
            label = {k: "[H] tensor" if isinstance(v, torch.Tensor) else v
                     for k, v in kw.items()}
            failures += _report("variants", "auto", {**label, "q_len": 1 if query is None
                                                     else 3, "num_splits": splits}, ok, err)
    return failures


def _plan_runs(graph: bool = False) -> int:
    """A plan's folded merge (``FOLD_MERGE``: the last unit of each (sequence, kv head) to
    arrive merges the pair's split rows through an arrival counter in the plan's workspace),
    in both of its plans: 17 sequences x 8 kv heads fill the H200's 132 SMs (a per-group
    merge), 3 x 8 do not (a per-head merge's plan, folded because each sequence holds three
    forced split rows; its 304-token table splits); forced splits, empty sequences, sinks
    and the LSE; run twice (the counters must be back at 0 after each run), or (``graph``)
    captured at short lengths and replayed twice at long ones. A plan that is not folded on
    the GPU fails (it would not test the fold)."""
    failures = 0
    for lens in ([0 if i % 5 == 2 else 9 + 23 * i for i in range(17)], [300, 170, 0]):
        failures += _plan_run(lens, graph)
    return failures


def _plan_run(lens: list[int], graph: bool) -> int:
    from pagedattn.bench.timing import capture_graph

    batch = len(lens)
    inputs = make_paged_inputs(lens, num_q_heads=16, num_kv_heads=8, head_dim=64,
                               page_size=16, dtype=torch.bfloat16, seed=13, device=DEVICE)
    sinks = torch.linspace(-1.0, 1.0, 16, device=DEVICE)
    plan = pagedattn.plan_decode(inputs.block_tables, inputs.context_lens, num_q_heads=16,
                                 num_kv_heads=8, head_dim=64, page_size=16,
                                 q_dtype=torch.bfloat16, num_splits=3)
    engine = plan._engine()
    folded = engine.fold_merge if DEVICE == "cuda" else True

    def step():
        return plan.run(*inputs[:3], sinks=sinks, return_lse=True)

    failures = 0
    if graph:
        lens_long = inputs.context_lens.clone()
        inputs.context_lens.copy_(lens_long.clamp(max=16))
        g, (out, lse) = capture_graph(step)
        inputs.context_lens.copy_(lens_long)
        results = []
        for _ in range(2):
            out.fill_(float("nan"))
            g.replay()
            _sync()
            results.append((out.clone(), lse.clone()))
        del g
    else:
        results = [step() for _ in range(2)]
        _sync()
    ref = paged_decode_reference(*inputs, sinks=sinks)
    counters_zero = bool((engine.seq_rows == 0).all()) if folded else True
    for i, (out, lse) in enumerate(results):
        err = rel_l2_error(out, ref.out)
        ok = err <= tolerance_for(torch.bfloat16) and counters_zero and folded
        ok &= bool(torch.allclose(lse.double().cpu(), ref.lse.cpu(), rtol=1e-3, atol=1e-3))
        failures += _report("plan folded merge",
                            "graph replay" if graph else "run",
                            {"batch": batch, "run": i, "folded": folded}, ok, err)
    return failures


def _prefill_runs() -> int:
    """The prefill kernel and a mixed step (decodes first, ``num_decodes``): bf16, fp8 e4m3
    with per-head scales, fp16 HND over a combined buffer; a window, every variant; pages of
    1 and 16; the LSE; padding rows past ``query_start_loc[-1]`` (never written)."""
    failures = 0
    seq_lens, q_lens = [31, 9, 0, 70, 5], [1, 1, 0, 40, 5]
    sinks = torch.linspace(-1.0, 1.0, 8, device=DEVICE)
    slopes = torch.linspace(0.0, 0.3, 8, device=DEVICE)
    for dtype, cache, layout, page, kw in (
            (torch.bfloat16, None, "NHD", 16, {}),
            (torch.bfloat16, torch.float8_e4m3fn, "NHD", 16, {}),
            (torch.float16, None, "HND", 1, {"window_left": 6}),
            (torch.bfloat16, None, "NHD", 16, {"window_left": 20, "logits_soft_cap": 5.0,
                                               "sinks": sinks, "alibi_slopes": slopes})):
        inputs = make_paged_inputs(seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                   page_size=page, dtype=dtype, cache_dtype=cache,
                                   kv_layout=layout, seed=page, device=DEVICE)
        n = sum(q_lens)
        g = torch.Generator().manual_seed(n)
        query = torch.randn(n + 3, 8, 64, generator=g).to(dtype).to(DEVICE)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                           device=DEVICE)
        scales = {}
        if cache is not None:
            scales = dict(k_scale=torch.tensor([0.5, 1.5], device=DEVICE), v_scale=1.25)
        for nd in (0, 2):
            out = torch.full_like(query, float("nan"))
            res = pagedattn.paged_attention(query, *inputs[1:], qsl, kv_layout=layout, out=out,
                                            return_lse=True, num_decodes=nd, **scales, **kw)
            _sync()
            ref = pagedattn.paged_attention_reference(query, *inputs[1:], qsl,
                                                      kv_layout=layout, **scales, **kw)
            err = rel_l2_error(out[:n], ref.out[:n])
            ok = err <= tolerance_for(cache or dtype) and bool(torch.isnan(out[n:]).all())
            want = ref.lse[:n].cpu()  # the oracle's tensors are on the inputs' device
            finite = torch.isfinite(want)
            ok &= bool(torch.allclose(res.lse[:n].double().cpu()[finite], want[finite],
                                      atol=1e-3, rtol=1e-3))
            label = {k: "[H] tensor" if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            failures += _report("prefill", f"{str(cache or dtype)[6:]} {layout}",
                                {**label, "page": page, "num_decodes": nd}, ok, err)
    LAUNCHED.add("paged_prefill")
    return failures


def _gluon_prefill_runs() -> int:
    """The Gluon prefill kernel (opt-in: forced through the policy; sm_90 only, else the
    plain kernel runs and the check says which): bf16 NHD pages of 16 on 128-key tiles, fp16
    HND pages of 1 on 64-key tiles three deep, bf16 with the consumer warpgroups as two
    partitions (``split``), fp16 with them in turns (``ping_pong``), head dim 64, the LSE, a
    chunk over a cached prefix, an empty sequence and padding rows; then a length past the
    table (reported)."""
    from policy_patch import patched_config  # noqa: PLC0415 (scripts/: the script's path)

    failures = 0
    seq_lens, q_lens = [200, 0, 150, 9], [130, 0, 150, 9]
    for dtype, layout, page, tiles in ((torch.bfloat16, "NHD", 16, (128, 2, False, False)),
                                       (torch.float16, "HND", 1, (64, 3, False, False)),
                                       (torch.bfloat16, "NHD", 16, (64, 3, True, False)),
                                       (torch.float16, "NHD", 16, (64, 3, True, True))):
        with patched_config(dict(gluon=True, block_n=tiles[0], num_stages=tiles[1],
                                 split=tiles[2], ping_pong=tiles[3])):
            inputs = make_paged_inputs(seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                       page_size=page, dtype=dtype, kv_layout=layout,
                                       seed=page, device=DEVICE)
            n = sum(q_lens)
            g = torch.Generator().manual_seed(n)
            query = torch.randn(n + 3, 8, 64, generator=g).to(dtype).to(DEVICE)
            qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                               dtype=torch.int32, device=DEVICE)
            plan = pagedattn.plan_attention(inputs.block_tables, inputs.context_lens, qsl,
                                            num_q_heads=8, num_kv_heads=2, head_dim=64,
                                            page_size=page, q_dtype=dtype, kv_layout=layout)
            out = torch.full_like(query, float("nan"))
            res = plan.run(query, *inputs[1:3], out=out, return_lse=True)
            _sync()
            path = "gluon" if plan._engine(query.shape[0]).gluon else "plain"
        ref = pagedattn.paged_attention_reference(query, *inputs[1:], qsl, kv_layout=layout)
        err = rel_l2_error(out[:n], ref.out[:n])
        ok = err <= tolerance_for(dtype) and bool(torch.isnan(out[n:]).all())
        want = ref.lse[:n].cpu()
        finite = torch.isfinite(want)
        ok &= bool(torch.allclose(res.lse[:n].double().cpu()[finite], want[finite],
                                  atol=1e-3, rtol=1e-3))
        failures += _report("prefill gluon", f"{str(dtype)[6:]} {layout}",
                            {"page": page, "tiles": tiles, "path": path}, ok, err)
        inputs.context_lens[0] = 1_000_000  # past the table: clamped, reported
        plan.run(query, *inputs[1:3], out=out, validate=False)
        _sync()
        try:
            pagedattn.check_errors(DEVICE)
            ok, why = False, "not reported"
        except ValueError as e:
            ok, why = str(e).startswith("seq_lens[0]"), str(e)[:60]
        failures += _report("prefill gluon", "seq_lens", why, ok, 0.0)
    LAUNCHED.add("paged_prefill_gluon")
    return failures


def _mla_runs() -> int:
    """``mla_decode`` at DeepSeek's dims (512 + 64), 16 and 128 heads, bf16 and fp8, pages of
    64 and 1, empty and one-token sequences (on sm_90 the policy's Gluon kernel, warp-specialized);
    the last two again on its single-partition form (through the plan's ``kernel_config``)."""
    import dataclasses

    from pagedattn.testing import make_mla_inputs

    failures = 0
    for heads, cache, page, single in ((16, None, 64, False), (128, None, 64, False),
                                       (16, torch.float8_e4m3fn, 1, False),
                                       (128, None, 64, True), (16, torch.float8_e4m3fn, 1, True),
                                       (128, None, 64, "land"),
                                       (16, torch.float8_e4m3fn, 1, "land")):
        inputs = make_mla_inputs([0, 1, 90, 130], num_q_heads=heads, page_size=page,
                                 dtype=torch.bfloat16, cache_dtype=cache, device=DEVICE)
        kv_scale = 0.5 if cache is not None else None
        out = torch.full_like(inputs.q_nope, float("nan"))
        plan = pagedattn.plan_mla_decode(
            inputs.block_tables, inputs.context_lens, num_q_heads=heads, latent_dim=512,
            rope_dim=64, page_size=page, q_dtype=torch.bfloat16, kv_dtype=cache)
        if single:  # True: the single partition; "land": step 60's producer (both opt-in)
            plan.kernel_config = dataclasses.replace(plan.policy_config(),
                                                     ws=single == "land", land=single == "land")
        res = plan.run(*inputs[:4], scale=0.07, kv_scale=kv_scale, out=out, return_lse=True)
        _sync()
        ref = pagedattn.mla_decode_reference(*inputs, scale=0.07, kv_scale=kv_scale)
        err = rel_l2_error(out, ref.out)
        ok = err <= tolerance_for(cache or torch.bfloat16)
        want = ref.lse.cpu()  # the oracle's tensors are on the inputs' device
        finite = torch.isfinite(want)
        ok &= bool(torch.allclose(res.lse.double().cpu()[finite], want[finite], atol=1e-3,
                                  rtol=1e-3))
        failures += _report("mla", f"{heads} heads", {"fp8": cache is not None, "page": page,
                                                      "single": single}, ok, err)
    LAUNCHED.add("mla_decode")
    return failures


def _bad_metadata_runs() -> int:
    """Metadata past the tables with the value checks off (as ``validate=None`` on a GPU):
    lengths past the block table and negative, page ids outside the cache in used entries (the
    decode kernel reads page 0 for them without a report),
    ``query_start_loc`` decreasing and past the rows, ``seq_lens`` shorter than the new
    tokens, an append slot at the cache's capacity. The kernels clamp (memcheck: no access
    outside a tensor) and report; each run must raise its report at ``check_errors``."""
    failures = 0
    inputs = make_paged_inputs([9, 40, 3], num_q_heads=8, num_kv_heads=2, head_dim=64,
                               page_size=16, dtype=torch.bfloat16, seed=5, device=DEVICE)
    pages = inputs.key_cache.shape[0]
    lens = inputs.context_lens.clone()
    tables = inputs.block_tables.clone()
    g = torch.Generator().manual_seed(5)
    query = torch.randn(20, 8, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    qsl = torch.tensor([0, 5, 12, 15], dtype=torch.int32, device=DEVICE)

    def expect(name, fn):
        nonlocal failures
        try:
            fn()
            _sync()
            pagedattn.check_errors(DEVICE)
            ok, why = False, "not reported"
        except ValueError as e:
            ok, why = str(e).startswith(name), str(e)[:60]
        failures += _report("bad metadata", name, why, ok, 0.0)

    lens[1] = 100_000
    expect("context_lens", lambda: pagedattn.paged_decode(*inputs[:4], lens, validate=False))
    lens[1] = -4
    expect("context_lens", lambda: pagedattn.mla_decode(
        inputs.query, inputs.query[..., :8], inputs.key_cache[:, :, 0],
        inputs.value_cache[:, :, 0, :8], tables, lens, scale=0.1, validate=False))
    bad_tables = tables.clone()
    bad_tables[1, 1] = pages + 1000
    bad_tables[2, 0] = -9
    # the decode kernel clamps page ids without a report (memcheck: no access outside)
    pagedattn.paged_decode(*inputs[:3], bad_tables, inputs.context_lens, validate=False)
    _sync()
    pagedattn.check_errors(DEVICE)
    expect("block_tables", lambda: pagedattn.paged_attention(
        query, *inputs[1:3], bad_tables, inputs.context_lens, qsl, validate=False))
    seq = inputs.context_lens.clone()
    seq[2] = 2  # 3 new tokens in a sequence of 2
    expect("seq_lens", lambda: pagedattn.paged_attention(query, *inputs[1:4], seq, qsl,
                                                          validate=False))
    seq[0] = 50_000
    expect("seq_lens", lambda: pagedattn.paged_attention(query, *inputs[1:4], seq, qsl,
                                                          validate=False))
    for wrong in ([0, 15, 3, 15], [0, 5, 12, 4_000], [7, 5, 12, 15]):
        loc = torch.tensor(wrong, dtype=torch.int32, device=DEVICE)
        expect("query_start_loc", lambda loc=loc: pagedattn.paged_attention(
            query, *inputs[1:4], inputs.context_lens, loc, validate=False))
    key = torch.randn(2, 2, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    kc, vc = inputs.key_cache.clone(), inputs.value_cache.clone()
    slots = torch.tensor([pages * 16, 3], device=DEVICE)
    expect("slot_mapping", lambda: pagedattn.append_kv(key, key, kc, vc, slots,
                                                       validate=False))
    return failures


#: names of the kernels the runs launched (the summary's last line)
LAUNCHED: set[str] = set()


def _run(impl, inputs, ref_kw=None, **kw):
    if kw.get("batch_invariant") and kw.get("num_splits"):  # a fixed split size instead
        kw = {k: v for k, v in kw.items() if k != "num_splits"}
    out = torch.full_like(inputs[0], float("nan"))
    result, kernels = pagedattn.compiled_kernels(*inputs, impl=impl, out=out, **kw)
    LAUNCHED.update(kernels)
    _sync()
    ref = paged_decode_reference(*inputs, **(ref_kw or {}))
    err = rel_l2_error(out, ref.out)
    tol = tolerance_for(inputs[1].dtype)
    ok = err <= tol
    if kw.get("return_lse"):
        lse, want = result.lse.double().cpu(), ref.lse.cpu()
        finite = torch.isfinite(want)
        ok &= bool(torch.isneginf(lse[~finite]).all())
        ok &= bool(torch.allclose(lse[finite], want[finite], rtol=1e-3, atol=1e-3))
    return ok, err


def _decode_runs() -> int:
    """Every impl on each of ``SHAPES`` (the interpreter's smoke: the first): forced and
    automatic splits, the LSE, a repeat from the recorded plan; ``auto`` with fp8 per-kv-head
    scales and an HND view of a combined KV buffer."""
    failures = 0
    for name, lens, hq, hkv, dim, page_size, dtype in SHAPES[:1] if DEVICE == "cpu" else SHAPES:
        inputs = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                                   page_size=page_size, dtype=dtype, extra_pages=0,
                                   max_pages=max(-(-n // page_size) for n in lens) + 2,
                                   seed=len(lens), device=DEVICE)
        num_pages = inputs.key_cache.shape[0]
        assert int(inputs.block_tables.max()) >= num_pages  # out-of-range padding present
        used = inputs.block_tables[inputs.block_tables < num_pages]
        assert int(used.max()) == num_pages - 1  # the highest page id is read
        runs = [(impl, {}) for impl in pagedattn.IMPLS]
        runs += [("split_kv_v4", {"num_splits": 4}), ("auto", {"num_splits": 3}),
                 ("auto", {"return_lse": True}),
                 ("auto", {})]  # a repeat: launched from the recorded plan, not by Triton
        for impl, kw in runs:
            ok, err = _run(impl, inputs, **kw)
            failures += _report(name, impl, kw, ok, err)

        k_scale = torch.linspace(0.2, 0.6, hkv, device=DEVICE)
        v_scale = torch.linspace(0.5, 1.5, hkv, device=DEVICE)
        q, k, v = inputs[:3]
        k8 = (k.float() / k_scale[None, None, :, None]).to(torch.float8_e4m3fn)
        v8 = (v.float() / v_scale[None, None, :, None]).to(torch.float8_e4m3fn)
        fp8 = (q, k8, v8, *inputs[3:])
        ok, err = _run("auto", fp8, ref_kw=dict(k_scale=k_scale, v_scale=v_scale),
                       k_scale=k_scale, v_scale=v_scale, return_lse=True)
        failures += _report(name, "auto fp8", "per-head scales", ok, err)
        kv = torch.stack([k, v], dim=1).transpose(2, 3).contiguous()  # [P, 2, H, page, D]
        hnd = (q, kv[:, 0], kv[:, 1], *inputs[3:])
        ok, err = _run("auto", hnd, ref_kw=dict(kv_layout="HND"), kv_layout="HND")
        failures += _report(name, "auto HND", "combined KV", ok, err)
    return failures


def _graph_sections() -> int:
    return _graph_runs() + _plan_runs(graph=True)


# the driver's parts, in the order a whole run takes them (``--only`` picks some: the
# sanitizers' passes run parts side by side in separate processes)
SECTIONS = {"decode": _decode_runs, "append": _append_kv_runs, "variants": _variant_runs,
            "prefill": _prefill_runs, "gluon": _gluon_prefill_runs, "mla": _mla_runs,
            "bad": _bad_metadata_runs,
            "plans": _plan_runs, "graphs": _graph_sections}


def main(argv: list[str]) -> int:
    global DEVICE
    cpu_smoke = "--cpu-smoke" in argv
    if cpu_smoke:  # the interpreter: a check of the driver itself, one shape, no graphs
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu-smoke with TRITON_INTERPRET=1)")
        return 1
    only = list(SECTIONS)
    if "--only" in argv:
        pos = argv.index("--only") + 1
        only = argv[pos].split(",") if pos < len(argv) else []
        if not only or not set(only) <= set(SECTIONS):
            print(f"--only: a comma-separated list of {','.join(SECTIONS)}")
            return 2
    if "--new-kernels" in argv:  # racecheck's pass: the kernels with shared-memory hand-offs
        only = ["prefill", "gluon", "mla", "bad"]
    # CUDA graphs need PyTorch's caching allocator (capture forbids cudaMalloc): with it
    # off (one allocation per tensor, for memcheck) the graph runs are a separate pass
    if "--graphs-only" in argv:
        only = ["graphs"]
    if cpu_smoke:  # DeepSeek's dims and 136-program launches: too slow for the interpreter
        only = [name for name in only if name not in ("mla", "plans", "graphs")]
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1" and "graphs" in only:
        print("graph runs skipped (PYTORCH_NO_CUDA_MEMORY_CACHING=1): run --graphs-only")
        only.remove("graphs")
    failures = 0
    t0 = time.time()
    for name in only:
        failures += SECTIONS[name]()
    print(f"sections: {','.join(only)}")
    print(f"kernels launched: {', '.join(sorted(LAUNCHED))}")
    print(f"{failures} failure(s), {time.time() - t0:.1f} s")
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
