"""Cases B01, B15, B19 and B20 of the first series of cases (public bug reports): a cache past
2^31 elements, many decode steps with growing lengths, CUDA-graph capture and replay, and
host-side hints.

B01 and the graph tests need a GPU (``gpu``-marked); B15 and B20 also run a small CPU
variant. Outputs are NaN-poisoned before every call.
"""

import math

import pytest
import torch
from _hardening import IMPLS, NAN, SPLIT_IMPLS, check, run, sizes

import pagedattn
from pagedattn.bench.timing import capture_graph
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

BF16 = torch.bfloat16

# -- B01: > 2^31 elements ---------------------------------------------------------------------

B01_PAGES, B01_HKV, B01_DIM = 150_000, 8, 128  # 150000·16·8·128 = 2.46e9 elements (4.9 GB bf16)


@pytest.fixture(scope="module", params=["NHD", "head_major"])
def big_cache(request):
    """K and V caches of 2.46e9 elements each. ``head_major`` is an NHD-shaped view of a
    ``[num_kv_heads, num_pages, page_size, head_dim]`` buffer, so kv head 7 starts 2.15e9
    elements in (the head offset overflows int32, not only the page offset)."""
    shape = (B01_PAGES, 16, B01_HKV, B01_DIM)
    if request.param == "NHD":
        k, v = (torch.empty(shape, dtype=BF16, device="cuda") for _ in range(2))
    else:
        k, v = (torch.empty(B01_HKV, B01_PAGES, 16, B01_DIM, dtype=BF16, device="cuda")
                .permute(1, 2, 0, 3) for _ in range(2))
    assert k.numel() > 2**31 and k.shape == shape
    yield k, v
    del k, v
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_B01_cache_over_2_31_elements(impl, big_cache):
    """A cache above 2^31 elements, the block table using the highest page ids (down to
    num_pages - 1): bitwise the output of a control with the same data at low page ids, and
    within tolerance of the oracle. No impl rejects it (they all compute page offsets in
    int64; the alternative would be a ValueError naming key_cache)."""
    key_cache, value_cache = big_cache
    lens = [33, 64]
    need = [math.ceil(n / 16) for n in lens]
    high = torch.arange(B01_PAGES - 1, B01_PAGES - 1 - 2 * sum(need), -2)  # every other id
    low = torch.arange(0, sum(need))
    g = torch.Generator().manual_seed(1)
    data_k = torch.randn(sum(need), 16, B01_HKV, B01_DIM, generator=g).to(BF16).cuda()
    data_v = torch.randn(sum(need), 16, B01_HKV, B01_DIM, generator=g).to(BF16).cuda()
    for ids in (high, low):
        key_cache[ids.cuda()] = data_k
        value_cache[ids.cuda()] = data_v
    query = torch.randn(2, 32, B01_DIM, generator=g).to(BF16).cuda()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def tables(ids):
        t = torch.full((2, max(need)), -1, dtype=torch.int32)
        t[0, : need[0]], t[1, : need[1]] = ids[: need[0]], ids[need[0]:]
        return t.cuda()

    hi_in = (query, key_cache, value_cache, tables(high), lens_t)
    lo_in = (query, key_cache, value_cache, tables(low), lens_t)
    out_hi, out_lo = run(impl, hi_in), run(impl, lo_in)
    torch.cuda.synchronize()
    assert torch.equal(out_hi, out_lo)
    check(out_lo, lo_in)


# -- B15: many decode steps ------------------------------------------------------------------

B15_SIZES = sizes(dict(batch=3, heads=(2, 1), dim=16, steps=40, start=(90, 127), every=4),
                  dict(batch=8, heads=(32, 8), dim=128, steps=500, start=(1, 4096), every=1))


@pytest.mark.parametrize("size", B15_SIZES)
def test_B15_decode_steps_with_automatic_splits(size, device):
    """torchtitan #3235: consecutive decode steps, bf16, page 16, each sequence growing by one
    token per step from a random start, a new page appended from a shuffled free list when
    one fills; ``auto`` with its automatic split count (re-planned every step on the device).
    No NaN in any step; each step matches the oracle and the num_splits=1 call. CPU: 40
    steps from starts in 90..127 (auto's minimum split chunk there is 128, so sequences cross
    a split boundary as they grow), compared with num_splits=1 every 4th step and at the
    crossings (the interpreter needs about 0.3 s a call)."""
    g = torch.Generator().manual_seed(15)
    batch, steps, (hq, hkv), dim = size["batch"], size["steps"], size["heads"], size["dim"]
    lens = torch.randint(size["start"][0], size["start"][1] + 1, (batch,), generator=g).tolist()
    max_pages = max(math.ceil((n + steps) / 16) for n in lens)
    num_pages = sum(math.ceil((n + steps) / 16) for n in lens) + 4
    free = torch.randperm(num_pages, generator=g).tolist()
    key_cache = torch.full((num_pages, 16, hkv, dim), NAN, dtype=BF16)
    value_cache = key_cache.clone()
    tables = torch.full((batch, max_pages), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(math.ceil(n / 16)):
            tables[b, j] = free.pop()
            filled = min(16, n - 16 * j)
            key_cache[tables[b, j], :filled] = torch.randn(filled, hkv, dim, generator=g).to(BF16)
            value_cache[tables[b, j], :filled] = torch.randn(filled, hkv, dim, generator=g).to(BF16)
    key_cache, value_cache, tables = key_cache.to(device), value_cache.to(device), tables.to(device)
    if size["cpu"]:  # the trigger: some sequence crosses a multiple of the 128-token chunk
        assert any((n - 1) // 128 != (n + steps - 1) // 128 for n in lens)
    for step in range(steps):
        for b in range(batch):  # append one token
            n = lens[b]
            if n % 16 == 0:
                tables[b, n // 16] = free.pop()
            page = int(tables[b, n // 16])
            key_cache[page, n % 16] = torch.randn(hkv, dim, generator=g).to(BF16).to(device)
            value_cache[page, n % 16] = torch.randn(hkv, dim, generator=g).to(BF16).to(device)
            lens[b] = n + 1
        query = torch.randn(batch, hq, dim, generator=g).to(BF16).to(device)
        inputs = (query, key_cache, value_cache, tables,
                  torch.tensor(lens, dtype=torch.int32, device=device))
        out = run("auto", inputs)
        assert not torch.isnan(out).any(), f"NaN at step {step}"
        check(out, inputs)
        if step % size["every"] == 0 or any(n % 128 in (0, 1) for n in lens):
            one = run("auto", inputs, num_splits=1)
            err = rel_l2_error(out, one)
            assert err <= tolerance_for(BF16), f"step {step}: {err:.3g} from num_splits=1"


# -- B19 / B20: CUDA graphs and host hints ----------------------------------------------------

B19_PARAMS = [(impl, None) for impl in IMPLS] + [(impl, 4) for impl in SPLIT_IMPLS]


@pytest.mark.gpu
@pytest.mark.parametrize(("impl", "num_splits"), B19_PARAMS)
def test_B19_graph_captured_short_replayed_long(impl, num_splits):
    """FastDeploy #3223: capture at ctx [16, 16, 16, 16] (B 4, Hq 32 / Hkv 8, D 128, page 16,
    bf16), then update ``context_lens`` and ``block_tables`` in place to [8192, 20, 4000, 1]
    and replay: equal to the eager call on the new inputs (bitwise: same kernels, same
    arguments, plans made on the device from the lengths), and to the oracle.

    The declared maximum length (the case's ``max_context_length``) is the block table's
    width: ``max_pages * page_size`` = 512 · 16 = 8192 here. ``auto`` sizes its workspace and
    grid from shapes only, never from lengths, so nothing captured depends on the capture-time
    lengths. Longer lengths are refused with a ValueError at an eager call (validate=True; on
    the CPU always); a replay runs no Python and cannot raise, so the kernels clamp lengths to
    the table's capacity and never read past it."""
    new_lens = [8192, 20, 4000, 1]
    max_pages = 512
    big = make_paged_inputs(new_lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            page_size=16, dtype=BF16, max_pages=max_pages, seed=19,
                            device="cuda")
    query, key_cache, value_cache, new_tables, new_ctx = big
    tables = new_tables.clone()
    tables[:, 1:] = -1  # capture time: one full page per sequence (row 3 borrows one of row 0:
    tables[3, 0] = new_tables[0, 1]  # its own first page holds one token, then NaN)
    ctx = torch.full_like(new_ctx, 16)
    out = torch.full_like(query, NAN)
    graph, _ = capture_graph(lambda: pagedattn.paged_decode(
        query, key_cache, value_cache, tables, ctx, impl=impl, num_splits=num_splits, out=out),
        warmup=1)
    graph.replay()
    check(out, (query, key_cache, value_cache, tables, ctx))

    tables.copy_(new_tables)
    ctx.copy_(new_ctx)
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    eager = run(impl, big, num_splits=num_splits)
    assert torch.equal(out, eager)
    check(out, big)

    over = new_ctx.clone()
    over[0] = max_pages * 16 + 1
    with pytest.raises(ValueError, match=r"context_lens.*row 0"):
        pagedattn.paged_decode(query, key_cache, value_cache, new_tables, over, impl=impl,
                               validate=True)


@pytest.mark.parametrize("validate", [None, True])
def test_B19_length_over_declared_maximum_raises(validate, device):
    """A length over ``max_pages * page_size`` is a ValueError naming context_lens (on the
    CPU with validate=None too; on CUDA with validate=True)."""
    if validate is None and device != "cpu":
        pytest.skip("validate=None skips value checks on CUDA (no host sync)")
    inputs = make_paged_inputs([16, 3], num_q_heads=4, num_kv_heads=2, max_pages=2,
                               device=device)
    over = torch.tensor([33, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"context_lens.*32.*row 0"):
        pagedattn.paged_decode(*inputs[:4], over, validate=validate)


@pytest.mark.parametrize("impl", IMPLS)
def test_B20_host_hints_do_not_change_results(impl, device):
    """B20, eager part: the same inputs under different host-side hints. The hints our API has
    are the block table's width (the declared maximum length; widened here with -1 columns)
    and num_splits. Documented bitwise behaviour:

    * every impl but ``split_kv_v4`` ignores the width: bitwise the same output;
    * ``split_kv_v4``'s default split count is capped by the width, so its output may change
      in the last bits (within tolerance); with a forced num_splits it is bitwise the same;
    * a different forced num_splits (split impls) stays within tolerance of the oracle."""
    inputs = make_paged_inputs([1, 17, 40, 0], num_q_heads=2, num_kv_heads=1, head_dim=32,
                               page_size=8, dtype=BF16, seed=20, device=device)
    wide = torch.full((4, 40), -1, dtype=torch.int32, device=device)
    wide[:, : inputs.block_tables.shape[1]] = inputs.block_tables
    wide_in = inputs._replace(block_tables=wide)
    narrow_out, wide_out = run(impl, inputs), run(impl, wide_in)
    check(wide_out, inputs)
    if impl == "split_kv_v4":
        assert rel_l2_error(wide_out, narrow_out) <= tolerance_for(BF16)
    else:
        assert torch.equal(wide_out, narrow_out)
    if impl in SPLIT_IMPLS:
        for num_splits in (2, 3):
            forced = run(impl, inputs, num_splits=num_splits)
            assert torch.equal(run(impl, wide_in, num_splits=num_splits), forced)
            check(forced, inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_B20_graph_replay_bitwise_equals_eager(impl):
    """B20, graph part: natural sizes (B 4, Hq 32 / Hkv 8, D 128, bf16, ragged lengths);
    a graph replay is bitwise the eager result, for the automatic and a forced split count."""
    inputs = make_paged_inputs([1, 700, 3000, 65], num_q_heads=32, num_kv_heads=8,
                               head_dim=128, page_size=16, dtype=BF16, seed=20, device="cuda")
    for num_splits in ([None, 3] if impl in SPLIT_IMPLS else [None]):
        out = torch.full_like(inputs.query, NAN)
        graph, _ = capture_graph(lambda ns=num_splits, out=out: pagedattn.paged_decode(
            *inputs, impl=impl, num_splits=ns, out=out), warmup=1)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(impl, inputs, num_splits=num_splits))
        check(out, inputs)
