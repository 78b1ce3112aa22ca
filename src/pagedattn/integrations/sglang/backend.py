"""pagedattn as an SGLang attention backend: the class SGLang's registry builds for
``--attention-backend pagedattn`` (``pagedattn.integrations.sglang.register``; this module
imports SGLang).

Per batch, :meth:`PagedAttnSGLangBackend.init_forward_metadata` maps SGLang's
``ForwardBatch`` to one step (``layer.py``: the block table from ``req_to_token``, the query
offsets, the lengths) and plans it lazily, once per layer variant, through
:func:`pagedattn.integrations.step.plan_step` (decode rows through
:func:`pagedattn.plan_attention`'s decode plan, the rest through one varlen plan) or, for an
absorbed-MLA model, :func:`pagedattn.plan_mla_decode`. Per layer, ``forward_decode`` and
``forward_extend`` write the new K/V through SGLang's own pool (``set_kv_buffer``, which owns
the pool's bytes and any quantization) and attend through the plans; SGLang's attention
kernels never run.

What is not supported, refused by name when met: an MLA model's extend (prefill) batches
(serve them with another backend: ``--prefill-attention-backend``, and this one as
``--decode-attention-backend pagedattn``), speculative-decoding modes (target verify, draft
extend), encoder lengths, SGLang's CUDA graphs (``init_cuda_graph_state`` raises: run with
``--disable-cuda-graph``), and what ``layer.py`` refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

import pagedattn
from pagedattn.integrations.layer import LayerOptions
from pagedattn.integrations.sglang.layer import (
    MLAOptions,
    batch_tables,
    cache_views,
    checks,
    layer_options,
    mla_cache_views,
    mla_options,
    query_starts,
)
from pagedattn.integrations.step import plan_step, run_step


@dataclass
class Step:
    """One batch in pagedattn's terms (plan_step's arguments) and its plans by variant."""

    args: dict[str, Any]
    decode: bool
    plans: dict[tuple, Any] = field(default_factory=dict)


class PagedAttnSGLangBackend(AttentionBackend):
    """SGLang's ``AttentionBackend`` over pagedattn's plans (the module docstring)."""

    def __init__(self, model_runner) -> None:
        super().__init__()
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.pool = model_runner.token_to_kv_pool
        self.page_size = int(getattr(model_runner, "page_size", None) or 1)
        self.q_dtype = model_runner.dtype
        self.kv_dtype = self.pool.dtype
        self.use_mla = bool(getattr(model_runner, "use_mla_backend", False))
        self.hnd = bool(getattr(self.pool, "use_hnd", False))
        self.layers: dict[int, LayerOptions | MLAOptions] = {}
        self.forward_metadata: Step | None = None

    # --- per batch ------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if not (mode.is_decode() or mode.is_extend()) or mode.is_target_verify() or (
                getattr(mode, "is_draft_extend", lambda: False)()):
            checks.refuse(ValueError, "forward_mode", "a decode or extend batch "
                          "(speculative decoding is not supported)", mode)
        if getattr(forward_batch, "encoder_lens", None) is not None:
            checks.refuse(ValueError, "encoder_lens", "None (encoder-decoder models are not "
                          "supported)", "a tensor")
        batch = forward_batch.batch_size
        decode = mode.is_decode()
        seq_lens_cpu = forward_batch.seq_lens_cpu
        if decode:
            qsl_cpu = torch.arange(batch + 1, dtype=torch.int32)
            qsl = query_starts(None, batch, self.device)
        else:
            qsl_cpu = query_starts(torch.as_tensor(forward_batch.extend_seq_lens_cpu), batch,
                                   torch.device("cpu"))
            qsl = query_starts(forward_batch.extend_seq_lens, batch, self.device)
        max_len = int(seq_lens_cpu.max()) if batch else 1
        tables = batch_tables(self.req_to_token, forward_batch.req_pool_indices, max_len,
                              self.page_size)
        q_lens = (qsl_cpu[1:] - qsl_cpu[:-1]) if batch else qsl_cpu[:0]
        self.forward_metadata = Step(args=dict(
            block_table=tables, seq_lens=forward_batch.seq_lens.to(torch.int32),
            query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, num_reqs=batch,
            num_actual_tokens=int(qsl_cpu[-1]),
            max_query_len=int(q_lens.max()) if batch else 1, page_size=self.page_size),
            decode=decode)

    def _plans(self, options: LayerOptions | MLAOptions):
        step = self.forward_metadata
        plans = step.plans.get(options.variant)
        if plans is None:
            if isinstance(options, MLAOptions):
                if not step.decode:
                    checks.refuse(ValueError, "forward_extend", "decode batches only under an "
                                  "MLA model (run its prefill with another backend: "
                                  "--prefill-attention-backend)", "an extend batch")
                a = step.args
                plans = pagedattn.plan_mla_decode(
                    a["block_table"], a["seq_lens"], num_q_heads=options.num_q_heads,
                    latent_dim=options.latent_dim, rope_dim=options.rope_dim,
                    page_size=self.page_size, q_dtype=options.q_dtype,
                    kv_dtype=options.kv_dtype, logits_soft_cap=options.logits_soft_cap)
            else:
                plans = plan_step(layers=[options], kv_layout="HND" if self.hnd else "NHD",
                                  **step.args)[options.variant]
            step.plans[options.variant] = plans
        return plans

    # --- per layer ------------------------------------------------------------------------

    def _options(self, layer) -> LayerOptions | MLAOptions:
        options = self.layers.get(layer.layer_id)
        if options is None:
            if self.use_mla:
                options = mla_options(layer, self.pool.kv_lora_rank,
                                      self.pool.qk_rope_head_dim, self.q_dtype, self.kv_dtype)
            else:
                options = layer_options(layer, self.q_dtype, self.kv_dtype)
            self.layers[layer.layer_id] = options
        return options

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, sinks=None, q_rope=None,
                 k_rope=None, **kwargs):
        """Write the new K/V, attend; returns ``[tokens, tp_q_head_num * v_head_dim]``."""
        unknown = sorted(kwargs)
        if unknown:
            checks.refuse(ValueError, unknown[0], "no such argument (pagedattn's backend "
                          "takes q, k, v, sinks, q_rope and k_rope)", kwargs[unknown[0]])
        options = self._options(layer)
        if isinstance(options, MLAOptions):
            return self._forward_mla(q, k, v, layer, forward_batch, save_kv_cache, options,
                                     q_rope, k_rope, sinks)
        if q_rope is not None or k_rope is not None:
            checks.refuse(ValueError, "q_rope", "None outside MLA", "a tensor")
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v,
                                    layer.k_scale, layer.v_scale)
        key_cache, value_cache, _ = cache_views(
            self.pool.get_key_buffer(layer.layer_id), self.pool.get_value_buffer(layer.layer_id),
            self.page_size, self.hnd)
        query = q.view(-1, options.num_q_heads, options.head_dim)
        out = query.new_empty(query.shape)
        scales = (dict(k_scale=_scale(layer, "k"), v_scale=_scale(layer, "v"))
                  if options.fp8 else {})
        run_step(self._plans(options), options, query, key_cache, value_cache, out,
                 sinks=None if sinks is None else sinks.detach().to(torch.float32), **scales)
        return out.view(-1, options.num_q_heads * options.head_dim)

    def _forward_mla(self, q, k, v, layer, forward_batch, save_kv_cache, options: MLAOptions,
                     q_rope, k_rope, sinks):
        latent, rope = options.latent_dim, options.rope_dim
        if save_kv_cache and k is not None:
            loc = KVWriteLoc.for_layer(forward_batch, layer)
            if k_rope is not None:
                self.pool.set_mla_kv_buffer(layer, loc, k, k_rope)
            else:
                self.pool.set_kv_buffer(layer, loc, k, v)
        ckv, kpe = mla_cache_views(self.pool.get_key_buffer(layer.layer_id), self.page_size,
                                   latent)
        if q_rope is not None:
            q_nope = q.view(-1, options.num_q_heads, latent)
            q_pe = q_rope.view(-1, options.num_q_heads, rope)
        else:
            q_all = q.view(-1, options.num_q_heads, latent + rope)
            q_nope, q_pe = q_all[..., :latent], q_all[..., latent:]
        plan = self._plans(options)
        out = plan.run(q_nope, q_pe, ckv, kpe, scale=options.scale,
                       sinks=None if sinks is None else sinks.detach().to(torch.float32))
        return out.reshape(-1, options.num_q_heads * latent)

    # --- CUDA graphs ----------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        checks.refuse(ValueError, "cuda_graph", "no CUDA graphs (run SGLang with "
                      "--disable-cuda-graph: this backend's graph hooks are not written yet)",
                      f"max_bs={max_bs}")

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def support_triton(self):
        return True


def _scale(layer, which: str) -> Any:
    """An SGLang layer's fp8 scale for ``which`` ("k", "v"): its ``*_scale_float``, else its
    ``*_scale`` (a tensor), else 1 (SGLang's pool divides by the same when it writes)."""
    value = getattr(layer, f"{which}_scale_float", None)
    if value is None:
        value = getattr(layer, f"{which}_scale", None)
    if isinstance(value, torch.Tensor):
        return value.reshape(()).to(torch.float32)
    return 1.0 if value is None else float(value)
