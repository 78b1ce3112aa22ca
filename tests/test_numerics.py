"""Issue 28, the kernel/validation part: int32 safety of the planner and kernels, value bounds
derived from the kernels' float32 arithmetic, fp8 scale values of the serving cache, and one
error type per mistake on both entry points (``paged_decode`` and ``DecodePlan.run``)."""

from __future__ import annotations

import pytest
import torch

import pagedattn
from pagedattn.serving.cache import PagedKVCache
from pagedattn.testing import make_paged_inputs

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
