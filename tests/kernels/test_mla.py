"""Absorbed multi-head latent attention (``pagedattn.mla_decode`` / ``plan_mla_decode``: the
MLA kernel) against the float64 MLA oracle.

Every case draws fresh random inputs with NaN in every unused cache slot and garbage in the
block tables' padding (``make_mla_inputs``) and a NaN-filled ``out``; the plan cases poison
the workspace's partials too. DeepSeek-V3's 512 + 64 dims at 16 and 128 heads (one and two
blocks of heads), small latents at odd head counts, page sizes 1 to 128, bf16/fp16/fp32 and
fp8 caches, 1-4 query tokens (causal), the MLA kernel's balanced parts (one to more parts
than tiles, sequences cut and merged), soft-cap and sinks, and bad arguments (the removed
``schedule`` and ``num_splits`` among them) named before any launch and any write.
"""

import dataclasses
import math
import re

import pytest
import torch
from _hardening import MBarrier, check_lse, run_sides
from _scripts import run_script

from pagedattn import mla_decode, mla_decode_reference, plan_mla_decode
from pagedattn.testing import make_mla_inputs, rel_l2_error, tolerance_for

RAGGED = [0, 1, 17, 70, 3]  # empty, one token, page boundaries, one longer sequence


def _scale(inputs):
    return 1.0 / math.sqrt(inputs.q_nope.shape[-1] / 4 + inputs.q_pe.shape[-1])


def _check(inputs, kv_scale=None, sinks=None, logits_soft_cap=None, plan=None, **kw):
    """``mla_decode`` (or ``plan.run``) into a NaN-filled ``out`` against the oracle: out
    within the cache dtype's tolerance, LSE within 1e-3 where finite and ``-inf`` exactly
    where the oracle's is."""
    out = torch.full_like(inputs.q_nope, float("nan"))
    scale = _scale(inputs)
    if plan is None:
        res = mla_decode(*inputs, scale=scale, kv_scale=kv_scale, out=out, return_lse=True,
                         sinks=sinks, logits_soft_cap=logits_soft_cap, **kw)
    else:
        res = plan.run(*inputs[:4], scale=scale, kv_scale=kv_scale, out=out, return_lse=True,
                       sinks=sinks)
    ref = mla_decode_reference(*inputs, scale=scale, kv_scale=kv_scale, sinks=sinks,
                               logits_soft_cap=logits_soft_cap)
    assert res.out is out
    err = rel_l2_error(out, ref.out)
    assert err <= tolerance_for(inputs.ckv_cache.dtype), err
    check_lse(res.lse, ref, rtol=1e-4, atol=1e-3)
    return res


@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_deepseek_v3_dims(device, num_q_heads):
    """512 latent + 64 rope dims, 64-token pages (FlashMLA's); 128 heads are two blocks of 64
    that each read every latent tile."""
    _check(make_mla_inputs(RAGGED, num_q_heads=num_q_heads, page_size=64, seed=num_q_heads,
                           device=device))


@pytest.mark.parametrize("num_q_heads, latent_dim, rope_dim", [
    (1, 32, 16), (3, 48, 8), (7, 64, 64), (12, 16, 1), (65, 32, 16), (4, 32, 0)])
def test_small_latents_and_head_counts(device, num_q_heads, latent_dim, rope_dim):
    """Latent and rope dims that are no power of two (masked lanes), head counts 1 to 65 (65:
    five blocks of 13 heads)."""
    _check(make_mla_inputs(RAGGED, num_q_heads=num_q_heads, latent_dim=latent_dim,
                           rope_dim=rope_dim, page_size=16, seed=latent_dim, device=device))


@pytest.mark.parametrize("page_size", [1, 16, 32, 64, 128])
def test_page_sizes(device, page_size):
    """SGLang's one-token pages to 128-token ones; tiles span pages."""
    _check(make_mla_inputs([5, 0, 129, 40], num_q_heads=8, latent_dim=64, rope_dim=16,
                           page_size=page_size, seed=page_size, device=device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float_dtypes(device, dtype):
    _check(make_mla_inputs(RAGGED, num_q_heads=8, latent_dim=64, rope_dim=16, page_size=16,
                           dtype=dtype, seed=3, device=device))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("kv_scale", [None, 0.75, "tensor"])
def test_fp8_latent_cache(device, fp8, kv_scale):
    """An fp8 latent and rope cache with one per-tensor scale (a float or a 0-d tensor, the
    graph-safe form), the query scaled per row into fp16's range by a power of two."""
    inputs = make_mla_inputs(RAGGED, num_q_heads=16, latent_dim=64, rope_dim=16,
                             page_size=16, cache_dtype=fp8, seed=4, device=device)
    if kv_scale == "tensor":
        kv_scale = torch.tensor(1.5, device=device)
    _check(inputs, kv_scale=kv_scale)


def test_fp8_query_range(device):
    """A bf16 query far outside fp16's range stays exact: its power-of-two row scale spans
    both parts (a large rope part, a small latent one)."""
    inputs = make_mla_inputs([9, 33], num_q_heads=4, latent_dim=32, rope_dim=16, page_size=8,
                             cache_dtype=torch.float8_e4m3fn, seed=5, device=device)
    q_nope = inputs.q_nope * 1e-3
    q_pe = inputs.q_pe * 3e5
    _check(inputs._replace(q_nope=q_nope, q_pe=q_pe), kv_scale=1e-4)


@pytest.mark.parametrize("q_len", [2, 3, 4])
def test_multi_token_queries_are_causal(device, q_len):
    """Token ``j`` sits at ``len - q_len + j`` and sees keys up to it; a sequence shorter than
    ``q_len`` has tokens that see nothing (out 0, LSE -inf)."""
    _check(make_mla_inputs([2, 0, 40, 17], num_q_heads=16, latent_dim=64, rope_dim=16,
                           page_size=16, q_len=q_len, seed=q_len, device=device))


def test_one_token_4d_query(device):
    inputs = make_mla_inputs([5, 30], num_q_heads=4, latent_dim=32, rope_dim=16, page_size=8,
                             q_len=1, seed=6, device=device)
    four = inputs._replace(q_nope=inputs.q_nope[:, None], q_pe=inputs.q_pe[:, None])
    res = _check(four)
    assert res.out.shape == (2, 1, 4, 32) and res.lse.shape == (2, 1, 4)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("num_programs", [1, 2, 5, 40])
def test_balanced_parts(device, q_len, num_programs):
    """The MLA kernel's parts: one part takes the whole batch; two and five cut the long
    sequence where a share ends (five do; two share 49 tiles of cost at 25 and do not),
    leaving partials that the merge combines; 40
    parts are more than the batch's tiles (most parts hold one tile or none). The plan's
    workspace is poisoned first: partials NaN, piece records garbage."""
    inputs = make_mla_inputs([0, 300, 7, 1, 45], num_q_heads=16, latent_dim=64, rope_dim=16,
                             page_size=16, q_len=q_len, seed=num_programs + q_len,
                             device=device)
    plan = plan_mla_decode(inputs.block_tables, inputs.context_lens, num_q_heads=16,
                           latent_dim=64, rope_dim=16, page_size=16, q_dtype=torch.bfloat16,
                           q_len=q_len, num_programs=num_programs)
    part_o, part_lse, pieces = plan._engine().workspace
    part_o.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    pieces.fill_(-3)
    _check(inputs, plan=plan)
    counts = pieces.view(-1, 2)[:, 1].cpu()
    assert counts[0] == 0  # the empty sequence: no piece
    if num_programs == 1:
        assert int(counts.max()) == 1  # nothing cut
    if num_programs >= 5:  # shares of at most 10 tiles: the long sequence (19 tiles) is cut
        assert counts[1] > 1
    assert int(counts.max()) <= num_programs


def test_soft_cap_and_sinks(device):
    inputs = make_mla_inputs(RAGGED, num_q_heads=8, latent_dim=64, rope_dim=16, page_size=16,
                             seed=7, device=device)
    sinks = torch.linspace(-2.0, 3.0, 8, device=device)
    res = _check(inputs, sinks=sinks, logits_soft_cap=0.5)
    assert torch.allclose(res.lse[0].cpu(), sinks.cpu())  # an empty sequence: the sink


def test_combined_cache_and_query_buffers(device):
    """One ``[pages, page_size, 576]`` cache and one ``[batch, heads, 576]`` query, split into
    strided views (FlashMLA's and SGLang's layout)."""
    inputs = make_mla_inputs(RAGGED, num_q_heads=16, page_size=64, combined=True, seed=8,
                             device=device)
    assert inputs.ckv_cache.stride(1) == 576 and not inputs.q_pe.is_contiguous()
    _check(inputs)


def test_plan_across_layers_and_steps(device):
    """One plan serves several layers and a next step whose lengths and pages are written in
    place (what a CUDA graph replays): the workspace poisoned before each run (the MLA
    kernel's partials and piece records)."""
    first = make_mla_inputs([3, 0, 90, 61], num_q_heads=32, latent_dim=64, rope_dim=16,
                            page_size=16, max_pages=8, seed=9, device=device)
    bt, cl = first.block_tables.clone(), first.context_lens.clone()
    plan = plan_mla_decode(bt, cl, num_q_heads=32, latent_dim=64, rope_dim=16, page_size=16,
                           q_dtype=torch.bfloat16)
    part_o, part_lse, pieces = plan._engine().workspace
    second = make_mla_inputs([77, 5, 0, 128], num_q_heads=32, latent_dim=64, rope_dim=16,
                             page_size=16, max_pages=8, seed=10, device=device)
    for step, inputs in enumerate((first, first, second)):
        if step == 2:
            bt.copy_(second.block_tables)
            cl.copy_(second.context_lens)
        layer = inputs._replace(ckv_cache=inputs.ckv_cache * (step + 1),
                                kpe_cache=inputs.kpe_cache - step,
                                block_tables=bt, context_lens=cl)
        part_o.fill_(float("nan"))
        part_lse.fill_(float("nan"))
        pieces.fill_(-7)  # every sequence's record is rewritten by the part that owns it
        _check(layer, plan=plan)
        assert int(pieces.min()) >= 0


def test_head_blocks_policy():
    """The heads are cut into the fewest blocks that divide them within the tile's rows."""
    from pagedattn.launch.policy_mla import mla_head_blocks

    assert [mla_head_blocks(h, 1, 64) for h in (1, 16, 64, 128, 96, 127)] == [1, 1, 1, 2, 2,
                                                                             127]
    assert mla_head_blocks(128, 4, 64) == 8 and mla_head_blocks(16, 4, 64) == 1


# --- bad arguments: named, before any launch and any write ---------------------------------

def _bad_cases(inputs, device):
    q_nope, q_pe, ckv, kpe, bt, cl = inputs
    good = dict(zip(("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables",
                     "context_lens"), inputs, strict=True))
    return [
        (dict(q_nope=q_nope.int()), TypeError, "q_nope"),
        (dict(q_nope=q_nope.float(), q_pe=q_pe.float()), TypeError, "ckv_cache"),
        (dict(q_nope=q_nope[0]), ValueError, "q_nope"),
        (dict(q_pe=q_pe[:, :2]), ValueError, "q_pe"),
        (dict(q_pe=q_pe[..., :8]), ValueError, "kpe_cache"),
        (dict(q_pe=q_pe.half()), TypeError, "q_pe"),
        (dict(ckv_cache=ckv.half()), TypeError, "ckv_cache"),
        (dict(ckv_cache=ckv[:, :, :16]), ValueError, "ckv_cache"),
        (dict(kpe_cache=kpe[:-1]), ValueError, "kpe_cache"),
        (dict(kpe_cache=kpe.to(torch.float8_e4m3fn)), TypeError, "kpe_cache"),
        (dict(q_nope=q_nope[..., :8], ckv_cache=ckv[..., :8]), ValueError, "latent_dim"),
        (dict(block_tables=bt.float()), TypeError, "block_tables"),
        (dict(block_tables=bt[:1]), ValueError, "block_tables"),
        (dict(context_lens=cl[:1]), ValueError, "context_lens"),
        (dict(context_lens=cl.clone().fill_(10**6)), ValueError, "context_lens"),
        (dict(block_tables=bt.clone().fill_(10**6)), ValueError, "block_tables"),
        (dict(scale=None), TypeError, "scale"),
        (dict(scale=math.nan), ValueError, "scale"),
        (dict(kv_scale=-1.0), ValueError, "kv_scale"),
        (dict(kv_scale=torch.ones(3, device=device)), ValueError, "kv_scale"),
        (dict(return_lse=1), TypeError, "return_lse"),
        (dict(num_programs=0), ValueError, "num_programs"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
        (dict(sinks=torch.zeros(3, device=device)), ValueError, "sinks"),
        (dict(sinks=torch.full((4,), math.nan, device=device)), ValueError, "sinks"),
        (dict(out=torch.full_like(q_nope, 7.0).float()), TypeError, "out"),
        (dict(out=q_pe), ValueError, "out"),
        (dict(q_nope=q_nope.cpu().to("meta")), ValueError, None),
        (dict(q_nope=q_nope * 1e37), ValueError, "q_nope"),
    ], good


def test_bad_arguments_are_named_before_any_launch(device, monkeypatch):
    from pagedattn.launch import mla

    inputs = make_mla_inputs([9, 20], num_q_heads=4, latent_dim=32, rope_dim=16, page_size=8,
                             seed=12, device=device)
    launches = []
    monkeypatch.setattr(mla.MLALauncher, "launch", lambda *a, **k: launches.append(1))
    cases, good = _bad_cases(inputs, device)
    for change, exc, name in cases:
        kw = {**good, "scale": 0.1, **change}
        out = kw.pop("out", None)
        if out is None:
            out = torch.full_like(inputs.q_nope, 7.0)
        before = out.clone() if out.device.type != "meta" else None
        args = [kw.pop(n) for n in ("q_nope", "q_pe", "ckv_cache", "kpe_cache",
                                    "block_tables", "context_lens")]
        with pytest.raises(exc) as info:
            mla_decode(*args, out=out, **kw)
        if name is not None:
            assert re.match(rf"{name}\b", str(info.value)), (change, str(info.value))
        if before is not None:
            assert torch.equal(out, before)
    assert not launches


def test_the_removed_keywords_are_refused(device, monkeypatch):
    """``schedule`` and ``num_splits`` (the split path's, removed: docs/perf-notes.md step 52)
    are no keywords of the plan or the one-shot call: a TypeError that names each, before any
    launch and any write; ``num_programs`` stays the MLA kernel's parts."""
    from pagedattn.launch import mla

    launches = []
    monkeypatch.setattr(mla.MLALauncher, "launch", lambda *a, **k: launches.append(1))
    inputs = make_mla_inputs([9, 20], num_q_heads=4, latent_dim=32, rope_dim=16, page_size=8,
                             seed=12, device=device)
    kw = dict(num_q_heads=4, latent_dim=32, rope_dim=16, page_size=8, q_dtype=torch.bfloat16)
    out = torch.full_like(inputs.q_nope, 7.0)
    for removed in (dict(schedule="split"), dict(schedule=None), dict(num_splits=2)):
        (name,) = removed
        with pytest.raises(TypeError, match=rf"keyword argument '{name}'"):
            plan_mla_decode(*inputs[4:], **removed, **kw)
        with pytest.raises(TypeError, match=rf"keyword argument '{name}'"):
            mla_decode(*inputs, scale=0.1, out=out, **removed)
    assert torch.equal(out, torch.full_like(out, 7.0)) and not launches
    plan_mla_decode(*inputs[4:], num_programs=3, **kw)  # the MLA kernel's parts: accepted


def test_plan_checks_its_arguments(device):
    inputs = make_mla_inputs([9], num_q_heads=4, latent_dim=32, rope_dim=16, page_size=8,
                             device=device)
    kw = dict(num_q_heads=4, latent_dim=32, rope_dim=16, page_size=8, q_dtype=torch.bfloat16)
    for change, exc, name in [(dict(latent_dim=1024), ValueError, "latent_dim"),
                              (dict(rope_dim=-1), ValueError, "rope_dim"),
                              (dict(q_len=65), ValueError, "q_len"),
                              (dict(kv_dtype=torch.float16), TypeError, "kv_dtype"),
                              (dict(num_q_heads=0), ValueError, "num_q_heads"),
                              (dict(page_size=0), ValueError, "page_size")]:
        with pytest.raises(exc, match=rf"^{name}\b"):
            plan_mla_decode(*inputs[4:], **{**kw, **change})
    plan = plan_mla_decode(*inputs[4:], **kw)
    with pytest.raises(ValueError, match="^ckv_cache"):  # the plan's page size
        plan.run(*inputs[:2], inputs.ckv_cache.view(-1, 4, 32), inputs.kpe_cache, scale=0.1)
    with pytest.raises(ValueError, match="^q_nope"):
        plan.run(inputs.q_nope[:, :2], *inputs[1:4], scale=0.1)


def test_mla_kernel_compiles_for_sm90():
    """The MLA kernel's cases of ``scripts/compile_sm90.py`` (``MLAK_CASES``: TP1 and TP8,
    fp8, two tokens with LSE, soft-cap and sinks, one-token pages) compile for sm_90 with
    wgmma, within an H200's 227 KB of shared memory a program; the merge kernel does not
    spill. (Its token loop's spills at 64-token tiles are recorded in docs/perf-notes.md,
    step 47, not bounded here until the GPU has chosen the tile.)"""
    cases = ("mlak-tp1-bf16", "mlak-tp8-bf16", "mlak-tp1-fp8", "mlak-tp1-q_len2-everything",
             "mlak-tp8-page1")
    run = run_script("compile_sm90.py", "--cases", ",".join(cases), interpret=False,
                     timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if " ok," in line]
    assert sorted({line.split(":")[0] for line in lines}) == sorted(cases)
    for line in lines:
        assert int(re.search(r"(\d+) bytes of shared memory", line).group(1)) <= 227 * 1024
        if "_mla_decode_kernel" in line:
            assert "wgmma" in line, line
        else:
            assert "_mla_merge_kernel" in line, line
            spilled = re.search(r"(\d+)/(\d+) bytes spilled", line)
            assert spilled is None or int(spilled.group(1)) == 0, line


def _ws_handoff(tiles: list[int]) -> list[tuple[int, int]]:
    """The warp-specialized Gluon MLA kernel's hand-offs (``_ws_producer``, ``_ws_consumer``)
    for one part whose sequences have ``tiles`` tiles each, as two coroutines over mbarriers
    (``_hardening.MBarrier``, as the prefill kernel's model): the consumer's reads
    ``(sequence, tile)`` in order, or ``[(-1, -1)]`` for a deadlock. A read checks that the
    stage holds that tile and the query buffer that sequence."""
    q_ready, q_empty = MBarrier(), MBarrier()
    ready, empty = [MBarrier(), MBarrier()], [MBarrier(), MBarrier()]
    stage, query, read = [None, None], [None], []

    def producer():
        g = nq = 0
        for b, n in enumerate(tiles):
            if n == 0:
                continue
            if nq > 0:
                yield q_empty, (nq + 1) % 2
            query[0] = b
            q_ready.completed += 1
            nq += 1
            for i in range(n):
                if g >= 2:
                    yield empty[g % 2], ((g // 2) + 1) % 2
                stage[g % 2] = (b, i)
                ready[g % 2].completed += 1
                g += 1

    def consumer():
        g = nq = 0
        for b, n in enumerate(tiles):
            if n == 0:
                continue
            yield q_ready, nq % 2
            for i in range(n):
                yield ready[g % 2], (g // 2) % 2
                assert stage[g % 2] == (b, i) and query[0] == b
                read.append((b, i))
                empty[g % 2].completed += 1
                g += 1
            q_empty.completed += 1
            nq += 1

    return read if run_sides(producer(), consumer()) else [(-1, -1)]


@pytest.mark.parametrize("tiles", [[], [0], [1], [3], [1, 1, 1], [2, 0, 5, 1], [0, 4, 0, 0, 2]])
def test_gluon_ws_handoff_never_deadlocks(tiles):
    """The warp-specialized MLA kernel's query and stage hand-offs, modelled step for step
    (the interpreter runs no Gluon; a GPU hangs rather than fails): every tile of every
    sequence is read once, in order, from a stage and a query buffer that hold it, and
    neither side waits forever; empty sequences take no hand-off."""
    want = [(b, i) for b, n in enumerate(tiles) for i in range(n)]
    assert _ws_handoff(tiles) == want


def test_gluon_ws_kernel_compiles_for_sm90():
    """The Gluon MLA kernel's warp-specialized form (``MLAKernelConfig.ws``: a producer
    warpgroup issues the copies) compiles for sm_90: TP1 bf16, two tokens with soft-cap, sinks
    and LSE, TP8 fp8, and its producer that never waits for its copies (``land``) at TP1 bf16
    and fp8; wgmma, within 227 KB of shared memory, nothing spilled in the
    consumers' tile loop (Triton 3.6's bound; another Triton's own where measured)."""
    from _scripts import sm90_bound

    cases = ("mlak-tp1-ws-gluon", "mlak-tp1-q_len2-everything-ws-gluon", "mlak-tp8-fp8-ws-gluon",
             "mlak-tp1-ws-land-gluon", "mlak-tp1-fp8-ws-land-gluon")
    run = run_script("compile_sm90.py", "--cases", ",".join(cases), interpret=False,
                     timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = {line.split(":")[0]: line for line in run.stdout.splitlines()
             if " ok," in line and "_mla_decode_gluon_ws_kernel" in line}
    assert set(lines) == set(cases)  # each case's main kernel (beside its schedule and merge)
    for case, line in lines.items():
        assert "wgmma" in line, line
        assert int(re.search(r"(\d+) bytes of shared memory", line).group(1)) <= 227 * 1024
        loop = re.search(r"(\d+) spill instructions in the token loop", line)
        assert loop is None or int(loop.group(1)) <= sm90_bound(case, "loop spills", 0), line


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                      torch.float32])
def test_policy_asks_for_the_warp_specialized_gluon_kernel(kv_dtype):
    """On a GPU the policy asks for the Gluon kernel in its warp-specialized form for 16-bit
    and fp8 latents (faster than the single partition on every bench_mla row: perf-notes step
    55), and for neither for fp32 (the reference path) or under the interpreter."""
    from pagedattn.launch.policy_mla import mla_kernel_config

    cfg = mla_kernel_config(num_heads=128, q_len=1, latent_dim=512, kv_dtype=kv_dtype,
                            num_sms=132, interpret=False)
    fast = kv_dtype != torch.float32
    assert (cfg.gluon, cfg.ws) == (fast, fast)
    cpu = mla_kernel_config(num_heads=128, q_len=1, latent_dim=512, kv_dtype=kv_dtype,
                            num_sms=132, interpret=True)
    assert not (cpu.gluon or cpu.ws)


def test_racecheck_probe_refuses_in_one_line():
    """scripts/racecheck_probe.py (one small launch for compute-sanitizer's racecheck) names
    its kernels in one line and exits 2 on an unknown one, or without a GPU."""
    run = run_script("racecheck_probe.py", "nope", interpret=True, timeout=120)
    assert run.returncode == 2 and run.stdout.count("\n") == 1, run.stdout + run.stderr
    assert run.stdout.startswith("usage: racecheck_probe.py mla|mla-ws|prefill-gluon|fa3")


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads, q_len, page_size, cache, ws", [
    (128, 1, 64, None, False), (16, 1, 64, None, False), (16, 3, 1, None, False),
    (128, 2, 16, None, False), (128, 1, 64, torch.float8_e4m3fn, False),
    (16, 2, 1, torch.float8_e5m2, False), (128, 1, 64, None, True), (16, 3, 1, None, True),
    (128, 2, 16, None, True), (16, 2, 1, torch.float8_e5m2, True),
    (128, 1, 64, torch.float8_e4m3fn, True), (128, 1, 64, None, "land"),
    (16, 3, 1, None, "land"), (128, 2, 16, None, "land"), (16, 2, 1, torch.float8_e5m2, "land"),
    (128, 1, 64, torch.float8_e4m3fn, "land")])
def test_gluon_path(num_q_heads, q_len, page_size, cache, ws):
    """The Gluon path (Hopper only: the interpreter runs no Gluon) against the oracle at
    DeepSeek's 512 + 64 dims: TP1 and TP8 heads, several query tokens, one-token pages, fp8
    latents (converted in shared memory) with a scale, with the workspace poisoned and a
    NaN-filled ``out``; soft-cap, sinks and LSE on one case; ``ws``: its warp-specialized
    form (a producer warpgroup); ``"land"``: that form with the producer that never waits for
    its copies (perf-notes step 60)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon path is for sm_90 (H100/H200)")
    inputs = make_mla_inputs([0, 1, 300, 4100, 65, 64], num_q_heads=num_q_heads,
                             page_size=page_size, q_len=q_len, seed=num_q_heads + q_len,
                             cache_dtype=cache, device="cuda")
    everything = q_len == 2 and cache is None
    plan = plan_mla_decode(inputs.block_tables, inputs.context_lens,
                           num_q_heads=num_q_heads, latent_dim=512, rope_dim=64,
                           page_size=page_size, q_dtype=torch.bfloat16, kv_dtype=cache,
                           q_len=q_len, logits_soft_cap=30.0 if everything else None)
    land = ws == "land"
    plan.kernel_config = dataclasses.replace(plan.policy_config(), gluon=True, ws=bool(ws),
                                             land=land)
    launcher = plan._engine()
    assert launcher.gluon and launcher.config.ws == bool(ws) and launcher.config.land == land
    part_o, part_lse, pieces = launcher.workspace
    part_o.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    pieces.fill_(-3)
    sinks = torch.linspace(-1.0, 2.0, num_q_heads, device="cuda") if everything else None
    _check(inputs, plan=plan, sinks=sinks, logits_soft_cap=30.0 if everything else None,
           kv_scale=None if cache is None else 0.7)
    assert "mla_schedule" in plan.last_compiled  # the Gluon path ran, not the fallback
