"""The one-shot ``paged_decode``'s template cache: a validated call's static key (its shapes,
dtypes, device, layout and plan-time variants) -> a template :class:`DecodePlan` that holds no
tensor, so that the next plain call of the key skips ``check_metadata`` and the plan's
construction (:mod:`pagedattn.api`'s fast path), and :func:`decode`, the planned one-shot
call after its checks.

Below :mod:`pagedattn.api`, above :mod:`pagedattn.plan`. The templates are module state (see
DESIGN.md's "Module state"): filled only by a call that passed every check, at most
:data:`TEMPLATES_MAX` of them, the oldest dropped first.
"""

from __future__ import annotations

import threading

import torch

from pagedattn import _validation as V
from pagedattn import options as O
from pagedattn.plan import DecodeOutput, DecodePlan

#: one-shot templates kept, at most (the oldest dropped first)
TEMPLATES_MAX = 64
#: static key (:func:`static_key`) -> a template DecodePlan (no tensor): filled only by a
#: call that passed check_metadata
TEMPLATES: dict[tuple, DecodePlan] = {}
_LOCK = threading.Lock()
_STRIDED = torch.strided  # the dense layout, tested by identity
_SCHEDULE_KEYS = (None, *V.SCHEDULES)  # the schedules of a plain call (exact strings)


def static_key(query, key_cache, block_tables, context_lens, kv_layout, num_splits,
               options_key, schedule=None, num_programs=None) -> tuple | None:
    """What ``check_metadata`` reads of a one-shot call apart from the per-call checks of
    the fast path: the shapes, dtypes and device of the tensors, the layout and the
    plan-time variants (``options_key``: :func:`pagedattn.options.fast_key`, exact types: a
    bool ``window_left`` is no int there). ``None`` for a call that is not plain
    (non-tensors, other types, a 4-D query of one token, a per-call variant, a ``schedule``
    other than ``None`` or ``"split"``, a ``num_programs``: the checks refuse those)."""
    if not (options_key is not None and type(query) is torch.Tensor
            and type(key_cache) is torch.Tensor
            and type(block_tables) is torch.Tensor and type(context_lens) is torch.Tensor
            and block_tables.layout is _STRIDED and context_lens.layout is _STRIDED
            and (num_splits is None or type(num_splits) is int) and type(kv_layout) is str
            and schedule in _SCHEDULE_KEYS
            and num_programs is None):
        return None
    rank, shape = query.dim(), query.shape
    if key_cache.dim() != 4 or not (rank == 3 or rank == 4 and shape[1] > 1):
        return None
    return (shape, query.dtype, query.device, key_cache.shape[1:], key_cache.dtype, kv_layout,
            block_tables.shape, block_tables.dtype, context_lens.shape, context_lens.dtype,
            num_splits, options_key)


def _keep(key: tuple, plan: DecodePlan) -> DecodePlan:
    with _LOCK:
        if len(TEMPLATES) >= TEMPLATES_MAX:
            del TEMPLATES[next(iter(TEMPLATES))]
        return TEMPLATES.setdefault(key, plan)


def runnable(query) -> bool:
    """``check_device_runnable`` as a test (the full check raises its error in order)."""
    try:
        V.check_device_runnable("query", query)
    except ValueError:
        return False
    return True


def decode(query, key_cache, value_cache, block_tables, context_lens, *, scale, num_splits,
           out, kv_layout, k_scale, v_scale, return_lse, options, calls,
           plan_variants) -> tuple[object, dict[str, object]]:
    """A one-shot ``impl="auto"`` call whose checks (metadata and values) have passed:
    through its key's template (made and kept now if new), or a plan of its own for a call
    with no key. ``options``: the plan-time variants, checked; ``calls``: the per-call
    variant tensors that are on; ``plan_variants``: the plan-time keywords as given (their
    exact types make the key). Returns ``(out or DecodeOutput, compiled kernels)``."""
    _, page_size, num_kv_heads, head_dim = V.cache_dims(key_cache, kv_layout)
    q_len = query.shape[1] if query.dim() == 4 else 1
    squeeze = query.dim() == 4 and q_len == 1  # a one-token plan on 3-D views
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    statics = dict(num_q_heads=query.shape[-2], num_kv_heads=num_kv_heads, head_dim=head_dim,
                   page_size=page_size, q_dtype=query.dtype, kv_dtype=key_cache.dtype,
                   kv_layout=kv_layout, num_splits=num_splits, q_len=q_len, options=options,
                   one_shot=True)
    # validated: a call of this static key may take the fast path from now on (a call with
    # per-call variants never does: its template serves the plain calls of the key)
    key = static_key(query, key_cache, block_tables, context_lens, kv_layout, num_splits,
                     O.fast_key(plan_variants) or options.key())
    if key is None:  # a 4-D query of one token, a str subclass...: a plan of its own
        plan = DecodePlan(block_tables, context_lens, **statics)
    else:
        plan = TEMPLATES.get(key) or _keep(
            key, DecodePlan(None, None, table_shape=block_tables.shape, device=query.device,
                            **statics))
    result, compiled = plan.launch(
        query[:, 0] if squeeze else query, key_cache, value_cache, scale, k_scale, v_scale,
        out[:, 0] if squeeze else out, return_lse, calls, tables=(block_tables, context_lens))
    if return_lse:
        result = DecodeOutput(out, result.lse.unsqueeze(1) if squeeze else result.lse)
    else:
        result = out
    return result, dict(compiled)  # a copy: the shared launcher's records
