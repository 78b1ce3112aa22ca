"""vLLM's attention-layer arguments mapped to pagedattn's, and the KV cache's bytes.

Pure Python over torch: nothing here imports vLLM, so the mapping and its refusals are tested
without it (``tests/integrations/test_vllm_plugin.py``).

**The layer.** vLLM builds one ``AttentionImpl`` per attention layer with ``num_heads``,
``head_size``, ``scale``, ``num_kv_heads``, ``alibi_slopes``, ``sliding_window``,
``kv_cache_dtype``, ``logits_soft_cap``, ``attn_type``, ``kv_sharing_target_layer_name`` and
``sinks``; :func:`layer_options` turns them into :class:`LayerOptions`:

=========================  ==================================================================
vLLM                       pagedattn
=========================  ==================================================================
``scale``                  ``scale``
``num_heads``              ``num_q_heads`` (a multiple of ``num_kv_heads``)
``head_size``              ``head_dim``, 16 to 256
``sliding_window`` ``w``   ``window_left = w - 1`` (vLLM's window counts the token itself)
``logits_soft_cap``        ``logits_soft_cap`` (``None`` or 0: none)
``alibi_slopes``           ``alibi_slopes``, a float32 ``[num_q_heads]`` tensor
``sinks``                  ``sinks``, float32 ``[num_q_heads]`` (read after weights load)
``kv_cache_dtype``         ``auto`` (the model's dtype) or the model's dtype by name;
                           ``fp8``/``fp8_e4m3`` (``float8_e4m3fn``), ``fp8_e5m2``, scaled by the
                           layer's ``k_scale``/``v_scale`` (``stored = x / scale``, as vLLM)
=========================  ==================================================================

Anything else is refused with a ``ValueError`` or ``TypeError`` naming vLLM's option, when
vLLM builds the model, never run wrong: another ``attn_type`` (encoder, encoder-only, cross
attention), a head size outside 16..256, a cache dtype other than the above (a 16-bit cache
under an fp32 model included: the kernels read a cache of the query's dtype, or fp8), an
extra implementation argument, and any value the kernels would refuse at serving time (a
``scale`` of 1e39, a ``logits_soft_cap`` of 1e-45: the checks of
:class:`pagedattn.integrations.layer.Refusals`). So are, when vLLM sets up the KV cache
(:func:`config_refusals`), MLA, batch invariance, non-causal attention, reference sliding
windows, decode/prefill context parallelism and KV connectors.

**The cache.** vLLM hands each layer one tensor, logically ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` (its strides follow the KV cache layout vLLM resolved:
``LBHNC`` is head-major within a block, ``LBNHC`` token-major), and lets the backend decide
what the last dim's bytes mean. Here token ``t``'s key is the first ``head_size`` entries and
its value the last (:func:`split_kv_cache`), so the key and value caches are two HND views
``[num_pages, num_kv_heads, page_size, head_dim]`` of the one tensor, any layout: each K or V
row is ``head_dim`` contiguous elements and the two share their cache lines' page.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedattn.integrations.layer import LayerOptions, Refusals

#: vLLM's ``kv_cache_dtype`` names of the fp8 caches pagedattn reads, and their dtypes
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                    "fp8_e5m2": torch.float8_e5m2}
#: the model dtypes (query dtypes) the kernels take, by vLLM's name of a 16/32-bit cache
MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
#: the ``kv_cache_dtype`` values accepted (a 16/32-bit name only when it is the model's dtype)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", *FP8_CACHE_DTYPES)
_checks = Refusals("pagedattn's vLLM attention backend")
_refuse = _checks.refuse


def cache_dtype(kv_cache_dtype: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype pagedattn reads for vLLM's ``kv_cache_dtype`` under a model of
    ``model_dtype`` (the query's), or a refusal naming the option."""
    if model_dtype not in MODEL_DTYPES.values():
        _refuse(TypeError, "dtype", "float32, float16 or bfloat16 (the model's dtype)",
                model_dtype)
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[kv_cache_dtype]
    if MODEL_DTYPES.get(kv_cache_dtype) == model_dtype:
        return model_dtype
    _refuse(ValueError, "kv_cache_dtype",
            f"'auto', the model's dtype ({str(model_dtype).removeprefix('torch.')}), 'fp8', "
            "'fp8_e4m3' or 'fp8_e5m2' (the kernels read a cache of the query's dtype, or fp8)",
            kv_cache_dtype)


def layer_options(num_heads: Any, head_size: Any, scale: Any, num_kv_heads: Any = None,
                  alibi_slopes: Any = None, sliding_window: Any = None,
                  kv_cache_dtype: Any = "auto", logits_soft_cap: Any = None,
                  attn_type: Any = "decoder", kv_sharing_target_layer_name: Any = None,
                  *, sinks: Any = None, model_dtype: torch.dtype = torch.float16,
                  **extra: Any) -> LayerOptions:
    """vLLM's ``AttentionImpl`` arguments (in its order) as :class:`LayerOptions`.

    Args:
        num_heads ... kv_sharing_target_layer_name: as vLLM passes them to an
            ``AttentionImpl`` (``attn_type`` a string: vLLM's ``AttentionType`` is a ``str``
            enum; a shared KV cache, ``kv_sharing_target_layer_name``, needs nothing here).
        sinks: ``None`` or the layer's ``[num_heads]`` sink logits (their values are read at
            each call, after vLLM loads the weights).
        model_dtype: the model's dtype, which is the query's.
        extra: any further implementation argument vLLM passes; each is refused.

    Raises:
        TypeError, ValueError: an argument pagedattn does not support, naming vLLM's option,
            among them a value the kernels would refuse at serving time: a ``scale`` past
            float32's range over log2(e) (``|scale| > 2.36e38``), a ``logits_soft_cap``
            below ``ln 2 / FLOAT32_MAX`` (2.04e-39) or past 2.36e38, ALiBi slopes past
            2.36e38.
    """
    for name in sorted(extra):
        _refuse(ValueError, name, "no such argument (pagedattn's backend takes vLLM's "
                "standard attention arguments only)", extra[name])
    attn_type = getattr(attn_type, "value", attn_type)  # vLLM's AttentionType: a str enum
    if attn_type != "decoder":
        _refuse(ValueError, "attn_type", "'decoder' (decoder self-attention over the paged "
                "cache; encoder, encoder-only and cross attention are not supported)",
                attn_type)
    num_heads, num_kv_heads, head_size = _checks.heads(
        num_heads, num_heads if num_kv_heads is None else num_kv_heads, head_size,
        ("num_heads", "num_kv_heads", "head_size"))
    scale = _checks.scale("scale", scale)
    window_left = _checks.window("sliding_window", sliding_window, counts_the_token=True)
    cap = _checks.soft_cap("logits_soft_cap", logits_soft_cap)
    slopes = None if alibi_slopes is None else _checks.head_floats("alibi_slopes",
                                                                   alibi_slopes, num_heads)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.numel() != num_heads):
        _refuse(ValueError, "sinks", f"a tensor of {num_heads} sink logits (one per head)",
                getattr(sinks, "shape", type(sinks).__name__))
    return LayerOptions(num_q_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
                        scale=scale, q_dtype=model_dtype,
                        kv_dtype=cache_dtype(kv_cache_dtype, model_dtype),
                        window_left=window_left, logits_soft_cap=cap, alibi_slopes=slopes)


def config_refusals(vllm_config: Any, *, batch_invariant: bool = False) -> list[str]:
    """What in vLLM's ``VllmConfig`` the backend does not run, one line per option naming it
    (empty: nothing). ``batch_invariant`` is vLLM's ``VLLM_BATCH_INVARIANT``. vLLM's CUDA
    platform also asks the backend class (``validate_configuration``); its CPU platform does
    not, so the metadata builder asks this when vLLM sets up the KV cache."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    checks = (
        (getattr(model, "use_mla", False), "use_mla: MLA is not supported"),
        (batch_invariant, "VLLM_BATCH_INVARIANT: batch invariance is not supported"),
        (getattr(vllm_config.attention_config, "use_non_causal", False),
         "use_non_causal: only causal attention is supported"),
        (getattr(model, "rswa_window", None) is not None,
         "rswa_window: reference sliding-window attention is not supported"),
        (getattr(parallel, "decode_context_parallel_size", 1) > 1,
         "decode_context_parallel_size: decode context parallelism is not supported"),
        (getattr(parallel, "prefill_context_parallel_size", 1) > 1,
         "prefill_context_parallel_size: prefill context parallelism is not supported"),
        (getattr(vllm_config, "kv_transfer_config", None) is not None,
         "kv_transfer_config: KV connectors are not supported (they move cache bytes whose "
         "meaning this backend owns)"),
    )
    return [reason for refused, reason in checks if refused]


def split_kv_cache(kv_cache: torch.Tensor, options: LayerOptions) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """The key and value caches of vLLM's per-layer tensor ``[num_blocks, num_kv_heads,
    block_size, 2 * head_size]`` (any strides with a unit last stride; fp8 caches arrive as
    ``uint8``): two HND views ``[num_pages, num_kv_heads, page_size, head_dim]``, the key the
    first ``head_size`` entries of the last dim, the value the rest. No copy."""
    if not isinstance(kv_cache, torch.Tensor):
        _refuse(TypeError, "kv_cache", "a tensor", type(kv_cache).__name__)
    shape = (options.num_kv_heads, 2 * options.head_dim)
    if kv_cache.dim() != 4 or (kv_cache.shape[1], kv_cache.shape[3]) != shape:
        _refuse(ValueError, "kv_cache", "[num_blocks, num_kv_heads="
                f"{options.num_kv_heads}, block_size, 2 * head_size={2 * options.head_dim}]",
                tuple(kv_cache.shape))
    if kv_cache.dtype == torch.uint8 and options.fp8:
        kv_cache = kv_cache.view(options.kv_dtype)
    if kv_cache.dtype != options.kv_dtype:
        _refuse(TypeError, "kv_cache", f"dtype {options.kv_dtype}", kv_cache.dtype)
    pairs = kv_cache.unflatten(-1, (2, options.head_dim))
    return pairs[..., 0, :], pairs[..., 1, :]


def cache_layout(key_cache: torch.Tensor) -> str:
    """``"HND"`` when a page's tokens of one kv head are adjacent in memory (vLLM's
    ``LBHNC``), else ``"NHD"`` (``LBNHC``): the physical order within a page."""
    return "HND" if key_cache.stride(1) > key_cache.stride(2) else "NHD"
