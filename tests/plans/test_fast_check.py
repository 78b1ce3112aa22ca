"""``DecodePlan.run``'s fast check accepts nothing that the precise check refuses.

``run`` first tries one expression for the serving call (``DecodePlan.is_plain_call``); on
anything else it falls through to ``_validation.check_run``, which names the argument. A
property test (hypothesis) draws run arguments that vary dtype, shape, strides, device
(cpu/meta), layout (strided/sparse), contiguity, storage overlap of ``out`` with the query
and the caches, float and tensor scales, ``out``, ``return_lse`` and ``validate``, and
asserts: whenever ``check_run`` raises, the fast check refuses, and ``run`` raises
``check_run``'s error (same type, same message) before any launch.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedattn
from pagedattn import _validation as V
from pagedattn import api, one_shot, options
from pagedattn._env import is_interpreter
from pagedattn.testing import make_paged_inputs

FP8 = torch.float8_e4m3fn
SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
#: (q_dtype, kv_dtype, kv_layout, q_len) of the plans the arguments are drawn against
PLANS = [(torch.float16, torch.float16, "NHD", 1), (torch.bfloat16, FP8, "HND", 1),
         (torch.float32, torch.float32, "NHD", 2)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, FP8, torch.int32]
FLOATS = [0.5, 1.0, 1e-30, 2.0e38, 3.0e38, -0.5, 0.0, -1.0, math.inf, -math.inf, math.nan]


class Launched(Exception):
    pass


def _plan(q_dtype, kv_dtype, kv_layout, q_len):
    x = make_paged_inputs([5, 9], dtype=q_dtype, cache_dtype=kv_dtype, kv_layout=kv_layout,
                          max_pages=3, **SHAPE)
    plan = pagedattn.plan_decode(x.block_tables, x.context_lens, q_dtype=q_dtype,
                                 kv_dtype=kv_dtype, kv_layout=kv_layout, q_len=q_len, **SHAPE)
    return plan, x


def _shape(draw, shape):
    """The plan's shape, or one with a dim changed, added or dropped."""
    kind = draw(st.sampled_from(["same"] * 4 + ["dim", "extra", "fewer"]))
    shape = list(shape)
    if kind == "dim":
        i = draw(st.integers(0, len(shape) - 1))
        shape[i] = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 32]))
    elif kind == "extra":
        shape.insert(draw(st.integers(0, len(shape))), 1)
    elif kind == "fewer":
        shape.pop(draw(st.integers(0, len(shape) - 1)))
    return shape


def _tensor(draw, shape, dtype, base=None):
    """A tensor of ``shape`` and ``dtype`` with one change drawn: another shape or dtype, a
    transposed or sliced (non-contiguous) view, a stride-0 broadcast, a view into ``base``'s
    storage, sparse, on meta, or a subclass (``nn.Parameter``)."""
    change = draw(st.sampled_from(["shape", "dtype", "transposed", "sliced",
                                   "broadcast", "sparse", "meta", "param"]
                                  + (["in_base"] * 2 if base is not None else [])))
    if change == "shape":
        shape = _shape(draw, shape)
    if change == "dtype":
        dtype = draw(st.sampled_from([d for d in DTYPES if d != dtype]))

    def make(s):
        return torch.randn(s).to(dtype) if dtype.is_floating_point \
            else torch.zeros(s, dtype=dtype)

    if change == "transposed" and len(shape) >= 2:
        return make(shape[:-2] + shape[-2:][::-1]).transpose(-1, -2)
    if change == "sliced" and shape:
        return make(shape[:-1] + [shape[-1] * 2])[..., ::2]
    if change == "broadcast" and shape:
        return make([1] + shape[1:]).expand(shape)
    if change == "sparse" and dtype != FP8:  # (torch has no fp8 sparse tensors)
        return make(shape).float().to_sparse().to(dtype)
    if change == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if change == "param" and dtype.is_floating_point:
        return torch.nn.Parameter(make(shape), requires_grad=False)
    if change == "in_base" and base.dtype == dtype and base.is_contiguous() \
            and base.numel() >= math.prod(shape):
        flat = base.view(-1)
        offset = draw(st.integers(0, base.numel() - math.prod(shape)))
        return flat[offset:offset + math.prod(shape)].view(shape)
    return make(shape)


def _scale(draw, fp8_tensor_shape):
    kind = draw(st.sampled_from(["none"] * 3 + ["float"] * 4 + ["int", "bool", "numpy",
                                                                "tensor0", "tensor1",
                                                                "tensor_bad", "string"]))
    if kind == "none":
        return None
    if kind == "float":
        return draw(st.sampled_from(FLOATS))
    if kind == "int":
        return draw(st.sampled_from([1, 0, -2, 10**400]))
    if kind == "bool":
        return True
    if kind == "numpy":
        return np.float32(draw(st.sampled_from(FLOATS)))
    if kind == "tensor0":
        return torch.tensor(draw(st.sampled_from(FLOATS)))
    if kind == "tensor1":
        return torch.rand(fp8_tensor_shape) + 0.5
    if kind == "tensor_bad":
        return torch.ones(fp8_tensor_shape + 1)
    return "0.5"


#: the arguments a draw may vary; the others keep a valid value
NAMES = ("query", "key_cache", "value_cache", "out", "scale", "k_scale", "v_scale",
         "return_lse", "validate")


@st.composite
def run_args(draw):
    """A plan and run arguments: valid except for one or two drawn from wide strategies
    (a draw then fails on one argument, not always on the query)."""
    plan, x = draw(st.sampled_from(PLAN_OBJECTS))
    q_shape = list(plan.q_shape)
    varied = draw(st.sets(st.sampled_from(NAMES), min_size=1, max_size=2))
    query = (_tensor(draw, q_shape, plan.q_dtype) if "query" in varied
             else torch.randn(q_shape).to(plan.q_dtype))
    key_cache = (_tensor(draw, list(x.key_cache.shape), plan.kv_dtype)
                 if "key_cache" in varied else x.key_cache)
    value_cache = (_tensor(draw, list(x.value_cache.shape), plan.kv_dtype)
                   if "value_cache" in varied else x.value_cache)
    out = draw(st.sampled_from([None, "fresh", "query"]))
    out = {None: None, "query": query}.get(out, torch.empty(q_shape, dtype=plan.q_dtype))
    if "out" in varied:
        out_kind = draw(st.sampled_from(["drawn", "query_view", "key_cache"]))
        strided_cpu = [t for t in (query, key_cache) if isinstance(t, torch.Tensor)
                       and t.layout == torch.strided and t.device.type == "cpu"]
        base = (query if out_kind == "query_view" else key_cache) \
            if out_kind != "drawn" else None
        out = _tensor(draw, q_shape, plan.q_dtype,
                      base=base if any(base is t for t in strided_cpu) else None)
    args = dict(query=query, key_cache=key_cache, value_cache=value_cache, out=out)
    if draw(st.integers(0, 15)) == 0:  # not a tensor at all
        args[draw(st.sampled_from(NAMES[:4]))] = [1.0]
    valid_scale = st.sampled_from([None, None, 0.5, 1.0, 2.0e38])
    for name in ("scale", "k_scale", "v_scale"):
        args[name] = (_scale(draw, SHAPE["num_kv_heads"]) if name in varied
                      else draw(valid_scale))
    args["return_lse"] = draw(st.sampled_from([0, 1, None, np.bool_(True), "no"])
                              if "return_lse" in varied else st.booleans())
    args["validate"] = draw(st.sampled_from([False, True, 0, "yes"])
                            if "validate" in varied else st.just(None))
    return plan, args


if not is_interpreter():  # CPU tensors run through Triton's interpreter only (a GPU machine)
    pytest.skip("the fast checks are drawn on CPU tensors: TRITON_INTERPRET=1 is not set",
                allow_module_level=True)
PLAN_OBJECTS = [_plan(*p) for p in PLANS]


def _precise(plan, a):
    """``check_run``'s verdict: the exception it raises, or None."""
    try:
        V.check_run(plan, a["query"], a["key_cache"], a["value_cache"], scale=a["scale"],
                    k_scale=a["k_scale"], v_scale=a["v_scale"], out=a["out"],
                    return_lse=a["return_lse"], validate=a["validate"])
    except (TypeError, ValueError) as e:
        return e
    return None


@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run_args())
def test_the_fast_check_accepts_nothing_check_run_refuses(drawn):
    plan, a = drawn
    refused = _precise(plan, a)
    fast = plan.is_plain_call(a["query"], a["key_cache"], a["value_cache"], a["scale"],
                              a["k_scale"], a["v_scale"], a["out"], a["return_lse"],
                              a["validate"])
    if refused is None:
        return
    assert fast is False, f"the fast check accepted what check_run refuses: {refused}"
    plan_launch = plan.launch

    def launched(*args, **kwargs):
        raise Launched

    plan.launch = launched
    try:
        with pytest.raises(type(refused)) as raised:
            plan.run(**a)
    finally:
        plan.launch = plan_launch
    assert str(raised.value) == str(refused)


def test_a_sparse_query_is_refused_by_name():
    """Found by the property test: a sparse query of the plan's shape, dtype and device
    passed the fast check (``type(query) is torch.Tensor``) and failed in the launcher with
    ``NotImplementedError``; it is the precise check's ``TypeError`` naming ``query`` now."""
    plan, x = PLAN_OBJECTS[0]
    with pytest.raises(TypeError, match="query: expected a dense"):
        plan.run(x.query.to_sparse(), x.key_cache, x.value_cache)


@st.composite
def one_shot_args(draw):
    """``paged_decode`` arguments: a plan's run arguments (as above) plus the tables, the
    layout and the plan-time variants, each valid or drawn wide."""
    plan, a = draw(run_args())
    x = next(x for p, x in PLAN_OBJECTS if p is plan)
    varied = draw(st.sets(st.sampled_from(["block_tables", "context_lens", "num_splits",
                                           "window_left", "logits_soft_cap",
                                           "batch_invariant", "kv_layout", "impl"]),
                          max_size=2))
    for name in ("block_tables", "context_lens"):
        t = getattr(x, name)
        a[name] = _tensor(draw, list(t.shape), t.dtype) if name in varied else t
        if name in varied and a[name].dtype.is_floating_point:
            a[name] = a[name].to(draw(st.sampled_from([torch.int64, torch.int16,
                                                       torch.float32])))
    wide = dict(num_splits=[0, 1, 3, 10**6, np.int64(2), True, 2.0],
                window_left=[-2, -1, 0, 5, 2**40, np.int32(3), True, 1.5],
                logits_soft_cap=[0.0, -1.0, 1e-45, 30.0, math.inf, math.nan, 30, True],
                batch_invariant=[0, 1, np.bool_(True), None],
                kv_layout=["nhd", "HND", "NHD", 1], impl=["Auto", None, "split_kv_v4"])
    valid = dict(num_splits=[None, 2], window_left=[-1, 6], logits_soft_cap=[None, 20.0],
                 batch_invariant=[False, True], kv_layout=[plan.kv_layout], impl=["auto"])
    for name in wide:
        a[name] = draw(st.sampled_from(wide[name] if name in varied else valid[name]))
    if plan.q_len > 1:  # the plan's 4-D query: its tokens are the one-shot's q_len
        a["window_left"] = -1 if "window_left" not in varied else a["window_left"]
    return plan, a


def _precise_one_shot(a):
    """``check_metadata``'s verdict with the variants' (``api.check_decode``), then the
    impl's capabilities, or None."""
    names = ("query", "key_cache", "value_cache", "block_tables", "context_lens")
    variants = {k: v for k, v in a.items() if k in options.OPTIONS}
    try:
        api.check_decode(*(a[n] for n in names), variants=variants,
                         **{k: v for k, v in a.items() if k not in names and k not in variants})
        spec = pagedattn.IMPLS[a["impl"]]
        api._check_capabilities(spec, a["key_cache"], a["kv_layout"], a["k_scale"],
                                a["v_scale"], a["return_lse"], a["query"], variants)
    except (TypeError, ValueError) as e:
        return e
    return None


@pytest.fixture(scope="module")
def warm_templates():
    """One valid one-shot call per plan's shapes and each valid variant choice, launches
    stubbed: the templates the fast path would use."""
    real = api.DecodePlan.launch

    def stub(self, query, *args, tables=None, **kwargs):
        out = torch.zeros(self.q_shape, dtype=self.q_dtype)
        return (out, {}) if tables is not None else out

    api.DecodePlan.launch = stub
    try:
        for plan, x in PLAN_OBJECTS:
            q = torch.randn(plan.q_shape).to(plan.q_dtype)
            for splits, window, cap, inv in itertools.product((None, 2), (-1, 6),
                                                              (None, 20.0), (False, True)):
                pagedattn.paged_decode(q, x.key_cache, x.value_cache, x.block_tables,
                                       x.context_lens, kv_layout=plan.kv_layout,
                                       num_splits=splits, window_left=window,
                                       logits_soft_cap=cap, batch_invariant=inv)
    finally:
        api.DecodePlan.launch = real
    templates = dict(one_shot.TEMPLATES)
    assert len(templates) == 16 * len(PLAN_OBJECTS)
    return templates


@settings(max_examples=2500, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(drawn=one_shot_args())
def test_the_one_shot_fast_path_accepts_nothing_check_metadata_refuses(drawn,
                                                                       warm_templates):
    """With the templates of earlier valid calls in place, a one-shot call that
    ``check_metadata`` refuses never reaches a launch: it raises that error."""
    plan, a = drawn
    one_shot.TEMPLATES.clear()
    one_shot.TEMPLATES.update(warm_templates)
    refused = _precise_one_shot(a)
    if refused is None:
        return
    real = api.DecodePlan.launch

    def launched(*args, **kwargs):
        raise Launched

    api.DecodePlan.launch = launched
    try:
        with pytest.raises(type(refused)) as raised:
            pagedattn.paged_decode(**a)
    finally:
        api.DecodePlan.launch = real
    assert str(raised.value) == str(refused)
