"""The model seam: :class:`ModelConfig`, a format-independent description of a decoder, and
:func:`load_hf`, the loader of a Hugging Face checkpoint directory (``config.json`` plus
``*.safetensors``) of the Llama, Mistral, Qwen2, Qwen3 and Gemma 2 families. The GGUF loader
(:mod:`pagedattn.serving.gguf_loader`) returns the same config and weight names.

Weights come back in one layout for every format (``nn.Linear``'s out × in, fp32 on the
CPU): ``embed``, ``final_norm``, ``lm_head`` (absent when tied) and ``layers.{i}.{name}`` for
``attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down`` and, where the family has them,
``bq, bk, bv`` (Qwen2's QKV bias), ``q_norm, k_norm`` (Qwen3's per-head norms ``[head_dim]``),
``post_attn_norm, post_ffn_norm`` (Gemma 2's extra norms). Gemma's ``(1 + w)`` RMSNorm weights
come back with the 1 added (exact in fp32), so every norm is ``w * x / rms(x)``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder, whatever file it came from.

    The first fields are those of a Llama (SmolLM2); the rest default to Llama's behaviour:
    ``activation`` ``"silu"`` or ``"gelu_tanh"`` (the FFN's ``act(gate) * up``);
    ``qkv_bias`` (Q/K/V projections with a bias); ``qk_norm`` (an RMSNorm over ``head_dim``
    of each Q and K head before RoPE); ``post_norms`` (Gemma 2's norms of the attention and
    FFN outputs before each residual add); ``embed_scale`` (embeddings times it, in the
    model's dtype; Gemma's ``sqrt(hidden)``); ``attn_scale`` (softmax scale, ``None`` for
    ``head_dim ** -0.5``); ``final_logit_soft_cap`` (``cap * tanh(logits / cap)``, 0 off).
    Per layer (tuples of ``num_layers``, empty for "none anywhere"): ``window_left`` (keys
    attended besides the current one, -1 for all: the kernel's convention; Hugging Face's
    ``sliding_window`` ``w`` is ``w - 1``) and ``logits_soft_cap`` (0.0 for none).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    activation: str = "silu"
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    final_logit_soft_cap: float = 0.0
    window_left: tuple[int, ...] = ()
    logits_soft_cap: tuple[float, ...] = ()

    def __post_init__(self):
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation: expected 'silu' or 'gelu_tanh', "
                             f"got {self.activation!r}")
        for name in ("window_left", "logits_soft_cap"):
            v = getattr(self, name)
            if v and len(v) != self.num_layers:
                raise ValueError(f"{name}: expected {self.num_layers} entries (one per layer) "
                                 f"or none, got {len(v)}")

    def layer_variants(self, layer: int) -> tuple[int, float]:
        """``(window_left, logits_soft_cap)`` of ``layer``: ``-1`` and ``0.0`` when off."""
        return (self.window_left[layer] if self.window_left else -1,
                self.logits_soft_cap[layer] if self.logits_soft_cap else 0.0)


#: Hugging Face ``model_type`` values :func:`load_hf` reads
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2")

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}


def hf_config(c: dict) -> ModelConfig:
    """A :class:`ModelConfig` from a parsed ``config.json``. Raises ValueError for a
    ``model_type`` outside :data:`HF_MODEL_TYPES`, RoPE scaling, ``attention_bias`` /
    ``mlp_bias`` (outside Qwen2's QKV bias), or an activation other than SiLU / tanh-GELU."""
    mt = c.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise ValueError(f"config.json: model_type {mt!r} is not supported "
                         f"(expected one of {', '.join(HF_MODEL_TYPES)})")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: rope scaling {rope_type!r} is not supported")
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    for key in ("attention_bias", "mlp_bias"):  # Qwen2's QKV bias is implied, not this key
        if c.get(key) and mt != "qwen2":
            raise ValueError(f"config.json: {key} (biases on the output or FFN projections) "
                             "is not supported")
    act = c.get("hidden_activation") or c.get("hidden_act", "silu")
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in acts:
        raise ValueError(f"config.json: activation {act!r} is not supported "
                         f"(expected one of {', '.join(acts)})")
    layers, hidden = int(c["num_hidden_layers"]), int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    head_dim = c.get("head_dim") or hidden // heads
    # sliding windows per layer: layer_types where the config has them (transformers >= 4.53
    # writes them), else Mistral's every-layer window
    window = c.get("sliding_window")
    if mt in ("qwen2", "qwen3") and not c.get("use_sliding_window", False):
        window = None
    types = c.get("layer_types")
    if types is None:
        types = ["sliding_attention" if mt == "gemma2" and i % 2 == 0 or mt == "mistral"
                 else "full_attention" for i in range(layers)]
    windows = tuple(window - 1 if window and t == "sliding_attention" else -1 for t in types)
    cap = c.get("attn_logit_softcapping") if mt == "gemma2" else None
    gemma = mt == "gemma2"
    return ModelConfig(
        vocab_size=int(c["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]), num_layers=layers, num_q_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=int(head_dim),
        rope_theta=float(theta), rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", gemma)),
        bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"),
        activation=acts[act],
        qkv_bias=mt == "qwen2",
        qk_norm=mt == "qwen3", post_norms=gemma,
        embed_scale=math.sqrt(hidden) if gemma else None,
        attn_scale=float(c["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        final_logit_soft_cap=float(c.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
        window_left=windows if any(w >= 0 for w in windows) else (),
        logits_soft_cap=(float(cap),) * layers if cap else ())


def load_hf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and fp32 CPU weights (the names of this module's docstring) of a Hugging Face
    checkpoint directory: ``config.json`` and its ``*.safetensors`` (one file or shards).

    Raises FileNotFoundError without the directory, its ``config.json`` or any safetensors
    file; ValueError for an unsupported ``model_type`` (see :func:`hf_config`) or a missing
    tensor.
    """
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {str(d)!r}")
    cfg = hf_config(json.loads((d / "config.json").read_text()))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors file in {str(d)!r}")
    gemma = cfg.embed_scale is not None
    norm_names = {"post_attention_layernorm.weight": "post_attn_norm" if gemma else "ffn_norm",
                  "pre_feedforward_layernorm.weight": "ffn_norm",
                  "post_feedforward_layernorm.weight": "post_ffn_norm"}
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            t = t.float()
            if name == "model.embed_tokens.weight":
                key = "embed"
            elif name == "model.norm.weight":
                key = "final_norm"
            elif name == "lm_head.weight":
                key = "lm_head"
            elif name.startswith("model.layers."):
                _, _, idx, suffix = name.split(".", 3)
                short = _HF_LAYER_NAMES.get(suffix) or norm_names.get(suffix)
                if short is None:
                    continue
                key = f"layers.{int(idx)}.{short}"
            else:
                continue
            if gemma and (key.endswith("norm")):
                t = t + 1.0  # Gemma's RMSNorm scales by (1 + w)
            weights[key] = t
    if cfg.tie_word_embeddings:
        weights.pop("lm_head", None)
    per_layer = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    per_layer += ["bq", "bk", "bv"] * cfg.qkv_bias + ["q_norm", "k_norm"] * cfg.qk_norm
    per_layer += ["post_attn_norm", "post_ffn_norm"] * cfg.post_norms
    need = ["embed", "final_norm"] + ["lm_head"] * (not cfg.tie_word_embeddings)
    need += [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in per_layer]
    missing = [n for n in need if n not in weights]
    if missing:
        raise ValueError(f"model: tensors missing from {str(d)!r}: {missing[:5]}")
    return cfg, weights
