"""torch integration: the kernels as ``torch.library`` custom ops with fake (meta) kernels.

Registered names (on the first import of this module, as ``torch.library`` requires):

* ``torch.ops.pagedattn.paged_decode`` -- functional: returns a new ``out``.
* ``torch.ops.pagedattn.paged_decode_lse`` -- functional: returns ``(out, lse)``.
* ``torch.ops.pagedattn.append_kv`` -- mutates ``key_cache`` and ``value_cache`` in place.

Each has a fake implementation (shapes and dtypes only), so ``torch.compile(fullgraph=True)``
traces a decode step through them without a graph break, and ``torch.library.opcheck``
passes. The fake kernels run the same metadata validation as the eager path, so a bad shape
fails at trace time with the eager error. Triton is imported only when a real kernel runs.

In the ops the fp8 scales are tensors (0-d or ``[num_kv_heads]``, on the query's device), as
a schema cannot hold "float or tensor"; the Python wrappers :func:`paged_decode` and
:func:`append_kv` below also take floats and turn them into 0-d device tensors with a fill
(no host-to-device copy, so it is CUDA-graph safe).
"""

import inspect

import torch

from pagedattn import _validation as V
from pagedattn import api
from pagedattn import options as O

#: the decode ops' arguments before the variants: (name, schema type, default or EMPTY);
#: the variants (pagedattn.options) follow, then ``(out, lse)`` differ only in the return
_EMPTY = inspect.Parameter.empty
_DECODE_ARGS = (("query", "Tensor", _EMPTY), ("key_cache", "Tensor", _EMPTY),
                ("value_cache", "Tensor", _EMPTY), ("block_tables", "Tensor", _EMPTY),
                ("context_lens", "Tensor", _EMPTY), ("scale", "float?", None),
                ("impl", "str", "auto"), ("num_splits", "int?", None),
                ("schedule", "str?", None), ("num_programs", "int?", None),
                ("kv_layout", "str", "NHD"), ("k_scale", "Tensor?", None),
                ("v_scale", "Tensor?", None))

_TENSORS = ("query", "key_cache", "value_cache", "block_tables", "context_lens")


def _literal(v) -> str:
    return repr(v).replace("'", '"') if isinstance(v, str) else repr(v)


#: the schema's arguments, ``"Tensor query, ..., int window_left=-1, ..."``
DECODE_SCHEMA_ARGS = ", ".join(
    [f"{t} {n}" + ("" if d is _EMPTY else f"={_literal(d)}") for n, t, d in _DECODE_ARGS]
    + [O.schema()])
_SIGNATURE = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
     for n, _, d in _DECODE_ARGS]
    + [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
       for p in O.signature_params()])


def _bound(args, kwargs) -> dict:
    """An op call's arguments by name, defaults filled (the dispatcher passes those given)."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _check(kw: dict, return_lse: bool) -> None:
    """The eager API's metadata checks of one call (``kw``: the op's arguments by name)."""
    core = {n: kw[n] for n, _, _ in _DECODE_ARGS}
    tensors = [core.pop(n) for n in _TENSORS]
    api.check_decode(*tensors, out=None, return_lse=return_lse, validate=None,
                     variants={n: kw[n] for n in O.OPTIONS}, **core)


def _decode_op(name: str, return_lse: bool):
    """Register ``pagedattn::<name>`` (functional) and its fake kernel, the schema from
    ``_DECODE_ARGS`` and the options' fields."""
    returns = "(Tensor, Tensor)" if return_lse else "Tensor"

    def real(*args, **kwargs):
        kw = _bound(args, kwargs)
        tensors = [kw.pop(n) for n in _TENSORS]
        result = api.paged_decode(*tensors, return_lse=return_lse, **kw)
        return tuple(result) if return_lse else result

    def fake(*args, **kwargs):
        kw = _bound(args, kwargs)
        _check(kw, return_lse)
        query = kw["query"]
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if not return_lse:
            return out
        return out, query.new_empty(query.shape[:-1], dtype=torch.float32)  # [b, (t,) H]

    op = torch.library.custom_op(f"pagedattn::{name}", real, mutates_args=(),
                                 schema=f"({DECODE_SCHEMA_ARGS}) -> {returns}")
    op.register_fake(fake)
    return op


_paged_decode_op = _decode_op("paged_decode", return_lse=False)
_paged_decode_lse_op = _decode_op("paged_decode_lse", return_lse=True)


@torch.library.custom_op("pagedattn::append_kv", mutates_args=("key_cache", "value_cache"))
def _append_kv_op(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_layout: str = "NHD",
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    api.append_kv(key, value, key_cache, value_cache, slot_mapping, kv_layout=kv_layout,
                  k_scale=k_scale, v_scale=v_scale)


@_append_kv_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, kv_layout="NHD", k_scale=None,
      v_scale=None):
    V.check_append_kv_args(key, value, key_cache, value_cache, slot_mapping, kv_layout=kv_layout,
                         k_scale=k_scale, v_scale=v_scale)


def _scale_tensor(s, device: torch.device) -> torch.Tensor | None:
    if s is None or isinstance(s, torch.Tensor):
        return s
    return torch.full((), float(s), dtype=torch.float32, device=device)


def paged_decode(query, key_cache, value_cache, block_tables, context_lens, *, scale=None,
                 impl="auto", num_splits=None, schedule=None, num_programs=None,
                 kv_layout="NHD", k_scale=None, v_scale=None, return_lse=False, **variants):
    """:func:`pagedattn.paged_decode` through the custom op (traceable by ``torch.compile``).

    Same arguments, shapes, dtypes and errors as the eager API (the variants of
    :mod:`pagedattn.options` and 4-D multi-token queries included), without ``out=`` and
    ``validate=`` (CPU inputs are value-checked; CUDA inputs are not). Float scales become
    0-d device tensors. Returns ``out`` in the query's shape, or ``(out, lse)`` with
    ``return_lse=True`` (``lse`` the query's shape without ``head_dim``, fp32, natural log).
    """
    # the eager API's checks on the caller's own values first: a float scale becomes a tensor
    # below, whose value no metadata check sees (a bool, 0 or NaN scale would pass)
    api.check_decode(query, key_cache, value_cache, block_tables, context_lens, scale=scale,
                     impl=impl, num_splits=num_splits, out=None, kv_layout=kv_layout,
                     k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, validate=None,
                     variants=variants, schedule=schedule, num_programs=num_programs)
    args = (query, key_cache, value_cache, block_tables, context_lens, scale, impl,
            num_splits, schedule, num_programs, kv_layout, _scale_tensor(k_scale, query.device),
            _scale_tensor(v_scale, query.device))
    op = torch.ops.pagedattn.paged_decode_lse if return_lse else torch.ops.pagedattn.paged_decode
    return op(*args, **variants)


def append_kv(key, value, key_cache, value_cache, slot_mapping, *, kv_layout="NHD",
              k_scale=None, v_scale=None) -> None:
    """:func:`pagedattn.append_kv` through the custom op (in place).

    ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]``; caches ``[num_pages,
    page_size, num_kv_heads, head_dim]`` (NHD) or HND; ``slot_mapping`` ``[num_tokens]``
    int32/int64 (negative = skip). fp8 caches take ``k_scale``/``v_scale`` (stored = x/scale).
    Raises TypeError/ValueError naming the argument.
    """
    V.check_append_kv_args(key, value, key_cache, value_cache, slot_mapping, kv_layout=kv_layout,
                           k_scale=k_scale, v_scale=v_scale)  # before floats become tensors
    torch.ops.pagedattn.append_kv(key, value, key_cache, value_cache, slot_mapping, kv_layout,
                                  _scale_tensor(k_scale, key.device),
                                  _scale_tensor(v_scale, key.device))
