"""FlashMLA's ``get_mla_metadata`` / ``flash_mla_with_kvcache`` on pagedattn's MLA kernel.

A drop-in for code written against ``flash_mla`` (deepseek-ai/FlashMLA, MIT; the signatures
and semantics of ``flash_mla/flash_mla_interface.py``, dense decode, no code copied), running
:func:`pagedattn.mla_decode`:

- ``get_mla_metadata(...)`` returns ``(FlashMLASchedMeta(), None)`` as FlashMLA's current
  interface does (its arguments, those of the older interface, are accepted and unused: the
  kernel plans its splits on the device at every call). The object records the first call's
  shapes; a later call with other shapes on the same object is refused with a ``ValueError``
  naming ``tile_scheduler_metadata``, as FlashMLA asserts.
- ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
  tile_scheduler_metadata, num_splits=None, softmax_scale=None, causal=False, ...)``: ``q``
  ``[batch, seq_len_q, num_heads_q, head_dim]`` with ``head_dim = head_dim_v + rope dims``
  (DeepSeek-V3: 576 = 512 + 64), ``k_cache`` ``[num_blocks, page_block_size, 1, head_dim]``
  (the latent is its first ``head_dim_v`` dims, and the values). Returns ``out`` ``[batch,
  seq_len_q, num_heads_q, head_dim_v]`` and ``softmax_lse`` ``[batch, num_heads_q,
  seq_len_q]`` float32, **natural log** (FlashMLA's). ``softmax_scale`` defaults to ``1 /
  sqrt(head_dim)``. ``causal=True`` with ``seq_len_q > 1`` masks bottom-right aligned (token
  ``j`` at position ``cache_seqlens - seq_len_q + j``); ``causal=False`` gives every token
  all the keys.
- An fp8 ``k_cache`` (e4m3/e5m2 tensor) takes its dequantization scale from ``descale_k``
  (a one-element float32 tensor, the older interface's keyword; 1 without it).
- Refused with a ``ValueError`` naming them (as FlashMLA's dense path refuses most of
  them): ``is_fp8_kvcache=True`` (DeepSeek's 656-byte FP8 format with per-tile scales),
  sparse attention (``indices``, ``topk_length``, ``extra_k_cache``,
  ``extra_indices_in_kvcache``, ``extra_topk_length``), ``attn_sink``, ``descale_q`` (an fp8
  query), ``num_heads_k`` other than 1, a ``num_splits`` other than ``None``.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedattn import _validation as V
from pagedattn.mla import mla_decode

#: pagedattn's argument names in the errors of the MLA call -> FlashMLA's
_NAMES = {"q_nope": "q", "q_pe": "q", "ckv_cache": "k_cache", "kpe_cache": "k_cache",
          "block_tables": "block_table", "context_lens": "cache_seqlens",
          "scale": "softmax_scale", "kv_scale": "descale_k", "latent_dim": "head_dim_v",
          "rope_dim": "head_dim_v"}


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduling metadata: here only the shapes of the first call it served
    (``config``); the kernel plans its splits on the device."""

    have_initialized: bool = False
    config: tuple | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """``(FlashMLASchedMeta(), None)``; the arguments of FlashMLA's older interface
    (``cache_seqlens``, ``num_q_tokens_per_head_k``, ``num_heads_k``, ...) are accepted and
    unused."""
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int,
                           tile_scheduler_metadata: FlashMLASchedMeta, num_splits=None,
                           softmax_scale: float | None = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None,
                           topk_length=None, extra_topk_length=None, *, descale_q=None,
                           descale_k=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense MLA decode as FlashMLA's (see the module docstring). Raises TypeError/ValueError
    naming FlashMLA's argument, before any launch and any write."""
    refused = (("indices", indices), ("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
               ("extra_indices_in_kvcache", extra_indices_in_kvcache),
               ("topk_length", topk_length), ("extra_topk_length", extra_topk_length),
               ("descale_q", descale_q), ("num_splits", num_splits))
    for name, value in refused:
        if value is not None:
            raise ValueError(f"{name}: expected None (sparse attention, sinks on the dense "
                             "path, fp8 queries and host split counts are not supported)")
    if is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache: DeepSeek's FP8 cache format (fp8 latent with "
                         "per-tile scales, bf16 rope) is not supported; pass an fp8 k_cache "
                         "tensor with descale_k instead")
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise TypeError("tile_scheduler_metadata: expected the FlashMLASchedMeta of "
                        f"get_mla_metadata(), got {type(tile_scheduler_metadata).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a Python bool, got {V.type_name(causal)}")
    V.check_tensor("q", q, 4, V.FLOAT_DTYPES, "float32, float16 or bfloat16")
    V.check_tensor("k_cache", k_cache, 4, V.FLOAT_DTYPES + V.FP8_DTYPES,
                   "float32, float16, bfloat16 or an fp8 dtype")
    if k_cache.shape[2] != 1:
        raise ValueError(f"k_cache: expected num_heads_k = 1 (dim 2: MLA's one latent), got "
                         f"{k_cache.shape[2]}")
    V.check_int("head_dim_v", head_dim_v, 1, q.shape[-1])
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"k_cache: expected head_dim {q.shape[-1]} (q's) in the last dim, "
                         f"got {k_cache.shape[-1]}")
    batch, s_q, h_q, head_dim = q.shape
    config = (batch, s_q, h_q, k_cache.shape[1], k_cache.shape[2], causal)
    if not tile_scheduler_metadata.have_initialized:
        tile_scheduler_metadata.have_initialized, tile_scheduler_metadata.config = True, config
    elif tile_scheduler_metadata.config != config:
        raise ValueError(f"tile_scheduler_metadata: made for (batch, seq_len_q, num_heads_q, "
                         f"page_block_size, num_heads_k, causal) = "
                         f"{tile_scheduler_metadata.config}, got {config}: use one "
                         "get_mla_metadata() per shape")
    kv_scale = None
    if descale_k is not None:
        if not isinstance(descale_k, torch.Tensor) or descale_k.numel() != 1:
            raise ValueError("descale_k: expected a one-element float32 tensor")
        kv_scale = descale_k.reshape(())
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    q_nope, q_pe = q[..., :head_dim_v], q[..., head_dim_v:]
    if s_q == 1:
        q_nope, q_pe = q_nope[:, 0], q_pe[:, 0]
    elif not causal:  # every token sees every key: the tokens as more heads of one
        q_nope = q_nope.reshape(batch, s_q * h_q, head_dim_v)
        q_pe = q_pe.reshape(batch, s_q * h_q, head_dim - head_dim_v)
    try:
        out, lse = mla_decode(q_nope, q_pe, k_cache[:, :, 0, :head_dim_v],
                              k_cache[:, :, 0, head_dim_v:], block_table, cache_seqlens,
                              scale=scale, kv_scale=kv_scale, return_lse=True)
    except (TypeError, ValueError) as e:
        raise V.renamed(e, _NAMES) from None
    out = out.reshape(batch, s_q, h_q, head_dim_v)
    lse = lse.reshape(batch, s_q, h_q).transpose(1, 2).contiguous()  # [batch, h_q, s_q]
    return out, lse
