"""``DecodePlan.run``'s fast check accepts nothing that the precise check refuses.

``run`` first tries one expression for the serving call (``DecodePlan._common_call``); on
anything else it falls through to ``_validation.check_run``, which names the argument. A
property test (hypothesis) draws run arguments that vary dtype, shape, strides, device
(cpu/meta), layout (strided/sparse), contiguity, storage overlap of ``out`` with the query
and the caches, float and tensor scales, ``out``, ``return_lse`` and ``validate``, and
asserts: whenever ``check_run`` raises, the fast check refuses, and ``run`` raises
``check_run``'s error (same type, same message) before any launch.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedattn
from pagedattn import _validation as V
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
    """A tensor of about ``shape``: contiguous, a transposed or sliced (non-contiguous) view,
    a stride-0 broadcast, a view into ``base``'s storage, sparse, on meta, or a subclass."""
    shape = _shape(draw, shape)
    dtype = draw(st.sampled_from([dtype] * 6 + DTYPES))
    form = draw(st.sampled_from(["contiguous"] * 4 + ["transposed", "sliced", "broadcast",
                                                      "sparse", "meta", "param"]
                                + (["in_base"] * 2 if base is not None else [])))
    make = (lambda s: torch.randn(s).to(dtype)) if dtype.is_floating_point \
        else (lambda s: torch.zeros(s, dtype=dtype))
    if form == "transposed" and len(shape) >= 2:
        return make(shape[:-2] + shape[-2:][::-1]).transpose(-1, -2)
    if form == "sliced" and shape:
        return make(shape[:-1] + [shape[-1] * 2])[..., ::2]
    if form == "broadcast" and shape:
        return make([1] + shape[1:]).expand(shape)
    if form == "sparse" and dtype in (torch.float16, torch.float32, torch.int32):
        return make(shape).to_sparse()
    if form == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if form == "param" and dtype.is_floating_point:
        return torch.nn.Parameter(make(shape), requires_grad=False)
    if form == "in_base" and base.dtype == dtype and base.is_contiguous() \
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
    """A plan and run arguments: valid except for at most two drawn from wide strategies
    (most draws then fail on one argument, not always on the query)."""
    plan, x = draw(st.sampled_from(PLAN_OBJECTS))
    q_shape = list(plan._q_shape)
    varied = draw(st.sets(st.sampled_from(NAMES), max_size=2))
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


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run_args())
def test_the_fast_check_accepts_nothing_check_run_refuses(drawn):
    plan, a = drawn
    refused = _precise(plan, a)
    fast = plan._common_call(a["query"], a["key_cache"], a["value_cache"], a["scale"],
                             a["k_scale"], a["v_scale"], a["out"], a["return_lse"],
                             a["validate"])
    if refused is None:
        return
    assert fast is False, f"the fast check accepted what check_run refuses: {refused}"
    plan_launch = plan._launch

    def launched(*args, **kwargs):
        raise Launched

    plan._launch = launched
    try:
        with pytest.raises(type(refused)) as raised:
            plan.run(**a)
    finally:
        plan._launch = plan_launch
    assert str(raised.value) == str(refused)


def test_a_sparse_query_is_refused_by_name():
    """Found by the property test: a sparse query of the plan's shape, dtype and device
    passed the fast check (``type(query) is torch.Tensor``) and failed in the launcher with
    ``NotImplementedError``; it is the precise check's ``TypeError`` naming ``query`` now."""
    plan, x = PLAN_OBJECTS[0]
    with pytest.raises(TypeError, match="query: expected a dense"):
        plan.run(x.query.to_sparse(), x.key_cache, x.value_cache)
