"""Paged attention over varlen queries (``paged_attention``, ``plan_attention``: paged
prefill, chunks over a cached prefix, mixed batches) against the float64 oracle.

Every case draws fresh random inputs with NaN in every unused page, slot and table entry
(``make_paged_inputs``), and NaN in ``out`` (its padding rows past ``query_start_loc[-1]``
must stay NaN: engines pad their batches). Each sequence's new tokens are the last
``q_len`` of its ``seq_lens`` (their K/V appended first), token ``j`` at position
``seq_len - q_len + j``, attending causally.
"""

import pytest
import torch
from _hardening import MBarrier, check_lse, head_values, run_sides
from _scripts import assert_unknown_row_exits_2, compiled_sm90, run_script, sm90_bound

from pagedattn import (
    paged_attention,
    paged_attention_reference,
    paged_decode,
    plan_attention,
)
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
PAD = 3  # query rows past the last sequence's (padding)


def _batch(seq_lens, q_lens, device, dtype=torch.float32, seed=0, **kw):
    """Inputs, a ``[num_tokens + PAD, heads, head_dim]`` query and ``query_start_loc``."""
    shape = {**SHAPE, **kw}
    inputs = make_paged_inputs(seq_lens, dtype=dtype, seed=seed, device=device, **shape)
    g = torch.Generator().manual_seed(seed + 1)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens + PAD, shape["num_q_heads"], shape["head_dim"],
                        generator=g).to(dtype).to(device)
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.long).cumsum(0).tolist()],
                       dtype=torch.int32, device=device)
    return inputs, query, qsl


def _check(inputs, query, qsl, kv_layout="NHD", **kw):
    """NaN-poisoned ``out``: valid rows within the cache dtype's tolerance of the oracle,
    LSE within 1e-3 where finite (``-inf`` exactly where the oracle's is), padding rows
    untouched (NaN)."""
    out = torch.full_like(query, float("nan"))
    res = paged_attention(query, *inputs[1:], qsl, out=out, return_lse=True,
                          kv_layout=kv_layout, **kw)
    ref = paged_attention_reference(query, *inputs[1:], qsl, kv_layout=kv_layout, **kw)
    n = int(qsl[-1])
    assert res.out is out
    err = rel_l2_error(out[:n], ref.out[:n])
    assert err <= tolerance_for(inputs.key_cache.dtype), err
    assert torch.isnan(out[n:]).all()
    check_lse(res.lse[:n], ref.lse[:n], rtol=1e-4, atol=1e-3)
    return res


@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 5, 9, 13])
def test_pure_prefill_and_chunks_over_a_cached_prefix(device, q_len):
    """``seq_lens == q_len`` (a whole prompt) and ``seq_lens >> q_len`` (a chunk after a
    cached prefix), from one token to several tiles of new tokens."""
    _check(*_batch([q_len, 40 + q_len], [q_len, q_len], device, seed=q_len))


def test_mixed_batch_of_decodes_chunks_and_empty_sequences(device):
    seq_lens = [30, 1, 0, 17, 9, 61, 5]
    q_lens = [1, 1, 0, 17, 0, 7, 2]
    _check(*_batch(seq_lens, q_lens, device, seed=1))


@pytest.mark.parametrize("page_size,seq_lens", [(1, [9, 8]), (16, [40, 19]), (64, [90, 7]),
                                                (128, [100, 128])])  # 128: a whole sequence
def test_page_sizes(device, page_size, seq_lens):
    _check(*_batch(seq_lens, [6, 7], device, seed=page_size, page_size=page_size))


def test_hnd_strided_and_vllm_page_caches(device):
    inputs, query, qsl = _batch([33, 8, 20], [5, 8, 1], device, seed=2, kv_layout="HND")
    _check(inputs, query, qsl, kv_layout="HND")
    # vLLM's page: each (page, kv head) holds a K tile, then a V tile
    nhd, query, qsl = _batch([33, 8, 20], [5, 8, 1], device, seed=3)
    k_hnd, v_hnd = nhd.key_cache.transpose(1, 2), nhd.value_cache.transpose(1, 2)
    paged = torch.stack([k_hnd, v_hnd], dim=2)  # [pages, kv heads, 2, page, head_dim]
    _check(nhd._replace(key_cache=paged[:, :, 0], value_cache=paged[:, :, 1]), query, qsl,
           kv_layout="HND")


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 1), (8, 2), (8, 1), (6, 2),
                                                    (7, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_groups_and_head_dims(device, num_q_heads, num_kv_heads, head_dim):
    _check(*_batch([21, 6], [6, 3], device, seed=head_dim + num_q_heads,
                   num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_caches(device, dtype):
    _check(*_batch([25, 12, 3], [9, 12, 1], device, dtype=dtype, seed=4))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_caches_with_scales(device, fp8):
    inputs, query, qsl = _batch([25, 12, 3], [9, 12, 1], device, dtype=torch.bfloat16,
                                seed=5, cache_dtype=fp8, head_dim=32)
    _check(inputs, query, qsl, k_scale=torch.tensor([0.5, 2.0], device=device), v_scale=1.5)


@pytest.mark.parametrize("scale", [-0.4, 0.0, 2.5])
def test_any_softmax_scale(device, scale):
    """The unmasked loop takes a row's max before the scale where the scale is >= 0
    (``SCALE_NONNEG``): a negative scale, zero and a large one against the oracle, over
    cached prefixes long enough for unmasked tiles on every machine."""
    inputs, query, qsl = _batch([300, 160, 9], [21, 1, 9], device, seed=12)
    _check(inputs, query, qsl, scale=scale)


def _heads(device, seed, low, high):
    return head_values(device, seed, low, high, SHAPE["num_q_heads"])


@pytest.mark.parametrize("kw", [dict(window_left=3), dict(window_left=0),
                                dict(logits_soft_cap=2.0), dict(sinks="sinks"),
                                dict(alibi_slopes="alibi")])
def test_variants(device, kw):
    kw = {k: (_heads(device, 6, -2.0, 2.0) if v == "sinks" else
              _heads(device, 7, 0.0, 0.5) if v == "alibi" else v) for k, v in kw.items()}
    inputs, query, qsl = _batch([30, 1, 17, 9], [11, 1, 17, 3], device, seed=8)
    _check(inputs, query * 8 if "logits_soft_cap" in kw else query, qsl, **kw)


def test_every_variant_at_once(device):
    inputs, query, qsl = _batch([30, 1, 17, 9], [11, 1, 17, 3], device, seed=9)
    _check(inputs, query, qsl, window_left=6, logits_soft_cap=4.0,
           sinks=_heads(device, 10, -1.0, 1.0), alibi_slopes=_heads(device, 11, 0.0, 0.3))


def test_decode_rows_agree_with_paged_decode(device):
    """A step of one token per sequence gives paged_decode's answer, through the prefill
    kernel (``num_decodes=0``) and through the decode plan (``num_decodes=batch``)."""
    seq_lens = [30, 1, 17, 9]
    inputs, query, qsl = _batch(seq_lens, [1, 1, 1, 1], device, seed=12)
    query = query[:4]
    dec = paged_decode(query, *inputs[1:], return_lse=True)
    var = paged_attention(query, *inputs[1:], qsl, return_lse=True)
    plan = plan_attention(inputs.block_tables, inputs.context_lens, qsl, q_dtype=query.dtype,
                          max_query_len=1, num_decodes=4, **SHAPE)
    via_decode = plan.run(query, *inputs[1:3], return_lse=True)
    assert plan._decode is not None and not plan._launchers  # the decode plan ran
    tol = tolerance_for(torch.float32)
    for res in (var, via_decode):
        assert rel_l2_error(res.out, dec.out) <= tol
        assert torch.allclose(res.lse, dec.lse, atol=1e-4)


def test_one_plan_across_layers_and_steps(device):
    """One plan, several layers, then the next step's metadata written in place (same
    shapes): each run matches its oracle; the query rows may be padded differently."""
    inputs, query, qsl = _batch([30, 9, 17], [4, 9, 1], device, seed=13, max_pages=12)
    bt, lens, loc = inputs.block_tables.clone(), inputs.context_lens.clone(), qsl.clone()
    plan = plan_attention(bt, lens, loc, q_dtype=torch.float32, **SHAPE)
    for layer in range(2):
        k, v = inputs.key_cache * (layer + 1), inputs.value_cache - layer
        out = plan.run(query, k, v)
        ref = paged_attention_reference(query, k, v, bt, lens, loc)
        assert rel_l2_error(out[:14], ref.out[:14]) <= tolerance_for(torch.float32)
    nxt, query2, qsl2 = _batch([34, 0, 18], [4, 0, 1], device, seed=14, max_pages=12)
    bt.copy_(nxt.block_tables)
    lens.copy_(nxt.context_lens)
    loc.copy_(qsl2)
    out = plan.run(query2, *nxt[1:3])
    ref = paged_attention_reference(query2, *nxt[1:], qsl2)
    assert rel_l2_error(out[:5], ref.out[:5]) <= tolerance_for(torch.float32)
    assert (out[5:] == 0).all()  # rows past query_start_loc[-1]: the plan's zeros


def _poison_before_windows(inputs, seq_lens, q_lens, window_left, page_size):
    """NaN in V and Inf in K of every page wholly before each sequence's window (the first
    new token's): engines free such pages or point them at a shared null page."""
    k, v = inputs.key_cache.clone(), inputs.value_cache.clone()
    for b, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        first = max(n - q - window_left, 0)
        for j in range(first // page_size):
            page = int(inputs.block_tables[b, j])
            k[page] = float("inf")
            v[page] = float("nan")
    return inputs._replace(key_cache=k, value_cache=v)


@pytest.mark.parametrize("window_left", [0, 5, 13])
def test_pages_before_the_window_are_never_read(device, window_left):
    """Whatever the pages before a window hold (NaN, Inf), the output is the oracle's on the
    clean cache: neither their K nor their V is loaded (one new token at position 40 with
    ``window_left=0`` and pages of 8 was NaN before)."""
    seq_lens, q_lens = [41, 30, 64, 9], [1, 11, 17, 3]
    inputs, query, qsl = _batch(seq_lens, q_lens, device, seed=21, page_size=8)
    ref = paged_attention_reference(query, *inputs[1:], qsl, window_left=window_left).out
    bad = _poison_before_windows(inputs, seq_lens, q_lens, window_left, 8)
    out = paged_attention(query, *bad[1:], qsl, window_left=window_left)
    n = int(qsl[-1])
    assert torch.isfinite(out[:n]).all()
    assert rel_l2_error(out[:n], ref[:n]) <= tolerance_for(torch.float32)


def test_decode_reads_no_page_before_the_window(device):
    """The decode kernel too (one and several query tokens)."""
    seq_lens = [41, 30, 64]
    for q_len in (1, 3):
        inputs = make_paged_inputs(seq_lens, device=device, dtype=torch.float32, seed=22,
                                   **{**SHAPE, "page_size": 8})
        g = torch.Generator().manual_seed(q_len)
        q = torch.randn(3, q_len, 4, 16, generator=g).to(device)
        ref = paged_decode(q, *inputs[1:], window_left=6)
        bad = _poison_before_windows(inputs, seq_lens, [q_len] * 3, 6, 8)
        out = paged_decode(q, *bad[1:], window_left=6)
        assert torch.isfinite(out).all()
        assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)


def test_mixed_step_decodes_through_the_decode_plan(device):
    """``num_decodes``: the first sequences bring one token each and run through the decode
    plan, the rest through the prefill kernel; two launches, the oracle's answer."""
    seq_lens, q_lens = [30, 9, 17, 40, 12], [1, 1, 1, 13, 12]
    inputs, query, qsl = _batch(seq_lens, q_lens, device, seed=23)
    plan = plan_attention(inputs.block_tables, inputs.context_lens, qsl, q_dtype=torch.float32,
                          max_query_len=13, num_decodes=3, **SHAPE)
    out = torch.full_like(query, float("nan"))
    res = plan.run(query, *inputs[1:3], out=out, return_lse=True)
    ref = paged_attention_reference(query, *inputs[1:], qsl)
    n = int(qsl[-1])
    assert plan._decode is not None and plan._launchers  # both ran
    assert rel_l2_error(out[:n], ref.out[:n]) <= tolerance_for(torch.float32)
    assert torch.allclose(res.lse[:n].double().cpu(), ref.lse[:n].cpu(), atol=1e-3)
    assert torch.isnan(out[n:]).all()


def test_one_token_steps_with_an_empty_sequence_and_padding(device):
    """``max_query_len=1`` with as many rows as sequences, one sequence empty and one padding
    row: every row is its own sequence's (the old decode shortcut computed a row over the
    wrong sequence's keys and overwrote the padding row)."""
    seq_lens, q_lens = [30, 9, 17, 5], [1, 0, 1, 1]
    inputs, query, qsl = _batch(seq_lens, q_lens, device, seed=24)
    query = query[:4]  # 3 tokens and one padding row
    out = torch.full_like(query, float("nan"))
    plan = plan_attention(inputs.block_tables, inputs.context_lens, qsl, q_dtype=torch.float32,
                          max_query_len=1, **SHAPE)
    plan.run(query, *inputs[1:3], out=out)
    ref = paged_attention_reference(query, *inputs[1:], qsl).out
    assert rel_l2_error(out[:3], ref[:3]) <= tolerance_for(torch.float32)
    assert torch.isnan(out[3]).all()  # the padding row: untouched


def test_num_decodes_is_checked():
    inputs, query, qsl = _batch([9, 5, 12], [1, 5, 2], "cpu", seed=25)
    for bad, exc in ((4, ValueError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(exc, match="^num_decodes"):
            plan_attention(inputs.block_tables, inputs.context_lens, qsl,
                           q_dtype=torch.float32, num_decodes=bad, **SHAPE)
    plan = plan_attention(inputs.block_tables, inputs.context_lens, qsl, q_dtype=torch.float32,
                          num_decodes=2, **SHAPE)  # sequence 1 brings 5 tokens, not 1
    with pytest.raises(ValueError, match="^num_decodes"):
        plan.run(query, *inputs[1:3])


BAD = [
    (lambda q, i, s: dict(query_start_loc=s[:-1]), ValueError, "query_start_loc"),
    (lambda q, i, s: dict(query_start_loc=s.long()), TypeError, "query_start_loc"),
    (lambda q, i, s: dict(query_start_loc=s.float()), TypeError, "query_start_loc"),
    (lambda q, i, s: dict(query_start_loc=s.flip(0)), ValueError, "query_start_loc"),
    (lambda q, i, s: dict(query_start_loc=s + 1), ValueError, "query_start_loc"),
    (lambda q, i, s: dict(query_start_loc=s * 9), ValueError, "query_start_loc"),
    (lambda q, i, s: dict(query=q[:, :3]), ValueError, "query"),
    (lambda q, i, s: dict(query=q[None]), ValueError, "query"),
    (lambda q, i, s: dict(value_cache=i.value_cache.half()), TypeError, "value_cache"),
    (lambda q, i, s: dict(seq_lens=i.context_lens.float()), TypeError, "seq_lens"),
    (lambda q, i, s: dict(seq_lens=i.context_lens[:2]), ValueError, "seq_lens"),
    (lambda q, i, s: dict(seq_lens=torch.tensor([1, 1, 1], dtype=torch.int32)), ValueError,
     "seq_lens"),  # fewer tokens than the sequence's new ones
    (lambda q, i, s: dict(out=torch.empty_like(q)[:, :, :8]), ValueError, "out"),
    (lambda q, i, s: dict(window_left=-2), ValueError, "window_left"),
    (lambda q, i, s: dict(sinks=torch.zeros(3)), ValueError, "sinks"),
    (lambda q, i, s: dict(k_scale=0.0), ValueError, "k_scale"),
    (lambda q, i, s: dict(kv_layout="NDH"), ValueError, "kv_layout"),
]


@pytest.mark.parametrize("make,exc,name", BAD)
def test_bad_input_is_named_before_any_write(make, exc, name):
    inputs, query, qsl = _batch([9, 5, 12], [3, 5, 2], "cpu", seed=15)
    args = dict(query=query, key_cache=inputs.key_cache, value_cache=inputs.value_cache,
                block_tables=inputs.block_tables, seq_lens=inputs.context_lens,
                query_start_loc=qsl)
    args.update(make(query, inputs, qsl))
    out = args.pop("out", None)
    kw = {k: args.pop(k) for k in list(args) if k not in (
        "query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")}
    sentinel = torch.full_like(query, 7.0)
    with pytest.raises(exc, match=f"^{name}"):
        paged_attention(*args.values(), out=sentinel if out is None else out, **kw)
    assert (sentinel == 7.0).all()


def test_prefill_kernels_compile_for_sm90():
    """The prefill kernel's cases compile for sm_90 without the interpreter (a subprocess) on
    Hopper's wgmma (128-row tiles at eight warps: one program an SM, 255 registers at most),
    nothing spilled inside the key loops (Triton 3.6's bounds; another Triton's own measured
    counts where they differ: ``_scripts.sm90_bound``)."""
    import re

    cases = ("prefill-bf16", "prefill-fp8", "prefill-everything")
    lines = compiled_sm90(cases)
    assert set(lines) == set(cases)  # one kernel a call
    measured = {case: line for case, line in lines.items() if " registers" in line}
    for line in measured.values():
        assert "wgmma" in line, line
    for case, line in measured.items():
        regs = int(re.search(r"(\d+) registers", line).group(1))
        assert regs <= sm90_bound(case, "registers", 255), line
        loop = re.search(r"(\d+) spill instructions in the token loop", line)
        assert loop is None or int(loop.group(1)) <= sm90_bound(case, "loop spills", 0), line


@pytest.mark.parametrize("tokens", [4, 128])
def test_gluon_schedule_kernel(device, tokens):
    """The Gluon prefill kernel's schedule (``_prefill_schedule_kernel``, plain Triton: it runs
    in the interpreter) against the block rows computed here: each sequence's blocks longest
    first (its last block at its lowest row), the block's first row, row count, first token's
    position, ``kv_end`` and the no-clamp flag; rows past the batch's blocks say ``-1``; a
    length past the table is clamped, flagged and reported as ``seq_lens``; decodes before
    ``first_row`` are skipped."""
    from pagedattn import check_errors
    from pagedattn._errors import error_word
    from pagedattn.kernels.prefill import _prefill_schedule_kernel

    first_row, page, max_pages = 2, 4, 30
    seq_lens = [20, 9, 0, 7, 100]
    q_lens = [13, 9, 0, 3, 5]
    qsl = torch.tensor([first_row, *(first_row + torch.tensor(q_lens).cumsum(0)).tolist()],
                       dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    num_tokens = first_row + sum(q_lens) + 3  # padding rows
    rows = num_tokens
    sched = torch.full((rows * 8,), -7, dtype=torch.int32, device=device)
    _prefill_schedule_kernel[(rows,)](
        query_start_loc_ptr=qsl, seq_lens_ptr=lens, sched_ptr=sched,
        errors_ptr=error_word(torch.device(device)), batch=len(seq_lens), first_row=first_row,
        num_tokens=num_tokens, num_pages=64, max_pages=max_pages, stride_sl=1,
        TOKENS=tokens, PAGE_SIZE=page, BLOCK_B=4, num_warps=1)
    capacity = max_pages * page
    want = []
    start = first_row
    for b, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        blocks = -(-q // tokens)
        seq = min(n, capacity)
        for m in reversed(range(blocks)):  # longest first
            here = min(q - m * tokens, tokens)
            p0 = seq - q + m * tokens
            want.append([b, start + m * tokens, here, p0, max(min(p0 + here, seq), 0),
                         int(seq == n)])
        start += q
    want += [[-1, first_row, 0, 0, 0, 0]] * (rows - len(want))
    got = sched.view(rows, 8)[:, :6].cpu().tolist()
    assert got == want
    lens[4] = capacity + 1  # past the table: clamped to it, flagged, reported
    _prefill_schedule_kernel[(rows,)](
        query_start_loc_ptr=qsl, seq_lens_ptr=lens, sched_ptr=sched,
        errors_ptr=error_word(torch.device(device)), batch=len(seq_lens), first_row=first_row,
        num_tokens=num_tokens, num_pages=64, max_pages=max_pages, stride_sl=1,
        TOKENS=tokens, PAGE_SIZE=page, BLOCK_B=4, num_warps=1)
    last = [row for row in sched.view(rows, 8)[:, :6].cpu().tolist() if row[0] == 4]
    start4 = first_row + sum(q_lens[:4])
    assert last == [[4, start4 + m * tokens, min(5 - m * tokens, tokens),
                     capacity - 5 + m * tokens, capacity - 5 + m * tokens + min(5 - m * tokens,
                                                                                   tokens), 0]
                    for m in reversed(range(-(-5 // tokens)))]
    with pytest.raises(ValueError, match=r"^seq_lens\[4\]"):
        check_errors(device)


def _handoff(n_tiles: int, stages: int, overlap: bool, consumers: int = 1,
             releases: int | None = None, lag: bool = False, ping_pong: bool = False,
             turn_parity_shift: int = 0, order: list | None = None) -> list[str]:
    """The Gluon prefill kernel's stage hand-offs (``_producer``, ``_consumer``), step for
    step, as coroutines over mbarriers: the order of the first consumer's reads (each
    consumer must read the same), or ``["deadlock"]``. A wait names its barrier and parity.
    The producer never waits for its own copies: tile ``t``'s ``kv_ready`` completes when
    they land (``cp.async.mbarrier.arrive``), modelled as at their issue; it waits only for
    a stage's release, which takes one arrival from each consumer partition (``consumers``
    2: ``SPLIT``, the warpgroups apart; ``releases``: the arrivals ``kv_empty`` expects, as
    the kernel initializes it; ``lag``: the second consumer starts once the first has
    finished, as far apart as two partitions can drift). A tile issued into a stage that a
    consumer has not released fails an assertion. ``ping_pong`` (two consumers): the turns
    of step 59, consumer 1 waiting its turn barrier at parity ``j % 2`` (shifted by
    ``turn_parity_shift``, a wrong kernel) and consumer 0 at ``(j + 1) % 2`` from tile 1;
    ``order`` collects ``(consumer, tile)`` as each issues its scores' dots."""
    q_ready, ready = MBarrier(), [MBarrier() for _ in range(stages)]
    empty = [MBarrier(releases or consumers) for _ in range(stages)]
    issued, reads, released = [], [[] for _ in range(consumers)], [0] * consumers
    lead_done = MBarrier()
    turn = [MBarrier(), MBarrier()]
    order = [] if order is None else order

    def producer():
        q_ready.completed += 1
        for j in range(n_tiles):
            s = j % stages
            if j >= stages:
                yield empty[s], ((j // stages) + 1) % 2
            assert min(released) >= j - stages + 1, "a stage overwritten while read"
            issued.append(j)
            ready[s].completed += 1

    def consumer(k, read):
        if lag and k:
            yield lead_done, 0
        yield q_ready, 0
        if overlap and n_tiles > 0:
            yield ready[0], 0
            read.append(0)
        last = max(n_tiles - 1, 0)
        for j in range(n_tiles):
            s = j % stages
            if overlap:
                nxt = min(j + 1, last)
                yield ready[nxt % stages], (nxt // stages) % 2
                assert nxt in issued
                read.append(nxt)
            else:
                yield ready[s], (j // stages) % 2
                assert j in issued
                if ping_pong and k == 1:
                    yield turn[1], (j + turn_parity_shift) % 2
                elif ping_pong and j > 0:
                    yield turn[0], (j + 1) % 2
                read.append(j)
                order.append((k, j))
                if ping_pong:
                    turn[1 - k].arrive()
            released[k] += 1
            empty[s].arrive()
        if k == 0:
            lead_done.completed += 1

    if not run_sides(producer(), *(consumer(k, read) for k, read in enumerate(reads))):
        return ["deadlock"]
    assert all(read == reads[0] for read in reads)
    return reads[0]


@pytest.mark.parametrize("stages,overlap", [(2, False), (3, False), (2, True), (3, True)])
@pytest.mark.parametrize("consumers", [1, 2])
def test_gluon_prefill_handoff_never_deadlocks(stages, overlap, consumers):
    """The stage hand-offs of the Gluon prefill kernel, modelled step for step (the
    interpreter runs no Gluon and a GPU hangs rather than fails), with the two consumer
    warpgroups as one partition or as two (``SPLIT``: a stage is free once both released
    it): every side finishes for 0 to 9 tiles and each consumer reads each tile in order
    (with the overlap: tile ``j + 1``'s scores before tile ``j`` is released, the last tile
    twice); with one stage and the overlap the sides would wait on each other, which the
    kernel's ``static_assert`` (``OVERLAP < STAGES``) refuses."""
    for n in range(10):
        want = list(range(n)) + ([n - 1] if overlap and n else [])
        assert _handoff(n, stages, overlap, consumers) == want
    if overlap:  # the configuration the kernel refuses: a deadlock once a tile waits a release
        assert _handoff(5, 1, overlap, consumers) == ["deadlock"]
    if consumers == 2:  # kv_empty expecting one release: the faster consumer frees the stage
        with pytest.raises(AssertionError, match="overwritten"):
            _handoff(9, stages, overlap, consumers, releases=1, lag=True)


@pytest.mark.parametrize("stages", [2, 3])
def test_gluon_prefill_ping_pong_alternates_and_never_deadlocks(stages):
    """Step 59's turns, modelled with the stage hand-offs: the two consumer partitions
    finish for 0 to 9 tiles, each reads every tile in order, and they issue their scores'
    dots strictly in turn (consumer 0's tile 0, consumer 1's tile 0, consumer 0's tile 1,
    ...). Consumer 1 waiting one phase early (a fresh barrier passes parity 1) would issue
    before consumer 0: the order check catches it."""
    for n in range(10):
        order = []
        assert _handoff(n, stages, False, 2, ping_pong=True, order=order) == list(range(n))
        assert order == [(k, j) for j in range(n) for k in (0, 1)]
    order = []
    _handoff(4, stages, False, 2, ping_pong=True, turn_parity_shift=1, order=order)
    assert order != [(k, j) for j in range(4) for k in (0, 1)]
    # the partitions cannot drift apart under the turns: one that waits for the other's end
    # (lag) never gets its turn
    assert _handoff(4, stages, False, 2, lag=True, ping_pong=True) == ["deadlock"]


def test_gluon_prefill_kernel_compiles_for_sm90():
    """The Gluon prefill kernel (``kernels/prefill_gluon.py``, warp-specialized) compiles for
    sm_90 with its schedule kernel: 128- and 64-key tiles, head dims 128 and 64, the
    consumers' overlap of the next tile's scores with the softmax, the consumer warpgroups
    as two partitions (``split``); wgmma, within
    227 KB of shared memory, three warpgroups (``.reqntid 384``: a producer and two
    consumers), nothing spilled in the consumers' key loop (Triton 3.6's bound)."""
    import re

    cases = ("prefill-bf16-gluon", "prefill-n64s3-gluon", "prefill-hd64-gluon",
             "prefill-overlap-gluon", "prefill-split-gluon", "prefill-pingpong-gluon")
    lines = compiled_sm90(cases)
    assert set(lines) == set(cases)
    for case, line in lines.items():
        assert "_paged_prefill_gluon_kernel" in line and "wgmma" in line, line
        assert int(re.search(r"(\d+) bytes of shared memory", line).group(1)) <= 227 * 1024
        loop = re.search(r"(\d+) spill instructions in the token loop", line)
        assert loop is None or int(loop.group(1)) <= sm90_bound(case, "loop spills", 0), line


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,page_size,tiles", [
    (torch.bfloat16, 128, 16, None), (torch.float16, 128, 1, (64, 3, False)),
    (torch.bfloat16, 64, 64, (128, 3, False)), (torch.bfloat16, 128, 5, (64, 2, True)),
    (torch.float16, 128, 16, (128, 2, True)), (torch.bfloat16, 128, 16, (64, 3, False, True)),
    (torch.float16, 64, 1, (64, 2, True, True)),
    (torch.bfloat16, 128, 16, (64, 3, False, True, True)),
    (torch.float16, 64, 5, (128, 2, False, True, True))])
def test_gluon_prefill_path(monkeypatch, dtype, head_dim, page_size, tiles):
    """The Gluon prefill kernel (Hopper only) against the oracle, with ``out`` NaN-poisoned:
    long chunks over cached prefixes, a chunk shorter than a block, a sequence with no new
    token, GQA 4, every tile config it takes, the consumers' overlap and the consumer
    warpgroups as two partitions (``split``), the LSE; a length
    past the table reports
    ``seq_lens`` (the schedule kernel's report)."""
    import dataclasses

    import pagedattn.launch.prefill as LP
    from pagedattn import check_errors

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon path is for sm_90 (H100/H200)")
    base = LP.prefill_config
    extra = {} if tiles is None else dict(block_n=tiles[0], num_stages=tiles[1],
                                          overlap=tiles[2], split=tiles[3:4] == (True,),
                                          ping_pong=tiles[4:] == (True,))
    monkeypatch.setattr(LP, "prefill_config", lambda *a, **k: dataclasses.replace(
        base(*a, **k), gluon=True, **extra))
    seq_lens, q_lens = [700, 300, 0, 1100, 9], [300, 300, 0, 200, 9]
    inputs, query, qsl = _batch(seq_lens, q_lens, "cuda", dtype=dtype, seed=head_dim,
                                num_q_heads=16, num_kv_heads=4, head_dim=head_dim,
                                page_size=page_size)
    plan = plan_attention(inputs.block_tables, inputs.context_lens, qsl, num_q_heads=16,
                          num_kv_heads=4, head_dim=head_dim, page_size=page_size,
                          q_dtype=dtype)
    out = torch.full_like(query, float("nan"))
    res = plan.run(query, *inputs[1:3], out=out, return_lse=True)
    launcher = plan._engine(query.shape[0])
    assert launcher.gluon and "paged_prefill_gluon" in launcher.last_compiled.name
    ref = paged_attention_reference(query, *inputs[1:], qsl)
    n = int(qsl[-1])
    assert rel_l2_error(out[:n], ref.out[:n]) <= tolerance_for(dtype)
    assert torch.isnan(out[n:]).all()
    check_lse(res.lse[:n], ref.lse[:n], rtol=1e-4, atol=1e-3)
    inputs.context_lens[3] = 1_000_000  # the plan reads it at the next run
    plan.run(query, *inputs[1:3], out=out)
    with pytest.raises(ValueError, match=r"^seq_lens\[3\]"):
        check_errors("cuda")


def test_the_prefill_bench_checks_its_rows_on_the_cpu():
    """``scripts/bench_prefill.py --dry-run``: its rows, interpreter-sized, checked against
    the oracle (exit 0, an error per row); a bad ``--rows`` exits 2."""
    run = run_script("bench_prefill.py", "--dry-run", interpret=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    errs = [float(line.split("pagedattn err ")[1].split()[0])
            for line in run.stdout.splitlines() if "pagedattn err" in line]
    assert len(errs) == 7 and max(errs) <= tolerance_for(torch.float32)
    assert_unknown_row_exits_2("bench_prefill.py")


def test_the_prefill_bench_variants_leave_the_decode_tiles_alone(monkeypatch):
    """``bench_prefill.py --variants`` patches the prefill policy (``policy_patch``,
    ``prefill_first``): a field both policies have leaves a mixed step's decode tiles as the
    decode policy chose them; without ``prefill_first`` both change; a field neither has
    raises."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts"))
    sys.modules.pop("policy_patch", None)
    from policy_patch import patched_config

    from pagedattn.launch import policy
    from pagedattn.launch import prefill as prefill_launch

    def tiles():
        d = policy.choose_config(128, 4, torch.bfloat16, 16, interpret=False)
        p = prefill_launch.prefill_config(head_dim=128, group=4, kv_dtype=torch.bfloat16,
                                          page_size=16, max_query_len=None, interpret=False)
        return d.block_n, p.block_n

    decode_n, prefill_n = tiles()
    new = 8 if 8 not in (decode_n, prefill_n) else 4
    with patched_config(dict(block_n=new), prefill_first=True):
        assert tiles() == (decode_n, new)
    with patched_config(dict(block_n=new)):
        assert tiles() == (new, new)
    assert tiles() == (decode_n, prefill_n)
    with pytest.raises(ValueError, match="no_such_field"), \
            patched_config(dict(no_such_field=1)):
        pass
