"""Issue 28, the kernel/validation part: int32 safety of the planner and kernels, value bounds
derived from the kernels' float32 arithmetic, fp8 scale values of the serving cache, and one
error type per mistake on both entry points (``paged_decode`` and ``DecodePlan.run``)."""

from __future__ import annotations

import pytest
import torch

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.serving.cache import PagedKVCache
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

NAN = float("nan")
INF = float("inf")


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
    from _int32 import gpu_int32

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
    from _int32 import gpu_int32

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
