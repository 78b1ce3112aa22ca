"""The plan/run API (``plan_decode`` + ``DecodePlan.run``) against the float64 oracle.

A plan is built once per decode step and run once per layer; it reads ``block_tables`` and
``context_lens`` at every run, so updating them in place between runs (as a serving engine
does between CUDA-graph replays) must give the new step's answer. Outputs are NaN-poisoned.
"""

import pytest
import torch

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

SHAPE = dict(num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=8)


def _plan(inputs, **kw):
    return pagedattn.plan_decode(inputs.block_tables, inputs.context_lens,
                                 q_dtype=inputs.query.dtype,
                                 kv_dtype=inputs.key_cache.dtype, **SHAPE, **kw)


def _check(out, inputs, **kw):
    ref = paged_decode_reference(*inputs, **kw)
    assert rel_l2_error(out, ref.out) <= tolerance_for(inputs.key_cache.dtype)
    return ref


def test_several_layers_per_plan(device):
    """One plan, three layers (three cache pairs and queries): each matches its oracle."""
    base = make_paged_inputs([0, 9, 40, 17], dtype=torch.float16, seed=0, device=device,
                             **SHAPE)
    g = torch.Generator().manual_seed(1)
    # three layers: their own queries and caches (unused slots stay NaN), the step's table
    layers = [base._replace(
        query=torch.randn(base.query.shape, generator=g).half().to(device),
        key_cache=base.key_cache * (i + 1) - i, value_cache=base.value_cache.flip(-1) + i)
        for i in range(3)]
    plan = pagedattn.plan_decode(base.block_tables, base.context_lens, q_dtype=torch.float16,
                                 **SHAPE)
    for layer in layers:
        out = torch.full_like(layer.query, float("nan"))
        assert plan.run(*layer[:3], out=out) is out
        _check(out, layer)


def test_in_place_updates_between_runs(device):
    """New lengths and page ids written into the plan's tensors between runs are honoured
    (the next decode step reuses the plan, as a captured CUDA graph would)."""
    first = make_paged_inputs([3, 0, 30], dtype=torch.float32, seed=1, device=device,
                              max_pages=6, **SHAPE)
    bt, cl = first.block_tables.clone(), first.context_lens.clone()
    plan = pagedattn.plan_decode(bt, cl, q_dtype=torch.float32, **SHAPE)
    _check(plan.run(*first[:3]), first)
    second = make_paged_inputs([48, 5, 0], dtype=torch.float32, seed=2, device=device,
                               max_pages=6, **SHAPE)
    bt.copy_(second.block_tables)
    cl.copy_(second.context_lens)
    res = plan.run(*second[:3], return_lse=True)
    ref = _check(res.out, second)
    assert (res.out[2] == 0).all() and torch.isneginf(res.lse[2]).all()
    finite = torch.isfinite(ref.lse)
    torch.testing.assert_close(res.lse.double()[finite].cpu(), ref.lse[finite].cpu(),
                               rtol=1e-5, atol=1e-5)


def test_all_empty_and_forced_splits(device):
    """Context 0 everywhere gives zeros and LSE -inf; forced splits match the oracle."""
    inputs = make_paged_inputs([0, 0], dtype=torch.float16, seed=3, device=device, **SHAPE)
    res = _plan(inputs).run(*inputs[:3], return_lse=True)
    assert (res.out == 0).all() and torch.isneginf(res.lse).all()
    inputs = make_paged_inputs([1, 33, 70], dtype=torch.float16, seed=4, device=device, **SHAPE)
    _check(_plan(inputs, num_splits=3).run(*inputs[:3]), inputs)


def test_hnd_fp8_and_scales(device):
    """HND layout and an fp8 cache with per-kv-head scale tensors, through the plan."""
    fp8 = torch.float8_e4m3fn
    inputs = make_paged_inputs([5, 26], dtype=torch.float16, cache_dtype=fp8, kv_layout="HND",
                               seed=5, device=device, **SHAPE)
    k_scale = torch.tensor([0.5, 2.0], device=device)
    plan = _plan(inputs, kv_layout="HND")
    out = plan.run(*inputs[:3], k_scale=k_scale, v_scale=0.25)
    _check(out, inputs, kv_layout="HND", k_scale=k_scale, v_scale=0.25)


def test_paged_decode_is_the_one_shot_plan(device):
    """``paged_decode(impl='auto')`` and ``plan_decode(...).run`` give the same bits."""
    inputs = make_paged_inputs([7, 19, 2], dtype=torch.float16, seed=6, device=device, **SHAPE)
    assert torch.equal(pagedattn.paged_decode(*inputs), _plan(inputs).run(*inputs[:3]))


@pytest.mark.parametrize("lse", [False, True])
def test_one_unit_plan_without_merge(device, lse):
    """A table whose capacity is at most the smallest split chunk (a short ``max_model_len``)
    plans one unit per sequence: no merge is launched, an empty sequence gives 0 (LSE -inf),
    and every other sequence gets the same bits as under a wider table (the one-row path)."""
    lens = [0, 5, 16, 1]
    narrow = make_paged_inputs(lens, dtype=torch.float32, seed=12, device=device,
                               max_pages=2, **SHAPE)  # capacity 16 <= any chunk
    plan = _plan(narrow)
    out = torch.full_like(narrow.query, float("nan"))
    res = plan.run(*narrow[:3], out=out, return_lse=lse)
    assert plan._engine().one_unit and set(plan.last_compiled) == {"paged_decode"}
    ref = _check(out, narrow)
    assert (out[0] == 0).all()
    if lse:
        assert torch.isneginf(res.lse[0]).all()
        assert torch.allclose(res.lse[1:].double().cpu(), ref.lse[1:].cpu(), atol=1e-3)
    wide_bt = torch.cat([narrow.block_tables, torch.zeros_like(narrow.block_tables).repeat(
        1, 40)], dim=1)  # capacity 672: the device-planned path (one row per sequence here)
    wide = _plan(narrow._replace(block_tables=wide_bt))
    wide_out = wide.run(narrow.query, narrow.key_cache, narrow.value_cache)
    assert not wide._engine().one_unit
    assert torch.equal(wide_out[1:], out[1:])


def test_host_lengths_refine_the_plan(device):
    """A host copy of ragged lengths picks the ragged tiles; the result is the same answer
    (and stays right after in-place updates, since the kernel reads the device lengths)."""
    lens = [1, 3, 200, 7]
    inputs = make_paged_inputs(lens, dtype=torch.bfloat16, seed=9, device=device, **SHAPE)
    plan = _plan(inputs, host_context_lens=lens)
    assert plan.ragged
    _check(plan.run(*inputs[:3]), inputs)
    assert not _plan(inputs, host_context_lens=torch.tensor([50, 50, 50, 50])).ragged
    with pytest.raises(ValueError, match="host_context_lens"):
        _plan(inputs, host_context_lens=[1, 2])
    with pytest.raises(TypeError, match="host_context_lens"):
        _plan(inputs, host_context_lens=3)
    for floats in ([1.5, 3, 200, 7], [True, 3, 200, 7], torch.tensor([1, 0, 1, 1]).bool()):
        with pytest.raises((TypeError, ValueError), match="host_context_lens"):
            _plan(inputs, host_context_lens=floats)  # truncated silently before


@pytest.mark.parametrize("field,value,exc,name", [
    ("num_q_heads", 5, ValueError, "num_q_heads"),
    ("num_kv_heads", 0, ValueError, "num_kv_heads"),
    ("head_dim", 8, ValueError, "head_dim"),
    ("page_size", 0, ValueError, "page_size"),
    ("q_dtype", torch.int32, TypeError, "q_dtype"),
    ("kv_dtype", torch.float32, TypeError, "kv_dtype"),
    ("kv_layout", "NDH", ValueError, "kv_layout"),
    ("num_splits", 0, ValueError, "num_splits"),
    ("num_splits", 1.5, TypeError, "num_splits"),
])
def test_plan_errors_name_the_argument(field, value, exc, name):
    inputs = make_paged_inputs([3, 4], dtype=torch.float16, seed=7, **SHAPE)
    kw = dict(SHAPE, q_dtype=torch.float16, kv_dtype=None, kv_layout="NHD", num_splits=None)
    kw[field] = value
    with pytest.raises(exc, match=name):
        pagedattn.plan_decode(inputs.block_tables, inputs.context_lens, **kw)
    with pytest.raises(TypeError, match="block_tables"):
        pagedattn.plan_decode(inputs.block_tables.float(), inputs.context_lens,
                              q_dtype=torch.float16, **SHAPE)
    with pytest.raises(ValueError, match="context_lens"):
        pagedattn.plan_decode(inputs.block_tables, inputs.context_lens[:1],
                              q_dtype=torch.float16, **SHAPE)


def test_run_refuses_tensors_that_do_not_match_the_plan():
    inputs = make_paged_inputs([3, 4], dtype=torch.float16, seed=8, **SHAPE)
    plan = _plan(inputs)
    q, k, v = inputs[:3]
    with pytest.raises(TypeError, match="query"):
        plan.run(q.float(), k, v)
    with pytest.raises(ValueError, match="query"):
        plan.run(q[:1], k, v)
    with pytest.raises(ValueError, match="key_cache"):
        plan.run(q, k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="value_cache"):
        plan.run(q, k, v[:, :4])
    with pytest.raises(ValueError, match="out"):
        plan.run(q, k, v, out=torch.empty(2, 6, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="k_scale"):
        plan.run(q, k, v, k_scale=torch.ones(3))
    bad = inputs.context_lens.clone()
    plan = _plan(inputs._replace(context_lens=bad))
    bad[0] = 10**6  # value checks run on CPU tensors at every run
    with pytest.raises(ValueError, match="context_lens"):
        plan.run(q, k, v)


@pytest.mark.gpu
def test_graph_captured_run_replays_after_in_place_updates():
    """A CUDA graph captured around ``plan.run`` at short lengths replays correctly at long
    ones (and at 0) after in-place updates of the plan's tensors."""
    shape = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    small = make_paged_inputs([16, 3, 1, 0], dtype=torch.bfloat16, seed=9, device="cuda",
                              max_pages=600, **shape)
    bt, cl = small.block_tables.clone(), small.context_lens.clone()
    plan = pagedattn.plan_decode(bt, cl, q_dtype=torch.bfloat16, **shape)
    q = small.query.clone()
    big = make_paged_inputs([8192, 20, 4000, 1], dtype=torch.bfloat16, seed=10,
                            device="cuda", max_pages=600, **shape)
    k = torch.zeros_like(big.key_cache)  # one pair of caches that holds either batch
    v = torch.zeros_like(big.value_cache)
    plan.run(q, k, v)  # compile and bind outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    out = torch.full_like(q, float("nan"))
    with torch.cuda.graph(graph):
        plan.run(q, k, v, out=out)
    k.copy_(big.key_cache)
    v.copy_(big.value_cache)
    q.copy_(big.query)
    bt.copy_(big.block_tables)
    cl.copy_(big.context_lens)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_l2_error(out, paged_decode_reference(*big).out) <= tolerance_for(torch.bfloat16)


def test_run_with_every_per_call_option_spelled_off_takes_the_fast_check(monkeypatch):
    """``run(..., sinks=None, alibi_slopes=None)`` (what the FlashInfer wrapper and the
    transformers hook pass) is the plain call: the one-expression check, not ``check_run``
    (the H200 measured the FlashInfer wrapper 4.5-5.1 µs above plan.run while it took the full
    check); an unknown keyword, even ``None``, is still refused."""
    from pagedattn import _validation, options

    x = make_paged_inputs([5, 40], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                          dtype=torch.float16, seed=3, device="cpu")
    plan = pagedattn.plan_decode(x.block_tables, x.context_lens, num_q_heads=4,
                                 num_kv_heads=2, head_dim=32, page_size=16,
                                 q_dtype=torch.float16)
    ref = paged_decode_reference(*x).out
    full = []
    real = _validation.check_run
    monkeypatch.setattr(_validation, "check_run", lambda *a, **k: full.append(1) or real(*a, **k))
    off = {name: None for name in options.CALL}
    assert off  # the per-call options (sinks, alibi_slopes) exist
    out = plan.run(x.query, x.key_cache, x.value_cache, **off)
    assert rel_l2_error(out, ref) <= tolerance_for(torch.float16)
    assert full == []
    with pytest.raises(TypeError, match="window_lft"):
        plan.run(x.query, x.key_cache, x.value_cache, window_lft=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's lock: CPU only")
def test_launches_in_several_threads_on_the_cpu():
    """Two plans, a study stage and a KV append, each in its own thread, three times each: all
    right (Triton's interpreter keeps a launch's grid process-wide: without the library's
    interpreter lock they crashed, ``InterpreterError: ValueError('y >= grid_dim[1]')``).
    The CPU only (the lock is the interpreter's)."""
    import threading

    errors, done = [], []

    def plan_worker(seed):
        inputs = make_paged_inputs([5 + seed, 30, 2], dtype=torch.float32, seed=seed, **SHAPE)
        plan = _plan(inputs)
        for _ in range(3):
            _check(plan.run(inputs.query, inputs.key_cache, inputs.value_cache), inputs)

    def stage_worker():
        inputs = make_paged_inputs([17, 9], dtype=torch.float32, seed=7, **SHAPE)
        for _ in range(3):
            _check(pagedattn.paged_decode(*inputs, impl="gqa_reuse_v3"), inputs)

    def append_worker():
        inputs = make_paged_inputs([3], dtype=torch.float32, seed=8, **SHAPE)
        for i in range(3):
            key = torch.randn(2, 2, 64)
            slots = torch.tensor([i, 8 + i])
            pagedattn.append_kv(key, key, inputs.key_cache, inputs.value_cache, slots)
            assert torch.equal(inputs.key_cache[0, i], key[0])
            assert torch.equal(inputs.value_cache[1, i], key[1])

    def guarded(fn, *args):
        try:
            fn(*args)
            done.append(fn.__name__)
        except Exception as e:  # reported below, with the thread's error
            errors.append(repr(e))

    threads = [threading.Thread(target=guarded, args=a) for a in (
        (plan_worker, 0), (plan_worker, 1), (stage_worker,), (append_worker,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(done) == 4
