"""SGLang's attention layer, batch and KV pool in pagedattn's terms. Pure Python over torch:
nothing here imports SGLang, so the mapping and its refusals are tested without it
(``tests/integrations/test_sglang_backend.py``).

**The layer** (SGLang's ``RadixAttention``) maps to :class:`LayerOptions`:

=============================  ===============================================================
SGLang                         pagedattn
=============================  ===============================================================
``tp_q_head_num``              ``num_q_heads`` (a multiple of ``tp_k_head_num``)
``tp_k_head_num``              ``num_kv_heads``
``qk_head_dim``                ``head_dim``, 16 to 256 (``v_head_dim`` must equal it)
``scaling``                    ``scale``
``sliding_window_size``        ``window_left`` (SGLang's window already excludes the token
                               itself: key ``p`` is seen from ``i`` when ``i - w <= p <= i``)
``logit_cap``                  ``logits_soft_cap`` (0: none; ``logit_capping_method`` "tanh")
``sinks`` (forward keyword)    ``sinks``, float32 ``[num_q_heads]``, at each run
``k_scale`` / ``v_scale``      an fp8 pool's ``k_scale`` / ``v_scale`` (``None``: 1)
=============================  ===============================================================

Refused by name, when the backend first meets the layer: cross attention, encoder-only and
bidirectional attention, ``use_irope`` (chunked local attention), a ``pos_encoding_mode``
other than ``NONE``, xAI's temperature (``xai_temperature_len``), and any value the kernels
would refuse (a ``scaling`` of 1e39, a ``logit_cap`` of 1e-45).

**MLA layers** (DeepSeek-V2/V3, Kimi K2 under an MLA pool): ``qk_head_dim = kv_lora_rank +
qk_rope_head_dim`` (576), ``v_head_dim = kv_lora_rank`` (512), one KV head; the query
arrives absorbed. :class:`MLAOptions` holds them for :func:`pagedattn.plan_mla_decode`.

**The batch** (``ForwardBatch``) maps to :func:`pagedattn.integrations.step.plan_step`'s
arguments (:func:`batch_tables`, :func:`query_starts`):

=================================================  ============================================
SGLang                                             pagedattn
=================================================  ============================================
``req_to_token[req_pool_indices, ::page_size]``    ``block_tables`` (``// page_size``: a
                                                   request's token slots are whole pages)
``seq_lens`` (new tokens included)                 ``seq_lens``
decode: one token each; extend: ``cumsum``         ``query_start_loc``
of ``extend_seq_lens``
``seq_lens_cpu``, ``extend_seq_lens_cpu``          the table's width and the decode rows (host
                                                   data: no device sync)
``out_cache_loc``                                  the new tokens' slots (SGLang's own
                                                   ``set_kv_buffer`` writes them)
=================================================  ============================================

**The pool.** ``MHATokenToKVPool`` keeps per layer ``k_buffer`` / ``v_buffer`` of token slots
``[slots, kv_heads, head_dim]``; slot ``s`` is token ``s % page_size`` of page
``s // page_size``, so ``view(-1, page_size, kv_heads, head_dim)`` is pagedattn's NHD cache with
no copy (:func:`cache_views`; an HND pool, ``[pages, kv_heads, page_size, head_dim]``, is read
as it is). Page size 1 (SGLang's default) is a page per token. An MLA pool's ``kv_buffer``
``[slots, 1, kv_lora_rank + rope]`` gives the latent and rope caches as two views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedattn.integrations.layer import FP8_DTYPES, QUERY_DTYPES, LayerOptions, Refusals

WHO = "pagedattn's SGLang attention backend"
checks = Refusals(WHO)


@dataclass(frozen=True)
class MLAOptions:
    """One absorbed-MLA layer: what :func:`pagedattn.plan_mla_decode` and its ``run`` need."""

    num_q_heads: int
    latent_dim: int
    rope_dim: int
    scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    logits_soft_cap: float | None = None

    @property
    def variant(self) -> tuple:
        return ("mla", self.logits_soft_cap)


def kv_dtype_of(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype as the kernels read it: the model's dtype or an fp8 dtype."""
    if q_dtype not in QUERY_DTYPES:
        checks.refuse(TypeError, "dtype", "float32, float16 or bfloat16 (the model's dtype)",
                      q_dtype)
    if kv_dtype not in (q_dtype, *FP8_DTYPES):
        checks.refuse(ValueError, "kv_cache_dtype",
                      f"the model's dtype ({q_dtype}) or fp8 (e4m3, e5m2): the kernels read "
                      "a cache of the query's dtype, or fp8", kv_dtype)
    return kv_dtype


def _common(layer: Any) -> tuple[float, float | None]:
    """What every layer kind checks: its attention type and extras, the scale, the cap."""
    attn_type = getattr(getattr(layer, "attn_type", "decoder"), "value",
                        getattr(layer, "attn_type", "decoder"))
    if attn_type != "decoder":
        checks.refuse(ValueError, "attn_type", "'decoder' (causal decoder self-attention; "
                      "encoder-only and bidirectional attention are not supported)", attn_type)
    if getattr(layer, "is_cross_attention", False):
        checks.refuse(ValueError, "is_cross_attention", "False (cross attention is not "
                      "supported)", True)
    for name, off in (("use_irope", False), ("pos_encoding_mode", "NONE"),
                      ("xai_temperature_len", -1), ("logit_capping_method", "tanh")):
        value = getattr(layer, name, off)
        if value != off:
            checks.refuse(ValueError, name, repr(off), value)
    return (checks.scale("scaling", layer.scaling),
            checks.soft_cap("logit_cap", getattr(layer, "logit_cap", 0.0)))


def layer_options(layer: Any, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> LayerOptions:
    """An SGLang ``RadixAttention`` (any object with its attributes) as
    :class:`LayerOptions`, under a model of ``q_dtype`` over a pool of ``kv_dtype``.

    Raises:
        TypeError, ValueError: what the backend does not run (the module docstring), naming
            SGLang's attribute.
    """
    scale, cap = _common(layer)
    if layer.v_head_dim != layer.qk_head_dim:
        checks.refuse(ValueError, "v_head_dim", f"qk_head_dim={layer.qk_head_dim} (MLA layers "
                      "go through an MLA pool)", layer.v_head_dim)
    num_q_heads, num_kv_heads, head_dim = checks.heads(
        layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim,
        ("tp_q_head_num", "tp_k_head_num", "qk_head_dim"))
    window = getattr(layer, "sliding_window_size", -1)
    return LayerOptions(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        scale=scale, q_dtype=q_dtype, kv_dtype=kv_dtype_of(q_dtype, kv_dtype),
                        window_left=checks.window("sliding_window_size",
                                                  None if window in (None, -1) else window,
                                                  counts_the_token=False),
                        logits_soft_cap=cap)


def mla_options(layer: Any, kv_lora_rank: int, rope_dim: int, q_dtype: torch.dtype,
                kv_dtype: torch.dtype) -> MLAOptions:
    """An absorbed-MLA ``RadixAttention`` (``qk_head_dim = kv_lora_rank + rope_dim``,
    ``v_head_dim = kv_lora_rank``, one KV head) as :class:`MLAOptions`."""
    scale, cap = _common(layer)
    if getattr(layer, "sliding_window_size", -1) not in (None, -1):
        checks.refuse(ValueError, "sliding_window_size", "-1 (no window under MLA)",
                      layer.sliding_window_size)
    expected = (kv_lora_rank + rope_dim, kv_lora_rank, 1)
    got = (layer.qk_head_dim, layer.v_head_dim, layer.tp_k_head_num)
    if got != expected:
        checks.refuse(ValueError, "qk_head_dim, v_head_dim, tp_k_head_num",
                      f"{expected} (kv_lora_rank + qk_rope_head_dim, kv_lora_rank, 1: absorbed "
                      "MLA)", got)
    return MLAOptions(num_q_heads=checks.int_at_least("tp_q_head_num", layer.tp_q_head_num, 1),
                      latent_dim=kv_lora_rank, rope_dim=rope_dim, scale=scale, q_dtype=q_dtype,
                      kv_dtype=kv_dtype_of(q_dtype, kv_dtype), logits_soft_cap=cap)


def batch_tables(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_len: int,
                 page_size: int) -> torch.Tensor:
    """``[batch, ceil(max_len / page_size)]`` int32 page ids: each request's token slots
    (``req_to_token[req_pool_indices]``, one per position) taken a page at a time. A device
    gather, no sync; ``max_len`` is a host int (the batch's longest sequence, at least 1)."""
    width = -(-max(int(max_len), 1) // page_size)
    rows = req_to_token[req_pool_indices.long(), : width * page_size : page_size]
    return torch.div(rows, page_size, rounding_mode="floor").to(torch.int32)


def query_starts(extend_seq_lens: torch.Tensor | None, batch: int,
                 device: torch.device) -> torch.Tensor:
    """``query_start_loc`` ``[batch + 1]`` int32: ``0, 1, ..., batch`` for a decode batch
    (``extend_seq_lens`` None), else the cumulative extend lengths."""
    if extend_seq_lens is None:
        return torch.arange(batch + 1, dtype=torch.int32, device=device)
    qsl = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    qsl[1:] = extend_seq_lens.to(device=device, dtype=torch.int32).cumsum(0)
    return qsl


def cache_views(key_buffer: torch.Tensor, value_buffer: torch.Tensor, page_size: int,
                hnd: bool = False) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A layer's K and V caches and their ``kv_layout`` from SGLang's buffers: token slots
    ``[slots, kv_heads, head_dim]`` viewed as NHD pages (no copy), or an HND pool's
    ``[pages, kv_heads, page_size, head_dim]`` as it is."""
    if hnd:
        return key_buffer, value_buffer, "HND"
    for name, buf in (("k_buffer", key_buffer), ("v_buffer", value_buffer)):
        if buf.dim() != 3 or buf.shape[0] % page_size:
            checks.refuse(ValueError, name, f"[slots, kv_heads, head_dim] with slots a "
                          f"multiple of page_size={page_size}", tuple(buf.shape))
    return (key_buffer.view(-1, page_size, *key_buffer.shape[1:]),
            value_buffer.view(-1, page_size, *value_buffer.shape[1:]), "NHD")


def mla_cache_views(kv_buffer: torch.Tensor, page_size: int,
                    latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA pool's ``[slots, 1, latent_dim + rope_dim]`` buffer as the latent cache
    ``[pages, page_size, latent_dim]`` and the rope cache ``[pages, page_size, rope_dim]``
    (two views, no copy)."""
    if kv_buffer.dim() != 3 or kv_buffer.shape[1] != 1 or kv_buffer.shape[0] % page_size:
        checks.refuse(ValueError, "kv_buffer", "[slots, 1, kv_lora_rank + qk_rope_head_dim] "
                      f"with slots a multiple of page_size={page_size}", tuple(kv_buffer.shape))
    pages = kv_buffer[:, 0, :].view(-1, page_size, kv_buffer.shape[-1])
    return pages[..., :latent_dim], pages[..., latent_dim:]
