"""A DeepSeek-V2/V3-shaped model whose decode attention is ``pagedattn``'s absorbed MLA.

The architecture of transformers' ``deepseek_v3`` and ``deepseek_v2`` (DeepSeek-AI 2024:
multi-head latent attention, DeepSeekMoE with shared and routed experts), read from a
Hugging Face checkpoint directory by :func:`load_hf` (``config.json`` checked field by field,
every tensor against the shapes it implies; FP8 checkpoints of transformers' formats
dequantized as :func:`pagedattn.serving.config.load_hf` does), and run by
:class:`DeepseekModel`:

* **The cache** is MLA's latent: per layer one ``[num_pages, page_size, kv_lora_rank +
  qk_rope_head_dim]`` tensor holding each token's normalized latent and its rotated rope
  key (transformers' MLA cache, paged); its two parts are the kernel's ``ckv_cache`` and
  ``kpe_cache`` views.
* **Prefill** takes the expanded path (the simplest correct one): the prompt's latents are
  written to the cache, then ``kv_b_proj`` expands them to per-head keys and values and
  causal attention runs in torch, as transformers runs it.
* **Decode** takes the absorbed path: ``q_nope`` is multiplied into the latent space by each
  head's ``W_UK`` (the key half of ``kv_b_proj``), :func:`pagedattn.plan_mla_decode`'s plan
  (one per step, its lengths and pages updated in place) attends over the latent cache with
  the rotated ``q_pe``, and the latent output goes back through ``W_UV`` before ``o_proj``.
  The softmax scale is ``qk_head_dim^-0.5`` times YaRN's ``mscale²`` where the rope is YaRN.
* **MoE**: DeepSeek-V3's sigmoid router with the score-correction bias and group-limited
  top-k (``noaux_tc``), DeepSeek-V2's softmax router (``greedy``, ``group_limited_greedy``),
  normalized or not, times ``routed_scaling_factor``, plus the shared experts; the first
  ``first_k_dense_replace`` layers dense.

:meth:`DeepseekModel.generate` runs a batch of prompts greedily (a decode step for all
sequences at once, each at its own length); the serving ``Engine`` (continuous batching,
CUDA graphs) does not take this model yet (its cache and runner hold K/V pages).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedattn.mla import plan_mla_decode
from pagedattn.serving.config import bad_field, bool_field, float_field, int_field
from pagedattn.serving.families import MLA_FAMILIES

#: the model types read, and the routers each may name
MODEL_TYPES = tuple(MLA_FAMILIES)
_TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


def _int(c: dict, key: str, default=None, low: int = 1) -> int:
    """``c[key]`` (``default`` when absent), an int >= ``low``. Unlike the Llama-family
    reader's (:mod:`pagedattn.serving.config`), a null field is not replaced by ``default``
    and a missing one without a default is refused as ``got None``."""
    return int_field(key, c.get(key, default), low)


def _float(c: dict, key: str, default=None, low: float = 0.0, *, inclusive: bool = False,
           name: str | None = None) -> float:
    """``c[key]`` (``default`` when absent), a finite number > ``low`` (>= with
    ``inclusive``; a null field is refused as ``got None``), named ``name`` (``key``) in the
    error."""
    return float_field(name or key, c.get(key, default), low, inclusive=inclusive)


@dataclass(frozen=True)
class DeepseekConfig:
    """The shapes and constants of a DeepSeek-V2/V3 model (``config.json``'s names)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    topk_method: str
    rms_norm_eps: float
    rope_theta: float
    rope: dict  # YaRN's parameters, or {} for the default rope
    attention_bias: bool
    tie_word_embeddings: bool
    eos_token_id: int | list | None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def hf_config(c: dict) -> DeepseekConfig:
    """A :class:`DeepseekConfig` from a ``config.json`` of model type ``deepseek_v3`` or
    ``deepseek_v2``. Raises ValueError naming the field for any other model type, a
    malformed field (a constant that is not a finite number in its range: ``rope_theta``,
    ``rms_norm_eps``, ``routed_scaling_factor`` and YaRN's ``factor``, ``beta_fast``,
    ``beta_slow`` > 0, ``mscale``/``mscale_all_dim`` >= 0; a switch that is not a JSON
    boolean), a rope other than the default or YaRN, or shapes that do not fit (experts not
    divisible into groups, ``noaux_tc``'s groups of one expert: its group score is the sum
    of each group's top two, ``topk_group`` past ``n_group``, ``num_experts_per_tok`` past
    the experts of the groups kept)."""
    mt = c.get("model_type")
    if mt not in MODEL_TYPES:
        bad_field("model_type", f"one of {MODEL_TYPES}", mt)
    v3 = mt == "deepseek_v3"
    rope_key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    rope = c.get(rope_key) or {}
    if not isinstance(rope, dict):
        bad_field("rope_scaling", "an object or null", rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        bad_field("rope_scaling", "the default rope or 'yarn'", rope_type)
    theta = _float(c, "rope_theta", rope.get("rope_theta", 10000.0))
    q_lora = c.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _int(c, "q_lora_rank")
    experts = _int(c, "n_routed_experts")
    n_group = _int(c, "n_group", 1)
    if experts % n_group:
        bad_field("n_group", f"a divisor of n_routed_experts={experts}", n_group)
    topk_group = _int(c, "topk_group", 1)
    if topk_group > n_group:
        bad_field("topk_group", f"at most n_group={n_group}", topk_group)
    method = c.get("topk_method", "noaux_tc" if v3 else "greedy")
    if method not in _TOPK_METHODS or (v3 != (method == "noaux_tc")):
        bad_field("topk_method", "'noaux_tc' (deepseek_v3) or 'greedy'/'group_limited_greedy' "
                  "(deepseek_v2)", method)
    if method == "noaux_tc" and experts // n_group < 2:  # a group's score: its top two
        bad_field("n_group", f"at most n_routed_experts / 2 = {experts // 2} groups (noaux_tc "
                  "scores a group by its top two experts)", n_group)
    top_k = _int(c, "num_experts_per_tok")
    kept = experts if method == "greedy" else topk_group * (experts // n_group)
    if top_k > kept:
        bad_field("num_experts_per_tok", f"at most {kept}, the experts of the topk_group="
                  f"{topk_group} groups kept" if kept < experts else
                  f"at most n_routed_experts={experts}", top_k)
    heads = _int(c, "num_attention_heads")
    if c.get("num_key_value_heads", heads) != heads:
        bad_field("num_key_value_heads", f"num_attention_heads={heads} (MLA)",
                  c.get("num_key_value_heads"))
    if c.get("moe_layer_freq", 1) != 1:
        bad_field("moe_layer_freq", "1", c.get("moe_layer_freq"))
    if rope_type == "yarn":
        orig = rope.get("original_max_position_embeddings")
        rope = {"factor": _float(rope, "factor", name=f"{rope_key}.factor"),
                "original_max_position_embeddings": int_field(
                    f"{rope_key}.original_max_position_embeddings", orig, 1),
                **{k: _float(rope, k, default, name=f"{rope_key}.{k}")
                   for k, default in (("beta_fast", 32.0), ("beta_slow", 1.0))},
                **{k: _float(rope, k, default, inclusive=True, name=f"{rope_key}.{k}")
                   for k, default in (("mscale", 1.0), ("mscale_all_dim", 0.0))}}
    else:
        rope = {}
    return DeepseekConfig(
        model_type=str(mt), vocab_size=_int(c, "vocab_size"), hidden_size=_int(c, "hidden_size"),
        num_layers=_int(c, "num_hidden_layers"), num_heads=heads, q_lora_rank=q_lora,
        kv_lora_rank=_int(c, "kv_lora_rank"), qk_nope_head_dim=_int(c, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(c, "qk_rope_head_dim"), v_head_dim=_int(c, "v_head_dim"),
        intermediate_size=_int(c, "intermediate_size"),
        moe_intermediate_size=_int(c, "moe_intermediate_size"), n_routed_experts=experts,
        n_shared_experts=_int(c, "n_shared_experts", 0, low=0), num_experts_per_tok=top_k,
        first_k_dense_replace=_int(c, "first_k_dense_replace", 0, low=0), n_group=n_group,
        topk_group=topk_group, routed_scaling_factor=_float(c, "routed_scaling_factor", 1.0),
        norm_topk_prob=bool_field("norm_topk_prob", c.get("norm_topk_prob"), False),
        topk_method=method, rms_norm_eps=_float(c, "rms_norm_eps", 1e-6), rope_theta=theta,
        rope=rope, attention_bias=bool_field("attention_bias", c.get("attention_bias"), False),
        tie_word_embeddings=bool_field("tie_word_embeddings", c.get("tie_word_embeddings"),
                                       False),
        eos_token_id=c.get("eos_token_id"))


def weight_shapes(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``cfg`` reads, by its checkpoint name (``nn.Linear``'s out x
    in): the per-expert layout of DeepSeek's and transformers' saved checkpoints."""
    h, heads = cfg.hidden_size, cfg.num_heads
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (heads * cfg.qk_head_dim, h)
        else:
            shapes.update({a + "q_a_proj.weight": (cfg.q_lora_rank, h),
                           a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                           a + "q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank)})
        shapes.update({
            a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
            a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                     cfg.kv_lora_rank),
            a + "o_proj.weight": (h, heads * cfg.v_head_dim)})
        m = p + "mlp."
        if i < cfg.first_k_dense_replace:
            shapes.update(_mlp_shapes(m, h, cfg.intermediate_size))
            continue
        shapes[m + "gate.weight"] = (cfg.n_routed_experts, h)
        if cfg.topk_method == "noaux_tc":
            shapes[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            shapes.update(_mlp_shapes(f"{m}experts.{e}.", h, cfg.moe_intermediate_size))
        if cfg.n_shared_experts:
            shapes.update(_mlp_shapes(m + "shared_experts.", h,
                                      cfg.moe_intermediate_size * cfg.n_shared_experts))
    return shapes


def _mlp_shapes(prefix: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
            prefix + "down_proj.weight": (h, inter)}


def load_hf(path: str | os.PathLike) -> tuple[DeepseekConfig, dict[str, torch.Tensor]]:
    """Config and fp32 CPU weights (checkpoint names) of a ``deepseek_v3`` / ``deepseek_v2``
    Hugging Face checkpoint directory. Raises FileNotFoundError without ``config.json`` or a
    safetensors file; ValueError naming the field (:func:`hf_config`), or the tensor that is
    missing or whose shape contradicts ``config.json``."""
    from pagedattn.serving.config import check_shapes, read_checkpoint
    from pagedattn.serving.fp8_weights import dequantized

    raw, tensors = read_checkpoint(path, hf_config)
    cfg = hf_config(raw)
    shapes = weight_shapes(cfg)
    weights = {k: t.float() for k, t in dequantized(tensors, raw).items() if k in shapes}
    check_shapes(shapes, weights, {}, "config.json")
    return cfg, weights


def _yarn_inv_freq(cfg: DeepseekConfig) -> tuple[torch.Tensor, float, float]:
    """``(inv_freq, cos/sin factor, softmax scale)`` of the rope dims: YaRN's blend of
    interpolated and extrapolated frequencies (Peng et al. 2023) and its ``mscale`` on
    cos/sin; the softmax scale ``qk_head_dim^-0.5`` times ``mscale(factor,
    mscale_all_dim)²`` (DeepSeek's; 1 for the default rope)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scale = cfg.qk_head_dim ** -0.5
    if not cfg.rope:
        return 1.0 / pos, 1.0, scale
    r = cfg.rope
    factor, orig = r["factor"], r["original_max_position_embeddings"]

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = float(max(math.floor(correction_dim(r["beta_fast"])), 0))
    high = float(min(math.ceil(correction_dim(r["beta_slow"])), dim - 1))
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    inv_freq = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    if r["mscale"] and r["mscale_all_dim"]:
        attention = mscale(r["mscale"]) / mscale(r["mscale_all_dim"])
    else:
        attention = mscale(1.0)
    if r["mscale_all_dim"]:
        scale = scale * mscale(r["mscale_all_dim"]) ** 2
    return inv_freq, attention, scale


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope on interleaved pairs ``(x0, x1), (x2, x3), ...``, each rotated by one
    frequency; the result laid out as ``[rotated evens | rotated odds]`` (transformers'
    ``rope_interleave`` form; the V2 layout is a permutation of it, and query and key take
    the same one, so every score is the same). ``cos``/``sin``: ``[tokens, dim / 2]``
    broadcast over the heads (``x``: ``[tokens, heads, dim]`` or ``[tokens, dim]``)."""
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DeepseekModel:
    """A DeepSeek-V2/V3 model over pagedattn's MLA decode (see the module docstring).

    Args:
        cfg, weights: :func:`load_hf`'s (checkpoint names).
        dtype, device: where the model runs (fp32 on the CPU runs token for token as
            transformers; bf16 on a GPU).
    """

    def __init__(self, cfg: DeepseekConfig, weights: dict[str, torch.Tensor], *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.w = {k: t.to(device=self.device, dtype=torch.float32 if "gate." in k else dtype)
                  for k, t in weights.items()}
        inv_freq, self.rope_factor, self.scale = _yarn_inv_freq(cfg)
        self.inv_freq = inv_freq.to(self.device)
        heads, nope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        # each layer's kv_b_proj split per head: W_UK [H, nope, latent], W_UV [H, v, latent]
        self.w_uk, self.w_uv = [], []
        for i in range(cfg.num_layers):
            kv_b = self.w[f"model.layers.{i}.self_attn.kv_b_proj.weight"].view(
                heads, nope + v, cfg.kv_lora_rank)
            self.w_uk.append(kv_b[:, :nope])
            self.w_uv.append(kv_b[:, nope:])

    @classmethod
    def from_hf(cls, path, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> DeepseekModel:
        cfg, weights = load_hf(path)
        return cls(cfg, weights, dtype=dtype, device=device)

    # --- the blocks ---------------------------------------------------------------------

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return self._linear(F.silu(self._linear(x, prefix + "gate_proj"))
                            * self._linear(x, prefix + "up_proj"), prefix + "down_proj")

    def _route(self, x: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The router: ``(weights, expert ids)`` ``[tokens, top_k]`` (see the module
        docstring), in float32 as transformers' router."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.w[prefix + "gate.weight"])
        n, groups = cfg.n_routed_experts, cfg.n_group
        if cfg.topk_method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.w[prefix + "gate.e_score_correction_bias"]
            group_scores = choice.view(-1, groups, n // groups).topk(2, dim=-1)[0].sum(-1)
        else:
            scores = logits.softmax(dim=-1)
            choice = scores
            group_scores = scores.view(-1, groups, n // groups).max(dim=-1).values
        if cfg.topk_method != "greedy":  # the experts of the best topk_group groups only
            keep = torch.zeros_like(group_scores).scatter_(
                1, group_scores.topk(cfg.topk_group, dim=-1)[1], 1.0).bool()
            keep = keep[:, :, None].expand(-1, groups, n // groups).reshape(-1, n)
            choice = choice.masked_fill(~keep, float("-inf") if cfg.topk_method == "noaux_tc"
                                        else 0.0)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob and cfg.topk_method == "noaux_tc":  # V2's router never does
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids

    def _moe(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        weights, ids = self._route(x, prefix)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            y = self._mlp(x[rows], f"{prefix}experts.{e}.")
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
        if self.cfg.n_shared_experts:
            out = out + self._mlp(x, prefix + "shared_experts.")
        return out

    def _ffn(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        prefix = f"model.layers.{layer}.mlp."
        if layer < self.cfg.first_k_dense_replace:
            return self._mlp(x, prefix)
        return self._moe(x, prefix)

    def _qkv(self, x: torch.Tensor, layer: int, positions: torch.Tensor):
        """``(q_nope [T, H, nope], q_rot [T, H, rope], latent [T, kv_lora],
        k_rot [T, rope])`` of tokens ``x`` at ``positions``: the latent normalized and the
        rope parts rotated (what the cache holds)."""
        cfg, a = self.cfg, f"model.layers.{layer}.self_attn."
        if cfg.q_lora_rank is None:
            q = self._linear(x, a + "q_proj")
        else:
            q = self._linear(_rms_norm(self._linear(x, a + "q_a_proj"),
                                       self.w[a + "q_a_layernorm.weight"], cfg.rms_norm_eps),
                             a + "q_b_proj")
        q = q.view(x.shape[0], cfg.num_heads, cfg.qk_head_dim)
        kv = self._linear(x, a + "kv_a_proj_with_mqa")
        latent = _rms_norm(kv[:, :cfg.kv_lora_rank], self.w[a + "kv_a_layernorm.weight"],
                           cfg.rms_norm_eps)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.rope_factor).to(x.dtype)
        sin = (freqs.sin() * self.rope_factor).to(x.dtype)
        q_rot = _rope(q[..., cfg.qk_nope_head_dim:], cos, sin)
        k_rot = _rope(kv[:, cfg.kv_lora_rank:], cos, sin)
        return q[..., :cfg.qk_nope_head_dim], q_rot, latent, k_rot

    # --- prefill (expanded) and decode (absorbed) -------------------------------------

    def _prefill_attention(self, layer: int, q_nope, q_rot, latent, k_rot) -> torch.Tensor:
        """One sequence's causal attention over its own tokens, expanded: per-head keys
        ``[W_UK·latent | k_rot]`` and values ``W_UV·latent``. Returns ``[T, H·v]``."""
        k_nope = torch.einsum("tc,hnc->thn", latent, self.w_uk[layer])
        v = torch.einsum("tc,hvc->thv", latent, self.w_uv[layer])
        k = torch.cat([k_nope, k_rot[:, None].expand(-1, self.cfg.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True,
                                             scale=self.scale)
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(x, self.w["model.norm.weight"], self.cfg.rms_norm_eps)
        head = self.w["model.embed_tokens.weight" if self.cfg.tie_word_embeddings
                      else "lm_head.weight"]
        return F.linear(x, head).float()

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            h = _rms_norm(x, self.w[p + "input_layernorm.weight"], self.cfg.rms_norm_eps)
            x = x + self._linear(attend(i, h, positions), p + "self_attn.o_proj")
            h = _rms_norm(x, self.w[p + "post_attention_layernorm.weight"],
                          self.cfg.rms_norm_eps)
            x = x + self._ffn(h, i)
        return x

    def make_cache(self, num_pages: int, page_size: int) -> list[torch.Tensor]:
        """One ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` latent cache per
        layer (NaN-filled: a slot is read only once written)."""
        dims = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
        return [torch.full((num_pages, page_size, dims), float("nan"), dtype=self.dtype,
                           device=self.device) for _ in range(self.cfg.num_layers)]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, page_size: int = 16,
                 return_logits: bool = False):
        """Greedy generation for a batch of prompts (token id lists, each non-empty): each
        prompt prefilled alone (expanded attention), then ``max_new_tokens - 1`` decode steps
        for the whole batch (absorbed MLA through one plan per step, every sequence at its
        own length). Returns the new tokens per prompt (and, with ``return_logits``, each
        step's ``[batch, vocab]`` float32 logits: the prefill's last row first). A prompt's
        sequence stops at an end-of-sequence token, as transformers' ``generate``."""
        cfg, dev = self.cfg, self.device
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompts: expected a non-empty list of non-empty token lists")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        batch = len(prompts)
        pages_each = -(-(max(map(len, prompts)) + max_new_tokens) // page_size)
        caches = self.make_cache(batch * pages_each, page_size)
        tables = torch.arange(batch * pages_each, dtype=torch.int32,
                              device=dev).view(batch, pages_each)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
        lat = cfg.kv_lora_rank
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else \
            [] if cfg.eos_token_id is None else [cfg.eos_token_id]

        def write(layer, b, positions, latent, k_rot):
            slots = tables[b].long()[positions // page_size] * page_size + positions % page_size
            flat = caches[layer].view(-1, lat + cfg.qk_rope_head_dim)
            flat[slots] = torch.cat([latent, k_rot], dim=-1).to(self.dtype)

        last, step_logits = [], []
        for b, prompt in enumerate(prompts):
            ids = torch.tensor(prompt, device=dev)
            positions = torch.arange(len(prompt), device=dev)

            def prefill(layer, h, pos, b=b):
                q_nope, q_rot, latent, k_rot = self._qkv(h, layer, pos)
                write(layer, b, pos, latent, k_rot)
                return self._prefill_attention(layer, q_nope, q_rot, latent, k_rot)

            x = self._layers(self.w["model.embed_tokens.weight"][ids], positions, prefill)
            last.append(self._logits(x[-1:]))
        logits = torch.cat(last)
        tokens = logits.argmax(-1)
        out = [[int(t)] for t in tokens]
        done = [int(t) in eos for t in tokens]
        step_logits.append(logits)
        plan = plan_mla_decode(tables, lens, num_q_heads=cfg.num_heads, latent_dim=lat,
                               rope_dim=cfg.qk_rope_head_dim, page_size=page_size,
                               q_dtype=self.dtype)
        for _ in range(max_new_tokens - 1):
            if all(done):
                break
            positions = lens.long()
            lens += 1  # the plan reads the lengths on the device: the new token included

            def decode(layer, h, pos):
                q_nope, q_rot, latent, k_rot = self._qkv(h, layer, pos)
                for b in range(batch):
                    write(layer, b, pos[b:b + 1], latent[b:b + 1], k_rot[b:b + 1])
                q_abs = torch.einsum("bhn,hnc->bhc", q_nope, self.w_uk[layer])
                cache = caches[layer]
                o = plan.run(q_abs.contiguous(), q_rot.contiguous(), cache[..., :lat],
                             cache[..., lat:], scale=self.scale)
                return torch.einsum("bhc,hvc->bhv", o, self.w_uv[layer]).reshape(batch, -1)

            x = self._layers(self.w["model.embed_tokens.weight"][tokens], positions, decode)
            logits = self._logits(x)
            step_logits.append(logits)
            tokens = logits.argmax(-1)
            for b in range(batch):
                if not done[b]:
                    out[b].append(int(tokens[b]))
                    done[b] = int(tokens[b]) in eos
        return (out, step_logits) if return_logits else out
