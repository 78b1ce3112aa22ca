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
extend), encoder lengths, and what ``layer.py`` refuses.

**CUDA graphs** (SGLang 0.5.23's decode graphs; the hooks of its ``AttentionBackend``, whose
older ``init_forward_metadata_capture_cuda_graph`` / ``..._replay_cuda_graph`` pair 0.5.23
removed): :meth:`~PagedAttnSGLangBackend.init_cuda_graph_state` allocates the static metadata
once, a block table ``[max_bs, ceil(req_to_token width / page_size)]`` and lengths
``[max_bs]`` (int32); :meth:`~PagedAttnSGLangBackend.init_forward_metadata_out_graph` at
capture (``in_capture=True``) makes one step per captured batch size over views of them, whose
plans the captured forward builds once, and at replay writes this step's tables and lengths
into the same memory in place and makes that step current again. The plans read their tables
and lengths on the device at every run, so the replayed kernels see the new ones. Decode
graphs only: a capture or replay of any other mode (SGLang's target-verify and draft graphs,
its full prefill graphs) is refused by name. Prefill under SGLang's default breakable prefill
graph runs attention eagerly between the graph's segments, through ``init_forward_metadata``.
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


@dataclass
class GraphState:
    """The decode graphs' static metadata (:meth:`PagedAttnSGLangBackend.init_cuda_graph_state`)
    and the step captured for each batch size, whose plans hold views of it."""

    max_bs: int
    block_table: torch.Tensor  # [max_bs, max_pages] int32 page ids
    seq_lens: torch.Tensor  # [max_bs] int32 tokens per sequence
    query_start_loc: torch.Tensor  # [max_bs + 1] int32: 0, 1, ..., max_bs (one token each)
    steps: dict[int, Step] = field(default_factory=dict)


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
        self.graph: GraphState | None = None

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

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """SGLang's decode-graph setup, once before any capture: the static metadata every
        captured batch size's plans read (views of it), allocated on the model's device.

        Args:
            max_bs: the largest batch size SGLang captures (an int >= 1).
            max_num_tokens: the largest token count of a captured batch (an int >= 1; a
                decode graph's is ``max_bs``, one token a request).

        Allocates ``block_table`` ``[max_bs, ceil(req_to_token.shape[1] / page_size)]`` int32
        page ids (zeros: page 0) and ``seq_lens`` ``[max_bs]`` int32 (the fill value, 1).
        Calling it again drops the earlier graphs' steps.

        Raises:
            TypeError, ValueError: ``max_bs`` or ``max_num_tokens`` not an int >= 1 (the
                message names it).
        """
        max_bs = checks.int_at_least("max_bs", max_bs, 1)
        checks.int_at_least("max_num_tokens", max_num_tokens, 1)
        max_pages = -(-self.req_to_token.shape[1] // self.page_size)
        self.graph = GraphState(
            max_bs=max_bs,
            block_table=torch.zeros(max_bs, max_pages, dtype=torch.int32, device=self.device),
            seq_lens=torch.full((max_bs,), self.get_cuda_graph_seq_len_fill_value(),
                                dtype=torch.int32, device=self.device),
            query_start_loc=torch.arange(max_bs + 1, dtype=torch.int32, device=self.device))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """A decode graph's metadata, outside the graph: at capture (``in_capture=True``) a
        step for ``forward_batch.batch_size`` over views of the static metadata (its plans are
        built by the captured forward, once, and reused by every replay); at replay this
        batch's block tables (``req_to_token[req_pool_indices, ::page_size] // page_size``, as
        wide as ``seq_lens_cpu`` needs: the kernels read no page past a length) and lengths
        written into the static metadata in place, and the captured step made current.

        ``forward_batch`` is SGLang's capture batch or replay view: ``batch_size`` (the
        captured size, padding rows included), ``forward_mode`` (decode), ``req_pool_indices``
        ``[batch_size]`` and ``seq_lens`` ``[batch_size]`` (int32 or int64, on the device),
        ``seq_lens_cpu`` (their host copy, or ``None``: then the tables are copied whole),
        ``encoder_lens`` and ``spec_info`` (``None``).

        Raises:
            ValueError: no :meth:`init_cuda_graph_state` first (``init_cuda_graph_state``), a
                ``batch_size`` outside ``[1, max_bs]`` or, at replay, one never captured, a
                mode other than decode (``forward_mode``), ``encoder_lens`` or ``spec_info``
                given, a ``seq_lens_cpu`` longer than ``req_to_token``'s rows (``seq_lens``);
                each message names it.
        """
        graph = self.graph
        if graph is None:
            checks.refuse(ValueError, "init_cuda_graph_state", "a call before the first "
                          "capture (SGLang's graph runner makes it)", "none")
        mode = forward_batch.forward_mode
        if not mode.is_decode():
            checks.refuse(ValueError, "forward_mode", "a decode graph (pagedattn captures "
                          "decode batches only: disable the others' graphs)", mode)
        for name in ("encoder_lens", "spec_info"):
            if getattr(forward_batch, name, None) is not None:
                checks.refuse(ValueError, name, "None (encoder-decoder models and "
                              "speculative decoding are not supported)", "a value")
        bs = forward_batch.batch_size
        if isinstance(bs, bool) or not isinstance(bs, int) or not 1 <= bs <= graph.max_bs:
            checks.refuse(ValueError, "batch_size", f"an int in [1, max_bs={graph.max_bs}] "
                          "(init_cuda_graph_state's max_bs)", bs)
        step: Step | None
        if in_capture:
            step = graph.steps[bs] = Step(args=dict(
                block_table=graph.block_table[:bs], seq_lens=graph.seq_lens[:bs],
                query_start_loc=graph.query_start_loc[:bs + 1],
                query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32), num_reqs=bs,
                num_actual_tokens=bs, max_query_len=1, page_size=self.page_size),
                decode=True)
        else:
            step = graph.steps.get(bs)
            if step is None:
                checks.refuse(ValueError, "batch_size", "a captured batch size "
                              f"({sorted(graph.steps)})", bs)
        self._fill_graph_metadata(graph, bs, forward_batch)
        self.forward_metadata = step

    def _fill_graph_metadata(self, graph: GraphState, bs: int, forward_batch) -> None:
        """This batch's lengths and page ids into the static metadata's first ``bs`` rows."""
        graph.seq_lens[:bs].copy_(forward_batch.seq_lens[:bs])
        max_pages = graph.block_table.shape[1]
        width = max_pages
        lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if lens_cpu is not None:
            longest = max(int(lens_cpu[:bs].max()), 1)
            if longest > max_pages * self.page_size:
                checks.refuse(ValueError, "seq_lens", "lengths within req_to_token's "
                              f"{max_pages * self.page_size} token slots a request", longest)
            width = -(-longest // self.page_size)
        tables = batch_tables(self.req_to_token, forward_batch.req_pool_indices[:bs],
                              width * self.page_size, self.page_size)
        graph.block_table[:bs, :tables.shape[1]].copy_(tables)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Nothing to record inside the graph: the metadata is written outside it
        (:meth:`init_forward_metadata_out_graph`) and read by the plans' kernels."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The length SGLang gives a captured batch's padding rows: 1 (one key each, page
        ``req_to_token[0, 0]``; their outputs are discarded)."""
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
