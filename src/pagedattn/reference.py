"""The float64 oracle: the definition of a correct paged decode.

Pure PyTorch, runs on any device (the tests use the CPU). It gathers each sequence's
first ``ceil(context_len / page_size)`` pages through ``block_tables``, keeps the first
``context_len`` tokens, dequantizes fp8 caches with ``k_scale``/``v_scale``, and computes
``softmax(q·Kᵀ·scale)·V`` per query head in float64 with grouped-query attention
(query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``).

The variants, straight from their definitions: a query token at position ``i`` sees keys
``p <= i`` (and ``p >= i - window_left`` with a window); its logits are ``s = scale·q·k``,
then ``cap·tanh(s / cap)``, then ``+ slope_h·(p - i)``; a sink adds ``exp(sink_h)`` to the
denominator only. A 4-D query puts token ``j`` at position ``context_len - q_len + j``.

Nothing else in the package is imported here: the oracle depends on torch only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class ReferenceOutput(NamedTuple):
    out: torch.Tensor  # the query's shape, float64
    # the query's shape without head_dim, float64, natural log; -inf for a row that saw no
    # key (the sink with sinks)
    lse: torch.Tensor


def _per_head_scale(scale, num_kv_heads: int) -> torch.Tensor:
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float64)
    t = torch.as_tensor(scale, dtype=torch.float64).detach().cpu()
    return t.expand(num_kv_heads) if t.dim() == 0 else t.reshape(num_kv_heads)


def paged_decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    kv_layout: str = "NHD",
    k_scale=None,
    v_scale=None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> ReferenceOutput:
    """Float64 paged decode attention.

    Args:
        query: ``[batch, num_q_heads, head_dim]`` or ``[batch, q_len, num_q_heads,
            head_dim]``, any float dtype.
        key_cache, value_cache: ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
            ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND); any float dtype, fp8 too.
        block_tables: ``[batch, max_pages]`` integer physical page ids; entries past
            ``ceil(context_len / page_size)`` are never read.
        context_lens: ``[batch]`` integer token counts.
        scale: softmax scale; defaults to ``head_dim ** -0.5``.
        kv_layout: ``"NHD"`` or ``"HND"``.
        k_scale, v_scale: fp8 dequantization scales (float, 0-d, or ``[num_kv_heads]``); the
            cache value is ``stored * scale``.
        window_left, logits_soft_cap, sinks, alibi_slopes: the variants (module docstring);
            ``sinks`` and ``alibi_slopes`` are ``[num_q_heads]``. The oracle takes every
            option of ``pagedattn.options`` by its keyword (``tests/plans/test_variants.py``).
        batch_invariant: changes no value (it makes the kernel's result bitwise independent
            of the batch); taken so that one set of keywords serves the kernel and the oracle.

    Returns:
        ``ReferenceOutput(out, lse)`` in float64; a row that sees no key has ``out == 0``
        and ``lse == -inf`` (``lse == sink`` with sinks).
    """
    if query.dim() == 4:  # token by token: each is a one-token query at its own position
        q_len = query.shape[1]
        parts = [paged_decode_reference(
            query[:, j], key_cache, value_cache, block_tables, context_lens - (q_len - 1 - j),
            scale=scale, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale,
            window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks,
            alibi_slopes=alibi_slopes) for j in range(q_len)]
        return ReferenceOutput(torch.stack([p.out for p in parts], 1),
                               torch.stack([p.lse for p in parts], 1))
    if kv_layout == "HND":
        key_cache = key_cache.transpose(1, 2)
        value_cache = value_cache.transpose(1, 2)
    batch, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    sm_scale = head_dim**-0.5 if scale is None else float(scale)
    ks = _per_head_scale(k_scale, num_kv_heads).to(query.device)
    vs = _per_head_scale(v_scale, num_kv_heads).to(query.device)
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64, device=query.device)
    lse = torch.full((batch, num_q_heads), -math.inf, dtype=torch.float64, device=query.device)
    sink = None if sinks is None else sinks.detach().to(torch.float64).to(query.device)
    if sink is not None:
        lse[:] = sink  # a row that sees no key: the denominator is the sink alone
    lens = context_lens.detach().cpu().tolist()
    for b, n in enumerate(lens):
        n = int(n)  # the query sits at position n - 1 and sees keys [first, n)
        first = 0 if window_left < 0 else max(0, n - 1 - window_left)
        if n <= 0:
            continue
        num_used = -(-n // page_size)
        p0 = first // page_size  # pages before the window are never read
        pages = block_tables[b, p0:num_used].long()
        lo, hi = first - p0 * page_size, n - p0 * page_size
        k = key_cache[pages].to(torch.float64).reshape(-1, num_kv_heads, head_dim)[lo:hi]
        v = value_cache[pages].to(torch.float64).reshape(-1, num_kv_heads, head_dim)[lo:hi]
        k = k * ks[None, :, None]
        v = v * vs[None, :, None]
        k = k.repeat_interleave(group, dim=1)  # [n, num_q_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[b].to(torch.float64)  # [num_q_heads, head_dim]
        scores = torch.einsum("hd,nhd->hn", q, k) * sm_scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        if alibi_slopes is not None:
            dist = torch.arange(first - (n - 1), 1, dtype=torch.float64, device=q.device)
            scores = scores + alibi_slopes.to(torch.float64)[:, None] * dist[None, :]
        if sink is not None:  # one more column in the denominator, none in the numerator
            scores = torch.cat([scores, sink[:, None]], dim=1)
            v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return ReferenceOutput(out, lse)


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              **kwargs) -> ReferenceOutput:
    """Float64 paged attention over varlen queries (``pagedattn.paged_attention``):
    sequence ``b``'s new tokens are query rows ``query_start_loc[b] : query_start_loc[b +
    1]``, token ``j`` of ``q_len`` at position ``seq_lens[b] - q_len + j``; each is the
    multi-token query of :func:`paged_decode_reference` at its sequence (``kwargs``: its
    keywords). Returns ``out`` ``[num_tokens, num_q_heads, head_dim]`` and ``lse``
    ``[num_tokens, num_q_heads]``, float64; rows past ``query_start_loc[-1]`` hold 0 and
    ``-inf`` (they are no token)."""
    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64,
                      device=query.device)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float64,
                     device=query.device)
    starts = query_start_loc.detach().cpu().tolist()
    for b, (lo, hi) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        if hi > lo:
            ref = paged_decode_reference(query[lo:hi][None], key_cache, value_cache,
                                         block_tables[b:b + 1], seq_lens[b:b + 1], **kwargs)
            out[lo:hi], lse[lo:hi] = ref.out[0], ref.lse[0]
    return ReferenceOutput(out, lse)


def mla_decode_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
                         kpe_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, *, scale: float, kv_scale=None,
                         logits_soft_cap: float | None = None,
                         sinks: torch.Tensor | None = None) -> ReferenceOutput:
    """Float64 absorbed multi-head latent attention (``pagedattn.mla_decode``; DeepSeek-V2,
    DeepSeek-AI 2024): every query head attends over one latent per token, ``out_h =
    softmax(scale·(q_nope_h·ckvᵀ + q_pe_h·kpeᵀ))·ckv``; the latent is both key and value.

    Args:
        q_nope: ``[batch, num_heads, d_latent]`` or ``[batch, q_len, num_heads, d_latent]``
            (token ``j`` at position ``context_len - q_len + j``, attending to keys ``p <=``
            its position), any float dtype.
        q_pe: the rope part, ``[..., num_heads, d_rope]`` of the same leading shape.
        ckv_cache, kpe_cache: ``[num_pages, page_size, d_latent]`` and ``[num_pages,
            page_size, d_rope]``, any float dtype, fp8 too (dequantized as ``stored ·
            kv_scale``, both).
        block_tables, context_lens: as in :func:`paged_decode_reference`.
        scale: the softmax scale (DeepSeek's ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``,
            not one of these dims: no default).
        kv_scale: the caches' dequantization scale (float or 0-d tensor), or ``None``.
        logits_soft_cap, sinks: as in :func:`paged_decode_reference` (``sinks``
            ``[num_heads]``).

    Returns:
        ``ReferenceOutput(out, lse)``, float64: ``out`` of ``q_nope``'s shape, ``lse``
        without its last dim (natural log); a row that sees no key has ``out == 0`` and
        ``lse == -inf`` (the sink with sinks).
    """
    if q_nope.dim() == 4:  # token by token, each a one-token query at its own position
        q_len = q_nope.shape[1]
        parts = [mla_decode_reference(
            q_nope[:, j], q_pe[:, j], ckv_cache, kpe_cache, block_tables,
            context_lens - (q_len - 1 - j), scale=scale, kv_scale=kv_scale,
            logits_soft_cap=logits_soft_cap, sinks=sinks) for j in range(q_len)]
        return ReferenceOutput(torch.stack([p.out for p in parts], 1),
                               torch.stack([p.lse for p in parts], 1))
    batch, num_heads, d_latent = q_nope.shape
    page_size = ckv_cache.shape[1]
    dev = q_nope.device
    s_kv = 1.0 if kv_scale is None else float(torch.as_tensor(kv_scale, dtype=torch.float64))
    out = torch.zeros(batch, num_heads, d_latent, dtype=torch.float64, device=dev)
    lse = torch.full((batch, num_heads), -math.inf, dtype=torch.float64, device=dev)
    sink = None if sinks is None else sinks.detach().to(torch.float64).to(dev)
    if sink is not None:
        lse[:] = sink  # a row that sees no key: the denominator is the sink alone
    for b, n in enumerate(context_lens.detach().cpu().tolist()):
        n = int(n)
        if n <= 0:
            continue
        pages = block_tables[b, :-(-n // page_size)].long()
        ckv = ckv_cache[pages].to(torch.float64).flatten(0, 1)[:n] * s_kv
        kpe = kpe_cache[pages].to(torch.float64).flatten(0, 1)[:n] * s_kv
        scores = (q_nope[b].to(torch.float64) @ ckv.T
                  + q_pe[b].to(torch.float64) @ kpe.T) * float(scale)  # [num_heads, n]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        values = ckv
        if sink is not None:  # one more column in the denominator, none in the numerator
            scores = torch.cat([scores, sink[:, None]], dim=1)
            values = torch.cat([ckv, torch.zeros_like(ckv[:1])], dim=0)
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.softmax(scores, dim=-1) @ values
    return ReferenceOutput(out, lse)
