"""pagedattn as a transformers attention implementation: ``attn_implementation="pagedattn"``.

``register()`` adds :func:`attention_forward` to transformers' ``AttentionInterface`` under a
name (``"pagedattn"``), and sdpa's mask builder to ``AttentionMaskInterface`` under the same
name, so the model receives the masks ``attn_implementation="sdpa"`` would (``None`` when
nothing is masked but causality)::

    import pagedattn.compat.transformers as pa_hf
    pa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="pagedattn")
    model.generate(input_ids, max_new_tokens=8)   # decode steps run pagedattn.paged_decode

What runs where, per attention call:

- **Decode** (one query token, ``query [batch, num_q_heads, 1, head_dim]``): transformers'
  cache (``DynamicCache``, ``StaticCache``) has already appended the step's key and value
  and passes the whole cache, ``key``/``value [batch, num_kv_heads, seq, head_dim]``. That
  tensor *is* an HND paged cache: batch row ``b`` is page ``b`` (``page_size = seq``),
  ``block_tables = arange(batch)``, so :func:`pagedattn.paged_decode` reads it with no copy.
  With a mask (a padded batch: ``generate`` pads on the left; a ``StaticCache`` masks its
  unused tail), every row's visible keys must be one contiguous range (they are, for left
  or right padding); the cache is then viewed as pages of one token
  (``page_size = 1``, still no copy) and row ``b`` reads its range. Checking the mask costs
  one device-to-host sync per attention call; an unpadded batch has no mask and no sync.
  ``sliding_window`` becomes ``window_left = sliding_window - 1``, ``softcap``
  ``logits_soft_cap``, ``s_aux`` (gpt-oss's sink logits) ``sinks``.
- **Everything else falls back to torch's SDPA**
  (``transformers.integrations.sdpa_attention.sdpa_attention_forward``, the default
  implementation, unchanged): prefill and any multi-token query, training with dropout,
  ``position_bias``, a float or per-head mask, a mask whose visible keys are not one range,
  key and value head dims that differ, and cache strides that cannot be viewed as pages.
  SDPA refuses ``softcap``, so a soft-capped model (Gemma 2) decodes through pagedattn but
  cannot prefill with this implementation.

Continuous batching (``generate_batch``, ``ContinuousBatchingManager``, the
``PagedAttentionCache``) depends on the version, because transformers changed its protocol:

- transformers 5.17 (the H200's) routes ``attn_implementation="paged|<name>"`` to a
  registered function that updates the cache itself (``integrations/flash_paged.py``'s
  protocol: ``cache.update(read_index=, write_index=)``); ``register()`` then also registers
  :func:`paged_attention_forward` as ``"paged|pagedattn"``, whose decode-only batches run
  :func:`pagedattn.paged_decode`. 5.17 keeps its block table (its paged decode fast path) for
  FlashAttention names on CUDA (``generation/continuous_batching/initialization.py``,
  ``ensure_decode_fast_path_is_available``, lines 120-136), so pagedattn reads the keys that
  ``cache.update`` gathered, not transformers' pages. Ask for ``"paged|pagedattn"``: with
  plain ``"pagedattn"`` 5.17's ``switch_to_cb_friendly_attn`` (``continuous_api.py``, lines
  661-682) switches to a FlashAttention when one is installed.
- transformers 5.24 refuses: ``generation/continuous_batching/continuous_api.py``,
  ``ContinuousBatchingManager.switch_to_cb_friendly_attn``, lines 780-784, accepts only
  ``"paged|eager"``, ``"sdpa"`` or a name containing ``"flash"`` and raises ``ValueError``
  ("Implementation ... is not supported for continuous batching") for any other. Only the
  ``"flash"`` names receive the block table and the paged cache (``cache.py``,
  ``PagedAttentionCache.update``, lines 413-418), and transformers then imports a
  FlashAttention package or Hub kernel for them (``modeling_utils.py``,
  ``_check_and_adjust_attn_implementation``), so nothing is registered for it there.

Supported transformers: the ``hf`` extra's range (``>=5.17,<6``; tested on 5.17 and 5.24;
the continuous-batching path is registered only where 5.17's protocol is found).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedattn import api

#: the ``attn_implementation`` name :func:`register` uses unless told otherwise
NAME = "pagedattn"


def register(name: str = NAME) -> str:
    """Register pagedattn in transformers under ``name``; returns ``name``.

    After it, ``from_pretrained(..., attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) decodes through :func:`attention_forward`. The
    registration is global (transformers' interfaces are process-wide) and idempotent.

    Raises:
        TypeError: ``name`` is not a non-empty string.
        ValueError: ``name`` is one of transformers' own implementations (``"sdpa"``,
            ``"eager"``, ``"flash_attention_2"``, ...) or starts with ``"paged|"``.
        ImportError: transformers is not installed (``pip install "pagedattn[hf]"``).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError("pagedattn.compat.transformers needs transformers: "
                          'pip install "pagedattn[hf]"') from e
    taken = AttentionInterface().get(name)
    if name == "eager" or name.startswith("paged|") or taken not in (None, attention_forward):
        raise ValueError(f"name: {name!r} is transformers' own attention implementation; "
                         "choose another name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    if _owns_cache_update(AttentionInterface):
        AttentionInterface.register(f"paged|{name}", paged_attention_forward)
    return name


def _owns_cache_update(interface) -> bool:
    """Whether this transformers routes ``"paged|<name>"`` to a registered function that
    updates the ``PagedAttentionCache`` itself (5.17's protocol: its own table still holds
    ``"paged|sdpa"``); 5.24 strips the prefix and refuses third-party names instead."""
    return "paged|sdpa" in interface._global_mapping


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; decode steps run :func:`pagedattn.paged_decode`.

    Args:
        module: the calling attention layer (read for ``training`` only).
        query: ``[batch, num_q_heads, q_len, head_dim]`` fp32/fp16/bf16.
        key, value: ``[batch, num_kv_heads, kv_len, head_dim]``, the whole cache after this
            step's append (``kv_len`` includes the new token), the query's dtype.
        attention_mask: ``None``, or sdpa's boolean ``[batch, 1, q_len, kv_len]`` (True =
            visible); anything else goes to SDPA.
        dropout: attention dropout probability; above 0 in training mode goes to SDPA.
        scaling: the softmax scale (None: ``head_dim ** -0.5``).
        kwargs: ``sliding_window`` (keys visible to a query, itself included), ``softcap``,
            ``s_aux`` (``[num_q_heads]`` sink logits); the rest are passed to SDPA or ignored.

    Returns:
        ``(attn_output [batch, q_len, num_q_heads, head_dim], None)``, in the query's dtype (no
        attention weights, as with SDPA).

    Raises:
        ValueError / TypeError: from :func:`pagedattn.paged_decode`, naming the argument (e.g.
            CPU tensors without ``TRITON_INTERPRET=1``).
    """
    pages = _decode_pages(module, query, key, value, attention_mask, dropout, kwargs)
    if pages is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    key_cache, value_cache, block_tables, context_lens, masked = pages
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    out = api.paged_decode(
        query[:, :, 0], key_cache, value_cache, block_tables, context_lens, scale=scaling,
        kv_layout="HND",
        # a mask already holds the window (sdpa's sliding-window mask)
        window_left=window - 1 if window and not masked else -1,
        logits_soft_cap=float(softcap) if softcap else None,
        sinks=None if sinks is None else sinks.float())
    return out.unsqueeze(1), None


def _decode_pages(module, query, key, value, attention_mask, dropout, kwargs):
    """``(key_cache, value_cache, block_tables, context_lens, masked)`` viewing transformers'
    dense cache as HND pages, or None when this call goes to SDPA (see the module docstring)."""
    if (query.dim() != 4 or key.dim() != 4 or query.shape[2] != 1 or key.shape != value.shape
            or key.shape[-1] != query.shape[-1] or key.shape[0] != query.shape[0]
            or (dropout and module.training) or kwargs.get("position_bias") is not None
            or key.stride() != value.stride()):
        return None
    batch, num_kv_heads, seq, head_dim = key.shape
    dev = key.device
    if attention_mask is None:  # each batch row is one page of `seq` tokens
        rows = torch.arange(batch, dtype=torch.int32, device=dev)[:, None]
        lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
        return key, value, rows, lens, False
    if (attention_mask.dtype != torch.bool or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or attention_mask.shape[0] not in (1, batch)
            or attention_mask.shape[-1] != seq):
        return None
    s_b, _, s_t, _ = key.stride()
    if s_t <= 0 or s_b % s_t:  # token (b, t) must be page b * (s_b / s_t) + t
        return None
    visible = attention_mask[:, 0, -1, :].expand(batch, seq)  # [batch, seq]
    pos = torch.arange(seq, device=dev)
    start = visible.int().argmax(-1)  # the first visible key (0 for an empty row)
    count = visible.sum(-1)
    one_range = (pos >= start[:, None]) & (pos < (start + count)[:, None])
    if not bool(torch.equal(one_range, visible)):  # the one host sync of a masked call
        return None
    per_row = s_b // s_t
    num_pages = (batch - 1) * per_row + seq
    views = [torch.as_strided(t, (num_pages, num_kv_heads, 1, head_dim),
                              (s_t, t.stride(1), s_t, t.stride(3)), t.storage_offset())
             for t in (key, value)]
    first = torch.arange(batch, device=dev)[:, None] * per_row + start[:, None]
    tables = (first + pos).clamp(max=num_pages - 1).int()  # entries past `count` unread
    return views[0], views[1], tables, count.int(), True


# attention_forward's signature again: transformers' AttentionInterface calls both with it
def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers 5.17's continuous-batching protocol (``attn_implementation="paged|pagedattn"``).

    The batch is packed: ``query [1, num_q_heads, num_tokens, head_dim]``, ``key``/``value
    [1, num_kv_heads, num_tokens, head_dim]`` (this step's tokens only), with ``cache`` (the
    ``PagedAttentionCache``), ``read_index``/``write_index`` and ``cu_seq_lens_q``/
    ``cu_seq_lens_k`` (``[num_seqs + 1]``, keys counting the new tokens), ``max_seqlen_q``
    (a host int). 5.17 gives the block table to FlashAttention names only
    (``continuous_batching/initialization.py``, ``ensure_decode_fast_path_is_available``), so
    ``cache.update`` writes the new keys and gathers each sequence's keys, packed
    ``[total_keys, num_kv_heads, head_dim]``. A decode-only batch (``max_seqlen_q == 1``, one
    query token per sequence) then runs :func:`pagedattn.paged_decode` on that tensor viewed
    as one-token NHD pages (no copy), ``block_tables[b, j] = cu_seq_lens_k[b] + j``; a batch
    with prefills runs torch's SDPA with a block-diagonal causal mask built on the device.
    Without a ``cache`` (a plain ``generate``) it is :func:`attention_forward`.

    Returns:
        ``(attn_output [1, num_tokens, num_q_heads, head_dim], None)``.

    Raises:
        ValueError: a sliding-window layer (its paged reads are a ring buffer, not served
            here), or a ``block_table`` (never sent to a third-party name by 5.17).
    """
    cache = kwargs.pop("cache", None)
    if cache is None:
        return attention_forward(module, query, key, value, attention_mask, dropout, scaling,
                                 **kwargs)
    if getattr(module, "sliding_window", None) or cache.sliding_windows[module.layer_idx] != 1:
        raise ValueError("attn_implementation: pagedattn's continuous-batching path serves "
                         "full-attention layers only; this layer has a sliding window")
    if kwargs.get("block_table") is not None:
        raise ValueError("block_table: transformers sent its FlashAttention decode path to "
                         "pagedattn; only read_index/write_index batches are served")
    cu_q, cu_k = kwargs["cu_seq_lens_q"].long(), kwargs["cu_seq_lens_k"]
    cu_k = (cu_k["full_attention"] if isinstance(cu_k, dict) else cu_k).long()
    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                        read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    num_seqs, num_tokens = cu_q.numel() - 1, query.shape[2]
    if kwargs.get("max_seqlen_q") == 1 and num_tokens == num_seqs:
        max_len = kwargs["max_seqlen_k"]
        max_len = max(max_len.values()) if isinstance(max_len, dict) else int(max_len)
        pages = (cu_k[:-1, None] + torch.arange(max(max_len, 1), device=cu_k.device))
        out = api.paged_decode(query[0].transpose(0, 1), k[:, None], v[:, None],
                               pages.clamp(max=max(k.shape[0] - 1, 0)),
                               cu_k[1:] - cu_k[:-1], scale=scaling)
        return out[None], None
    mask = _varlen_causal_mask(cu_q, cu_k, num_tokens, k.shape[0])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scaling,
        enable_gqa=True)
    return out.transpose(1, 2), None


def _varlen_causal_mask(cu_q, cu_k, num_q, num_k):
    """``[num_q, num_k]`` bool: query token ``i`` of sequence ``s`` sees key ``j`` of ``s`` when
    ``j``'s position is at most ``i``'s (bottom-right aligned); padding rows see key 0."""
    q_seq = torch.searchsorted(cu_q, torch.arange(num_q, device=cu_q.device), right=True) - 1
    k_seq = torch.searchsorted(cu_k, torch.arange(num_k, device=cu_k.device), right=True) - 1
    q_seq, k_seq = q_seq.clamp(max=cu_q.numel() - 2), k_seq.clamp(max=cu_k.numel() - 2)
    q_pos = torch.arange(num_q, device=cu_q.device) - cu_q[q_seq] + (
        (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1]))[q_seq]
    k_pos = torch.arange(num_k, device=cu_k.device) - cu_k[k_seq]
    real_q = torch.arange(num_q, device=cu_q.device) < cu_q[-1]
    real_k = torch.arange(num_k, device=cu_k.device) < cu_k[-1]
    mask = ((q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            & real_q[:, None] & real_k[None, :])
    mask[:, 0] |= ~mask.any(-1)  # a row with nothing to see (padding) must not give NaN
    return mask
