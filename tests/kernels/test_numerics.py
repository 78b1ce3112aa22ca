"""Issue 28, the kernel/validation part: int32 safety of the planner and kernels, value bounds
derived from the kernels' float32 arithmetic, fp8 scale values of the serving cache, and one
error type per mistake on both entry points (``paged_decode`` and ``DecodePlan.run``); and
issue 49's ``merge_states`` in the range of the LSEs it is given."""

from __future__ import annotations

import math

import pytest
import torch

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.serving.cache import PagedKVCache
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

NAN = float("nan")
INF = float("inf")


# --- merge_states in its LSEs' range (issue 49) ----------------------------------------------

@pytest.mark.parametrize("offset", [0.0, 1e8, 1e39, -1e30])
def test_merge_states_of_float64_lses_merges_in_float64(offset):
    """float64 LSEs (fresh random, around ``offset``) merge as the float64 softmax of the
    states weighs them, and the LSE comes back float64: float32 had [1e8, 1e8 + 1] equal
    (2.0 for outs 1 and 3 instead of 2.462) and 1e39 infinite (NaN)."""
    g = torch.Generator().manual_seed(int(abs(offset)) % 1000)
    outs = torch.randn(3, 2, 4, 16, generator=g)
    lses = torch.randn(3, 2, 4, generator=g, dtype=torch.float64) * 3 + offset
    m = pagedattn.merge_states(outs, lses)
    w = torch.softmax(lses, dim=0)
    assert m.lse.dtype == torch.float64
    assert torch.allclose(m.out.double(), (w[..., None] * outs.double()).sum(0), atol=1e-6)
    assert torch.allclose(m.lse, torch.logsumexp(lses, dim=0), rtol=1e-15, atol=1e-9)
    two = pagedattn.merge_states(torch.tensor([1.0, 3.0]).view(2, 1, 1, 1).expand(2, 1, 1, 16),
                                 torch.tensor([1e8, 1e8 + 1], dtype=torch.float64).view(2, 1, 1))
    assert torch.allclose(two.out, torch.full((1, 1, 16), (1 + 3 * math.e) / (1 + math.e)))


def test_merge_states_reads_plus_inf_as_an_empty_state():
    """FlashAttention-2 gave a row that saw no key an LSE of +inf (FA3: -inf); merged as
    empty, as vLLM's merge_attn_states does, not as NaN."""
    outs = torch.randn(2, 3, 2, 16)
    lses = torch.tensor([[math.inf, 0.5], [1.0, -2.0], [math.inf, -math.inf]]).T.reshape(2, 3, 1)
    lses = lses.expand(2, 3, 2).contiguous()
    m = pagedattn.merge_states(outs, lses)
    assert torch.equal(m.out[0], outs[1, 0]) and torch.equal(m.lse[0], lses[1, 0])
    assert torch.allclose(m.lse[1], torch.logsumexp(lses[:, 1], dim=0))
    assert (m.out[2] == 0).all() and (m.lse[2] == -math.inf).all()


# --- fp8 scales of the serving cache -------------------------------------------------------

@pytest.mark.parametrize("bad", [0.0, -1.0, NAN, INF, -INF])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("shape", [(), (2,)])
def test_cache_refuses_bad_tensor_scales(name, bad, shape):
    """A tensor scale of 0, < 0, NaN or inf is refused as the float scale is (it was stored
    and reached every decode step, where the hot path reads no data)."""
    s = torch.full(shape, 0.5)
    s.reshape(-1)[-1] = bad
    with pytest.raises(ValueError, match=name):
        PagedKVCache(1, 2, 16, num_pages=2, page_size=4, dtype=torch.float8_e4m3fn,
                     **{name: s})
    good = PagedKVCache(1, 2, 16, num_pages=2, page_size=4, dtype=torch.float8_e4m3fn,
                        **{name: torch.full(shape, 0.5)})
    assert torch.equal(getattr(good, name), torch.full(shape, 0.5))


# --- one error type per mistake on both entry points ----------------------------------------

def _base():
    inp = make_paged_inputs([5, 9], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                            dtype=torch.float32)
    return dict(query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache,
                block_tables=inp.block_tables, context_lens=inp.context_lens)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


# (id, edit of the call's arguments): every mistake that both entry points check
MISTAKES = [
    ("out-dtype", lambda a: a.update(out=torch.empty_like(a["query"], dtype=torch.float16))),
    ("out-shape", lambda a: a.update(out=torch.empty(2, 4, 8))),
    ("out-not-tensor", lambda a: a.update(out=[0.0])),
    ("out-device", lambda a: a.update(out=_meta(a["query"]))),
    ("out-broadcast", lambda a: a.update(out=torch.empty(1, 4, 16).expand(2, 4, 16))),
    ("query-dtype", lambda a: a.update(query=a["query"].half())),
    ("query-rank", lambda a: a.update(query=a["query"][0])),
    ("query-not-tensor", lambda a: a.update(query=a["query"].tolist())),
    ("query-device", lambda a: a.update(query=_meta(a["query"]))),
    ("key-dtype", lambda a: a.update(key_cache=a["key_cache"].half())),
    ("key-rank", lambda a: a.update(key_cache=a["key_cache"][0])),
    ("key-head-dim", lambda a: a.update(key_cache=a["key_cache"][..., :8],
                                        value_cache=a["value_cache"][..., :8])),
    ("value-shape", lambda a: a.update(value_cache=a["value_cache"][:1])),
    ("value-dtype", lambda a: a.update(value_cache=a["value_cache"].half())),
    ("value-not-tensor", lambda a: a.update(value_cache=None)),
    ("scale-str", lambda a: a.update(scale="0.1")),
    ("scale-bool", lambda a: a.update(scale=True)),
    ("scale-nan", lambda a: a.update(scale=NAN)),
    ("scale-huge", lambda a: a.update(scale=1e39)),
    ("k-scale-neg", lambda a: a.update(k_scale=-1.0)),
    ("k-scale-str", lambda a: a.update(k_scale="1")),
    ("k-scale-shape", lambda a: a.update(k_scale=torch.ones(3))),
    ("k-scale-int", lambda a: a.update(k_scale=torch.ones(2, dtype=torch.int32))),
    ("v-scale-bool", lambda a: a.update(v_scale=False)),
    ("return-lse-int", lambda a: a.update(return_lse=1)),
    ("validate-str", lambda a: a.update(validate="yes")),
    ("sinks-dtype", lambda a: a.update(sinks=torch.zeros(4, dtype=torch.float64))),
    ("sinks-shape", lambda a: a.update(sinks=torch.zeros(3))),
    ("alibi-device", lambda a: a.update(alibi_slopes=_meta(torch.zeros(4)))),
    ("alibi-not-tensor", lambda a: a.update(alibi_slopes=[0.0] * 4)),
]


def _call(entry: str, a: dict):
    tensors = ("query", "key_cache", "value_cache")
    if entry == "paged_decode":
        return pagedattn.paged_decode(a.pop("query"), a.pop("key_cache"), a.pop("value_cache"),
                                      a.pop("block_tables"), a.pop("context_lens"), **a)
    base = _base()
    plan = pagedattn.plan_decode(base["block_tables"], base["context_lens"], num_q_heads=4,
                                 num_kv_heads=2, head_dim=16, page_size=4,
                                 q_dtype=torch.float32)
    a.pop("block_tables"), a.pop("context_lens")
    q, k, v = (a.pop(n) for n in tensors)
    return plan.run(q, k, v, **a)


def _error_type(entry: str, edit) -> type:
    a = _base()
    edit(a)
    with pytest.raises((TypeError, ValueError)) as e:
        _call(entry, a)
    # pagedattn's own message, naming an argument ("name: ..."), not Python's call error
    assert str(e.value).split(":")[0].isidentifier(), str(e.value)
    return e.type


@pytest.mark.parametrize("mistake", [m[1] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_one_error_type_per_mistake(mistake):
    """The same mistake raises the same exception type through ``paged_decode`` and through
    ``plan_decode(...).run`` (a wrong-dtype ``out`` was TypeError in one, ValueError in the
    other)."""
    assert _error_type("paged_decode", mistake) is _error_type("plan.run", mistake)


def test_the_base_call_runs():
    """The mistakes above are edits of a call that both entry points accept."""
    for entry in ("paged_decode", "plan.run"):
        out = _call(entry, _base())
        assert torch.isfinite(out).all()


# --- int32 safety, with the interpreter's int32 wrapping as a GPU's -------------------------

INT32_MAX = (1 << 31) - 1


def _poisoned_run(inputs, query=None, **kw):
    query = inputs.query if query is None else query
    out = torch.full_like(query, NAN)
    result = pagedattn.paged_decode(query, *inputs[1:], out=out, **kw)
    assert result is out
    return out


@pytest.mark.parametrize("num_splits", [None, 2])
@pytest.mark.parametrize("window_left", [INT32_MAX, INT32_MAX - 1, 1 << 40, 200])
def test_multi_token_huge_window_is_int32_safe(window_left, num_splits):
    """A window at least as wide as the context sees every key (README), with several query
    tokens and a length-0 sequence in the batch: the planner's ``n - q_len - window_left``
    overflowed int32 (an interpreter traceback; with a GPU's wrapping the other sequences'
    outputs were left unwritten). Now no int32 operation of the kernels overflows."""
    from pagedattn.launch._triton_compat import gpu_int32

    inputs = make_paged_inputs([5, 0, 200], num_q_heads=4, num_kv_heads=2, head_dim=16,
                               page_size=16, dtype=torch.float32, max_pages=20, seed=1)
    query = torch.randn(3, 3, 4, 16, generator=torch.Generator().manual_seed(2))
    with gpu_int32() as overflows:
        out = _poisoned_run(inputs, query, window_left=window_left, num_splits=num_splits)
    assert overflows == []
    ref = paged_decode_reference(query, *inputs[1:], window_left=window_left).out
    assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)


@pytest.mark.parametrize("impl", list(pagedattn.IMPLS))
def test_table_capacity_past_int32_is_safe(impl):
    """``max_pages * page_size >= 2^31`` (a table of 2^19 pages of 4096 tokens): the kernels'
    int32 ``max_pages * page_size`` wrapped to a negative capacity (the stages returned zeros,
    ``auto`` read outside the cache). The kernels now see at most ``MAX_CONTEXT_LEN``."""
    from pagedattn.launch._triton_compat import gpu_int32

    lens = [4100, 0, 9] if impl in ("auto", "gqa_reuse_v3") else [20, 0, 9]
    inputs = make_paged_inputs(lens, num_q_heads=2, num_kv_heads=1, head_dim=16,
                               page_size=4096, dtype=torch.float32, max_pages=1 << 19)
    with gpu_int32() as overflows:
        out = _poisoned_run(inputs, impl=impl)
    assert overflows == []
    assert rel_l2_error(out, paged_decode_reference(*inputs).out) <= tolerance_for(
        torch.float32)


def test_lengths_past_the_kernels_int32_bound_are_refused():
    """A length past ``MAX_CONTEXT_LEN`` (2^30) is refused by the value checks, naming
    ``context_lens``, even when the table holds it; ``page_size`` past it by the metadata
    checks."""
    from pagedattn._validation import MAX_CONTEXT_LEN

    inputs = make_paged_inputs([5], num_q_heads=2, num_kv_heads=1, head_dim=16,
                               page_size=4096, dtype=torch.float32, max_pages=1 << 19)
    lens = torch.tensor([MAX_CONTEXT_LEN + 1], dtype=torch.int64)
    with pytest.raises(ValueError, match="context_lens.*int32"):
        pagedattn.paged_decode(*inputs[:4], lens)
    q = torch.zeros(1, 1, 16)
    k = torch.zeros(1, 1, 1, 16).expand(1, MAX_CONTEXT_LEN + 1, 1, 16)
    with pytest.raises(ValueError, match="page_size"):
        pagedattn.paged_decode(q, k, k, inputs.block_tables[:, :1], inputs.context_lens)


# --- value bounds derived from the kernels' float32 arithmetic ------------------------------

D = 16
LOG2E = 1.4426950408889634
LIMIT = 2.0 ** 127


def _uniform_inputs(dtype, q_val, k_val, v_scale_val=1.0, lens=(4, 7), seed=0, cache=None):
    """q all ``q_val``; token 0 of each sequence's keys all ``k_val`` (so ``q·k`` reaches
    ``D · q_val · k_val``), the other keys ``± k_val`` at random; values random in
    ``[-v_scale_val, v_scale_val]``."""
    inputs = make_paged_inputs(list(lens), num_q_heads=2, num_kv_heads=1, head_dim=D,
                               page_size=4, dtype=dtype, cache_dtype=cache, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.full_like(inputs.query, q_val)
    k = inputs.key_cache.float()
    v = inputs.value_cache.float()
    used = torch.isfinite(k)
    signs = torch.where(torch.rand(k.shape, generator=g) < 0.5, -1.0, 1.0)
    k = torch.where(used, signs * k_val, k)
    for b in range(len(lens)):  # token 0 of each sequence: all +k_val
        k[inputs.block_tables[b, 0], 0] = k_val
    v = torch.where(used, (torch.rand(v.shape, generator=g) * 2 - 1) * v_scale_val, v)
    cd = inputs.key_cache.dtype
    return inputs._replace(query=q, key_cache=k.to(cd), value_cache=v.to(cd))


def _inside_and_outside(impl, inside, outside, name, **kw):
    """``inside`` computes within tolerance of the float64 oracle; ``outside`` is refused,
    naming ``name``."""
    ref_kw = {k: v for k, v in kw.items() if k in ("scale", "k_scale", "v_scale")}
    out = _poisoned_run(inside, impl=impl, **kw)
    ref = paged_decode_reference(*inside, **ref_kw).out
    tol = tolerance_for(inside.key_cache.dtype)
    assert rel_l2_error(out, ref) <= tol, rel_l2_error(out, ref)
    with pytest.raises(ValueError, match=f"^{name}:.*2\\^127"):
        _poisoned_run(outside, impl=impl, **kw)


@pytest.mark.parametrize("impl", ["auto", "gqa_reuse_v3", "split_kv_v4"])
def test_qk_dot_bound(impl):
    """bf16 q and k near 1e19 with a small scale: ``q·k`` overflowed float32 before the scale
    (NaN). ``D · max|q| · max|k| <= 2^127`` (``query``): 2^127 exactly computes; one bf16 step
    more is refused."""
    a, b = 2.0 ** 62, 2.0 ** 61  # D · a · b = 2^127
    step = 1 + 2.0 ** -7  # the next bf16 value
    inside = _uniform_inputs(torch.bfloat16, a, b)
    outside = _uniform_inputs(torch.bfloat16, a, b * step)
    _inside_and_outside(impl, inside, outside, "query", scale=2.0 ** -123)


@pytest.mark.parametrize("impl", ["auto", "fused_v1", "split_kv_v4"])
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_score_bound(impl, sign):
    """scale = -1e37 or 2e38 with ordinary q and k: scores past float32 (``auto`` NaN, the
    stages a wrong average). ``D · max|q| · max|k| · |scale| · log2(e) <= 2^127``."""
    bound = LIMIT / (D * LOG2E)  # q = k = 1
    inside = _uniform_inputs(torch.float32, 1.0, 1.0)
    out = _poisoned_run(inside, impl=impl, scale=sign * bound * 0.999)
    ref = paged_decode_reference(*inside, scale=sign * bound * 0.999).out
    assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)
    for scale in (sign * bound * 1.001, -1e37, 2e38):
        with pytest.raises(ValueError, match="^scale:.*2\\^127"):
            _poisoned_run(inside, impl=impl, scale=scale)


@pytest.mark.parametrize("impl", ["fused_v1", "gqa_reuse_v3"])
def test_prescaled_query_bound(impl):
    """The stages multiply q by ``scale · log2(e)`` first: ``max|q| · |scale| · log2(e) <=
    2^127`` even where the scores are small (tiny keys)."""
    bound = LIMIT / LOG2E  # q = 1
    inside = _uniform_inputs(torch.float32, 1.0, 2.0 ** -8)
    out = _poisoned_run(inside, impl=impl, scale=bound * 0.999)
    ref = paged_decode_reference(*inside, scale=bound * 0.999).out
    assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)
    with pytest.raises(ValueError, match="^scale:.*2\\^127"):
        _poisoned_run(inside, impl=impl, scale=bound * 1.001)


@pytest.mark.parametrize("impl", ["auto", "gqa_reuse_v3", "split_kv_v4"])
def test_value_sum_bound(impl):
    """bf16 V near 1e38: the float32 sum of ``n`` probability-weighted values overflowed (inf
    in the output). ``max context_lens · max|v| <= 2^127`` (``value_cache``)."""
    lens = (4, 3)
    inside = _uniform_inputs(torch.bfloat16, 0.0, 1.0, lens=lens)  # q = 0: uniform weights
    v = inside.value_cache.float()
    v = torch.where(torch.isfinite(v), torch.where(v < 0, -1.0, 1.0) * 2.0 ** 125, v)
    inside = inside._replace(value_cache=v.to(torch.bfloat16))  # 4 · 2^125 = 2^127
    outside = inside._replace(value_cache=(v * (1 + 2.0 ** -7)).to(torch.bfloat16))
    _inside_and_outside(impl, inside, outside, "value_cache")


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qmax", [6e-35, 4e-35, 1e-38, 1e-40, 1e-45])
def test_fp8_tiny_query_rows(q_dtype, qmax):
    """An fp8 cache and a query row whose max |q| is below about 5e-35 (2^-114): the
    power-of-two rescale into fp16's range made 2^e inf and the row NaN. The exponent is
    clamped now; the scores are ~0 and the output the values' average, as in the oracle."""
    if q_dtype == torch.bfloat16 and qmax < 1e-40:
        pytest.skip("below bfloat16's subnormals")
    inputs = make_paged_inputs([5, 9], num_q_heads=4, num_kv_heads=2, head_dim=D,
                               page_size=4, dtype=q_dtype, cache_dtype=torch.float8_e4m3fn)
    q = inputs.query.float()
    q[0] = q[0] / q[0].abs().amax() * qmax  # one sequence's rows tiny
    q = q.to(q_dtype)
    assert q[0].abs().amax() > 0
    out = _poisoned_run(inputs, q, k_scale=0.5, v_scale=2.0)
    ref = paged_decode_reference(q, *inputs[1:], k_scale=0.5, v_scale=2.0).out
    assert rel_l2_error(out, ref) <= tolerance_for(torch.float8_e4m3fn)


def test_workspace_rows_past_int32_are_refused():
    """Forced splits whose partial rows (``rows · q_len · num_q_heads``) pass 2^31 would wrap
    the kernels' int32 row index: refused before any allocation or launch, naming
    ``num_splits``."""
    from pagedattn.launch.decode import AutoLauncher
    from pagedattn.spec import LaunchSpec

    kw = dict(max_pages=1 << 20, num_q_heads=64, num_kv_heads=8, head_dim=16, page_size=16,
              q_dtype=torch.float16, kv_dtype=torch.float16, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="num_splits"):
        AutoLauncher(LaunchSpec(batch=1 << 11, num_splits=1 << 14, **kw))
    assert AutoLauncher(LaunchSpec(batch=1, num_splits=1 << 10, **kw)).rows_max == 1 << 10


def test_value_bounds_ignore_unread_data():
    """The bounds cover what the kernels read: the query of an empty sequence and cache rows
    past a length (or in unused pages) may hold anything, even NaN or inf."""
    inputs = make_paged_inputs([0, 5, 9], num_q_heads=2, num_kv_heads=1, head_dim=D,
                               page_size=4, dtype=torch.bfloat16)  # poisoned past lengths
    q = inputs.query.clone()
    q[0] = float("inf")
    out = _poisoned_run(inputs, q)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = paged_decode_reference(q[1:], *inputs[1:3], inputs.block_tables[1:],
                                 inputs.context_lens[1:]).out
    assert rel_l2_error(out[1:], ref) <= tolerance_for(torch.bfloat16)


@pytest.mark.parametrize("kw", [
    dict(), dict(num_splits=3), dict(window_left=5), dict(window_left=0, num_splits=2),
    dict(batch_invariant=True), dict(logits_soft_cap=5.0, window_left=30),
    dict(q_len=3, window_left=7), dict(q_len=2, batch_invariant=True, window_left=1 << 31),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_no_int32_overflow_across_variants(kw):
    """Every variant of ``auto`` with a GPU's int32 wrapping: no int32 operation of the
    kernels overflows, and the result is the oracle's (the 2^31 table: see above)."""
    from pagedattn.launch._triton_compat import gpu_int32

    kw = dict(kw)
    q_len = kw.pop("q_len", 1)
    page_size, max_pages = 16, None
    lens = [70, 0, 33]
    inputs = make_paged_inputs(lens, num_q_heads=4, num_kv_heads=2, head_dim=16,
                               page_size=page_size, dtype=torch.float32, seed=3,
                               max_pages=max_pages)
    query = inputs.query
    if q_len > 1:
        query = torch.randn(len(lens), q_len, 4, 16, generator=torch.Generator().manual_seed(4))
    with gpu_int32() as overflows:
        out = _poisoned_run(inputs, query, **kw)
    assert overflows == []
    ref_kw = {k: v for k, v in kw.items() if k in ("window_left", "logits_soft_cap")}
    ref = paged_decode_reference(query, *inputs[1:], **ref_kw).out
    assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)
