"""``flash_attn_with_kvcache`` with FlashAttention's semantics, on pagedattn's decode kernel.

A drop-in for code written against FlashAttention-3's ``flash_attn_interface`` (or FA2's
``flash_attn``): the same tensors, the same masks, the same LSE. Written from the semantics
documented in FA3's ``hopper/flash_attn_interface.py`` and FA2's
``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention, BSD-3-Clause); no code is
copied. What is mapped, and how:

- ``q [batch, seqlen_q, heads, dim]``; paged caches ``[num_pages, page_size, heads_k, dim]``
  with ``page_table`` (FA3) or ``block_table`` (FA2), or a contiguous cache
  ``[batch_cache, seqlen_cache, heads_k, dim]`` without a table (each sequence is then one
  page of ``seqlen_cache`` tokens); ``cache_batch_idx`` picks the cache's (or the
  table's) rows.
- ``cache_seqlens`` (an int or ``[batch]``) are the lengths *before* ``k``/``v``; given,
  ``k``/``v`` ``[batch, seqlen_new, heads_k, dim]`` are written into the cache in place at
  those positions (:func:`pagedattn.append_kv`), and attention sees them.
- Masks as FA: ``causal`` is bottom-right aligned (query ``i`` sits at position
  ``seqlen_k - seqlen_q + i``); ``window_size=(left, right)`` keeps keys in
  ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]`` (``-1`` unbounded).
  Causal attention with a left window is our ``window_left``; non-causal attention without a
  window runs every query token at the last position (the token axis becomes heads).
  A right bound strictly between 0 and ``seqlen_q - 1``, or a left window on non-causal
  multi-token queries, has no kernel here and raises. A long multi-token query (more than
  ``_MAX_TILE_ROWS`` query rows: tokens x group) runs in chunks, each with its own lengths
  (the kernel is a decode kernel: one tile holds a call's query rows).
- ``softcap`` is our ``logits_soft_cap``; ``sinks`` (``[heads]`` float32, the gpt-oss sink
  logits that vLLM's FA fork calls ``s_aux``) and FA2's ``alibi_slopes`` (``[heads]``) map to
  ours.
- fp8 (e4m3/e5m2) caches: ``k_descale``/``v_descale`` ``[batch, heads_k]`` (FA3's shape; a
  float, 0-d or ``[heads_k]`` tensor also works). Per-batch descales are exact: ``k_descale``
  is folded into the query in float32 (the kernel scales a wide query into fp16's range by a
  power of two: an fp16 ``q`` times ``k_descale`` past 65,504 stays finite), ``v_descale``
  into the output. An fp8 query is dequantized with ``q_descale`` the same way (FA3 returns
  bfloat16 for fp8 inputs, and so does this).
- ``return_softmax_lse=True`` returns ``(out, lse)``: ``lse [batch, heads, seqlen_q]``
  float32, natural log (FA's convention), ``-inf`` for a row that sees no key (its out is 0).
- ``num_splits``: 0 is the heuristic (ours), ``n >= 1`` forces ``n`` context splits.
- ``scheduler_metadata``, ``pack_gqa``, ``sm_margin`` and ``rotary_interleaved`` change no
  value (a schedule, a tiling hint, SMs left free, the layout of absent rotary tables) and are
  ignored. Every other FA argument (rotary tables, ``cache_leftpad``, varlen ``cu_seqlens_*``,
  ``qv``, ``attention_chunk``, ...) raises a ``ValueError`` naming it when it is not at its
  default; an unknown keyword is a ``TypeError``.

Every check runs before anything is written: a refused call leaves ``k_cache``/``v_cache`` as
they were. An append past the table's capacity (``cache_seqlens + seqlen_new > pages x
page_size``) is refused naming ``cache_seqlens``: on the CPU always, on a GPU with one host
sync of the lengths per appending call, as FlashAttention-2's ``mha_fwd_kvcache`` does
(Dao-AILab/flash-attention#2711); under CUDA-graph capture, which forbids the sync, the
append skips the slots past the capacity and attention sees the lengths clamped to it. A
decode call without ``k``/``v`` reads no length on a GPU (no sync: lengths past the capacity
are clamped, as :func:`pagedattn.paged_decode` does). Errors name FlashAttention's arguments.

Plans are cached by what decides them (batch, table width, heads, dims, dtypes, device,
``num_splits``, the mask and soft-cap), never by a tensor's identity. A plan reads its own
``block_tables``/``context_lens`` tensors, and each call copies its ``page_table`` (or
``cache_batch_idx`` rows) and ``cache_seqlens`` (``+ seqlen_new`` with an append) into them
on the device: no host sync, and a CUDA graph captured around the call copies again at each
replay. So a call with freshly built tables or lengths costs two small copies and the plan's
run, never a new plan or a new kernel binding; the plain one-token decode call finds its plan
through a shorter key (its arguments' shapes, dtypes and options: ``_fast``). Each thread
has its own caches of at most ``_PLAN_CACHE_SIZE`` plans (least recently used dropped), so
threads never share a plan's tensors; a graph captured around a call reads that plan's
tensors and workspace: replay it only while its plan is among its thread's
``_PLAN_CACHE_SIZE`` most recently used.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
from collections import OrderedDict

import torch

from pagedattn import _validation as V
from pagedattn import options as O
from pagedattn.api import DecodeOutput, append_kv, plan_decode

#: FA arguments this layer has no kernel for, with their "off" values (given otherwise: error)
_UNSUPPORTED = {"qv": None, "rotary_cos": None, "rotary_sin": None, "rotary_seqlens": None,
                "cache_leftpad": None, "cu_seqlens_q": None, "cu_seqlens_k_new": None,
                "max_seqlen_q": None, "attention_chunk": 0, "out": None}
#: FA arguments that change no value (schedules and hints): accepted and ignored
_IGNORED = frozenset({"scheduler_metadata", "pack_gqa", "sm_margin", "rotary_interleaved"})
_PLAN_CACHE_SIZE = 32
_STRIDED = torch.strided  # the dense layout, tested by identity on the short path
#: query rows (tokens x group) per kernel call: a longer multi-token query runs in chunks
_MAX_TILE_ROWS = 64
#: per thread (``_caches``): ``plans``, the static key of a plan (:func:`_plan_for`) -> the
#: plan on its own metadata tensors, least recently used first; ``fast``, the signature of the
#: plain one-token decode call (the shapes and dtypes of its q, caches, table and lengths,
#: and its mask, soft-cap and split options) -> its plan, which checks the query's and the
#: caches' shapes and dtypes itself (``DecodePlan.run_4d``)
_local = threading.local()
#: pagedattn's argument names in the errors of the API this layer calls -> FlashAttention's
#: (the table's: as the caller named it); a name of a dimension keeps its name after the
#: argument's (``q (head_dim): ...``)
_FA_NAMES = {"query": "q", "key_cache": "k_cache", "value_cache": "v_cache",
             "context_lens": "cache_seqlens", "scale": "softmax_scale",
             "logits_soft_cap": "softcap", "window_left": "window_size", "k_scale": "k_descale",
             "v_scale": "v_descale", "q_dtype": "q (q_dtype)", "num_q_heads": "q (num_q_heads)",
             "head_dim": "q (head_dim)", "kv_dtype": "k_cache (kv_dtype)",
             "num_kv_heads": "k_cache (num_kv_heads)", "page_size": "k_cache (page_size)"}


def _caches() -> tuple[OrderedDict, dict]:
    """This thread's ``(plans, fast)`` (see ``_local``)."""
    try:
        return _local.plans, _local.fast
    except AttributeError:
        _local.plans, _local.fast = OrderedDict(), {}
        return _local.plans, _local.fast


def _refuse_unsupported(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name in _IGNORED:
            continue
        if name not in _UNSUPPORTED:
            raise TypeError(f"flash_attn_with_kvcache() got an unexpected keyword argument "
                            f"{name!r}")
        default = _UNSUPPORTED[name]
        at_default = value is None if default is None else (
            isinstance(value, numbers.Real) and value == default)
        if not at_default:
            raise ValueError(f"{name}: not supported by pagedattn.compat.flash_attn_with_kvcache "
                             f"(only its default {default!r}); apply it before the call")


def _tensor(name: str, t, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor, got shape {tuple(t.shape)}")


def _masks(causal: bool, window_size, seqlen_q: int) -> tuple[bool, int]:
    """FA's ``(causal, window_size)`` as ``(causal kernel?, window_left)``, FA3's
    normalization first: a right bound >= ``seqlen_q - 1`` is no bound; causal is a right
    bound of 0."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got "
                        f"{window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size: each bound is -1 (unbounded) or >= 0, got {(left, right)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if right >= seqlen_q - 1:
        right = -1
    if causal:
        right = 0
    if right == 0 or seqlen_q == 1:  # one token sits last: no key lies right of it
        return seqlen_q > 1, left
    if right > 0:
        raise ValueError(f"window_size: a right bound of {window_size[1]} with seqlen_q="
                         f"{seqlen_q} (strictly between 0 and seqlen_q - 1) is not supported")
    if left >= 0:
        raise ValueError(f"window_size: a left window ({left}) on non-causal multi-token "
                         "queries is not supported (use causal=True, or one query token)")
    return False, -1


def _descale(name: str, s, batch: int, num_kv_heads: int, device) -> torch.Tensor | None:
    """A ``[batch, 1, heads_k, 1, 1]`` float32 factor (broadcast over a query's group and dim),
    or ``None`` for no scaling."""
    if s is None:
        return None
    if isinstance(s, numbers.Real) and not isinstance(s, bool):
        s = torch.tensor(float(s), device=device)
    if not isinstance(s, torch.Tensor) or not s.is_floating_point():
        raise TypeError(f"{name}: expected a float tensor [batch, heads_k], got "
                        f"{type(s).__name__ if not isinstance(s, torch.Tensor) else s.dtype}")
    if s.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {s.device}")
    if s.shape not in ((batch, num_kv_heads), (num_kv_heads,), ()):
        raise ValueError(f"{name}: expected shape ({batch}, {num_kv_heads}) [batch, heads_k], "
                         f"({num_kv_heads},) or (), got {tuple(s.shape)}")
    return s.float().expand(batch, num_kv_heads).reshape(batch, 1, num_kv_heads, 1, 1)


@functools.cache
def _rows(batch: int, device: torch.device) -> torch.Tensor:
    """``arange(batch)`` as a ``[batch, 1]`` int32 table (a contiguous cache: each sequence
    is one page), one tensor per shape."""
    return torch.arange(batch, device=device, dtype=torch.int32).view(batch, 1)


def _index(name: str, t, rank: int, device) -> None:
    """An int32/int64 tensor of rank ``rank`` on ``device``."""
    _tensor(name, t, rank)
    if t.dtype not in V.INDEX_DTYPES:
        raise TypeError(f"{name}: expected int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on q's device {device}, got {t.device}")


def _plan_for(batch: int, max_pages: int, device, **options):
    """This thread's plan of these shapes and options, built once on its own int32
    ``block_tables [batch, max_pages]`` and ``context_lens [batch]`` (each call fills them:
    :func:`_fill`)."""
    plans = _caches()[0]
    key = (batch, max_pages, device, *options.items())
    plan = plans.get(key)
    if plan is None:
        plan = plan_decode(torch.zeros(batch, max_pages, dtype=torch.int32, device=device),
                           torch.zeros(batch, dtype=torch.int32, device=device), **options)
        plans[key] = plan
        if len(plans) > _PLAN_CACHE_SIZE:
            plans.popitem(last=False)
    else:
        plans.move_to_end(key)
    return plan


def _fill(plan, table: torch.Tensor, lens, added: int) -> None:
    """Copy a call's table rows and lengths (``lens + added``, at least 0; ``lens`` a tensor
    or an int) into ``plan``'s own tensors: device copies, no host sync."""
    plan.block_tables.copy_(table)
    if isinstance(lens, int):
        plan.context_lens.fill_(max(lens + added, 0))
    elif added:
        torch.add(lens, added, out=plan.context_lens)
        if added < 0:  # a causal chunk before the query's last tokens
            plan.context_lens.clamp_(min=0)
    else:
        plan.context_lens.copy_(lens)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                            page_table=None, block_table=None, cache_batch_idx=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, sinks=None, alibi_slopes=None, q_descale=None,
                            k_descale=None, v_descale=None, num_splits=0,
                            return_softmax_lse=False, **fa_kwargs):
    """FlashAttention's ``flash_attn_with_kvcache`` (FA3 semantics; FA2's ``block_table``).

    Args:
        q: ``[batch, seqlen_q, heads, dim]`` float16/bfloat16/float32, or float8 (dequantized
            with ``q_descale``).
        k_cache, v_cache: ``[num_pages, page_size, heads_k, dim]`` with a table, else
            ``[batch_cache, seqlen_cache, heads_k, dim]``; q's dtype or fp8. Mutated when
            ``k``/``v`` are given.
        k, v: optional ``[batch, seqlen_new, heads_k, dim]`` in the cache's dtype, appended at
            ``cache_seqlens``.
        cache_seqlens: int or ``[batch]`` int32/int64, tokens in the cache before ``k``/``v``
            (``None``: the whole table's capacity).
        page_table, block_table: ``[batch, max_pages]`` int32/int64 (FA3's and FA2's name;
            give one).
        cache_batch_idx: ``[batch]`` int rows of a contiguous cache, or of the table.
        softmax_scale: default ``dim ** -0.5``.
        causal: bottom-right aligned causal mask (FA's default ``False``).
        window_size: ``(left, right)``, ``-1`` unbounded.
        softcap: ``> 0`` caps the logits as ``softcap * tanh(s / softcap)``; 0 is off.
        sinks, alibi_slopes: ``[heads]`` float32.
        q_descale, k_descale, v_descale: ``[batch, heads_k]`` float (fp8 inputs).
        num_splits: 0 (heuristic) or the number of context splits.
        return_softmax_lse: also return the natural-log LSE ``[batch, heads, seqlen_q]``.

    Returns:
        ``out [batch, seqlen_q, heads, dim]`` (q's dtype; bfloat16 for an fp8 q), or
        ``(out, lse)``.

    Raises:
        TypeError, ValueError: an argument of the wrong type, shape or value (a NaN, negative
            or infinite ``softcap``; lengths past the table's capacity), an FA feature this
            layer does not implement (named), or what :func:`pagedattn.paged_decode` refuses,
            named as FlashAttention names it; before anything is written.
    """
    try:
        if not fa_kwargs and k is None and v is None and cache_batch_idx is None \
                and q_descale is None and k_descale is None and v_descale is None \
                and alibi_slopes is None and (page_table is None or block_table is None):
            # the decode call an engine repeats per layer: its plan, by its signature
            table = page_table if block_table is None else block_table
            try:
                fast = _local.fast
            except AttributeError:
                fast = _caches()[1]
            try:
                plan = fast.get((q.shape, q.dtype, k_cache.dtype, table.shape, table.dtype,
                                 cache_seqlens.shape, cache_seqlens.dtype, causal, window_size,
                                 softcap, num_splits))
            except (AttributeError, TypeError):  # not tensors, an unhashable window
                plan = None
            if plan is not None and type(table) is torch.Tensor \
                    and type(cache_seqlens) is torch.Tensor and table.layout is _STRIDED \
                    and cache_seqlens.layout is _STRIDED and table.device == plan.device \
                    and cache_seqlens.device == plan.device:
                if plan.on_cpu:  # the lengths and page ids, named as FA names them
                    V.check_values(table, cache_seqlens, k_cache.shape[0], plan.page_size,
                                   window_left=plan.options.window_left,
                                   names=("page_table" if block_table is None
                                          else "block_table", "cache_seqlens"))
                _fill(plan, table, cache_seqlens, 0)
                if sinks is None:
                    # the plan checks q's and the caches' shapes and dtypes, and runs FA's
                    # [batch, 1, heads, dim] query as it is; None for anything else
                    result = plan.run_4d(q, k_cache, v_cache, softmax_scale,
                                         return_softmax_lse)
                    if result is not None:
                        return (DecodeOutput(result.out, result.lse.unsqueeze(-1))
                                if return_softmax_lse else result)
                else:
                    result = plan.run(q.squeeze(1), k_cache, v_cache, scale=softmax_scale,
                                      return_lse=bool(return_softmax_lse), sinks=sinks)
                    if return_softmax_lse:
                        return DecodeOutput(result.out.unsqueeze(1), result.lse.unsqueeze(-1))
                    return result.unsqueeze(1)
        return _call(q, k_cache, v_cache, k, v, cache_seqlens, page_table, block_table,
                     cache_batch_idx, softmax_scale, causal, window_size, softcap, sinks,
                     alibi_slopes, q_descale, k_descale, v_descale, num_splits,
                     return_softmax_lse, fa_kwargs)
    except (TypeError, ValueError) as e:
        fa = V.renamed(e, {**_FA_NAMES, "block_tables": "page_table" if block_table is None
                           else "block_table"})
        if fa is e:
            raise
        raise fa from None


def _call(q, k_cache, v_cache, k, v, cache_seqlens, page_table, block_table, cache_batch_idx,
          softmax_scale, causal, window_size, softcap, sinks, alibi_slopes, q_descale,
          k_descale, v_descale, num_splits, return_softmax_lse, fa_kwargs):
    """The whole call: every check (the plans' included), then the append, then the runs."""
    if fa_kwargs:
        _refuse_unsupported(fa_kwargs)
    _tensor("q", q, 4)
    _tensor("k_cache", k_cache, 4)
    _tensor("v_cache", v_cache, 4)
    V.check_device_runnable("q", q)
    batch, seqlen_q, num_heads, head_dim = q.shape
    device = q.device
    if page_table is not None and block_table is not None and page_table is not block_table:
        raise ValueError("page_table, block_table: give one (FA3's and FA2's name of the table)")
    table_name = "page_table" if block_table is None else "block_table"
    table = given_table = page_table if page_table is not None else block_table
    num_pages, page_size, num_kv_heads = k_cache.shape[:3]
    if cache_batch_idx is not None:
        _index("cache_batch_idx", cache_batch_idx, 1, device)
        if cache_batch_idx.shape[0] != batch:
            raise ValueError(f"cache_batch_idx: expected {batch} entries (q's batch), got "
                             f"{cache_batch_idx.shape[0]}")
    if table is None:  # a contiguous cache: each sequence is one page of seqlen_cache tokens
        ids_name = "cache_batch_idx"
        table = _rows(batch, device) if cache_batch_idx is None else cache_batch_idx.view(-1, 1)
    else:
        _index(table_name, table, 2, device)
        ids_name = table_name
        if cache_batch_idx is not None:  # the rows of a table with batch_cache rows
            if device.type == "cpu":
                V.first_bad("cache_batch_idx", cache_batch_idx,
                            (cache_batch_idx < 0) | (cache_batch_idx >= table.shape[0]),
                            f"rows of {table_name} in [0, {table.shape[0]})")
            table = table.index_select(0, cache_batch_idx)
        elif table.shape[0] != batch:
            raise ValueError(f"{table_name}: expected {batch} rows (q's batch), got "
                             f"{table.shape[0]}")
    capacity = table.shape[1] * page_size
    if cache_seqlens is None:  # FA3: the whole table
        lens = capacity
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lens = int(cache_seqlens)  # FA3 accepts one int length for every sequence
    else:
        _index("cache_seqlens", cache_seqlens, 1, device)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens: expected {batch} entries (q's batch), got "
                             f"{cache_seqlens.shape[0]}")
        lens = cache_seqlens
    appended = k is not None or v is not None
    if appended:
        _check_new_kv(k, v, k_cache, batch, device)
    added = k.shape[1] if appended else 0

    out_dtype = q.dtype
    if q.dtype in V.FP8_DTYPES:  # FA3 returns bfloat16 for fp8 inputs
        out_dtype = torch.bfloat16
    elif q_descale is not None:
        raise ValueError("q_descale: only for an fp8 q")
    fp8_cache = k_cache.dtype in V.FP8_DTYPES
    if not fp8_cache and (k_descale is not None or v_descale is not None):
        raise ValueError(f"{'k_descale' if k_descale is not None else 'v_descale'}: only for "
                         f"fp8 caches (k_cache is {k_cache.dtype})")
    if num_heads % max(num_kv_heads, 1):
        raise ValueError(f"q: heads ({num_heads}) must be a multiple of k_cache's heads_k "
                         f"({num_kv_heads})")
    group = num_heads // max(num_kv_heads, 1)
    scales = [(name, _descale(name, s, batch, num_kv_heads, device)) for name, s in
              (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))]
    (_, qs), (_, ks), (_, vs) = scales
    causal_kernel, window_left = _masks(causal, window_size, seqlen_q)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):  # a NaN fails every comparison
        raise ValueError(f"softcap: expected a finite float >= 0 (0 is off), got {softcap!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) \
            or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = heuristic), got {num_splits!r}")
    if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2:
        raise ValueError("alibi_slopes: per-batch slopes [batch, heads] are not supported; "
                         "pass [heads]")
    if not causal_kernel and seqlen_q > 1 and alibi_slopes is not None:
        raise ValueError("alibi_slopes: non-causal multi-token queries put every token at the "
                         "last position, which changes ALiBi's distances; use causal=True")
    if qs is not None or ks is not None or q.dtype != out_dtype:
        # dequantize q and fold the per-(batch, kv head) key scale into it (exact for the
        # scores), in float32 for an fp8 cache: its kernel scales a wide query into fp16's
        # range by a power of two, where a 16-bit product would overflow
        factor = qs if ks is None else (ks if qs is None else qs * ks)
        q5 = q.float().view(batch, seqlen_q, num_kv_heads, group, head_dim)
        q = (q5 if factor is None else q5 * factor).view(q.shape).to(
            torch.float32 if fp8_cache else out_dtype)

    # one launch per chunk of at most _MAX_TILE_ROWS query rows (the decode kernel holds a
    # call's query rows in one tile), each planned and checked before anything is written
    step = seqlen_q if seqlen_q * group <= _MAX_TILE_ROWS else max(1, _MAX_TILE_ROWS // group)
    launches = [_checked_launch(q[:, j0:min(j0 + step, seqlen_q)], k_cache, v_cache, table,
                                causal_kernel, window_left, softcap, num_splits, softmax_scale,
                                sinks, alibi_slopes, bool(return_softmax_lse),
                                # a causal chunk keeps its positions: it ends seqlen_q - j1
                                # tokens before the last
                                added - (seqlen_q - min(j0 + step, seqlen_q)) * causal_kernel)
                for j0 in range(0, seqlen_q, step)]
    if seqlen_q == 1 and not (appended or fa_kwargs or alibi_slopes is not None) \
            and isinstance(lens, torch.Tensor) and table is given_table and q.dtype == out_dtype \
            and qs is None and ks is None and vs is None:  # the plain decode call: _fast
        fast = _caches()[1]
        sig = (q.shape, q.dtype, k_cache.dtype, table.shape, table.dtype, lens.shape,
               lens.dtype, causal, window_size, softcap, num_splits)
        try:
            hash(sig)
        except TypeError:  # an unhashable window (a tensor): no fast entry
            sig = None
        if sig is not None:
            if len(fast) >= 2 * _PLAN_CACHE_SIZE:
                fast.clear()
            fast[sig] = launches[0][0]
    if device.type == "cpu" or (appended and not torch.cuda.is_current_stream_capturing()):
        # the lengths and the page ids they use (the only host sync, on a GPU with an append)
        lens_t = torch.full((batch,), lens, device=device) if isinstance(lens, int) else lens
        V.check_values(table, lens_t, num_pages, page_size, window_left=window_left,
                       q_len=seqlen_q, added=added, names=(ids_name, "cache_seqlens"))
        if device.type == "cpu":  # the values of the scales, sinks, slopes and data
            V.check_scalar_values(scales)
            for launch in launches:
                O.check_values(launch[2])
            V.check_value_ranges(q, k_cache, v_cache, table, lens_t, scale=softmax_scale,
                                 window_left=window_left, q_len=seqlen_q,
                                 appended=(k, v) if appended else None)
    if appended:
        _append(k, v, k_cache, v_cache, table, lens, capacity)
    outs, lses = [], []
    for plan, query, calls, chunk_added, flat, sq in launches:
        _fill(plan, table, lens, chunk_added)
        result = plan.launch(query, k_cache, v_cache, softmax_scale, None, None, None,
                             bool(return_softmax_lse), calls)
        out, lse = (result.out, result.lse) if return_softmax_lse else (result, None)
        if flat:  # [b, (hk sq g), d] -> [b, sq, (hk g), d]
            out = out.view(batch, num_kv_heads, sq, group, head_dim).permute(0, 2, 1, 3, 4) \
                .reshape(batch, sq, num_heads, head_dim)
            if lse is not None:  # [b, (hk sq g)] -> [b, (hk g), sq]
                lse = lse.view(batch, num_kv_heads, sq, group).permute(0, 1, 3, 2) \
                    .reshape(batch, num_heads, sq)
        elif query.dim() == 3:
            out = out.unsqueeze(1)
            lse = None if lse is None else lse.unsqueeze(-1)
        elif lse is not None:
            lse = lse.transpose(1, 2)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if vs is not None or out.dtype != out_dtype:  # the per-(batch, kv head) value scale
        out5 = out.view(batch, seqlen_q, num_kv_heads, group, head_dim).float()
        out = (out5 if vs is None else out5 * vs).to(out_dtype).view(
            batch, seqlen_q, num_heads, head_dim)
    if not return_softmax_lse:
        return out
    lse = lses[0].contiguous() if len(lses) == 1 else torch.cat(lses, dim=2)
    return DecodeOutput(out, lse)


def _checked_launch(q, k_cache, v_cache, table, causal, window_left, softcap, num_splits,
                    softmax_scale, sinks, alibi_slopes, return_lse, added) -> tuple:
    """One kernel call of ``q [batch, sq, heads, dim]`` (a chunk of the call's tokens), planned
    and checked against its plan: ``(plan, query as the plan takes it, per-call variants,
    tokens added to the lengths, tokens-as-heads?, sq)``. Non-causal multi-token attention
    puts every token at the last position: the tokens become heads (``flat``)."""
    batch, sq, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    flat = not causal and sq > 1
    plan_heads, q_len = (num_kv_heads * sq * group, 1) if flat else (num_heads, sq)
    plan = _plan_for(batch, table.shape[1], q.device, num_q_heads=plan_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=k_cache.shape[1],
                     q_dtype=q.dtype, kv_dtype=k_cache.dtype, num_splits=num_splits or None,
                     q_len=q_len, window_left=window_left,
                     logits_soft_cap=float(softcap) if softcap > 0 else None)
    if flat:  # [b, sq, hk, g, d] -> [b, (hk sq g), d]
        query = q.view(batch, sq, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4) \
            .reshape(batch, plan_heads, head_dim)
        if isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.shape[0] == num_heads:
            sinks = sinks.view(num_kv_heads, 1, group).expand(num_kv_heads, sq, group) \
                .reshape(plan_heads)
    else:
        query = q.squeeze(1) if sq == 1 else q
    calls = plan.check_call(query, k_cache, v_cache, softmax_scale, None, None, None,
                            return_lse, None, dict(sinks=sinks, alibi_slopes=alibi_slopes))
    return plan, query, calls, added, flat, sq


def _check_new_kv(k, v, k_cache, batch: int, device) -> None:
    """``k``/``v``: given together, ``[batch, seqlen_new, heads_k, dim]`` of the cache's
    dtype, on q's device."""
    if k is None or v is None:
        raise ValueError(f"{'v' if k is not None else 'k'}: give k and v together")
    _tensor("k", k, 4)
    _tensor("v", v, 4)
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
        raise ValueError(f"k: expected [batch={batch}, seqlen_new, heads_k={k_cache.shape[2]}, "
                         f"dim={k_cache.shape[3]}] (q's batch, k_cache's heads and dim), got "
                         f"{tuple(k.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name}: expected the cache's dtype {k_cache.dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on q's device {device}, got {t.device}")


def _append(k, v, k_cache, v_cache, table, lens, capacity) -> None:
    """Write ``k``/``v`` ``[batch, seqlen_new, heads_k, dim]`` at positions ``lens + j``
    (FA's in-place cache update; ``lens`` a tensor or an int); a position past the table's
    capacity (possible only under CUDA-graph capture, where it is not checked) is skipped."""
    batch, seqlen_new, num_kv_heads, head_dim = k.shape
    if k_cache.dtype in V.FP8_DTYPES:  # raw fp8 values: widened losslessly, stored back unscaled
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    page_size = k_cache.shape[1]
    start = lens.long().view(batch, 1) if isinstance(lens, torch.Tensor) else lens
    pos = (start + torch.arange(seqlen_new, device=k.device)).expand(batch, seqlen_new)
    page = table.long().gather(1, (pos // page_size).clamp_(max=max(table.shape[1] - 1, 0)))
    slots = torch.where(pos < capacity, page * page_size + pos % page_size, -1)
    append_kv(k.reshape(batch * seqlen_new, num_kv_heads, head_dim),
              v.reshape(batch * seqlen_new, num_kv_heads, head_dim), k_cache, v_cache,
              slots.view(-1))
