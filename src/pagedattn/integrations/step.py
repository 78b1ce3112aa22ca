"""One serving step's attention plans: built once per step (vLLM's metadata builder, SGLang's
``init_forward_metadata``), run by every layer. Pure Python over pagedattn's API: nothing here
imports a framework. The arguments are named as vLLM names them; SGLang's batch maps to them in
``sglang/layer.py``.

vLLM's ``CommonAttentionMetadata`` maps to :func:`pagedattn.plan_attention` directly:

==============================  ===============================================================
vLLM                            pagedattn
==============================  ===============================================================
``block_table_tensor``          ``block_tables`` ``[batch, max_pages]`` int32 (kernel blocks =
                                pages: ``page_size`` is the cache's ``block_size``)
``seq_lens``                    ``seq_lens`` (the step's new tokens included, as vLLM counts)
``query_start_loc``             ``query_start_loc`` ``[batch + 1]`` int32
``query_start_loc_cpu``         where the decode rows end (host data: no device sync)
``max_query_len``               ``max_query_len``
``num_actual_tokens``           the query rows attended (rows past it are vLLM's padding)
``slot_mapping``                :func:`pagedattn.append_kv`'s ``slot_mapping`` (per layer, in
                                ``do_kv_cache_update``)
==============================  ===============================================================

vLLM puts decode rows first (the builder's ``reorder_batch_threshold = 1``). The leading
requests that bring exactly one token are the step's **decode part**: one plan over them with
``num_decodes`` equal to their count, which runs pagedattn's decode plan (split-KV for long
contexts; CUDA-graph safe). The rest, chunked-prefill chunks, prompts after a cached prefix
and anything else, is the **varlen part**: one plan over those rows, ``query_start_loc``
shifted to start at 0 (one device subtraction). A step of decodes only has no varlen part, a
step of prefills no decode part. Correctness does not rest on the order: the varlen kernel
takes any query lengths.

Layers whose plan-time variants differ (a sliding window, a soft-cap) get one plan each per
step (:attr:`LayerOptions.variant`); everything per layer (scale, fp8 scales, sinks, ALiBi
slopes) is passed at run.

Decode-part plans are kept across steps by :class:`PlanCache`, keyed by the metadata tensors'
addresses, shapes and strides: vLLM's are views of persistent buffers, so a decode step of
the same batch size finds its plan again, and a plan used in a CUDA-graph capture (``pin``)
stays alive, with its workspace, as long as the builder.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pagedattn.attention import AttentionPlan, plan_attention
from pagedattn.integrations.layer import LayerOptions

#: decode-part plans kept per builder besides the pinned ones
PLAN_CACHE_SIZE = 64


@dataclass
class StepPlans:
    """One variant's plans for one step: rows ``[:num_decode_tokens]`` through ``decode``,
    rows ``[num_decode_tokens:num_actual_tokens]`` through ``varlen``."""

    num_actual_tokens: int
    num_decode_tokens: int
    decode: AttentionPlan | None
    varlen: AttentionPlan | None


def _signature(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device


class PlanCache:
    """Decode-part plans by the identity of their metadata (see the module docstring): an
    LRU of :data:`PLAN_CACHE_SIZE`, plus the pinned plans of CUDA-graph captures. A cached
    plan holds its tensors, so an address in a key cannot be reused by other memory while the
    plan lives."""

    def __init__(self, size: int = PLAN_CACHE_SIZE) -> None:
        self.size = size
        self._lru: OrderedDict[tuple, AttentionPlan] = OrderedDict()
        self._pinned: dict[tuple, AttentionPlan] = {}

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def get(self, key: tuple, build, pin: bool = False) -> AttentionPlan:
        plan = self._pinned.get(key)
        if plan is None:
            plan = self._lru.pop(key, None)
            if plan is None:
                plan = build()
            if pin:
                self._pinned[key] = plan
            else:
                self._lru[key] = plan
                while len(self._lru) > self.size:
                    self._lru.popitem(last=False)
        return plan


def num_decodes(query_start_loc_cpu: torch.Tensor, num_reqs: int) -> int:
    """How many leading requests bring exactly one new token (host data only)."""
    q_lens = query_start_loc_cpu[1:num_reqs + 1] - query_start_loc_cpu[:num_reqs]
    other = (q_lens != 1).nonzero()
    return int(other[0, 0]) if other.numel() else num_reqs


def plan_step(*, block_table: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor, num_reqs: int,
              num_actual_tokens: int, max_query_len: int, page_size: int,
              layers: list[LayerOptions], cache: PlanCache | None = None,
              pin: bool = False, kv_layout: str = "HND") -> dict[tuple, StepPlans]:
    """The step's plans, one :class:`StepPlans` per distinct variant among ``layers`` (a
    vLLM KV-cache group's layers), from vLLM's ``CommonAttentionMetadata`` fields.

    ``cache`` keeps the decode-part plans across steps (``pin``: for a CUDA-graph capture).
    ``kv_layout``: the caches' page layout at run (vLLM's views are ``"HND"``, SGLang's token
    slots ``"NHD"``). Nothing is read from the device.
    """
    nd = num_decodes(query_start_loc_cpu, num_reqs)  # requests, and tokens: one each
    shifted = None
    if nd < num_reqs:
        start = int(query_start_loc_cpu[nd])
        shifted = query_start_loc[nd:num_reqs + 1] - start
    plans: dict[tuple, StepPlans] = {}
    for options in layers:
        if options.variant in plans:
            continue
        shapes: dict[str, Any] = dict(
            num_q_heads=options.num_q_heads, num_kv_heads=options.num_kv_heads,
            head_dim=options.head_dim, page_size=page_size, q_dtype=options.q_dtype,
            kv_dtype=options.kv_dtype, kv_layout=kv_layout, window_left=options.window_left,
            logits_soft_cap=options.logits_soft_cap)
        decode = varlen = None
        if nd:
            table, lens, qsl = block_table[:nd], seq_lens[:nd], query_start_loc[:nd + 1]

            def build(table=table, lens=lens, qsl=qsl, shapes=shapes):
                return plan_attention(table, lens, qsl, max_query_len=1, num_decodes=nd,
                                      **shapes)

            if cache is None:
                decode = build()
            else:
                key = (*map(_signature, (table, lens, qsl)), tuple(sorted(shapes.items(),
                                                                           key=str)))
                decode = cache.get(key, build, pin=pin)
        if shifted is not None:
            varlen = plan_attention(block_table[nd:num_reqs], seq_lens[nd:num_reqs], shifted,
                                    max_query_len=max(int(max_query_len), 1), **shapes)
        plans[options.variant] = StepPlans(num_actual_tokens=int(num_actual_tokens),
                                           num_decode_tokens=nd, decode=decode,
                                           varlen=varlen)
    return plans


def run_step(step: StepPlans, options: LayerOptions, query: torch.Tensor,
             key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor, *,
             k_scale=None, v_scale=None, sinks: torch.Tensor | None = None,
             alibi_slopes: torch.Tensor | None = None) -> None:
    """One layer's attention for the step into ``output`` (rows past the step's tokens left
    as they are): the decode part, then the varlen part. ``sinks`` and ``alibi_slopes`` are
    float32 ``[num_q_heads]`` tensors on the query's device, or ``None``."""
    nd, n = step.num_decode_tokens, step.num_actual_tokens
    per_call = dict(scale=options.scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                    alibi_slopes=alibi_slopes)
    if step.decode is not None:
        step.decode.run(query[:nd], key_cache, value_cache, out=output[:nd], **per_call)
    if step.varlen is not None:
        step.varlen.run(query[nd:n], key_cache, value_cache, out=output[nd:n], **per_call)
