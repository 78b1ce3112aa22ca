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
  is folded into the query, ``v_descale`` into the output. An fp8 query is dequantized to
  bfloat16 with ``q_descale`` (FA3 returns bfloat16 for fp8 inputs too).
- ``return_softmax_lse=True`` returns ``(out, lse)``: ``lse [batch, heads, seqlen_q]``
  float32, natural log (FA's convention), ``-inf`` for a row that sees no key (its out is 0).
- ``num_splits``: 0 is the heuristic (ours), ``n >= 1`` forces ``n`` context splits.
- ``scheduler_metadata``, ``pack_gqa``, ``sm_margin`` and ``rotary_interleaved`` change no
  value (a schedule, a tiling hint, SMs left free, the layout of absent rotary tables) and are
  ignored. Every other FA argument (rotary tables, ``cache_leftpad``, varlen ``cu_seqlens_*``,
  ``qv``, ``attention_chunk``, ...) raises a ``ValueError`` naming it when it is not at its
  default; an unknown keyword is a ``TypeError``.

The plan for a call is cached (keyed by the tables' and lengths' storage and every shape and
option): an engine calling once per layer with the same ``page_table`` and ``cache_seqlens``
tensors builds one :func:`pagedattn.plan_decode` per step, and the later layers run the plan
(the plain one-token call through a shorter path, ``_fast``). The caches hold at most
``_PLAN_CACHE_SIZE`` plans each (each keeps its tables alive).
"""

from __future__ import annotations

import functools
import numbers
from collections import OrderedDict

import torch

from pagedattn import _validation as V
from pagedattn.api import DecodeOutput, append_kv, plan_decode

#: FA arguments this layer has no kernel for, with their "off" values (given otherwise: error)
_UNSUPPORTED = {"qv": None, "rotary_cos": None, "rotary_sin": None, "rotary_seqlens": None,
                "cache_leftpad": None, "cu_seqlens_q": None, "cu_seqlens_k_new": None,
                "max_seqlen_q": None, "attention_chunk": 0, "out": None}
#: FA arguments that change no value (schedules and hints): accepted and ignored
_IGNORED = frozenset({"scheduler_metadata", "pack_gqa", "sm_margin", "rotary_interleaved"})
_PLAN_CACHE_SIZE = 32
#: query rows (tokens x group) per kernel call: a longer multi-token query runs in chunks
_MAX_TILE_ROWS = 64
_plans: OrderedDict = OrderedDict()
#: the repeated decode call (one query token, a table, tensor lengths, nothing appended or
#: rescaled), keyed by the identity of its table and lengths and by every other argument that
#: shapes the plan, and (the last plan of those tables) by the identities and options alone:
#: the plan then checks the query's and caches' shapes and dtypes itself
#: (``DecodePlan._run_4d``), cheaper than hashing them. An entry keeps its tensors alive, so
#: an id names the same tensor, and their pointers and shapes are checked again on every hit
_fast: dict = {}


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
    """``arange(batch)``, one tensor per shape (a table's storage keys the plan cache)."""
    return torch.arange(batch, device=device, dtype=torch.int32)


def _key(t: torch.Tensor):
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _plan(block_tables, context_lens, lens_key, appended, **options):
    """The cached plan for these tables and options (see the module docstring)."""
    key = (_key(block_tables), lens_key, appended, tuple(sorted(options.items())))
    plan = _plans.get(key)
    if plan is None:
        if appended:  # the lengths the kernel sees: cache_seqlens + seqlen_new, refreshed per call
            context_lens = torch.empty_like(context_lens)
        plan = plan_decode(block_tables, context_lens, **options)
        _plans[key] = plan
        if len(_plans) > _PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return plan


def _is_live(entry, table, cache_seqlens) -> bool:
    """A ``_fast`` entry (or ``None``) still names these tensors: the same objects, at the
    same addresses and shapes."""
    return (entry is not None and entry[0] is table and entry[1] is cache_seqlens
            and table.data_ptr() == entry[2] and table.shape == entry[3]
            and cache_seqlens.data_ptr() == entry[4] and cache_seqlens.shape == entry[5])


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
        softcap: ``> 0`` caps the logits as ``softcap * tanh(s / softcap)``.
        sinks, alibi_slopes: ``[heads]`` float32.
        q_descale, k_descale, v_descale: ``[batch, heads_k]`` float (fp8 inputs).
        num_splits: 0 (heuristic) or the number of context splits.
        return_softmax_lse: also return the natural-log LSE ``[batch, heads, seqlen_q]``.

    Returns:
        ``out [batch, seqlen_q, heads, dim]`` (q's dtype; bfloat16 for an fp8 q), or
        ``(out, lse)``.

    Raises:
        TypeError, ValueError: an argument of the wrong type or shape, an FA feature this layer
            does not implement (named), or what :func:`pagedattn.paged_decode` refuses.
    """
    if fa_kwargs:
        _refuse_unsupported(fa_kwargs)
    elif k is None and v is None and cache_batch_idx is None and q_descale is None \
            and k_descale is None and v_descale is None and alibi_slopes is None:
        # the decode call an engine repeats per layer: a plan found by identity (see _fast)
        table = page_table if block_table is None else block_table
        try:
            entry = _fast.get((id(table), id(cache_seqlens), causal, window_size, softcap,
                               num_splits, page_table is None))
        except TypeError:  # an unhashable window: the full path
            entry = None
        if sinks is None and _is_live(entry, table, cache_seqlens):
            # the plan checks q's and the caches' shapes and dtypes, and runs FA's [batch, 1,
            # heads, dim] query as it is (no view); None for anything else
            result = entry[6]._run_4d(q, k_cache, v_cache, softmax_scale, return_softmax_lse)
            if result is not None:
                return (DecodeOutput(result.out, result.lse.unsqueeze(-1))
                        if return_softmax_lse else result)
        try:
            entry = _fast.get((id(table), id(cache_seqlens), q.shape, q.dtype, k_cache.shape,
                               k_cache.dtype, causal, window_size, softcap, num_splits,
                               page_table is None))
        except (AttributeError, TypeError):  # not tensors, an unhashable window: full path
            entry = None
        if _is_live(entry, table, cache_seqlens):
            result = entry[6].run(q.squeeze(1), k_cache, v_cache, scale=softmax_scale,
                                  return_lse=bool(return_softmax_lse), sinks=sinks)
            if return_softmax_lse:
                return DecodeOutput(result.out.unsqueeze(1), result.lse.unsqueeze(-1))
            return result.unsqueeze(1)
    _tensor("q", q, 4)
    _tensor("k_cache", k_cache, 4)
    _tensor("v_cache", v_cache, 4)
    batch, seqlen_q, num_heads, head_dim = q.shape
    device = q.device
    if page_table is not None and block_table is not None and page_table is not block_table:
        raise ValueError("page_table, block_table: give one (FA3's and FA2's name of the table)")
    table = page_table if page_table is not None else block_table
    num_kv_heads = k_cache.shape[2]
    if table is None:  # a contiguous cache: each sequence is one page of seqlen_cache tokens
        rows = _rows(batch, device) if cache_batch_idx is None else cache_batch_idx
        _tensor("cache_batch_idx", rows, 1)
        if rows.shape[0] != batch:
            raise ValueError(f"cache_batch_idx: expected {batch} entries (q's batch), got "
                             f"{rows.shape[0]}")
        table = rows.view(batch, 1)
    elif cache_batch_idx is not None:  # the rows of a table with batch_cache rows
        _tensor("cache_batch_idx", cache_batch_idx, 1)
        _tensor("page_table", table, 2)
        table = table.index_select(0, cache_batch_idx)
    _tensor("page_table", table, 2)
    page_size = k_cache.shape[1]
    capacity = table.shape[1] * page_size
    # FA3 accepts an int length for every sequence
    if cache_seqlens is None or isinstance(cache_seqlens, numbers.Integral):
        fill = capacity if cache_seqlens is None else int(cache_seqlens)
        cache_seqlens = torch.full((batch,), fill, dtype=torch.int32, device=device)
        lens_key = ("full", fill, batch, device)
    else:
        _tensor("cache_seqlens", cache_seqlens, 1)
        lens_key = _key(cache_seqlens)

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
    qs = _descale("q_descale", q_descale, batch, num_kv_heads, device)
    ks = _descale("k_descale", k_descale, batch, num_kv_heads, device)
    vs = _descale("v_descale", v_descale, batch, num_kv_heads, device)
    if qs is not None or ks is not None or q.dtype != out_dtype:
        # dequantize q and fold the per-(batch, kv head) key scale into it (exact for scores)
        factor = qs if ks is None else (ks if qs is None else qs * ks)
        q5 = q.float().view(batch, seqlen_q, num_kv_heads, group, head_dim)
        q = (q5 if factor is None else q5 * factor).view(q.shape).to(out_dtype)

    appended = k is not None or v is not None
    if appended:
        _append(k, v, k_cache, v_cache, table, cache_seqlens, capacity)

    causal_kernel, window_left = _masks(causal, window_size, seqlen_q)
    flat = not causal_kernel and seqlen_q > 1  # tokens become heads: all at the last position
    if flat and alibi_slopes is not None:
        raise ValueError("alibi_slopes: non-causal multi-token queries put every token at the "
                         "last position, which changes ALiBi's distances; use causal=True")
    if seqlen_q > 1 and seqlen_q * group > _MAX_TILE_ROWS:
        total = cache_seqlens + k.shape[1] if appended else cache_seqlens
        out, lse = _in_chunks(q, k_cache, v_cache, table, total, group, causal_kernel,
                              window_left, dict(softmax_scale=softmax_scale, softcap=softcap,
                                                sinks=sinks, alibi_slopes=alibi_slopes,
                                                num_splits=num_splits))
        if vs is not None:
            out5 = out.view(batch, seqlen_q, num_kv_heads, group, head_dim)
            out = (out5.float() * vs).to(out_dtype).view(batch, seqlen_q, num_heads, head_dim)
        return DecodeOutput(out, lse) if return_softmax_lse else out
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) \
            or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = heuristic), got {num_splits!r}")
    if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2:
        raise ValueError("alibi_slopes: per-batch slopes [batch, heads] are not supported; "
                         "pass [heads]")
    plan_heads, q_len = (num_kv_heads * seqlen_q * group, 1) if flat else (num_heads, seqlen_q)
    plan = _plan(table, cache_seqlens, lens_key, appended,
                 num_q_heads=plan_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 page_size=page_size, q_dtype=q.dtype, kv_dtype=k_cache.dtype,
                 num_splits=num_splits or None, q_len=q_len, window_left=window_left,
                 logits_soft_cap=float(softcap) if softcap > 0 else None)
    if appended:
        torch.add(cache_seqlens, k.shape[1], out=plan.context_lens)
    elif seqlen_q == 1 and not fa_kwargs and cache_batch_idx is None and q_descale is None \
            and k_descale is None and v_descale is None and alibi_slopes is None \
            and table is (page_table if block_table is None else block_table) \
            and lens_key == _key(cache_seqlens):
        try:
            sig = (id(table), id(cache_seqlens), q.shape, q.dtype, k_cache.shape,
                   k_cache.dtype, causal, window_size, softcap, num_splits,
                   page_table is None)
            hash(sig)
        except TypeError:  # an unhashable window (a tensor): no fast entry
            sig = None
        if sig is not None:
            if len(_fast) >= 2 * _PLAN_CACHE_SIZE:
                _fast.clear()
            # under the full signature, and under the tables and options alone (the plan
            # checks the rest: _run_4d), which a later plan of the same tables replaces
            _fast[sig] = _fast[sig[:2] + sig[6:]] = (
                table, cache_seqlens, table.data_ptr(), table.shape, cache_seqlens.data_ptr(),
                cache_seqlens.shape, plan)

    if flat:  # [b, sq, hk, g, d] -> [b, (hk sq g), d]
        query = q.view(batch, seqlen_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4) \
            .reshape(batch, plan_heads, head_dim)
        if sinks is not None and isinstance(sinks, torch.Tensor) and sinks.dim() == 1 \
                and sinks.shape[0] == num_heads:
            sinks = sinks.view(num_kv_heads, 1, group).expand(num_kv_heads, seqlen_q, group) \
                .reshape(plan_heads)
    else:
        query = q.squeeze(1) if seqlen_q == 1 else q
    result = plan.run(query, k_cache, v_cache, scale=softmax_scale,
                      return_lse=bool(return_softmax_lse), sinks=sinks,
                      alibi_slopes=alibi_slopes)
    out, lse = (result.out, result.lse) if return_softmax_lse else (result, None)
    if flat:
        out = out.view(batch, num_kv_heads, seqlen_q, group, head_dim).permute(0, 2, 1, 3, 4) \
            .reshape(batch, seqlen_q, num_heads, head_dim)
        if lse is not None:  # [b, (hk sq g)] -> [b, (hk g), sq]
            lse = lse.view(batch, num_kv_heads, seqlen_q, group).permute(0, 1, 3, 2) \
                .reshape(batch, num_heads, seqlen_q)
    elif seqlen_q == 1:
        out = out.unsqueeze(1)
        lse = None if lse is None else lse.unsqueeze(-1)
    elif lse is not None:
        lse = lse.transpose(1, 2).contiguous()
    if vs is not None:  # the per-(batch, kv head) value scale, on the normalized output
        out5 = out.view(batch, seqlen_q, num_kv_heads, group, head_dim)
        out = (out5.float() * vs).to(out_dtype).view(batch, seqlen_q, num_heads, head_dim)
    return DecodeOutput(out, lse) if return_softmax_lse else out


def _in_chunks(q, k_cache, v_cache, table, total, group, causal, window_left, options):
    """A long multi-token query (a prefill, as FA's tests run) in chunks of at most
    ``_MAX_TILE_ROWS`` query rows: the decode kernel holds all of a call's query rows in one
    tile. Causal chunk ``[j0, j1)`` keeps its positions through ``total - (seqlen_q - j1)``
    (FA's window bounds move with them); non-causal chunks all see ``total``."""
    seqlen_q = q.shape[1]
    step = max(1, _MAX_TILE_ROWS // group)
    outs, lses = [], []
    for j0 in range(0, seqlen_q, step):
        j1 = min(j0 + step, seqlen_q)
        lens = (total - (seqlen_q - j1)).clamp_(min=0).to(torch.int32) if causal else total
        out, lse = flash_attn_with_kvcache(
            q[:, j0:j1], k_cache, v_cache, cache_seqlens=lens, page_table=table,
            causal=causal, window_size=(window_left, 0) if causal else (-1, -1),
            return_softmax_lse=True, **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _append(k, v, k_cache, v_cache, table, cache_seqlens, capacity) -> None:
    """Write ``k``/``v`` ``[batch, seqlen_new, heads_k, dim]`` at positions ``cache_seqlens +
    j`` (FA's in-place cache update); a position past the table's capacity is skipped."""
    if k is None or v is None:
        raise ValueError(f"{'v' if k is not None else 'k'}: give k and v together")
    _tensor("k", k, 4)
    _tensor("v", v, 4)
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    batch, seqlen_new, num_kv_heads, head_dim = k.shape
    if batch != table.shape[0]:
        raise ValueError(f"k: expected batch {table.shape[0]} (q's), got {batch}")
    fp8 = k_cache.dtype in V.FP8_DTYPES
    if k.dtype != k_cache.dtype:
        raise TypeError(f"k: expected the cache's dtype {k_cache.dtype}, got {k.dtype}")
    if fp8:  # raw fp8 values: widened losslessly, stored back unscaled
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    page_size = k_cache.shape[1]
    pos = cache_seqlens.long().view(batch, 1) + torch.arange(seqlen_new, device=k.device)
    page = table.long().gather(1, (pos // page_size).clamp_(max=table.shape[1] - 1))
    slots = torch.where(pos < capacity, page * page_size + pos % page_size, -1)
    append_kv(k.reshape(batch * seqlen_new, num_kv_heads, head_dim),
              v.reshape(batch * seqlen_new, num_kv_heads, head_dim), k_cache, v_cache,
              slots.view(-1))
