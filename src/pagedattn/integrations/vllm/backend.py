"""pagedattn as a vLLM attention backend: the classes vLLM loads by name once
:func:`pagedattn.integrations.vllm.register` has registered them (this module imports vLLM).

- :class:`PagedAttnBackend` (``CUSTOM``, on CUDA) and :class:`PagedAttnCPUBackend` (in
  ``CPU_ATTN``'s place, on the CPU) declare what the kernels take: fp32/fp16/bf16 models,
  caches of the model's dtype or fp8 (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``), head sizes 16 to
  256, any block size, decoder self-attention with sliding windows, soft-caps, sinks and ALiBi,
  the ``LBHNC`` (preferred) and ``LBNHC`` cache layouts.
- :class:`PagedAttnMetadataBuilder` plans once per step (``step.plan_step``: decode rows
  first through the decode plan, the rest through one varlen plan) and refuses, when vLLM is
  configured, what the backend does not run (``layer.config_refusals``).
- :class:`PagedAttnImpl` writes each layer's new K/V with :func:`pagedattn.append_kv`
  (``do_kv_cache_update``) and attends with the step's plans (``forward``). It never calls
  vLLM's attention ops.

CUDA graphs: ``UNIFORM_SINGLE_TOKEN_DECODE``. A decode-only step runs only the decode plan,
which reads the block table and lengths on the device at each run and owns its workspace;
the plans of a capture are pinned in the builder, so a replay finds them alive. Mixed and
prefill steps run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

import pagedattn
from pagedattn.integrations.layer import HEAD_SIZES, LayerOptions
from pagedattn.integrations.step import PlanCache, StepPlans, plan_step, run_step
from pagedattn.integrations.vllm.layer import (
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    cache_dtype,
    cache_layout,
    config_refusals,
    layer_options,
    split_kv_cache,
)

logger = logging.getLogger("vllm.plugins.pagedattn")
_announced = False


def _announce(key_cache: torch.Tensor) -> None:
    """The one INFO line a process logs when the backend first attends."""
    global _announced
    if not _announced:
        _announced = True
        logger.info("pagedattn %s attention backend (%s, %d)", pagedattn.__version__,
                    cache_layout(key_cache), key_cache.shape[2])


def _refuse_config(vllm_config) -> None:
    from vllm import envs

    reasons = config_refusals(vllm_config, batch_invariant=envs.VLLM_BATCH_INVARIANT)
    if reasons:
        raise ValueError("pagedattn's vLLM attention backend does not run this configuration: "
                         + "; ".join(reasons))


@dataclass
class PagedAttnMetadata:
    """One step for one KV-cache group: its plans by layer variant.

    ``slot_mapping`` is vLLM's for the step (``CommonAttentionMetadata.slot_mapping``, one
    slot per query row, -1 for padding): vLLM's runtime hands each layer its own, but vLLM's
    backend tests read it here. ``plan`` plans a variant the builder did not know of (a
    builder made without the model's layers, as those tests make one) on first use."""

    plans: dict[tuple, StepPlans]
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    plan: Callable[[LayerOptions], dict[tuple, StepPlans]]

    def plans_for(self, options: LayerOptions) -> StepPlans:
        step = self.plans.get(options.variant)
        if step is None:
            step = self.plans[options.variant] = self.plan(options)[options.variant]
        return step


class PagedAttnMetadataBuilder(AttentionMetadataBuilder[PagedAttnMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        _refuse_config(vllm_config)
        head_size_v = getattr(kv_cache_spec, "head_size_v", kv_cache_spec.head_size)
        if head_size_v != kv_cache_spec.head_size:
            raise ValueError(f"pagedattn's vLLM attention backend: head_size_v: expected the "
                             f"head size {kv_cache_spec.head_size}, got {head_size_v}")
        self._init_reorder_batch_threshold(1)  # decode rows first
        self.page_size = kv_cache_spec.block_size
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        self.layers: list[LayerOptions] = [layer.impl.options for layer in layers.values()]
        self.plans = PlanCache()

    def _build(self, m: CommonAttentionMetadata, pin: bool) -> PagedAttnMetadata:
        if m.causal is not True:
            raise ValueError("pagedattn's vLLM attention backend: causal: only causal "
                             f"attention is supported, got {m.causal!r}")
        step = partial(plan_step, block_table=m.block_table_tensor, seq_lens=m.seq_lens,
                       query_start_loc=m.query_start_loc,
                       query_start_loc_cpu=m.query_start_loc_cpu, num_reqs=m.num_reqs,
                       num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                       page_size=self.page_size, cache=self.plans, pin=pin)
        return PagedAttnMetadata(plans=step(layers=self.layers),
                                 num_actual_tokens=m.num_actual_tokens,
                                 slot_mapping=m.slot_mapping,
                                 plan=lambda options: step(layers=[options]))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedAttnMetadata:
        return self._build(common_attn_metadata, pin=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> PagedAttnMetadata:
        return self._build(common_attn_metadata, pin=True)


class PagedAttnImpl(AttentionImpl[PagedAttnMetadata]):
    """One attention layer: vLLM's arguments checked and mapped once (``layer.layer_options``),
    then ``do_kv_cache_update`` and ``forward`` per step."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **extra) -> None:
        model_dtype = get_current_vllm_config().model_config.dtype
        self.options = layer_options(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                                     sliding_window, kv_cache_dtype, logits_soft_cap,
                                     attn_type, kv_sharing_target_layer_name, sinks=sinks,
                                     model_dtype=model_dtype, **extra)
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads = self.options.num_kv_heads
        self.scale = self.options.scale
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self._sinks32: torch.Tensor | None = None
        self._slopes: torch.Tensor | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self._sinks32 = None  # the sinks' values are loaded now: converted at the next call

    def _per_call(self, layer, device: torch.device) -> dict:
        if self.sinks is not None and self._sinks32 is None:
            self._sinks32 = self.sinks.detach().to(device=device, dtype=torch.float32)
        if self.options.alibi_slopes is not None and self._slopes is None:
            self._slopes = self.options.alibi_slopes.to(device)
        scales = (dict(k_scale=layer._k_scale, v_scale=layer._v_scale) if self.options.fp8
                  else {})
        return dict(sinks=self._sinks32, alibi_slopes=self._slopes, **scales)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           skip_scale: bool = False) -> None:
        """Write the step's new keys and values into vLLM's per-layer cache at
        ``slot_mapping`` (-1: skipped). ``skip_scale`` (vLLM 0.33+ passes it to MLA
        implementations, when the layer's scales are 1): write an fp8 cache unscaled."""
        key_cache, value_cache = split_kv_cache(kv_cache, self.options)
        n = min(slot_mapping.shape[0], key.shape[0])
        scales = (dict(k_scale=layer._k_scale, v_scale=layer._v_scale)
                  if self.options.fp8 and not skip_scale else {})
        pagedattn.append_kv(key[:n], value[:n], key_cache, value_cache, slot_mapping[:n],
                            kv_layout="HND", **scales)

    def set_interleaved_v_cache(self):
        """vLLM 0.33+'s QK-norm+RoPE+KV-cache fusion asks this of the layers it fuses (only
        those whose ``fused_qk_norm_rope_kvcache_supported()`` is true, which this backend's
        is not): the kernels read the cache's layout of ``split_kv_cache`` only."""
        raise ValueError("pagedattn's vLLM attention backend: set_interleaved_v_cache: "
                         "expected no interleaved V cache (the kernels read each token's "
                         "key then value), got a request for one")

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: PagedAttnMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("pagedattn's vLLM attention backend: output_scale: fused output "
                             "quantization is not supported")
        if attn_metadata is None:  # vLLM's profiling run: nothing to attend
            return output
        key_cache, value_cache = split_kv_cache(kv_cache, self.options)
        _announce(key_cache)
        run_step(attn_metadata.plans_for(self.options), self.options, query, key_cache,
                 value_cache, output, **self._per_call(layer, query.device))
        return output


class PagedAttnBackend(AttentionBackend):
    """pagedattn's kernels as vLLM's ``CUSTOM`` attention backend (``--attention-backend
    CUSTOM``)."""

    forward_includes_kv_cache_update: bool = False
    # vLLM 0.33+: a model's fused op may write the cache with vLLM's own kernel and call
    # forward without key/value when this is true; the bytes of this cache are pagedattn's
    # (layer.split_kv_cache), so it is not
    supports_kv_cache_update_bypass: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = list(MODEL_DTYPES.values())
    supported_kv_cache_dtypes: ClassVar[list] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[PagedAttnImpl]:
        return PagedAttnImpl

    @staticmethod
    def get_builder_cls() -> type[PagedAttnMetadataBuilder]:
        return PagedAttnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # a page of any size (tiles span pages)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # any stride order works (layer.split_kv_cache); head-major pages read as whole runs
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):
        try:
            cache_dtype("auto" if kv_cache_dtype is None else kv_cache_dtype, dtype)
        except (TypeError, ValueError) as e:
            return str(e)
        return None


class PagedAttnCPUBackend(PagedAttnBackend):
    """The same backend in ``CPU_ATTN``'s place: vLLM's CPU platform always picks that name
    (``PAGEDATTN_VLLM_CPU=1``)."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"
