"""Paged attention for any number of new tokens per sequence: chunked prefill, prefix reuse,
speculative decoding and mixed batches in one call (:func:`paged_attention`, its plan form
:func:`plan_attention`).

The layout is the varlen one of FlashAttention's ``flash_attn_varlen_func`` and vLLM's
attention backends: the batch's new query tokens are rows of one ``[num_tokens,
num_q_heads, head_dim]`` tensor, sequence ``b`` owning rows ``query_start_loc[b] :
query_start_loc[b + 1]``; their K/V are already in the paged cache (appended first), so
``seq_lens[b]`` counts them too, and token ``j`` of ``q_len`` new tokens sits at position
``seq_lens[b] - q_len + j``, attending causally.

The kernel is the production decode kernel with its ``VARLEN`` flag (``kernels/decode.py``):
one program per (block of new tokens of a sequence, kv head), the block's tokens and the
kv head's query heads packed as the rows of one tile (as multi-token decode packs them), the
keys walked up to the causal limit of the block's last token (and from the window of its
first), the causal mask applied per row. The blocks are found on the device from
``query_start_loc`` (no host sync), so a mixed batch is one launch whatever its make-up. A
step whose every sequence brings one token (``max_query_len == 1`` and as many rows as
sequences) runs the decode plan itself (:func:`pagedattn.plan_decode`).
"""

from __future__ import annotations

import torch

from pagedattn import _validation as V
from pagedattn import options as O
from pagedattn._env import on_device
from pagedattn.api import plan_decode
from pagedattn.plan import DecodeOutput, nhd_views


def _auto_launcher_class():
    from pagedattn.launch.decode import AutoLauncher

    return AutoLauncher


def _block_m(group: int, device: torch.device) -> int:
    from pagedattn._env import is_interpreter
    from pagedattn.launch.policy import varlen_block_m

    return varlen_block_m(group, is_interpreter() or device.type == "cpu")


class AttentionPlan:
    """One step's paged attention over varlen queries: built once per step by
    :func:`plan_attention`, run once per layer with :meth:`run`.

    It keeps references to ``block_tables``, ``seq_lens`` and ``query_start_loc`` and reads
    them on the device at every run (update them in place between steps, as for a decode
    plan). Launchers are built on the first run of each query row count (an engine pads its
    batches to a few sizes) and kept. One plan serves one stream at a time.
    """

    def __init__(self, block_tables, seq_lens, query_start_loc, *, num_q_heads, num_kv_heads,
                 head_dim, page_size, q_dtype, kv_dtype, kv_layout, max_query_len, options):
        self.block_tables, self.seq_lens = block_tables, seq_lens
        self.query_start_loc = query_start_loc
        self.num_q_heads, self.num_kv_heads = int(num_q_heads), int(num_kv_heads)
        self.head_dim, self.page_size = int(head_dim), int(page_size)
        self.q_dtype, self.kv_dtype, self.kv_layout = q_dtype, kv_dtype, kv_layout
        self.max_query_len = None if max_query_len is None else int(max_query_len)
        self.options = options
        self.batch, self.max_pages = block_tables.shape
        self.device = block_tables.device
        self._launchers: dict[int, object] = {}
        self._decode = None  # the decode plan of one-token steps, built on first use
        self._block_m = _block_m(self.num_q_heads // self.num_kv_heads, self.device)

    def _decode_only(self, num_tokens: int) -> bool:
        """Every sequence brings exactly one new token: at most one each, as many as rows."""
        return self.max_query_len == 1 and num_tokens == self.batch

    def _launcher(self, num_tokens: int):
        launcher = self._launchers.get(num_tokens)
        if launcher is None:
            with on_device(self.device):
                launcher = _auto_launcher_class()(
                    batch=self.batch, max_pages=self.max_pages, num_q_heads=self.num_q_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    page_size=self.page_size, q_dtype=self.q_dtype, kv_dtype=self.kv_dtype,
                    device=self.device, num_splits=None, q_len=self._block_m,
                    options=self.options, record=False, num_tokens=num_tokens)
            self._launchers[num_tokens] = launcher
        return launcher

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
                any launch (value checks: CPU tensors or ``validate=True``).
        """
        V.check_attention_run(self, query, key_cache, value_cache, scale=scale,
                              k_scale=k_scale, v_scale=v_scale, out=out,
                              return_lse=return_lse, validate=validate)
        calls = O.call_options({"sinks": sinks, "alibi_slopes": alibi_slopes},
                               self.num_q_heads, self.device)
        if validate or (validate is None and self.device.type == "cpu"):
            V.check_attention_values(self, query.shape[0], key_cache.shape[0])
            V.check_scalar_values((("k_scale", k_scale), ("v_scale", v_scale)))
            if calls:
                O.check_values(calls)
        num_tokens = query.shape[0]
        if self._decode_only(num_tokens):
            if self._decode is None:
                self._decode = plan_decode(
                    self.block_tables, self.seq_lens, num_q_heads=self.num_q_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    page_size=self.page_size, q_dtype=self.q_dtype, kv_dtype=self.kv_dtype,
                    kv_layout=self.kv_layout,
                    **{name: getattr(self.options, name) for name in O.PLAN})
            return self._decode.run(query, key_cache, value_cache, scale=scale,
                                    k_scale=k_scale, v_scale=v_scale, out=out,
                                    return_lse=return_lse, validate=False, **calls)
        if out is None:
            out = torch.zeros_like(query, memory_format=torch.contiguous_format)
        lse = (torch.full((num_tokens, self.num_q_heads), float("-inf"), dtype=torch.float32,
                          device=self.device) if return_lse else None)
        if num_tokens > 0 and self.batch > 0:
            key_cache, value_cache = nhd_views(key_cache, value_cache, self.kv_layout)
            sm_scale = self.head_dim**-0.5 if scale is None else float(scale)
            with on_device(self.device):
                self._launcher(num_tokens).launch(
                    query, key_cache, value_cache, self.block_tables, self.seq_lens, out, lse,
                    scale=sm_scale, k_scale=k_scale, v_scale=v_scale, calls=calls,
                    query_start_loc=self.query_start_loc)
        return DecodeOutput(out, lse) if return_lse else out


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, page_size: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype | None = None, kv_layout: str = "NHD",
                   max_query_len: int | None = None, window_left: int = -1,
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
            ``None``. With 1, and as many query rows as sequences, a run is a decode step
            and goes through :func:`pagedattn.plan_decode`'s plan (CUDA-graph safe as it).
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
    options = O.plan_options({"window_left": window_left, "logits_soft_cap": logits_soft_cap},
                             "plan_attention")
    return AttentionPlan(block_tables, seq_lens, query_start_loc, num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                         q_dtype=q_dtype, kv_dtype=q_dtype if kv_dtype is None else kv_dtype,
                         kv_layout=kv_layout, max_query_len=max_query_len, options=options)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, *, scale: float | None = None,
                    kv_layout: str = "NHD", window_left: int = -1,
                    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                    alibi_slopes: torch.Tensor | None = None, k_scale=None, v_scale=None,
                    return_lse: bool = False, out: torch.Tensor | None = None,
                    validate: bool | None = None):
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
                          window_left=window_left, logits_soft_cap=logits_soft_cap)
    return plan.run(query, key_cache, value_cache, scale=scale, k_scale=k_scale,
                    v_scale=v_scale, out=out, return_lse=return_lse, validate=validate,
                    sinks=sinks, alibi_slopes=alibi_slopes)
