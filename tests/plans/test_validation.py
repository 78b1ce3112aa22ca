"""The validation contract (issue 6): one parametrized case per argument error, each asserting
the exception type, that the message names the argument, and that it is raised before any
kernel launch (every launcher is patched to fail); then ``validate=``'s value checks on the
CPU and, on a GPU, that ``validate=None`` never syncs and ``validate=True`` refuses graph
capture.
"""

import dataclasses
import math

import pytest
import torch
from _hardening import IMPLS, NAN, check, run

import pagedattn
from pagedattn import api
from pagedattn.launch import decode as launch_decode
from pagedattn.testing import make_paged_inputs

FP16, FP8 = torch.float16, torch.float8_e4m3fn


class Launched(Exception):
    pass


@pytest.fixture
def no_launch(monkeypatch):
    """Every launcher raises ``Launched``: an error raised later came too late."""
    def fail(*args, **kwargs):
        raise Launched("a kernel launched before validation finished")

    # every impl of the table: the planned one's launcher class, the others' launch functions
    monkeypatch.setattr(launch_decode.AutoLauncher, "launch", fail)
    for name, spec in api.IMPLS.items():
        if not spec.planned:
            monkeypatch.setitem(api.IMPLS, name, dataclasses.replace(spec, launcher=lambda: fail))


def _base(head_dim=64, dtype=FP16):
    """Valid inputs: ctx [5, 0, 17], Hq 4 / Hkv 2, page 8, 4 pages of table (capacity 32)."""
    return list(make_paged_inputs([5, 0, 17], num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
                                  page_size=8, dtype=dtype, max_pages=4))


def _arg(i, fn):
    """A case that replaces positional argument ``i`` by ``fn(it)``."""
    def mutate(args, kw):
        args[i] = fn(args[i])
    return mutate


def _kw(**values):
    def mutate(args, kw):
        kw.update(values)
    return mutate


def _both_caches(fn):
    def mutate(args, kw):
        args[1], args[2] = fn(args[1]), fn(args[2])
    return mutate


def _table(row, col, value):
    def mutate(args, kw):
        args[3] = args[3].clone()
        args[3][row, col] = value
    return mutate


def _lens(values):
    return _arg(4, lambda t: torch.tensor(values, dtype=t.dtype))


def _head_dim(d):
    def mutate(args, kw):
        args[:] = _base(head_dim=d)
    return mutate


Q, K, V, BT, CL = range(5)
META = torch.device("meta")
# id -> (mutation, exception, regex the message must match: the argument's name)
ERRORS = {
    "query-rank2": (_arg(Q, lambda t: t[:, 0]), ValueError, "query"),
    # (rank 4 is a multi-token query: tests/plans/test_variants.py)
    "query-rank5": (_arg(Q, lambda t: t[None, None]), ValueError, "query"),
    "query-not-tensor": (_arg(Q, lambda t: t.tolist()), TypeError, "query"),
    "query-int": (_arg(Q, lambda t: t.int()), TypeError, "query"),
    "query-fp8": (_arg(Q, lambda t: t.to(FP8)), TypeError, "query"),
    "key_cache-rank3": (_arg(K, lambda t: t[0]), ValueError, "key_cache"),
    "key_cache-dtype-mixed": (_arg(K, lambda t: t.float()), TypeError, "key_cache"),
    "key_cache-both-mixed": (_both_caches(lambda t: t.bfloat16()), TypeError, "key_cache"),
    "key_cache-head_dim": (_both_caches(lambda t: t[..., :32]), ValueError, "key_cache"),
    "value_cache-rank5": (_arg(V, lambda t: t[None]), ValueError, "value_cache"),
    "value_cache-shape": (_arg(V, lambda t: t[:, :4]), ValueError, "value_cache"),
    "value_cache-dtype": (_arg(V, lambda t: t.bfloat16()), TypeError, "value_cache"),
    "block_tables-rank1": (_arg(BT, lambda t: t[0]), ValueError, "block_tables"),
    "block_tables-rows": (_arg(BT, lambda t: t[:2]), ValueError, "block_tables"),
    "block_tables-float": (_arg(BT, lambda t: t.float()), TypeError, "block_tables"),
    "block_tables-int16": (_arg(BT, lambda t: t.short()), TypeError, "block_tables"),
    "block_tables-bool": (_arg(BT, lambda t: t > 0), TypeError, "block_tables"),
    "context_lens-rank2": (_arg(CL, lambda t: t[None]), ValueError, "context_lens"),
    "context_lens-entries": (_arg(CL, lambda t: t[:2]), ValueError, "context_lens"),
    "context_lens-float": (_arg(CL, lambda t: t.float()), TypeError, "context_lens"),
    "context_lens-uint8": (_arg(CL, lambda t: t.to(torch.uint8)), TypeError, "context_lens"),
    "context_lens-negative": (_lens([5, -1, 17]), ValueError, r"context_lens.*row 1"),
    "context_lens-over-capacity": (_lens([5, 0, 33]), ValueError, r"context_lens.*32.*row 2"),
    "block_tables-id-too-big": (_table(2, 1, 99), ValueError, r"block_tables.*row 2.*col"),
    "block_tables-id-minus1": (_table(0, 0, -1), ValueError, r"block_tables.*row 0"),
    "device-key_cache": (_arg(K, lambda t: t.to(META)), ValueError, "key_cache"),
    "device-value_cache": (_arg(V, lambda t: t.to(META)), ValueError, "value_cache"),
    "device-block_tables": (_arg(BT, lambda t: t.to(META)), ValueError, "block_tables"),
    "device-context_lens": (_arg(CL, lambda t: t.to(META)), ValueError, "context_lens"),
    "device-out": (lambda a, k: k.update(out=torch.empty_like(a[Q], device=META)), ValueError,
                   "out"),
    "heads-not-divisible": (_arg(Q, lambda t: t[:, :3]), ValueError, "num_q_heads"),
    "page_size-0": (_both_caches(lambda t: t[:, :0]), ValueError, "page_size"),
    "num_kv_heads-0": (_both_caches(lambda t: t[:, :, :0]), ValueError, "num_kv_heads"),
    "head_dim-8": (_head_dim(8), ValueError, "head_dim"),
    "head_dim-512": (_head_dim(512), ValueError, "head_dim"),
    "impl-unknown": (_kw(impl="fastest"), ValueError, "impl"),
    "impl-None": (_kw(impl=None), ValueError, "impl"),
    "kv_layout-unknown": (_kw(kv_layout="NCHW"), ValueError, "kv_layout"),
    "kv_layout-lowercase": (_kw(kv_layout="nhd"), ValueError, "kv_layout"),
    "num_splits-0": (_kw(num_splits=0), ValueError, "num_splits"),
    "num_splits-negative": (_kw(num_splits=-1), ValueError, "num_splits"),
    "num_splits-float": (_kw(num_splits=1.5), TypeError, "num_splits"),
    "num_splits-bool": (_kw(num_splits=True), TypeError, "num_splits"),
    "num_splits-str": (_kw(num_splits="2"), TypeError, "num_splits"),
    "scale-nan": (_kw(scale=float("nan")), ValueError, "scale"),
    "scale-inf": (_kw(scale=float("inf")), ValueError, "scale"),
    "scale-str": (_kw(scale="0.125"), TypeError, "scale"),
    "scale-bool": (_kw(scale=True), TypeError, "scale"),
    "out-shape": (lambda a, k: k.update(out=torch.empty_like(a[Q][:, :2])), ValueError, "out"),
    "out-dtype": (lambda a, k: k.update(out=a[Q].float()), TypeError, "out"),
    "out-not-tensor": (_kw(out=[0.0]), TypeError, "out"),
    "validate-str": (_kw(validate="yes"), TypeError, "validate"),
    "validate-int": (_kw(validate=1), TypeError, "validate"),
    "return_lse-str": (_kw(return_lse="yes"), TypeError, "return_lse"),
}
# the same for every impl but auto, which honours these (checked separately below)
AUTO_ONLY_ERRORS = {
    "k_scale-shape-3": (_kw(k_scale=torch.ones(3)), ValueError, "k_scale"),
    "k_scale-shape-2x1": (_kw(k_scale=torch.ones(2, 1)), ValueError, "k_scale"),
    "v_scale-shape-per-token": (_kw(v_scale=torch.ones(3, 2)), ValueError, "v_scale"),
    "k_scale-str": (_kw(k_scale="0.5"), TypeError, "k_scale"),
    "k_scale-nan": (_kw(k_scale=float("nan")), ValueError, "k_scale"),
    "k_scale-bool": (_kw(k_scale=True), TypeError, "k_scale"),
    "v_scale-int-tensor": (_kw(v_scale=torch.ones(2, dtype=torch.int32)), TypeError, "v_scale"),
    "k_scale-device": (_kw(k_scale=torch.ones(2, device=META)), ValueError, "k_scale"),
}


@pytest.mark.parametrize("case", list(ERRORS))
@pytest.mark.parametrize("impl", IMPLS)
def test_argument_error(impl, case, no_launch):
    mutate, exc, name = ERRORS[case]
    args, kw = _base(), {"impl": impl}
    mutate(args, kw)
    with pytest.raises(exc, match=name):
        pagedattn.paged_decode(*args, **kw)


@pytest.mark.parametrize("case", list(AUTO_ONLY_ERRORS))
def test_scale_argument_error(case, no_launch):
    mutate, exc, name = AUTO_ONLY_ERRORS[case]
    args, kw = _base(), {}
    mutate(args, kw)
    with pytest.raises(exc, match=name):
        pagedattn.paged_decode(*args, **kw)


# the schedule keywords: ``schedule`` None or "split" (impl="auto" only); "persistent" was
# removed (slower than the split schedule on the GPUs measured: perf-notes step 48) and is
# refused by name, with why; ``num_programs`` (its program count, kept for one release) too
SCHEDULE_ERRORS = {
    "schedule-persistent": (dict(schedule="persistent"), ValueError,
                            r"^schedule: 'persistent' was removed \(.*slower"),
    "schedule-persistent-programs": (dict(schedule="persistent", num_programs=4), ValueError,
                                     r"^schedule: 'persistent' was removed"),
    "schedule-unknown": (dict(schedule="stream-k"), ValueError, r"^schedule: expected None"),
    "schedule-int": (dict(schedule=1), TypeError, r"^schedule: expected None"),
    "schedule-on-a-stage": (dict(schedule="split", impl="gqa_reuse_v3"), ValueError,
                            r"^schedule: expected None for impl='gqa_reuse_v3'"),
    "num_programs": (dict(num_programs=4), ValueError, r"^num_programs: expected None.*removed"),
    "num_programs-split": (dict(schedule="split", num_programs=4), ValueError,
                           r"^num_programs"),
}


@pytest.mark.parametrize("case", list(SCHEDULE_ERRORS))
def test_schedule_error_before_any_launch(case, no_launch):
    """``paged_decode`` (after a plain call of the same shapes made the one-shot fast path's
    template), ``plan_decode`` and the custom op refuse before any launch and any write."""
    from pagedattn.serving import ops

    kw, exc, says = SCHEDULE_ERRORS[case]
    args = _base()
    with pytest.raises(Launched):  # the template of these shapes now exists
        pagedattn.paged_decode(*args)
    out = torch.full_like(args[Q], 7.0)
    with pytest.raises(exc, match=says):
        pagedattn.paged_decode(*args, out=out, **kw)
    assert (out == 7.0).all()
    with pytest.raises(exc, match=says):
        ops.paged_decode(*args, **kw)
    if "impl" not in kw:
        with pytest.raises(exc, match=says):
            pagedattn.plan_decode(args[BT], args[CL], num_q_heads=4, num_kv_heads=2,
                                  head_dim=64, page_size=8, q_dtype=FP16, **kw)


@pytest.mark.parametrize("schedule", [None, "split"])
def test_the_split_schedule_reaches_the_launcher(schedule, no_launch):
    """``schedule=None`` and ``"split"`` (kept for compatibility) are the same schedule."""
    with pytest.raises(Launched):
        pagedattn.paged_decode(*_base(), schedule=schedule)
    plan = pagedattn.plan_decode(*_base()[3:5], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                 page_size=8, q_dtype=FP16, schedule=schedule)
    with pytest.raises(Launched):
        plan.run(*_base()[:3])


# what a stage cannot honour -> the argument the error names
# case -> (mutation, the argument named, the ImplSpec capability that would honour it)
REFUSALS = {
    "fp8-cache": (_both_caches(lambda t: t.to(FP8)), "key_cache", "fp8"),
    "HND": (lambda a, k: (k.update(kv_layout="HND"),
                          _both_caches(lambda t: t.transpose(1, 2).contiguous())(a, k)),
            "kv_layout", "hnd"),
    "return_lse": (_kw(return_lse=True), "return_lse", "lse"),
    "k_scale": (_kw(k_scale=0.5), "k_scale", "fp8"),
    "v_scale": (_kw(v_scale=torch.tensor(0.5)), "v_scale", "fp8"),
}
# every (impl, case) whose capability the impl table says the impl lacks
LACKING = [(impl, case) for impl, spec in pagedattn.IMPLS.items()
           for case, (_, _, capability) in REFUSALS.items() if not getattr(spec, capability)]


@pytest.mark.parametrize("impl,case", LACKING)
def test_impl_refuses_what_it_cannot_honour(impl, case, no_launch):
    """ValueError naming the argument and the impl, never a silent fallback: every impl the
    table marks without a capability (the study's stages, any new impl) refuses it."""
    mutate, name, _ = REFUSALS[case]
    args, kw = _base(), {"impl": impl}
    mutate(args, kw)
    with pytest.raises(ValueError, match=f"{name}.*{impl}"):
        pagedattn.paged_decode(*args, **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_valid_inputs_reach_the_launcher(impl, no_launch):
    """The patch is live: valid inputs get as far as the launcher (so the table above
    proves its errors come before any launch)."""
    with pytest.raises(Launched):
        pagedattn.paged_decode(*_base(), impl=impl)


@pytest.mark.parametrize("validate", [None, True])
def test_value_checks_run_on_cpu(validate):
    """On the CPU, ``validate=None`` runs the value checks too; the message names the row."""
    args = _base()
    args[CL] = torch.tensor([5, 40, 17], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"context_lens.*row 1.*40"):
        pagedattn.paged_decode(*args, validate=validate)
    args = _base()
    args[BT][2, 2] = 1 << 20  # row 2 (ctx 17, page 8) uses columns 0..2
    with pytest.raises(ValueError, match=r"block_tables.*row 2, column 2"):
        pagedattn.paged_decode(*args, validate=validate)


@pytest.mark.parametrize("impl", IMPLS)
def test_validate_false_skips_checks_and_kernels_clamp(impl, device):
    """``validate=False`` skips the value checks (as ``None`` does on CUDA); the kernels then
    clamp each length to ``[0, max_pages * page_size]`` and stay in bounds: a negative length
    gives a zero row, an over-long one the result at the table's capacity."""
    inputs = make_paged_inputs([3, 16, 5], num_q_heads=2, num_kv_heads=1, head_dim=32,
                               page_size=8, dtype=FP16, seed=4, device=device)
    capacity = inputs.block_tables.shape[1] * 8
    wild = torch.tensor([-3, capacity + 100, 5], dtype=torch.int32, device=device)
    out = run(impl, inputs._replace(context_lens=wild), validate=False)
    clamped = torch.tensor([0, capacity, 5], dtype=torch.int32, device=device)
    check(out, inputs._replace(context_lens=clamped))
    assert (out[0] == 0).all()
    _reported(impl, device)
    # int64 lengths past 2^31 clamp too (they were narrowed to int32 first, and wrapped)
    wild64 = torch.tensor([-(1 << 40), (1 << 40) + 3, 5], dtype=torch.int64, device=device)
    out = run(impl, inputs._replace(context_lens=wild64), validate=False)
    check(out, inputs._replace(context_lens=clamped))
    _reported(impl, device)


def _reported(impl, device):
    """The production kernel reports the first length it clamped (the next call raises it,
    or ``check_errors``); the study's stages clamp without reporting."""
    if pagedattn.IMPLS[impl].stage is None:
        with pytest.raises(ValueError, match=r"^context_lens\[0\]"):
            pagedattn.check_errors(device)
    else:
        pagedattn.check_errors(device)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_validate_none_on_cuda_does_not_sync(impl):
    """``validate=None`` on CUDA runs no value check: the call does no device-to-host sync
    (checked with ``torch.cuda.set_sync_debug_mode("error")``), while ``validate=True``
    syncs and is caught by the same detector (so the detector works)."""
    inputs = make_paged_inputs([5, 0, 40], num_q_heads=8, num_kv_heads=2, head_dim=128,
                               page_size=16, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(inputs.query, NAN)
    pagedattn.paged_decode(*inputs, impl=impl, out=out)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pagedattn.paged_decode(*inputs, impl=impl, out=out)
        with pytest.raises(RuntimeError, match="synchroniz"):
            pagedattn.paged_decode(*inputs, impl=impl, out=out, validate=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(out, inputs)


@pytest.mark.gpu
def test_validate_true_on_cuda_checks_values():
    inputs = make_paged_inputs([5, 0, 40], num_q_heads=8, num_kv_heads=2, page_size=16,
                               device="cuda")
    tables = inputs.block_tables.clone()
    tables[2, 2] = 10_000
    with pytest.raises(ValueError, match=r"block_tables.*row 2"):
        pagedattn.paged_decode(*inputs[:3], tables, inputs.context_lens, validate=True)
    over = torch.tensor([5, 0, 49], dtype=torch.int32, device="cuda")  # capacity 48
    with pytest.raises(ValueError, match=r"context_lens.*row 2"):
        pagedattn.paged_decode(*inputs[:4], over, validate=True)


@pytest.mark.gpu
def test_validate_true_under_graph_capture_raises():
    """Capture forbids the sync ``validate=True`` needs: a clear ValueError naming validate,
    raised before anything is enqueued; ``validate=None`` captures fine."""
    inputs = make_paged_inputs([5, 40], num_q_heads=8, num_kv_heads=2, page_size=16,
                               device="cuda")
    out = torch.full_like(inputs.query, NAN)
    pagedattn.paged_decode(*inputs, out=out)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(ValueError, match="validate"):
            pagedattn.paged_decode(*inputs, out=out, validate=True)
        pagedattn.paged_decode(*inputs, out=out)
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    check(out, inputs)


# --- found by an adversarial pass (session 11) ---------------------------------------------


def test_an_out_that_overlaps_itself_or_the_query_is_refused(device):
    """Many programs write ``out`` at once: a broadcast (stride 0) or self-overlapping ``out``
    and one that partly overlaps the query came back as garbage. They are refused before any
    launch, by ``paged_decode`` and by ``plan.run``; ``out`` = the query itself still works
    (each program reads its query rows before writing them)."""
    inp = make_paged_inputs([5, 33], num_q_heads=4, num_kv_heads=2, head_dim=32,
                            dtype=torch.float32, device=device)
    plan = pagedattn.plan_decode(inp.block_tables, inp.context_lens, num_q_heads=4,
                                 num_kv_heads=2, head_dim=32, page_size=16,
                                 q_dtype=torch.float32)
    buf = torch.randn(3, 4, 32, device=device)
    bad = [
        (inp.query, torch.empty(1, 4, 32, device=device).expand(2, -1, -1), "do not overlap"),
        (inp.query, torch.empty(2, 4, 16, device=device).repeat_interleave(2, dim=2)
         .as_strided((2, 4, 32), (64, 16, 1)), "do not overlap"),
        (buf[:2], buf[1:], "apart from the query"),
    ]
    for query, out, words in bad:
        with pytest.raises(ValueError, match=f"out: .*{words}"):
            pagedattn.paged_decode(query, *inp[1:], out=out)
        with pytest.raises(ValueError, match=f"out: .*{words}"):
            plan.run(query, inp.key_cache, inp.value_cache, out=out)
    ref = pagedattn.paged_decode_reference(*inp).out
    for call in (lambda q: pagedattn.paged_decode(q, *inp[1:], out=q),
                 lambda q: plan.run(q, inp.key_cache, inp.value_cache, out=q)):
        q = inp.query.clone()
        assert call(q) is q
        assert torch.allclose(q.double().cpu(), ref.cpu(), atol=1e-4)
    # two halves of one buffer, apart: accepted
    both = torch.empty(4, 4, 32, device=device)
    both[:2] = inp.query
    out = pagedattn.paged_decode(both[:2], *inp[1:], out=both[2:])
    assert torch.allclose(out.double().cpu(), ref.cpu(), atol=1e-4)


@pytest.mark.parametrize("name, value", [
    ("scale", 1e39), ("scale", -1e39), ("scale", 10 ** 400), ("logits_soft_cap", 1e39),
    ("logits_soft_cap", 10 ** 400), ("k_scale", 1e39), ("v_scale", 10 ** 400),
])
def test_values_past_float32_are_refused(name, value):
    """A finite Python value past float32's range became inf (then NaN) in the kernels, and a
    huge int raised OverflowError: a ValueError naming the argument now."""
    args = _base()
    with pytest.raises(ValueError, match=f"^{name}: .*float32"):
        pagedattn.paged_decode(*args, **{name: value})


def test_numpy_integers_work_like_ints():
    """numpy integers pass validation (``numbers.Integral``) and reached Triton or the
    launcher as numpy values (InterpreterError, AttributeError): they now run as ints."""
    np = pytest.importorskip("numpy")
    inp = make_paged_inputs([5, 33], num_q_heads=4, num_kv_heads=2, head_dim=32,
                            dtype=torch.float32)
    ref = pagedattn.paged_decode_reference(*inp, window_left=3).out
    out = pagedattn.paged_decode(*inp, window_left=np.int64(3), num_splits=np.int32(2))
    assert torch.allclose(out.double(), ref, atol=1e-4)
    plan = pagedattn.plan_decode(inp.block_tables, inp.context_lens, num_q_heads=np.int64(4),
                                 num_kv_heads=np.int64(2), head_dim=np.int64(32),
                                 page_size=np.int64(16), q_dtype=torch.float32,
                                 num_splits=np.int64(3), window_left=np.int64(3))
    out = plan.run(inp.query, inp.key_cache, inp.value_cache)
    assert torch.allclose(out.double(), ref, atol=1e-4)


@pytest.mark.parametrize("window_left", [(1 << 31) - 1, 1 << 31, 1 << 63, 10 ** 30])
def test_a_window_past_int32_sees_every_key(window_left):
    """The kernels hold the window in 32 bits: 2^63 read as unsigned gave zeros, 10^30 an
    OverflowError. Any window at least as wide as the context is no window."""
    inp = make_paged_inputs([5, 33], num_q_heads=4, num_kv_heads=2, head_dim=32,
                            dtype=torch.float32)
    ref = pagedattn.paged_decode_reference(*inp).out
    out = pagedattn.paged_decode(*inp, window_left=window_left)
    assert torch.allclose(out.double(), ref, atol=1e-4)


def test_num_splits_is_bounded():
    """``num_splits=10**9`` tried to allocate a terabyte of partials; any count past the
    table's tiles only launched programs with no token (2,048 on 40 tokens took a minute
    in the interpreter). Past 65,536 it is refused; within, it is capped at the tiles."""
    inp = make_paged_inputs([5, 33], num_q_heads=4, num_kv_heads=2, head_dim=32,
                            dtype=torch.float32)
    with pytest.raises(ValueError, match=r"num_splits: expected an int in \[1, 65536\]"):
        pagedattn.paged_decode(*inp, num_splits=10 ** 9)
    with pytest.raises(ValueError, match="num_splits"):
        pagedattn.plan_decode(inp.block_tables, inp.context_lens, num_q_heads=4,
                              num_kv_heads=2, head_dim=32, page_size=16,
                              q_dtype=torch.float32, num_splits=1 << 17)
    plan = pagedattn.plan_decode(inp.block_tables, inp.context_lens, num_q_heads=4,
                                 num_kv_heads=2, head_dim=32, page_size=16,
                                 q_dtype=torch.float32, num_splits=2048)
    ref = pagedattn.paged_decode_reference(*inp).out
    out = plan.run(inp.query, inp.key_cache, inp.value_cache)
    assert torch.allclose(out.double(), ref, atol=1e-4)
    capacity = inp.block_tables.shape[1] * 16
    assert plan._engine().forced_splits <= capacity


def test_tensors_on_another_device_type_are_refused():
    """A ``meta`` tensor failed inside Triton (NotImplementedError): refused by name."""
    inp = make_paged_inputs([5, 33], num_q_heads=4, num_kv_heads=2, head_dim=32,
                            dtype=torch.float32)
    with pytest.raises(ValueError, match="query: expected a CUDA tensor .* got a tensor on meta"):
        pagedattn.paged_decode(*(t.to("meta") for t in inp))
    with pytest.raises(ValueError, match="block_tables: expected a CUDA tensor"):
        pagedattn.plan_decode(inp.block_tables.to("meta"), inp.context_lens.to("meta"),
                              num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                              q_dtype=torch.float32)


def test_messages_name_the_likely_mistake():
    np = pytest.importorskip("numpy")
    args = _base()
    with pytest.raises(ValueError, match="in layout HND: is kv_layout right"):
        pagedattn.paged_decode(*args, kv_layout="HND")  # an NHD cache
    with pytest.raises(TypeError, match="return_lse: expected a Python bool, got numpy.bool"):
        pagedattn.paged_decode(*args, return_lse=np.bool_(True))


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_fp8_scales_must_be_positive(scale):
    """A dequantization scale of 0 or below divided by zero (``append_kv`` stored saturated
    values silently): refused by name, for ``append_kv`` and ``paged_decode``."""
    inp = make_paged_inputs([5, 33], num_q_heads=4, num_kv_heads=2, head_dim=32,
                            dtype=torch.bfloat16, cache_dtype=FP8)
    k = torch.randn(2, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale: expected a finite scale > 0"):
        pagedattn.append_kv(k, k, inp.key_cache, inp.value_cache, torch.tensor([0, 1]),
                            k_scale=scale)
    with pytest.raises(ValueError, match="v_scale: expected a finite scale > 0"):
        pagedattn.paged_decode(*inp, v_scale=scale)


def test_a_window_leaves_the_pages_before_it_free():
    """With a sliding window the pages wholly before the earliest query token's window are
    never read, so a server may free them (-1 in the table): the value checks accept that,
    still refuse a freed page inside the window, and the result is the oracle's on the
    intact table."""
    lens = [70, 5, 0, 33]
    inp = make_paged_inputs(lens, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                            dtype=torch.float32)
    freed = inp.block_tables.clone()
    for b, n in enumerate(lens):
        freed[b, :max(0, n - 1 - 9) // 4] = -1
    ref = pagedattn.paged_decode_reference(*inp, window_left=9).out
    out = pagedattn.paged_decode(*inp[:3], freed, inp.context_lens, window_left=9)
    assert torch.allclose(out.double(), ref, atol=1e-4)
    plan = pagedattn.plan_decode(freed, inp.context_lens, num_q_heads=4, num_kv_heads=2,
                                 head_dim=32, page_size=4, q_dtype=torch.float32,
                                 window_left=9)
    assert torch.allclose(plan.run(*inp[:3]).double(), ref, atol=1e-4)
    with pytest.raises(ValueError, match=r"block_tables.*row 0, column 0"):
        pagedattn.paged_decode(*inp[:3], freed, inp.context_lens)  # no window: all used
    freed[0, (70 - 1 - 9) // 4] = -1  # the window's first page
    with pytest.raises(ValueError, match=r"block_tables.*row 0, column 15"):
        pagedattn.paged_decode(*inp[:3], freed, inp.context_lens, window_left=9)


@pytest.mark.parametrize("name, value", [
    ("scale", 3e38), ("scale", -2.4e38), ("logits_soft_cap", 3e38), ("k_scale", 2.4e38),
    ("logits_soft_cap", 1e-40),
])
def test_scalars_the_kernels_multiply_by_log2e_stay_finite(name, value):
    """The kernels work in base 2: ``scale``, the soft-cap and the fp8 scales are multiplied
    by log2(e) (the cap's reciprocal taken too), so a value within float32's range but past
    FLOAT32_MAX / log2(e) became inf there (scale=3e38: error 0.71; cap=3e38: all NaN)."""
    args = _base()
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        pagedattn.paged_decode(*args, **{name: value})


def test_scale_times_k_scale_must_stay_finite():
    args = list(make_paged_inputs([5, 17], num_q_heads=4, num_kv_heads=2, head_dim=32,
                                  page_size=8, dtype=FP16, cache_dtype=FP8))
    with pytest.raises(ValueError, match="^k_scale: expected scale \\* k_scale"):
        pagedattn.paged_decode(*args, scale=1e30, k_scale=1e30)
    plan = pagedattn.plan_decode(args[3], args[4], num_q_heads=4, num_kv_heads=2, head_dim=32,
                                 page_size=8, q_dtype=FP16, kv_dtype=FP8)
    with pytest.raises(ValueError, match="^k_scale: expected scale \\* k_scale"):
        plan.run(*args[:3], scale=1e30, k_scale=1e30)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), 1e300])
@pytest.mark.parametrize("where", ["paged_decode", "plan.run", "append_kv"])
def test_tensor_fp8_scales_are_value_checked(where, value):
    """fp8 scales given as tensors were never value-checked: a NaN scale gave NaN output, 0 or
    NaN stored saturated garbage (448 / 384) in the cache. Where value checks run (CPU
    tensors, or validate=True) they now raise a ValueError naming the scale, as a float
    scale does."""
    args = list(make_paged_inputs([5, 17], num_q_heads=4, num_kv_heads=2, head_dim=32,
                                  page_size=8, dtype=FP16, cache_dtype=FP8))
    bad = torch.tensor([1.0, value], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^k_scale: expected finite scales > 0 .*\(entry 1\)"):
        if where == "paged_decode":
            pagedattn.paged_decode(*args, k_scale=bad)
        elif where == "plan.run":
            plan = pagedattn.plan_decode(args[3], args[4], num_q_heads=4, num_kv_heads=2,
                                         head_dim=32, page_size=8, q_dtype=FP16, kv_dtype=FP8)
            plan.run(*args[:3], k_scale=bad)
        else:
            key = torch.randn(2, 2, 32)
            pagedattn.append_kv(key, key, args[1], args[2], torch.tensor([0, 1]), k_scale=bad)


@pytest.mark.parametrize("name, values", [
    ("sinks", [0.0, float("nan"), 0.0, 0.0]), ("sinks", [0.0, 0.0, 2.4e38, 0.0]),
    ("sinks", [0.0, 0.0, 0.0, float("inf")]), ("alibi_slopes", [0.0, float("nan"), 0.0, 0.0]),
    ("alibi_slopes", [0.0, float("-inf"), 0.0, 0.0]),
])
def test_sink_and_slope_values_are_checked(name, values):
    """A sink of 2.4e38 is inf once multiplied by log2(e) (the LSE came back inf); NaN sinks
    or slopes gave NaN. A sink of -inf is a head without one and stays valid."""
    args = _base(dtype=torch.float32)
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        pagedattn.paged_decode(*args, **{name: torch.tensor(values)})
    ok = pagedattn.paged_decode(*args, sinks=torch.tensor([0.0, -math.inf, 1.0, -2.0]))
    assert torch.isfinite(ok).all()


@pytest.mark.parametrize("which", ["key_cache", "value_cache"])
@pytest.mark.parametrize("path", ["paged_decode", "plan.run"])
def test_an_out_overlapping_a_cache_is_refused(which, path):
    """``out`` written while the caches are read: a view into a cache gave wrong output
    (error 0.21); only overlap with the query was refused."""
    q, k, v, bt, cl = make_paged_inputs([3, 9, 30], num_q_heads=4, num_kv_heads=2, head_dim=16,
                                        page_size=4, dtype=torch.float32, poison=False)
    cache = k if which == "key_cache" else v
    out = cache.view(-1, 16)[:12].view(3, 4, 16)
    with pytest.raises(ValueError, match=f"^out: expected memory apart from {which}'s"):
        if path == "paged_decode":
            pagedattn.paged_decode(q, k, v, bt, cl, out=out)
        else:
            plan = pagedattn.plan_decode(bt, cl, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                         page_size=4, q_dtype=torch.float32)
            plan.run(q, k, v, out=out)


def test_a_sparse_query_is_a_type_error_naming_it():
    args = _base(dtype=torch.float32)
    args[0] = args[0].to_sparse()
    with pytest.raises(TypeError, match="^query: expected a dense"):
        pagedattn.paged_decode(*args)


@pytest.mark.parametrize("lens", [torch.tensor([1, 2, 3], dtype=torch.complex64),
                                  torch.tensor([1.0, 2.0, 3.0])])
def test_host_context_lens_must_be_integers(lens):
    args = _base()
    with pytest.raises(ValueError, match="^host_context_lens: expected a 1-D integer CPU"):
        pagedattn.plan_decode(args[3], args[4], num_q_heads=4, num_kv_heads=2, head_dim=64,
                              page_size=8, q_dtype=FP16, host_context_lens=lens)


# --- session 14 -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "false", "False", "off", "no", "", "2"])
def test_a_false_triton_interpret_refuses_cpu_tensors(value, monkeypatch):
    """``TRITON_INTERPRET=false`` (or ``2``) read as on: the library now reads the variable as
    Triton does (``pagedattn._env.is_interpreter``, which the CLI uses too)."""
    args = _base(dtype=torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", value)
    with pytest.raises(ValueError, match="expected a CUDA tensor, or CPU tensors with "
                                         "TRITON_INTERPRET=1"):
        pagedattn.paged_decode(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors run in the interpreter only")
@pytest.mark.parametrize("value", ["1", "TRUE", "on", "Yes", "y"])
def test_every_true_word_of_triton_runs_cpu_tensors(value, monkeypatch):
    args = _base(dtype=torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", value)
    ref = pagedattn.paged_decode_reference(*args).out
    assert torch.allclose(pagedattn.paged_decode(*args).double(), ref, atol=1e-4)


@pytest.mark.parametrize("path", ["paged_decode", "plan.run"])
def test_a_sparse_out_is_a_type_error_naming_it(path):
    """A sparse ``out`` got the overlap error (its strides read as 0): refused for its layout,
    as a sparse query is."""
    inp = make_paged_inputs([5, 33], num_q_heads=4, num_kv_heads=2, head_dim=32,
                            dtype=torch.float32)
    out = torch.zeros(2, 4, 32).to_sparse()
    with pytest.raises(TypeError, match="^out: expected a dense"):
        if path == "paged_decode":
            pagedattn.paged_decode(*inp, out=out)
        else:
            plan = pagedattn.plan_decode(inp.block_tables, inp.context_lens, num_q_heads=4,
                                         num_kv_heads=2, head_dim=32, page_size=16,
                                         q_dtype=torch.float32)
            plan.run(inp.query, inp.key_cache, inp.value_cache, out=out)


@pytest.mark.parametrize("bad", [lambda q: q[:, 0], lambda q: q[None, None]],
                         ids=["rank2", "rank5"])
def test_a_query_of_another_rank_names_both_ranks(bad):
    """A query of rank 2 or 5: the error names the ranks a query may have, 3 and 4 (a
    multi-token query); it said rank 3 only."""
    args = _base()
    args[Q] = bad(args[Q])
    with pytest.raises(ValueError, match=r"^query: expected a rank-3 or rank-4 tensor, got "):
        pagedattn.paged_decode(*args)
