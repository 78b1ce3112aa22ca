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

from typing import cast

import torch

from pagedattn import _validation as V
from pagedattn import api


def _check(query, key_cache, value_cache, block_tables, context_lens, scale, impl, num_splits,
           kv_layout, k_scale, v_scale, return_lse, variants: dict) -> None:
    V.check_metadata(query, key_cache, value_cache, block_tables, context_lens, scale=scale,
                     impl=impl, impls=tuple(api.IMPLS), num_splits=num_splits, out=None,
                     kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale,
                     return_lse=return_lse, validate=None, **variants)


@torch.library.custom_op("pagedattn::paged_decode", mutates_args=())
def _paged_decode_op(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
    impl: str = "auto", num_splits: int | None = None, kv_layout: str = "NHD",
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    window_left: int = -1, logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    out = api.paged_decode(query, key_cache, value_cache, block_tables, context_lens,
                           scale=scale, impl=impl, num_splits=num_splits, kv_layout=kv_layout,
                           k_scale=k_scale, v_scale=v_scale, window_left=window_left,
                           logits_soft_cap=logits_soft_cap, sinks=sinks,
                           alibi_slopes=alibi_slopes, batch_invariant=batch_invariant)
    return cast(torch.Tensor, out)


@_paged_decode_op.register_fake
def _(query, key_cache, value_cache, block_tables, context_lens, scale=None, impl="auto",
      num_splits=None, kv_layout="NHD", k_scale=None, v_scale=None, window_left=-1,
      logits_soft_cap=None, sinks=None, alibi_slopes=None, batch_invariant=False):
    _check(query, key_cache, value_cache, block_tables, context_lens, scale, impl, num_splits,
           kv_layout, k_scale, v_scale, False, dict(
               window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks,
               alibi_slopes=alibi_slopes, batch_invariant=batch_invariant))
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("pagedattn::paged_decode_lse", mutates_args=())
def _paged_decode_lse_op(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
    impl: str = "auto", num_splits: int | None = None, kv_layout: str = "NHD",
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    window_left: int = -1, logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = api.paged_decode(query, key_cache, value_cache, block_tables, context_lens,
                                scale=scale, impl=impl, num_splits=num_splits,
                                kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale,
                                return_lse=True, window_left=window_left,
                                logits_soft_cap=logits_soft_cap, sinks=sinks,
                                alibi_slopes=alibi_slopes, batch_invariant=batch_invariant)
    return out, lse


@_paged_decode_lse_op.register_fake
def _(query, key_cache, value_cache, block_tables, context_lens, scale=None, impl="auto",
      num_splits=None, kv_layout="NHD", k_scale=None, v_scale=None, window_left=-1,
      logits_soft_cap=None, sinks=None, alibi_slopes=None, batch_invariant=False):
    _check(query, key_cache, value_cache, block_tables, context_lens, scale, impl, num_splits,
           kv_layout, k_scale, v_scale, True, dict(
               window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks,
               alibi_slopes=alibi_slopes, batch_invariant=batch_invariant))
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = query.new_empty(query.shape[:-1], dtype=torch.float32)  # 4-D query: [b, q_len, H]
    return out, lse


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
                 impl="auto", num_splits=None, kv_layout="NHD", k_scale=None, v_scale=None,
                 return_lse=False, window_left=-1, logits_soft_cap=None, sinks=None,
                 alibi_slopes=None, batch_invariant=False):
    """:func:`pagedattn.paged_decode` through the custom op (traceable by ``torch.compile``).

    Same arguments, shapes, dtypes and errors as the eager API (the variants
    ``window_left``, ``logits_soft_cap``, ``sinks``, ``alibi_slopes``, ``batch_invariant``
    and 4-D multi-token queries included), without ``out=`` and ``validate=`` (CPU inputs
    are value-checked; CUDA inputs are not). Float scales become 0-d device tensors.
    Returns ``out`` in the query's shape, or ``(out, lse)`` with ``return_lse=True``
    (``lse`` the query's shape without ``head_dim``, fp32, natural log).
    """
    # the eager API's checks on the caller's own values first: a float scale becomes a tensor
    # below, whose value no metadata check sees (a bool, 0 or NaN scale would pass)
    _check(query, key_cache, value_cache, block_tables, context_lens, scale, impl, num_splits,
           kv_layout, k_scale, v_scale, return_lse, dict(
               window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks,
               alibi_slopes=alibi_slopes, batch_invariant=batch_invariant))
    args = (query, key_cache, value_cache, block_tables, context_lens, scale, impl,
            num_splits, kv_layout, _scale_tensor(k_scale, query.device),
            _scale_tensor(v_scale, query.device), window_left, logits_soft_cap, sinks,
            alibi_slopes, batch_invariant)
    if return_lse:
        return torch.ops.pagedattn.paged_decode_lse(*args)
    return torch.ops.pagedattn.paged_decode(*args)


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
