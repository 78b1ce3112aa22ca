"""The persistent schedule of ``impl="auto"`` (``schedule="persistent"``) against the float64
oracle, and its split of the work.

A fixed number of programs (``num_programs``) shares the step's K/V tiles equally across
sequence and kv-head boundaries; a (sequence, kv head) shared by several programs is merged
by the last to finish, in the same launch (``kernels/persistent.py``). Every case draws fresh
random inputs with NaN in every unused page, slot and table entry (``make_paged_inputs``) and
in the output; the plan tests also poison the workspace's partial slots. Program counts run
from 1 (one program walks the whole step) to more than the step's tiles (programs without a
share), so shares start and end inside sequences, at their boundaries and across empty ones.
"""

import dataclasses
import math

import pytest
import torch
from _hardening import head_values
from _scripts import compiled_sm90, sm90_bound

from pagedattn import paged_decode, paged_decode_reference, plan_decode
from pagedattn.serving import ops
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
#: lengths 0 and 1, page boundaries (4, 8), one long sequence among short ones
RAGGED = [0, 1, 4, 9, 0, 150, 8, 3]
PROGRAMS = [1, 2, 5, 13, 200]  # 200: more programs than the step has tiles


def _inputs(lens, device, dtype=torch.float32, seed=0, **kw):
    return make_paged_inputs(lens, dtype=dtype, seed=seed, device=device, **{**SHAPE, **kw})


def _check(inputs, query=None, num_programs=None, kv_layout="NHD", **kw):
    """One-shot ``schedule="persistent"`` (NaN-poisoned ``out``) against the oracle: out within
    the cache dtype's tolerance, LSE within 1e-3 where finite, ``-inf`` exactly where the
    oracle's is."""
    query = inputs.query if query is None else query
    out = torch.full_like(query, float("nan"))
    res = paged_decode(query, *inputs[1:], out=out, return_lse=True, schedule="persistent",
                       num_programs=num_programs, kv_layout=kv_layout, **kw)
    ref = paged_decode_reference(query, *inputs[1:], kv_layout=kv_layout, **kw)
    assert res.out is out
    err = rel_l2_error(out, ref.out)
    assert err <= tolerance_for(inputs.key_cache.dtype), err
    lse, ref_lse = res.lse.double().cpu(), ref.lse.cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)
    return res


@pytest.mark.parametrize("num_programs", [None, *PROGRAMS])
def test_ragged_batch_any_program_count(device, num_programs):
    _check(_inputs(RAGGED, device, seed=num_programs or 0), num_programs=num_programs)


@pytest.mark.parametrize("lens", [[0], [0, 0, 0], [1], [4], [5, 0], [0, 0, 33]])
def test_empty_and_one_tile_batches(device, lens):
    """Empty sequences hold no tile: each is written by program ``b % P`` (P = 3 and 1)."""
    for num_programs in (3, 1):
        _check(_inputs(lens, device), num_programs=num_programs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_caches(device, dtype):
    _check(_inputs(RAGGED, device, dtype=dtype, seed=3), num_programs=5)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("tensor_scales", [False, True])
def test_fp8_caches_with_scales(device, fp8, tensor_scales):
    inputs = _inputs(RAGGED, device, dtype=torch.bfloat16, cache_dtype=fp8, seed=4,
                     head_dim=32)
    if tensor_scales:  # per kv head
        k_scale = torch.tensor([0.5, 2.0], device=device)
        v_scale = torch.tensor([1.5, 0.25], device=device)
    else:
        k_scale, v_scale = 0.75, 1.25
    _check(inputs, num_programs=7, k_scale=k_scale, v_scale=v_scale)


def test_hnd_and_strided_caches(device):
    inputs = _inputs(RAGGED, device, seed=5, kv_layout="HND")
    _check(inputs, num_programs=6, kv_layout="HND")
    # a combined [num_pages, 2, page_size, kv_heads, head_dim] cache, K and V as views
    nhd = _inputs(RAGGED, device, seed=6)
    both = torch.stack([nhd.key_cache, nhd.value_cache], dim=1)
    _check(nhd._replace(key_cache=both[:, 0], value_cache=both[:, 1]), num_programs=4)


@pytest.mark.parametrize("page_size,lens", [(1, [0, 7, 1, 30]), (16, [40, 0, 17, 3]),
                                            (256, [300, 0, 257, 5])])
def test_page_sizes(device, page_size, lens):
    _check(_inputs(lens, device, seed=page_size, page_size=page_size), num_programs=5)


@pytest.mark.parametrize("head_dim", [16, 40, 96, 256])
def test_head_dims(device, head_dim):
    _check(_inputs([0, 9, 70, 2], device, seed=head_dim, head_dim=head_dim), num_programs=3)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(3, 3), (8, 1), (8, 2), (16, 4)])
def test_groups(device, num_q_heads, num_kv_heads):
    _check(_inputs(RAGGED, device, seed=num_q_heads, num_q_heads=num_q_heads,
                   num_kv_heads=num_kv_heads), num_programs=9)


def _heads(device, seed, low, high):
    return head_values(device, seed, low, high, SHAPE["num_q_heads"])


@pytest.mark.parametrize("kw", [dict(window_left=5), dict(window_left=0),
                                dict(logits_soft_cap=2.0), dict(sinks="sinks"),
                                dict(alibi_slopes="alibi")])
@pytest.mark.parametrize("num_programs", [2, 11])
def test_each_variant(device, kw, num_programs):
    kw = {k: (_heads(device, 7, -2.0, 2.0) if v == "sinks" else
              _heads(device, 8, 0.0, 0.5) if v == "alibi" else v) for k, v in kw.items()}
    inputs = _inputs(RAGGED, device, seed=num_programs)
    # soft-cap: logits well past the cap
    query = inputs.query * 8 if "logits_soft_cap" in kw else None
    _check(inputs, query, num_programs=num_programs, **kw)


@pytest.mark.parametrize("q_len", [2, 3])
@pytest.mark.parametrize("num_programs", [1, 4, 17])
def test_multi_token_queries_with_every_variant(device, q_len, num_programs):
    """Several query tokens (a token at a position below 0 sees no key: out 0, LSE the
    sink), with a window, soft-cap, sinks and ALiBi together."""
    inputs = _inputs([1, 0, 6, 45, 2], device, seed=q_len)
    g = torch.Generator().manual_seed(q_len + 10)
    query = torch.randn(5, q_len, SHAPE["num_q_heads"], SHAPE["head_dim"], generator=g)
    _check(inputs, query.to(device), num_programs=num_programs, window_left=7,
           logits_soft_cap=3.0, sinks=_heads(device, 9, -1.0, 1.0),
           alibi_slopes=_heads(device, 10, 0.0, 0.3))


def _tiles(n, block_n, window_left=-1, q_len=1):
    """A sequence's tiles as the kernel counts them (the visible keys' with a window)."""
    if window_left >= 0:
        first = max(n - q_len - window_left, 0) // block_n * block_n
        n -= first
    return -(-n // block_n)


def _schedule(seq_tiles, num_kv_heads, num_programs):
    """The persistent schedule, modelled on the host from its definition: the shares
    ``[⌊p·T/P'⌋, ⌊(p+1)·T/P'⌋)`` of the step's ``T`` tiles (sequence-major, then kv head),
    and each program's pieces ``(sequence, kv head, first tile, end tile)``."""
    total = num_kv_heads * sum(seq_tiles)
    programs = min(num_programs, total)
    shares = [(p * total // programs, (p + 1) * total // programs) for p in range(programs)]
    segments = [(b, h, n) for b, n in enumerate(seq_tiles) if n for h in range(num_kv_heads)]
    starts = [0]
    for _, _, n in segments:
        starts.append(starts[-1] + n)
    pieces = []
    for t0, t1 in shares:
        mine = []
        for (b, h, n), s in zip(segments, starts, strict=False):
            lo, hi = max(t0, s), min(t1, s + n)
            if lo < hi:
                mine.append((b, h, lo - s, hi - s, n))
        pieces.append(mine)
    return shares, pieces


@pytest.mark.parametrize("lens", [RAGGED, [513, 1, 1, 200, 0, 64], [7] * 9])
@pytest.mark.parametrize("num_programs", [3, 8, 41])
def test_shares_are_equal_within_a_tile_and_the_kernel_keeps_them(device, lens, num_programs):
    """No program's share exceeds the mean by a tile or more. The kernel's shares are these:
    after a run whose partial slots were NaN, exactly the slots of the modelled shares' partial
    pieces hold a partial (slot ``2p``: the share's first piece, ``2p + 1``: its last), every
    output matches the oracle, and every arrival counter is back at 0."""
    inputs = _inputs(lens, device, seed=num_programs)
    plan = plan_decode(inputs.block_tables, inputs.context_lens, q_dtype=torch.float32,
                       schedule="persistent", num_programs=num_programs, **SHAPE)
    launcher = plan._engine()
    block_n = launcher.config.block_n
    seq_tiles = [_tiles(n, block_n) for n in lens]
    shares, pieces = _schedule(seq_tiles, SHAPE["num_kv_heads"], num_programs)
    sizes = [t1 - t0 for t0, t1 in shares]
    mean = sum(sizes) / len(sizes)
    assert max(sizes) < mean + 1 and min(sizes) > mean - 1
    assert len(shares) == min(num_programs, sum(sizes))

    part_ml, part_acc, counters = launcher.workspace_parts(launcher.workspace)
    part_ml.fill_(float("nan"))
    part_acc.fill_(float("nan"))
    out = torch.full_like(inputs.query, float("nan"))
    plan.run(*inputs[:3], out=out)
    ref = paged_decode_reference(*inputs)
    assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float32)
    assert torch.equal(counters.cpu(), torch.zeros_like(counters.cpu()))

    rows = SHAPE["num_q_heads"] // SHAPE["num_kv_heads"]  # q_len x group rows a slot
    written = {s for s in range(2 * num_programs)
               if not torch.isnan(part_ml[s * rows * 2]).item()}
    expected = set()
    for p, mine in enumerate(pieces):
        for i, (_, _, lo, hi, n) in enumerate(mine):
            if (lo, hi) != (0, n):  # a partial piece: the share's first or last
                assert i in (0, len(mine) - 1)
                expected.add(2 * p + (i > 0))
    assert written == expected
    if max(seq_tiles) > mean:  # a segment longer than a share is shared: partials exist
        assert expected


def test_int64_tile_indices(device, monkeypatch):
    """A step whose tiles times programs may pass 2^31 (from shapes: a table of 2^26 tokens)
    indexes tiles in int64 (``TILES_I64``); forced on for a small batch, that path matches the
    oracle as the int32 one does."""
    from pagedattn.launch import policy

    big = policy.plan_launch(batch=8, max_pages=1 << 22, num_q_heads=32, num_kv_heads=8,
                             head_dim=128, page_size=16, kv_dtype=torch.bfloat16,
                             num_splits=None, config=None, ragged=False, q_len=1,
                             window_left=-1, batch_invariant=False, interpret=False, sms=132,
                             device_name=None, schedule="persistent")
    small = policy.plan_launch(batch=64, max_pages=512, num_q_heads=32, num_kv_heads=8,
                               head_dim=128, page_size=16, kv_dtype=torch.bfloat16,
                               num_splits=None, config=None, ragged=False, q_len=1,
                               window_left=-1, batch_invariant=False, interpret=False,
                               sms=132, device_name=None, schedule="persistent")
    assert big.tiles_i64 and not small.tiles_i64
    real = policy.plan_launch
    monkeypatch.setattr(policy, "plan_launch",
                        lambda **kw: dataclasses.replace(real(**kw), tiles_i64=True))
    inputs = _inputs(RAGGED, device, seed=50)
    plan = plan_decode(inputs.block_tables, inputs.context_lens, q_dtype=torch.float32,
                       schedule="persistent", num_programs=6, **SHAPE)
    assert plan._engine().flags.TILES_I64
    out = plan.run(*inputs[:3])
    assert rel_l2_error(out, paged_decode_reference(*inputs).out) <= tolerance_for(torch.float32)


def test_one_plan_across_layers_and_steps(device):
    """One persistent plan serves several layers (their own caches and queries) and a next
    step whose lengths and pages are written in place; the counters stay at 0."""
    first = _inputs([3, 0, 30, 61], device, seed=11, max_pages=20)
    bt, cl = first.block_tables.clone(), first.context_lens.clone()
    plan = plan_decode(bt, cl, q_dtype=torch.float32, schedule="persistent", num_programs=6,
                       **SHAPE)
    for layer in range(3):
        cache_k = first.key_cache * (layer + 1)
        cache_v = first.value_cache - layer
        out = plan.run(first.query, cache_k, cache_v, return_lse=True)
        ref = paged_decode_reference(first.query, cache_k, cache_v, *first[3:])
        assert rel_l2_error(out.out, ref.out) <= tolerance_for(torch.float32)
    second = _inputs([77, 5, 0, 12], device, seed=12, max_pages=20)
    bt.copy_(second.block_tables)
    cl.copy_(second.context_lens)
    res = plan.run(*second[:3], return_lse=True)
    ref = paged_decode_reference(*second)
    assert rel_l2_error(res.out, ref.out) <= tolerance_for(torch.float32)
    assert torch.isinf(res.lse[2]).all() and torch.isfinite(res.lse[[0, 1, 3]]).all()
    counters = plan._engine().workspace_parts(plan._engine().workspace)[2]
    assert int(counters.abs().sum()) == 0


def test_repeated_one_shot_calls_and_the_op(device):
    """The one-shot call's fast path (a template per static key, a fresh workspace with zeroed
    counters per call) and the custom op take the schedule."""
    for seed in range(3):
        inputs = _inputs(RAGGED, device, seed=20 + seed)
        _check(inputs, num_programs=3)
    inputs = _inputs(RAGGED, device, seed=30)
    out = ops.paged_decode(*inputs, schedule="persistent", num_programs=5)
    assert rel_l2_error(out, paged_decode_reference(*inputs).out) <= tolerance_for(torch.float32)


def test_split_and_persistent_agree(device):
    """Both schedules compute the same attention (each within the tolerance of the oracle,
    and of each other)."""
    inputs = _inputs(RAGGED, device, dtype=torch.float16, seed=40)
    split = paged_decode(*inputs, schedule="split")
    persistent = paged_decode(*inputs, schedule="persistent", num_programs=7)
    assert rel_l2_error(persistent, split) <= 2 * tolerance_for(torch.float16)
    assert not math.isnan(rel_l2_error(split, paged_decode_reference(*inputs).out))


BAD = [
    (dict(schedule="stream-k"), ValueError, "schedule"),
    (dict(schedule=1), TypeError, "schedule"),
    (dict(num_programs=4), ValueError, "num_programs"),
    (dict(schedule="persistent", num_programs=0), ValueError, "num_programs"),
    (dict(schedule="persistent", num_programs=2.0), TypeError, "num_programs"),
    (dict(schedule="persistent", num_programs=True), TypeError, "num_programs"),
    (dict(schedule="persistent", num_programs=1 << 17), ValueError, "num_programs"),
    (dict(schedule="persistent", num_splits=2), ValueError, "num_splits"),
    (dict(schedule="persistent", batch_invariant=True), ValueError, "batch_invariant"),
    (dict(schedule="split", impl="gqa_reuse_v3"), ValueError, "schedule"),
]


@pytest.mark.parametrize("kw,exc,name", BAD)
def test_bad_schedules_are_named_before_any_write(kw, exc, name):
    inputs = _inputs([5, 9], "cpu")
    out = torch.full_like(inputs.query, 7.0)
    with pytest.raises(exc, match=f"^{name}"):
        paged_decode(*inputs, out=out, **kw)
    assert (out == 7.0).all()  # nothing written
    plan_kw = {k: v for k, v in kw.items() if k != "impl"}
    if "impl" not in kw:
        with pytest.raises(exc, match=f"^{name}"):
            plan_decode(inputs.block_tables, inputs.context_lens, q_dtype=torch.float32,
                        **SHAPE, **plan_kw)


def test_persistent_kernels_compile_for_sm90():
    """The persistent cases compile for sm_90 without the interpreter (a subprocess), stay
    within the register cap of three resident 4-warp programs per SM (168; fp32 255, two per
    SM) and spill nothing inside the token loop (what spills, spills around it: once a piece,
    not once a tile; perf-notes step 40). Triton 3.6's bounds; another Triton's own
    measured counts where they differ (``_scripts.sm90_bound``)."""
    import re

    cases = ("persistent-bf16", "persistent-fp8", "persistent-fp32", "persistent-everything",
             "persistent-int64")
    lines = compiled_sm90(cases)
    assert set(lines) == set(cases)  # the main kernel alone: no merge kernel is launched
    for case, line in lines.items():
        regs = re.search(r"(\d+) registers", line)
        if regs is None:  # no ptxas bundled with this Triton: compiled, not measured
            continue
        cap = 255 if case == "persistent-fp32" else 168
        assert int(regs.group(1)) <= sm90_bound(case, "registers", cap), line
        loop = re.search(r"(\d+) spill instructions in the token loop", line)
        assert loop is None or int(loop.group(1)) <= sm90_bound(case, "loop spills", 0), line
