"""Paged attention for any number of new tokens per sequence: chunked prefill, prefix reuse,
speculative decoding and mixed batches in one call (:func:`paged_attention`, its plan form
:func:`plan_attention`).

The layout is the varlen one of FlashAttention's ``flash_attn_varlen_func`` and vLLM's
attention backends: the batch's new query tokens are rows of one ``[num_tokens,
num_q_heads, head_dim]`` tensor, sequence ``b`` owning rows ``query_start_loc[b] :
query_start_loc[b + 1]``; their K/V are already in the paged cache (appended first), so
``seq_lens[b]`` counts them too, and token ``j`` of ``q_len`` new tokens sits at position
``seq_lens[b] - q_len + j``, attending causally.

Two kernels, one per roofline, planned once per step:

* the **prefill kernel** (``kernels/prefill.py``, :mod:`pagedattn.launch.prefill`): blocks of
  new tokens as 128-row wgmma tiles, the keys below the causal diagonal in an unmasked loop,
  the diagonal masked; the blocks found on the device from ``query_start_loc`` (no host
  sync), so a batch of chunks is one launch whatever its make-up;
* the **decode kernel** (:func:`pagedattn.plan_decode`'s split-KV plan) for the first
  ``num_decodes`` sequences, which bring exactly one token each at rows ``0 ..
  num_decodes - 1`` (vLLM's and FlashInfer's batch order: decodes first). A step of decodes
  only (``num_decodes == batch``) is one decode launch; a mixed step is two launches.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedattn import _errors
from pagedattn import _validation as V
from pagedattn import options as O
from pagedattn.api import plan_decode
from pagedattn.plan import DecodeOutput, PlanBase
from pagedattn.spec import LaunchSpec


def _prefill_launcher_class():
    from pagedattn.launch.prefill import PrefillLauncher

    return PrefillLauncher


class AttentionPlan(PlanBase):
    """One step's paged attention over varlen queries: built once per step by
    :func:`plan_attention`, run once per layer with :meth:`run`.

    It keeps references to ``block_tables``, ``seq_lens`` and ``query_start_loc`` and reads
    them on the device at every run (update them in place between steps, as for a decode
    plan; their shapes are checked at every run). The prefill launcher is built on the first
    run of each query row count (an engine pads its batches to a few sizes) and kept; the
    decode plan of the first ``num_decodes`` sequences on the first run. One plan serves one
    stream at a time.
    """

    def __init__(self, block_tables, seq_lens, query_start_loc, *, num_q_heads, num_kv_heads,
                 head_dim, page_size, q_dtype, kv_dtype, kv_layout, max_query_len,
                 num_decodes, options):
        batch, max_pages = block_tables.shape
        spec = LaunchSpec(batch=batch, max_pages=max_pages, num_q_heads=int(num_q_heads),
                          num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
                          page_size=int(page_size), q_dtype=q_dtype, kv_dtype=kv_dtype,
                          device=block_tables.device, options=options)
        super().__init__(
            spec, dict(block_tables=block_tables, seq_lens=seq_lens,
                       query_start_loc=query_start_loc),
            dict(block_tables=(batch, max_pages), seq_lens=(batch,),
                 query_start_loc=(batch + 1,)),
            kv_layout=kv_layout, contiguous=("seq_lens", "query_start_loc"))
        self.max_query_len = None if max_query_len is None else int(max_query_len)
        self.num_decodes = int(num_decodes)
        self._decode = None  # the decode plan of the first num_decodes sequences

    def _build_launcher(self, num_tokens: int):
        """The prefill launcher of the sequences after the decodes, for ``num_tokens`` query
        rows."""
        return _prefill_launcher_class()(
            replace(self.spec, batch=self.batch - self.num_decodes), num_tokens=num_tokens,
            max_query_len=self.max_query_len)

    def _decode_plan(self):
        if self._decode is None:
            nd = self.num_decodes
            self._decode = plan_decode(
                self.block_tables[:nd], self.seq_lens[:nd], num_q_heads=self.num_q_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                page_size=self.page_size, q_dtype=self.q_dtype, kv_dtype=self.kv_dtype,
                kv_layout=self.kv_layout,
                **{name: getattr(self.options, name) for name in O.PLAN})
        return self._decode

    def run(self, query, key_cache, value_cache, *, scale=None, k_scale=None, v_scale=None,
            out=None, return_lse=False, validate=None, sinks=None, alibi_slopes=None):
        """One layer: ``softmax(q·Kᵀ·scale)·V`` for every new token over its sequence's keys
        (causal; the plan's window and soft-cap; ``sinks`` and ``alibi_slopes`` per layer).

        Args:
            query: ``[num_tokens, num_q_heads, head_dim]`` of the plan's ``q_dtype``; rows
                past ``query_start_loc[-1]`` are padding (never read).
            key_cache, value_cache, scale, k_scale, v_scale, validate: as in
                :func:`pagedattn.paged_decode`.
            out: optional ``[num_tokens, num_q_heads, head_dim]``; its rows past
                ``query_start_loc[-1]`` are left untouched (without ``out``: zeros).
            return_lse: also return the natural-log LSE, ``[num_tokens, num_q_heads]``
                float32 (``-inf`` in padding rows when the plan allocates it).
            sinks, alibi_slopes: ``[num_q_heads]`` float32 tensors, or ``None``.

        Returns:
            ``out``, or ``DecodeOutput(out, lse)`` with ``return_lse=True``.

        Raises:
            TypeError, ValueError: an argument that does not fit the plan, named, before
                any launch (value checks: CPU tensors, ``validate=True`` or
                ``PAGEDATTN_VALIDATE=1``); metadata that an earlier launch on this device
                found out of its tables (:func:`pagedattn.check_errors`).
        """
        _errors.raise_pending(self.device)
        self.check_tables()
        V.check_attention_run(self, query, key_cache, value_cache, scale=scale,
                              k_scale=k_scale, v_scale=v_scale, out=out,
                              return_lse=return_lse, validate=validate)
        calls = O.call_options({"sinks": sinks, "alibi_slopes": alibi_slopes},
                               self.num_q_heads, self.device)
        if V.value_checks_due(validate, self.device):
            V.check_attention_values(self, query.shape[0], key_cache.shape[0])
            V.check_scalar_values((("k_scale", k_scale), ("v_scale", v_scale)))
            if calls:
                O.check_values(calls)
        num_tokens, nd = query.shape[0], self.num_decodes
        if num_tokens < nd:
            V.fail(ValueError, "query", f"at least num_decodes={nd} rows", num_tokens)
        out, lse = self.outputs(query, out, return_lse, (num_tokens, self.num_q_heads),
                                padded=True)
        if nd:  # the decodes: rows 0 .. nd - 1, one a sequence, split-KV
            res = self._decode_plan().run(query[:nd], key_cache, value_cache, scale=scale,
                                          k_scale=k_scale, v_scale=v_scale, out=out[:nd],
                                          return_lse=return_lse, validate=False, **calls)
            if return_lse:
                lse[:nd] = res.lse
        if num_tokens > nd and self.batch > nd:
            key_cache, value_cache = self.kernel_views(key_cache, value_cache)
            sm_scale = self.head_dim**-0.5 if scale is None else float(scale)
            with self.guard():
                self._engine(num_tokens).launch(
                    query, key_cache, value_cache, self.block_tables[nd:], self.seq_lens[nd:],
                    self.query_start_loc[nd:], out, lse, scale=sm_scale, k_scale=k_scale,
                    v_scale=v_scale, calls=calls, first_row=nd)
        return DecodeOutput(out, lse) if return_lse else out


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, page_size: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype | None = None, kv_layout: str = "NHD",
                   max_query_len: int | None = None, num_decodes: int = 0,
                   window_left: int = -1,
                   logits_soft_cap: float | None = None) -> AttentionPlan:
    """Plan one step of paged attention over varlen queries for every layer.

    Args:
        block_tables: ``[batch, max_pages]`` int32/int64 page ids, read at each run.
        seq_lens: ``[batch]`` int32/int64: each sequence's tokens in the cache, its new ones
            included, read at each run.
        query_start_loc: ``[batch + 1]`` int32: sequence ``b``'s new tokens are query rows
            ``query_start_loc[b] : query_start_loc[b + 1]`` (from 0, never decreasing; a
            sequence may bring none), read at each run.
        num_q_heads, num_kv_heads, head_dim, page_size, q_dtype, kv_dtype, kv_layout: as in
            :func:`pagedattn.plan_decode`.
        max_query_len: the most new tokens a sequence brings (a scheduler knows it), or
            ``None``; it picks the prefill kernel's tiles (short chunks pack the GQA group
            into the rows). Checked with the values (CPU tensors or ``validate=True``).
        num_decodes: the first ``num_decodes`` sequences each bring exactly one new token,
            at query rows ``0 .. num_decodes - 1`` (vLLM's and FlashInfer's batch order:
            decodes first). They run through :func:`pagedattn.plan_decode`'s split-KV plan,
            the other sequences through the prefill kernel: two launches for a mixed step,
            one for a step of decodes only (``num_decodes == batch``). An int in ``[0,
            batch]``; ``query_start_loc[num_decodes] == num_decodes`` is checked on the
            device (reported as ``query_start_loc``), the other entries of the decodes with
            the values.
        window_left, logits_soft_cap: the plan-time variants, as in
            :func:`pagedattn.paged_decode`.

    Returns:
        An :class:`AttentionPlan`. Nothing is read from the device (no host sync).

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, rank, value or device;
            the message names it.
    """
    V.check_plan(block_tables, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
                 kv_layout=kv_layout, num_splits=None, lens_name="seq_lens")
    V.check_query_start_loc(query_start_loc, block_tables)
    if max_query_len is not None:
        V.check_int("max_query_len", max_query_len, 1)
    V.check_int("num_decodes", num_decodes, 0, block_tables.shape[0])
    options = O.plan_options({"window_left": window_left, "logits_soft_cap": logits_soft_cap},
                             "plan_attention")
    return AttentionPlan(block_tables, seq_lens, query_start_loc, num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                         q_dtype=q_dtype, kv_dtype=q_dtype if kv_dtype is None else kv_dtype,
                         kv_layout=kv_layout, max_query_len=max_query_len,
                         num_decodes=num_decodes, options=options)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, *, scale: float | None = None,
                    kv_layout: str = "NHD", window_left: int = -1,
                    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                    alibi_slopes: torch.Tensor | None = None, k_scale=None, v_scale=None,
                    return_lse: bool = False, out: torch.Tensor | None = None,
                    validate: bool | None = None, num_decodes: int = 0):
    """Causal paged attention for any number of new tokens per sequence, in one launch.

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]`` float32/float16/bfloat16, any
            strides; sequence ``b``'s new tokens are rows ``query_start_loc[b] :
            query_start_loc[b + 1]``, token ``j`` of its ``q_len`` at position
            ``seq_lens[b] - q_len + j``, attending to keys ``p <= position`` (and ``p >=
            position - window_left`` with a window).
        key_cache, value_cache, block_tables, scale, kv_layout, k_scale, v_scale, validate:
            as in :func:`pagedattn.paged_decode` (fp8 caches with their scales included).
        seq_lens: ``[batch]`` int32/int64: tokens in the cache, the new ones included (their
            K/V appended first, e.g. with :func:`pagedattn.append_kv`); at least each
            sequence's ``q_len``.
        query_start_loc: ``[batch + 1]`` int32, from 0, non-decreasing, at most
            ``num_tokens`` (rows past it are padding: never read, ``out``'s left untouched).
        window_left, logits_soft_cap, sinks, alibi_slopes: the variants of
            :func:`pagedattn.paged_decode`, per token.
        return_lse: also return the LSE ``[num_tokens, num_q_heads]`` float32, natural log.
        out: optional output of the query's shape and dtype.
        num_decodes: as in :func:`plan_attention` (the first sequences bring one token each).

    Returns:
        ``out``, or ``DecodeOutput(out, lse)``.

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, rank, shape, device or
            (CPU tensors or ``validate=True``) value, named in the message, before any launch
            and before any write: e.g. ``query_start_loc`` of the wrong length or dtype,
            heads that do not divide, caches whose dtypes differ.

    Sources: the varlen layout of FlashAttention-2 (Dao, 2023) and vLLM's unified attention;
    paged prefill as FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (Ye et al., 2025).
    """
    V.check_attention_call(query, key_cache, value_cache, block_tables, seq_lens,
                           query_start_loc, kv_layout=kv_layout)
    num_pages, page_size, num_kv_heads, head_dim = V.cache_dims(key_cache, kv_layout)
    plan = plan_attention(block_tables, seq_lens, query_start_loc,
                          num_q_heads=query.shape[1], num_kv_heads=num_kv_heads,
                          head_dim=head_dim, page_size=page_size, q_dtype=query.dtype,
                          kv_dtype=key_cache.dtype, kv_layout=kv_layout,
                          num_decodes=num_decodes, window_left=window_left,
                          logits_soft_cap=logits_soft_cap)
    return plan.run(query, key_cache, value_cache, scale=scale, k_scale=k_scale,
                    v_scale=v_scale, out=out, return_lse=return_lse, validate=validate,
                    sinks=sinks, alibi_slopes=alibi_slopes)
