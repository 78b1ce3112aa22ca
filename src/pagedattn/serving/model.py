"""A small Llama (SmolLM2) in the style of gpt-fast: ``RMSNorm``, ``Attention``, ``FeedForward``,
``TransformerBlock`` and ``Transformer`` modules, with the attention backend a constructor
choice. The other families (:data:`pagedattn.serving.families.FAMILIES`) are options of the
same modules, read from a :class:`~pagedattn.serving.config.ModelConfig`: QKV bias, Q/K norms,
GeGLU, post norms and an embedding scale, a final logit soft-cap, and each layer's attention
variants (window, soft-cap, softmax scale) through prefill and the decode plans.

The attention backend owns the KV cache: each ``Attention`` layer computes its rotated
``q``/``k``/``v`` and calls ``backend(layer, q, k, v, step)``, where ``step`` is the backend's
per-step state. :class:`PagedAttention` (serving, here) writes K/V into a
:class:`PagedKVCache` with ``append_kv`` and attends with ``paged_decode`` at decode, with
one block-diagonal causal SDPA over all the prompts of a prefill (varlen, no loop per
prompt), or with ``paged_attention`` over the cache when sequences bring new tokens after
cached ones (:meth:`Transformer.extend`: chunked prefill, a prompt after a cached prefix).
The dense-KV reference backend used by the benchmark and the tests lives in
:mod:`pagedattn.serving.baselines`.

Kernel count matters at batch 1 (the step is launch-bound even inside a CUDA graph): Q/K/V are
one fused projection, gate/up another, RoPE runs on Q and K together, each residual add is
folded into the next norm, and on a GPU each of the layer's elementwise functions (the norm,
add + norm, RoPE, SwiGLU's activation, the RoPE tables) is one kernel compiled by
``torch.compile`` (:func:`fused_functions`): 11 kernels a layer where eager runs 16 or more.

Numerics follow Hugging Face's ``LlamaForCausalLM`` (fp32 RMSNorm statistics, RoPE ``freqs =
position * inv_freq`` with ``rotate_half``, ``down(silu(gate(x)) * up(x))``), so in fp32 greedy
decoding matches transformers token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.api import DecodePlan, plan_decode
from pagedattn.attention import AttentionPlan, plan_attention
from pagedattn.serving import ops
from pagedattn.serving.cache import PagedKVCache, StepMetadata
from pagedattn.serving.config import ModelConfig, load_hf
from pagedattn.serving.gguf_loader import load_gguf

_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
             mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """SDPA with grouped KV: ``q`` ``[B, Hq, Tq, D]``, ``k``/``v`` ``[B, Hkv, Tk, D]``."""
    if _SDPA_HAS_GQA and mask is None:  # as transformers does when there is no mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                              scale=scale)
    group = q.shape[1] // k.shape[1]  # with a mask: repeat, so the fused kernels apply
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      *, window_left: int = -1, logits_soft_cap: float = 0.0,
                      scale: float | None = None) -> torch.Tensor:
    """A prefill's attention over packed prompts: ``q`` ``[N, Hq, D]``, ``k``/``v`` ``[N,
    Hkv, D]``, ``mask`` ``[N, N]`` bool (:func:`prefill_mask`) -> ``[N, Hq, D]``.

    ``window_left >= 0`` keeps keys at most that many positions back (every prompt starts
    at position 0, so packed-index distance is position distance); ``logits_soft_cap > 0``
    caps the scores (``cap * tanh(s / cap)``) in explicit math, which SDPA cannot do."""
    if window_left >= 0:
        i = torch.arange(mask.shape[0], device=mask.device)
        mask = mask & (i[:, None] - i[None, :] <= window_left)
    q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if logits_soft_cap <= 0:
        return sdpa_gqa(q, k, v, mask=mask, scale=scale)[0].transpose(0, 1)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = torch.tanh(s / logits_soft_cap) * logits_soft_cap
    p = s.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return (p @ v)[0].transpose(0, 1)


# -- attention backends ------------------------------------------------------------------
class AttentionBackend(Protocol):
    """``backend(layer, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D], step) -> [N, Hq, D]``."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 step) -> torch.Tensor: ...


#: (q, key_cache, value_cache, k_scale, v_scale, window_left, logits_soft_cap, scale) -> out
Attend = Callable[..., torch.Tensor]


class PagedStep(NamedTuple):
    """One step of the paged backend: built once per step, read by every layer."""

    cache: PagedKVCache
    meta: StepMetadata
    mask: torch.Tensor | None  # prefill: [N, N] block-diagonal causal mask; decode: None
    # decode and extend: the paged attention of this step (decode_attend, extend_attend)
    attend: Attend | None
    calibrate: bool = False  # extend: an fp8 cache without scales takes them from its K/V


def decode_attend(meta: StepMetadata, impl: str) -> Attend:
    """The decode attention of one step, built once and run per layer.

    With ``impl="auto"`` this is the plan API: the first layer's call plans the step
    (:func:`pagedattn.plan_decode` over ``meta``'s block tables and lengths, shapes and dtypes
    from that layer's query and cache) and every layer runs that one plan, so a step pays for
    one launch plan and one workspace (one kernel that zeroes it), not one per layer. A
    model whose layers differ in their variants (``window_left``, ``logits_soft_cap``: compile-
    time specializations of a plan) gets one plan per distinct pair, planned by the first
    layer that has it (Gemma 2: two plans a step). Inside a ``torch.compile`` trace of the
    step, and for the study's stages, each layer calls the custom op
    (:func:`pagedattn.serving.ops.paged_decode`).
    """
    if impl != "auto" or torch.compiler.is_compiling():
        def attend_op(q, kc, vc, k_scale, v_scale, window_left=-1, logits_soft_cap=0.0,
                      scale=None):
            return ops.paged_decode(q, kc, vc, meta.block_tables, meta.context_lens, impl=impl,
                                    k_scale=k_scale, v_scale=v_scale, scale=scale,
                                    window_left=window_left,
                                    logits_soft_cap=logits_soft_cap or None)
        return attend_op
    plans: dict[tuple[int, float], DecodePlan] = {}

    def attend(q, kc, vc, k_scale, v_scale, window_left=-1, logits_soft_cap=0.0, scale=None):
        plan = plans.get((window_left, logits_soft_cap))
        if plan is None:
            plan = plans[window_left, logits_soft_cap] = plan_decode(
                meta.block_tables, meta.context_lens, num_q_heads=q.shape[1],
                num_kv_heads=kc.shape[2], head_dim=q.shape[2], page_size=kc.shape[1],
                q_dtype=q.dtype, kv_dtype=kc.dtype, window_left=window_left,
                logits_soft_cap=logits_soft_cap or None)
        return plan.run(q, kc, vc, k_scale=k_scale, v_scale=v_scale, scale=scale)
    return attend


def extend_attend(meta: StepMetadata) -> Attend:
    """The paged attention of a step whose sequences bring any number of new tokens over
    what the cache already holds (chunked prefill, a prompt after a cached prefix, decodes
    among them): :func:`pagedattn.plan_attention` over ``meta``'s block tables, lengths and
    ``query_start``, planned by the first layer of each distinct (window, soft-cap) pair and
    run by every layer, as :func:`decode_attend` does."""
    qsl = torch.tensor(meta.query_start, dtype=torch.int32).to(meta.context_lens.device)
    longest = max(b - a for a, b in zip(meta.query_start[:-1], meta.query_start[1:],
                                        strict=True))
    plans: dict[tuple[int, float], AttentionPlan] = {}

    def attend(q, kc, vc, k_scale, v_scale, window_left=-1, logits_soft_cap=0.0, scale=None):
        plan = plans.get((window_left, logits_soft_cap))
        if plan is None:
            plan = plans[window_left, logits_soft_cap] = plan_attention(
                meta.block_tables, meta.context_lens, qsl, num_q_heads=q.shape[1],
                num_kv_heads=kc.shape[2], head_dim=q.shape[2], page_size=kc.shape[1],
                q_dtype=q.dtype, kv_dtype=kc.dtype, max_query_len=max(longest, 1),
                window_left=window_left, logits_soft_cap=logits_soft_cap or None)
        return plan.run(q, kc, vc, k_scale=k_scale, v_scale=v_scale, scale=scale)
    return attend


def _checked_query_start(token_ids: torch.Tensor, meta: StepMetadata) -> list[int]:
    """``meta.query_start`` (host ``[batch + 1]`` offsets) once ``token_ids`` (``[num_tokens]``)
    holds exactly its last offset's tokens: a ragged pass (prefill, extend) reads its tokens
    by these offsets. Raises ValueError naming ``token_ids`` otherwise."""
    starts = meta.query_start
    if token_ids.shape[0] != starts[-1]:
        raise ValueError(f"token_ids: expected {starts[-1]} tokens (meta), "
                         f"got {token_ids.shape[0]}")
    return starts


def prefill_mask(query_start: list[int], device: torch.device) -> torch.Tensor:
    """``[N, N]`` bool: token ``i`` sees token ``j`` when both belong to one prompt (the
    ``query_start`` segments) and ``j <= i``."""
    lens = torch.tensor([b - a for a, b in zip(query_start[:-1], query_start[1:], strict=True)])
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens).to(device)
    n = query_start[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return causal & (seg[:, None] == seg[None, :])


class PagedAttention:
    """Paged backend: K/V through ``append_kv`` into the step's cache; decode attention by
    ``paged_decode`` (``impl``), prefill attention by one masked SDPA over the packed prompts
    (:func:`prefill_attention`). ``cfg`` gives each layer's variants (window, soft-cap) and
    the softmax scale (:class:`ModelConfig`); without one, none and ``head_dim ** -0.5``.
    An fp8 cache that still needs calibration takes its scales from the prefill's K/V."""

    def __init__(self, impl: str = "auto", cfg: ModelConfig | None = None):
        self.impl = impl
        n = cfg.num_layers if cfg is not None else 0
        self.variants = [cast(ModelConfig, cfg).layer_variants(i) for i in range(n)]
        self.scale = cfg.attn_scale if cfg is not None else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 step: PagedStep) -> torch.Tensor:
        cache = step.cache
        if (step.mask is not None or step.calibrate) and cache.needs_calibration:
            cache.calibrate(layer, k, v)
        k_scale, v_scale = cache.scales(layer)
        kc, vc = cache.key_cache(layer), cache.value_cache(layer)
        ops.append_kv(k, v, kc, vc, step.meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        window, cap = self.variants[layer] if self.variants else (-1, 0.0)
        if step.mask is not None:  # prefill
            return prefill_attention(q, k, v, step.mask, window_left=window,
                                     logits_soft_cap=cap, scale=self.scale)
        return cast(Attend, step.attend)(q, kc, vc, k_scale, v_scale, window, cap, self.scale)


# -- a layer's small functions -------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the normalization in float32 and the product in the
    model's dtype, as Llama's reference (and transformers' ``LlamaRMSNorm``) compute it.
    ``F.rms_norm`` on bf16 input normalizes in bf16. (The "L'É…" answer that led here starts
    from a near-tie: "The" 25.33 against "L" 25.24 in float32, so bf16 rounding anywhere can
    flip that first token.)"""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add folded into the next norm: ``h = x + residual`` (in the model's
    dtype, as the unfused block adds) and ``rms_norm(h)``; returns ``(h, rms_norm(h))``."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` for ``gate_up = [gate | up]`` on the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's activation: ``gelu_tanh(gate) * up`` for ``gate_up = [gate | up]`` (eager)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """``cos``, signed ``sin`` ``[N, 1, head_dim]`` for integer ``positions`` ``[N]``: with
    ``sin`` negated on the first half, ``rotate_half(x) * sin == roll(x, D/2) * signed_sin``
    exactly (a sign flip)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin = torch.cat((-sin[:, : freqs.shape[1]], sin[:, freqs.shape[1]:]), dim=-1)
    return emb.cos().to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[N, H, head_dim]``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class LayerFunctions(NamedTuple):
    """The elementwise work of a decode step, as functions: :data:`EAGER` (the definitions
    above: the CPU, and any ``torch.compile`` trace of a whole step) or, on a GPU, each one
    compiled by ``torch.compile`` (inductor) into one kernel (:func:`fused_functions`)."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]
    rope_tables: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    apply_rope: Callable[..., torch.Tensor]


EAGER = LayerFunctions(rms_norm, add_rms_norm, silu_mul, rope_tables, apply_rope)


def fused_functions() -> LayerFunctions:
    """:data:`EAGER`'s functions through ``torch.compile`` (``dynamic=True``: one graph for
    every token count above 1), compiled on first use.

    At batch 1 a decode step is launch-bound even inside a CUDA graph, so kernels per layer
    set its time. Eager, a layer runs 16: a norm of eight kernels (one once compiled), RoPE's
    three, SwiGLU's two and two residual adds beside the four GEMMs, ``append_kv`` and the
    attention's two. Compiled, with each residual add folded into the next norm, it runs 11;
    the step's RoPE tables (about eight kernels) become one."""
    def compiled(fn):
        return torch.compile(fn, dynamic=True)

    return LayerFunctions(*(compiled(fn) for fn in EAGER))


def _functions(fused: LayerFunctions | None, x: torch.Tensor) -> LayerFunctions:
    """``fused`` for CUDA tensors outside a ``torch.compile`` trace, else :data:`EAGER`."""
    if fused is not None and x.is_cuda and not torch.compiler.is_compiling():
        return fused
    return EAGER


# -- modules -------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """:func:`rms_norm` with a weight; with a ``residual``, :func:`add_rms_norm`. ``fused``
    (from :func:`fused_functions`, shared by a model's modules) runs on CUDA tensors."""

    def __init__(self, weight: torch.Tensor, eps: float, fused: LayerFunctions | None = None):
        super().__init__()
        self.weight, self.eps, self.fused = _param(weight), eps, fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rms_norm(x)``, or ``(x + residual, rms_norm(x + residual))`` with a residual."""
        fns = _functions(self.fused, x)
        if residual is None:
            return fns.rms_norm(x, self.weight, self.eps)
        return fns.add_rms_norm(x, residual, self.weight, self.eps)


class FeedForward(nn.Module):
    """SwiGLU: ``w_down(silu(w_gate x) * w_up x)``, gate and up as one ``w13`` projection
    (``activation="gelu_tanh"``: GeGLU, Gemma's)."""

    def __init__(self, w13: torch.Tensor, w_down: torch.Tensor,
                 fused: LayerFunctions | None = None, activation: str = "silu"):
        super().__init__()
        self.w13 = _param(w13)  # [2 * intermediate, hidden]: gate rows, then up rows
        self.w_down = _param(w_down)
        self.fused, self.activation = fused, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.w13)
        if self.activation == "gelu_tanh":
            return F.linear(gelu_tanh_mul(gate_up), self.w_down)
        return F.linear(_functions(self.fused, x).silu_mul(gate_up), self.w_down)


class Attention(nn.Module):
    """GQA self-attention: fused QKV projection (``bqkv``: its bias, Qwen2's), per-head Q/K
    norms (``qk_norm``: the ``[head_dim]`` weights of Q's and K's, Qwen3's), RoPE, the
    backend, output projection."""

    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                 wqkv: torch.Tensor, wo: torch.Tensor, fused: LayerFunctions | None = None,
                 bqkv: torch.Tensor | None = None,
                 qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.layer, self.backend = layer, backend
        self.num_q_heads, self.num_kv_heads = cfg.num_q_heads, cfg.num_kv_heads
        self.head_dim, self.eps = cfg.head_dim, cfg.rms_eps
        self.wqkv = _param(wqkv)  # [(Hq + 2 Hkv) D, hidden]: the Q, K, V rows
        self.wo = _param(wo)
        self.bqkv = None if bqkv is None else _param(bqkv)
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm, self.k_norm = _param(qk_norm[0]), _param(qk_norm[1])
        self.fused = fused

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                step) -> torch.Tensor:
        n, hq, hkv, d = x.shape[0], self.num_q_heads, self.num_kv_heads, self.head_dim
        fns = _functions(self.fused, x)
        qkv = F.linear(x, self.wqkv, self.bqkv)  # [N, (Hq + 2 Hkv) D]
        qk = qkv[:, :(hq + hkv) * d].view(n, hq + hkv, d)
        if self.q_norm is not None:
            qk = torch.cat([fns.rms_norm(qk[:, :hq], self.q_norm, self.eps),
                            fns.rms_norm(qk[:, hq:], self.k_norm, self.eps)], dim=1)
        qk = fns.apply_rope(qk, *rope)
        v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
        o = self.backend(self.layer, qk[:, :hq], qk[:, hq:], v, step)  # [N, Hq, D]
        return F.linear(o.reshape(n, hq * d), self.wo)


class TransformerBlock(nn.Module):
    """Pre-norm block. ``forward(x, residual, rope, step) -> (ffn_out, h)``: the block's
    input is ``x + residual`` (``x`` alone for the first block), added inside its first norm
    (:func:`add_rms_norm`), and it returns its FFN output beside the running sum ``h`` for the
    next block to add, so no residual add runs as a kernel of its own."""

    attention: Attention
    feed_forward: FeedForward
    attention_norm: RMSNorm
    ffn_norm: RMSNorm
    post_norms: tuple[RMSNorm, RMSNorm] | None  # Gemma 2's, of the attention and FFN outputs

    def __init__(self, attention: Attention, feed_forward: FeedForward,
                 attention_norm: RMSNorm, ffn_norm: RMSNorm,
                 post_norms: tuple[RMSNorm, RMSNorm] | None = None):
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward
        self.attention_norm, self.ffn_norm = attention_norm, ffn_norm
        self.post_attn_norm = self.post_ffn_norm = None
        if post_norms is not None:
            self.post_attn_norm, self.post_ffn_norm = post_norms

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope,
                step) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, normed = x, self.attention_norm(x)
        else:
            h, normed = self.attention_norm(x, residual)
        a = self.attention(normed, rope, step)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        h, normed = self.ffn_norm(a, h)
        f = self.feed_forward(normed)
        if self.post_ffn_norm is not None:
            f = self.post_ffn_norm(f)
        return f, h


class Transformer(nn.Module):
    """Llama decoder.

    Args:
        cfg: shapes, constants and variants (:class:`ModelConfig`, from any loader).
        weights: tensors as returned by :func:`load_gguf` or :func:`load_hf` (``nn.Linear``
            layout; the names of :mod:`pagedattn.serving.config`).
        dtype: compute dtype of weights and activations (float32/float16/bfloat16).
        device: where the weights live.
        impl: the ``paged_decode`` impl of the default backend.
        attention: the attention backend (default: :class:`PagedAttention` with ``impl``).

    ``forward(token_ids [N], positions [N], step)`` returns hidden states ``[N, hidden]``;
    :meth:`logits` the vocabulary logits of chosen rows. :meth:`prefill` and :meth:`decode`
    are the paged entry points.
    """

    inv_freq: torch.Tensor  # [head_dim // 2] fp32 RoPE frequencies (a buffer)
    fused: LayerFunctions | None  # the compiled functions (a CUDA model), shared by the layers
    embed_scale: float | None  # the embeddings' factor (Gemma's sqrt(hidden)), or None

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 impl: str = "auto", attention: AttentionBackend | None = None):
        super().__init__()
        self.cfg, self.impl = cfg, impl
        self.attention = PagedAttention(impl, cfg) if attention is None else attention
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.tok_embeddings = _param(w["embed"])
        # Gemma: embeddings times sqrt(hidden) rounded to the model's dtype, as transformers
        self.embed_scale = (None if cfg.embed_scale is None
                            else torch.tensor(cfg.embed_scale, dtype=dtype).item())
        self.fused = fused = fused_functions() if self.tok_embeddings.is_cuda else None
        self.norm = RMSNorm(w["final_norm"], cfg.rms_eps, fused)
        self.output = _param(w.get("lm_head", w["embed"]))  # tied: the same tensor
        self.layers = nn.ModuleList()
        for i in range(cfg.num_layers):
            lw = {k.split(".", 2)[2]: v for k, v in w.items() if k.startswith(f"layers.{i}.")}
            bias = torch.cat([lw["bq"], lw["bk"], lw["bv"]]) if cfg.qkv_bias else None
            post = None
            if cfg.post_norms:
                post = (RMSNorm(lw["post_attn_norm"], cfg.rms_eps, fused),
                        RMSNorm(lw["post_ffn_norm"], cfg.rms_eps, fused))
            self.layers.append(TransformerBlock(
                Attention(cfg, i, self.attention,
                          torch.cat([lw["wq"], lw["wk"], lw["wv"]]), lw["wo"], fused, bias,
                          (lw["q_norm"], lw["k_norm"]) if cfg.qk_norm else None),
                FeedForward(torch.cat([lw["w_gate"], lw["w_up"]]), lw["w_down"], fused,
                            cfg.activation),
                RMSNorm(lw["attn_norm"], cfg.rms_eps, fused),
                RMSNorm(lw["ffn_norm"], cfg.rms_eps, fused), post))
        self.register_buffer("inv_freq", cfg.inv_freq().to(device), persistent=False)

    @classmethod
    def from_gguf(cls, path=None, *, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", impl: str = "auto") -> Transformer:
        """Load SmolLM2 (or any llama GGUF); see :func:`pagedattn.serving.gguf_loader.find_gguf`."""
        cfg, weights = load_gguf(path)
        return cls(cfg, weights, dtype=dtype, device=device, impl=impl)

    @classmethod
    def from_hf(cls, path, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", impl: str = "auto") -> Transformer:
        """Load a Hugging Face checkpoint directory of a family of
        :data:`pagedattn.serving.families.FAMILIES`; see
        :func:`pagedattn.serving.config.load_hf`."""
        cfg, weights = load_hf(path)
        return cls(cfg, weights, dtype=dtype, device=device, impl=impl)

    def with_attention(self, attention: AttentionBackend) -> Transformer:
        """A twin sharing every weight tensor (no copy) over another attention backend.

        Raises ValueError for a model with attention variants (window, soft-cap, a softmax
        scale of its own) and a backend other than :class:`PagedAttention`: backends get no
        variants (:class:`pagedattn.serving.baselines.DenseAttention` applies none)."""
        c = self.cfg
        if not isinstance(attention, PagedAttention) and (
                c.window_left or c.logits_soft_cap or c.attn_scale is not None):
            raise ValueError(f"attention: {type(attention).__name__} applies no attention "
                             "variants; this model has some (window_left, logits_soft_cap "
                             "or attn_scale): use PagedAttention")
        twin = Transformer.__new__(Transformer)
        nn.Module.__init__(twin)
        twin.cfg, twin.impl, twin.attention = self.cfg, self.impl, attention
        twin.tok_embeddings, twin.norm, twin.output = self.tok_embeddings, self.norm, self.output
        twin.fused, twin.embed_scale = self.fused, self.embed_scale
        blocks = cast(list[TransformerBlock], list(self.layers))
        twin.layers = nn.ModuleList()
        for i, b in enumerate(blocks):
            a = b.attention
            qk_norm = None if a.q_norm is None else (a.q_norm, cast(torch.Tensor, a.k_norm))
            post = (None if b.post_attn_norm is None
                    else (b.post_attn_norm, cast(RMSNorm, b.post_ffn_norm)))
            twin.layers.append(TransformerBlock(
                Attention(self.cfg, i, attention, a.wqkv, a.wo, self.fused, a.bqkv, qk_norm),
                b.feed_forward, b.attention_norm, b.ffn_norm, post))
        twin.register_buffer("inv_freq", self.inv_freq, persistent=False)
        return twin

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.device

    def make_cache(self, num_pages: int, *, page_size: int = 16, dtype: torch.dtype | None = None,
                   k_scale=None, v_scale=None) -> PagedKVCache:
        """A paged cache shaped for this model (``dtype`` defaults to the model's)."""
        return PagedKVCache(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim,
                            num_pages=num_pages, page_size=page_size,
                            dtype=self.dtype if dtype is None else dtype, device=self.device,
                            k_scale=k_scale, v_scale=v_scale)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        x = F.embedding(token_ids, self.tok_embeddings)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = _functions(self.fused, x).rope_tables(positions, self.inv_freq, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, step)
        return x if residual is None else x + residual

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(self.norm(x), self.output)
        cap = self.cfg.final_logit_soft_cap
        return torch.tanh(out / cap) * cap if cap > 0 else out

    # -- paged entry points --------------------------------------------------------------
    def prefill(self, token_ids: torch.Tensor, meta: StepMetadata,
                cache: PagedKVCache) -> torch.Tensor:
        """All prompts of a ragged batch in one pass, each from position 0 of a fresh sequence.

        Args:
            token_ids: ``[num_tokens]`` int, the prompts concatenated in ``meta.query_start``
                order.
            meta: from ``cache.prepare_step(seq_ids, prompt_lengths)`` on empty sequences.
            cache: the paged cache (written through ``append_kv``; an fp8 cache without
                scales is calibrated here, on its first prefill).

        Returns: the last position's logits per prompt, ``[num_prompts, vocab]`` (model dtype).
        Raises ValueError if ``token_ids`` and ``meta`` disagree on the token count.
        """
        starts = _checked_query_start(token_ids, meta)
        step = PagedStep(cache, meta, prefill_mask(starts, token_ids.device), None)
        return self._last_logits(token_ids, meta, cache, step)

    def extend(self, token_ids: torch.Tensor, meta: StepMetadata,
               cache: PagedKVCache) -> torch.Tensor:
        """Any number of new tokens per sequence over what the cache already holds: a prompt
        in chunks, the rest of a prompt whose prefix is cached (a fork), decodes among them.
        Attention over the paged cache (:func:`extend_attend`), causal per token.

        Args:
            token_ids: ``[num_tokens]`` int, the sequences' new tokens concatenated in
                ``meta.query_start`` order (every sequence brings at least one).
            meta: from ``cache.prepare_step(seq_ids, new_token_counts)``.
            cache: the paged cache (an fp8 cache without scales is calibrated here, on its
                first pass).

        Returns: each sequence's last new position's logits, ``[batch, vocab]``.
        Raises ValueError if ``token_ids`` and ``meta`` disagree on the token count, or a
        sequence brings no token.
        """
        starts = _checked_query_start(token_ids, meta)
        if any(b <= a for a, b in zip(starts[:-1], starts[1:], strict=True)):
            raise ValueError("meta: expected at least one new token per sequence, got "
                             f"query_start {starts}")
        step = PagedStep(cache, meta, None, extend_attend(meta), cache.needs_calibration)
        return self._last_logits(token_ids, meta, cache, step)

    def _last_logits(self, token_ids: torch.Tensor, meta: StepMetadata, cache: PagedKVCache,
                     step: PagedStep) -> torch.Tensor:
        """The ragged pass of :meth:`prefill` and :meth:`extend` through ``step``: every layer
        over ``token_ids`` (``[num_tokens]``) at ``meta.positions``, then
        ``cache.needs_calibration`` cleared (an fp8 cache without scales took them in this
        pass); returns each sequence's last token's logits, ``[batch, vocab]`` (model dtype)."""
        x = self(token_ids, meta.positions, step)
        cache.needs_calibration = False
        last = torch.tensor([b - 1 for b in meta.query_start[1:]], device=x.device)
        return self.logits(x[last])

    def decode(self, token_ids: torch.Tensor, meta: StepMetadata,
               cache: PagedKVCache) -> torch.Tensor:
        """One new token per sequence of a ragged batch.

        Args:
            token_ids: ``[batch]`` int, each sequence's newest token.
            meta: from ``cache.prepare_step(seq_ids, [1] * batch)``: the token's slot and
                position, and the block tables and lengths including it.
            cache: the paged cache.

        Returns: logits ``[batch, vocab]`` in the model dtype. No host sync: traceable by
        ``torch.compile(fullgraph=True)`` and capturable in a CUDA graph.
        """
        step = PagedStep(cache, meta, None, decode_attend(meta, self.impl))
        return self.logits(self(token_ids, meta.positions, step))


Llama = Transformer  # the name the rest of the package and the tests used first
