"""The model seam: :class:`ModelConfig`, a format-independent description of a decoder, and
:func:`load_hf`, the loader of a Hugging Face checkpoint directory (``config.json`` plus
``*.safetensors``) of a family of :data:`pagedattn.serving.families.FAMILIES` (its spec says
what sets it apart from Llama; ``docs/models.md`` lists them). The GGUF loader
(:mod:`pagedattn.serving.gguf_loader`) returns the same config and weight names.

Weights come back in one layout for every format (``nn.Linear``'s out × in, fp32 on the
CPU): ``embed``, ``final_norm``, ``lm_head`` (absent when tied) and ``layers.{i}.{name}`` for
``attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down`` and, where the family has them,
``bq, bk, bv`` (QKV bias), ``q_norm, k_norm`` (per-head norms ``[head_dim]``),
``post_attn_norm, post_ffn_norm`` (norms of the attention and FFN outputs). A family's norm
offset comes back added (Gemma's ``(1 + w)``, exact in fp32), so every norm is
``w * x / rms(x)``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from pagedattn.serving.families import FAMILIES, LAYER_PREFIX, TENSORS, family


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder, whatever file it came from.

    The first fields are those of a Llama (SmolLM2); the rest default to Llama's behaviour:
    ``activation`` ``"silu"`` or ``"gelu_tanh"`` (the FFN's ``act(gate) * up``);
    ``qkv_bias`` (Q/K/V projections with a bias); ``qk_norm`` (an RMSNorm over ``head_dim``
    of each Q and K head before RoPE); ``post_norms`` (norms of the attention and FFN
    outputs before each residual add); ``embed_scale`` (embeddings times it, in the model's
    dtype; Gemma's ``sqrt(hidden)``); ``attn_scale`` (softmax scale, ``None`` for
    ``head_dim ** -0.5``); ``final_logit_soft_cap`` (``cap * tanh(logits / cap)``, 0 off).
    Per layer (tuples of ``num_layers``, empty for "none anywhere"): ``window_left`` (keys
    attended besides the current one, -1 for all: the kernel's convention; Hugging Face's
    ``sliding_window`` ``w`` is ``w - 1``) and ``logits_soft_cap`` (0.0 for none).
    ``rope_inv_freq``: RoPE's ``head_dim // 2`` inverse frequencies where they are not
    ``rope_theta ** (-2i / head_dim)`` (empty: they are), e.g. Llama 3's scaled ones
    (:func:`llama3_inv_freq`).
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
    rope_inv_freq: tuple[float, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_q_heads", "num_kv_heads", "head_dim", "max_position"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_q_heads="
                             f"{self.num_q_heads}, got {self.num_kv_heads}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation: expected 'silu' or 'gelu_tanh', "
                             f"got {self.activation!r}")
        for name in ("window_left", "logits_soft_cap"):
            v = getattr(self, name)
            if v and len(v) != self.num_layers:
                raise ValueError(f"{name}: expected {self.num_layers} entries (one per layer) "
                                 f"or none, got {len(v)}")
        if self.rope_inv_freq and (len(self.rope_inv_freq) != self.head_dim // 2 or not all(
                math.isfinite(f) and f > 0 for f in self.rope_inv_freq)):
            raise ValueError(f"rope_inv_freq: expected {self.head_dim // 2} finite frequencies "
                             f"> 0 (head_dim // 2) or none, got {self.rope_inv_freq!r}")

    def inv_freq(self) -> torch.Tensor:
        """RoPE's ``[head_dim // 2]`` fp32 inverse frequencies: ``rope_inv_freq``, or
        :func:`default_inv_freq`."""
        if self.rope_inv_freq:
            return torch.tensor(self.rope_inv_freq, dtype=torch.float32)
        return default_inv_freq(self.rope_theta, self.head_dim)

    def layer_variants(self, layer: int) -> tuple[int, float]:
        """``(window_left, logits_soft_cap)`` of ``layer``: ``-1`` and ``0.0`` when off."""
        return (self.window_left[layer] if self.window_left else -1,
                self.logits_soft_cap[layer] if self.logits_soft_cap else 0.0)


#: Hugging Face ``model_type`` values :func:`load_hf` reads (:data:`FAMILIES`' keys)
HF_MODEL_TYPES = tuple(FAMILIES)


def bad_field(key: str, expected: str, got) -> NoReturn:
    """Raise the ValueError of a malformed ``config.json`` field, in the one form its readers
    (this module's, :mod:`pagedattn.serving.deepseek`'s) use:
    ``config.json: <key>: expected <expected>, got <repr(got)>``."""
    raise ValueError(f"config.json: {key}: expected {expected}, got {got!r}")


def int_field(key: str, v, low: int) -> int:
    """``v``, the value of field ``key``, when it is an int >= ``low`` (a bool is not);
    else :func:`bad_field`'s ValueError (``expected an int >= <low>``)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        bad_field(key, f"an int >= {low}", v)
    return v


def is_finite_number(v) -> bool:
    """Whether ``v`` is a finite int or float (a bool, a string, None, NaN and inf are not):
    what a numeric ``config.json`` field must be before its own range is checked."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def float_field(key: str, v, low: float | None = None, *, inclusive: bool = False) -> float:
    """``v``, the value of field ``key``, as a float when it is a finite number above ``low``
    (at least ``low`` with ``inclusive``; any without ``low``); else :func:`bad_field`'s
    ValueError (``expected a finite number > <low>``)."""
    if not is_finite_number(v) or (low is not None and (v < low or (v == low and not inclusive))):
        bound = "" if low is None else f" {'>=' if inclusive else '>'} {low:g}"
        bad_field(key, f"a finite number{bound}", v)
    return float(v)


def bool_field(key: str, v, default: bool) -> bool:
    """``v``, the value of field ``key``, when it is a JSON boolean (``default`` when absent
    or null); else :func:`bad_field`'s ValueError: a string such as ``"false"`` or a number
    is not read as a truth value."""
    if v is None:
        return default
    if not isinstance(v, bool):
        bad_field(key, "a JSON boolean (true or false)", v)
    return v


def _int(c: dict, key: str, default=None, low: int = 1) -> int:
    """``c[key]``, an int >= ``low`` (``default`` when absent or null; required without
    one)."""
    v = c.get(key)
    if v is None:
        if default is None:
            raise ValueError(f"config.json: {key}: missing (an int >= {low})")
        return default
    return int_field(key, v, low)


def _float(c: dict, key: str, default: float, zero: bool = False) -> float:
    """``c[key]``, a finite number > 0 (>= 0 with ``zero``: a soft-cap's off), ``default``
    when absent or null."""
    v = c.get(key)
    return default if v is None else float_field(key, v, 0, inclusive=zero)


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """RoPE's unscaled ``[head_dim // 2]`` fp32 inverse frequencies ``theta ** (-2i /
    head_dim)``, computed as transformers does (its bits)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                            .to(torch.float32) / head_dim))


#: the keys of Llama 3's RoPE scaling (``rope_type`` ``"llama3"``), each required
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


def llama3_inv_freq(rope: dict, key: str, head_dim: int, theta: float) -> tuple[float, ...]:
    """Llama 3's RoPE inverse frequencies (Llama 3.1-3.3's ``rope_type`` ``"llama3"``,
    ``rope`` the ``config.json`` object under ``key``): the default ones divided by
    ``factor`` where the wavelength ``2π / f`` exceeds ``original_max_position_embeddings /
    low_freq_factor``, kept where it is below ``original_max_position_embeddings /
    high_freq_factor``, and blended linearly in ``original / wavelength`` between. In fp32,
    operation for operation as transformers' ``_compute_llama3_parameters``, so the
    frequencies are its bits. Raises ValueError naming a missing or malformed key."""
    for k in LLAMA3_ROPE_KEYS:
        v = rope.get(k)
        if v is None:
            raise ValueError(f"config.json: {key}.{k}: missing (Llama 3's RoPE scaling)")
        if not is_finite_number(v) or v <= 0:
            bad_field(f"{key}.{k}", "a finite number > 0", v)
    factor, low, high, original = (float(rope[k]) for k in LLAMA3_ROPE_KEYS)
    if high <= low:
        bad_field(f"{key}.high_freq_factor", f"a number > low_freq_factor={low}", high)
    inv = default_inv_freq(theta, head_dim)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return tuple(torch.where(medium, smoothed, scaled).tolist())


def _cap(c: dict, key: str | None) -> float:
    """The soft-cap under ``key`` (0.0, off, when the family has no such key or the config
    leaves it out)."""
    return _float(c, key, 0.0, zero=True) if key else 0.0


def hf_config(c: dict) -> ModelConfig:
    """A :class:`ModelConfig` from a parsed ``config.json``, each field checked, its
    family's options from the :class:`~pagedattn.serving.families.FamilySpec` of its
    ``model_type``. Raises ValueError naming the field for a ``model_type`` outside
    :data:`FAMILIES`, RoPE scaling other than Llama 3's (:func:`llama3_inv_freq`),
    ``attention_bias`` / ``mlp_bias`` (outside a family with QKV bias), an activation other
    than SiLU / tanh-GELU (read under the family's key: ``FamilySpec.activation``), a
    missing or malformed shape (``num_hidden_layers``, ``num_attention_heads``, ...: ints
    >= 1, kv heads dividing the heads), constant (``rope_theta``, ``rms_norm_eps``: finite
    numbers > 0) or switch (``tie_word_embeddings``, ``use_sliding_window``, ...: JSON
    booleans)."""
    if not isinstance(c, dict):
        raise ValueError(f"config.json: expected a JSON object, got a {type(c).__name__}")
    spec = family(c.get("model_type"))
    rope_key = "rope_scaling" if c.get("rope_scaling") is not None else "rope_parameters"
    rope = c.get(rope_key) or {}
    if not isinstance(rope, dict):
        bad_field(rope_key, "an object or null", rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config.json: rope scaling {rope_type!r} is not supported "
                         "(expected default or llama3)")
    theta = _float(c, "rope_theta", _float(rope, "rope_theta", 10000.0))
    for key in ("attention_bias", "mlp_bias"):  # a QKV bias family's is implied, not this key
        if bool_field(key, c.get(key), False) and not spec.qkv_bias:
            raise ValueError(f"config.json: {key} (biases on the output or FFN projections) "
                             "is not supported")
    act_key, act_default = spec.activation
    act = c.get(act_key)
    if act is None:
        act = act_default
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if spec.legacy_gelu:  # Gemma 1's released "gelu": transformers runs the tanh approximation
        acts["gelu"] = "gelu_tanh"
    if act not in acts:
        raise ValueError(f"config.json: {act_key}: activation {act!r} is not supported "
                         f"(expected one of {', '.join(acts)})")
    layers, hidden = _int(c, "num_hidden_layers"), _int(c, "hidden_size")
    heads = _int(c, "num_attention_heads")
    kv_heads = _int(c, "num_key_value_heads", heads)
    if heads % kv_heads:
        bad_field("num_key_value_heads", f"a divisor of num_attention_heads={heads}", kv_heads)
    if c.get("head_dim") is None and hidden % heads:
        bad_field("head_dim", f"a value, as hidden_size={hidden} is no multiple of "
                  f"num_attention_heads={heads}", None)
    head_dim = _int(c, "head_dim", hidden // heads)
    # sliding windows per layer: layer_types where the config has them (transformers >= 4.53
    # writes them), else the family's pattern
    window = _int(c, "sliding_window", 0) if c.get("sliding_window") is not None else None
    if spec.window_switch and not bool_field(spec.window_switch, c.get(spec.window_switch),
                                             False):
        window = None
    types = c.get("layer_types")
    if types is None:  # transformers' rule: the pattern's layers from window_from's on
        first = _int(c, *spec.window_from, low=0) if spec.window_from else 0
        types = ["sliding_attention" if spec.sliding(i) and i >= first else "full_attention"
                 for i in range(layers)]
    elif not (isinstance(types, list) and len(types) == layers and set(types) <= {
            "sliding_attention", "full_attention"}):
        bad_field("layer_types", f"a list of num_hidden_layers={layers} 'sliding_attention' "
                  "or 'full_attention'", types)
    windows = tuple(window - 1 if window and t == "sliding_attention" else -1 for t in types)
    cap = _cap(c, spec.attn_soft_cap_key)
    scalar = spec.attn_scalar
    return ModelConfig(
        vocab_size=_int(c, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(c, "intermediate_size"), num_layers=layers, num_q_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
        rms_eps=_float(c, "rms_norm_eps", 1e-6),
        max_position=_int(c, "max_position_embeddings", 2048),
        tie_word_embeddings=bool_field("tie_word_embeddings", c.get("tie_word_embeddings"),
                                       spec.tied),
        bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"),
        activation=acts[act], qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm,
        post_norms=spec.post_norms, embed_scale=spec.embed_factor(hidden),
        attn_scale=_float(c, *scalar) ** -0.5 if scalar else None,
        final_logit_soft_cap=_cap(c, spec.final_soft_cap_key),
        window_left=windows if any(w >= 0 for w in windows) else (),
        logits_soft_cap=(cap,) * layers if cap else (),
        rope_inv_freq=(llama3_inv_freq(rope, rope_key, head_dim, theta) if rope_type == "llama3"
                       else ()))


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every weight a model of ``cfg`` reads, by this module's names
    (``nn.Linear``'s out x in)."""
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_q_heads * hd, cfg.num_kv_heads * hd
    layer = {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
             "ffn_norm": (h,), "w_gate": (inter, h), "w_up": (inter, h), "w_down": (h, inter)}
    if cfg.qkv_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.qk_norm:
        layer.update(q_norm=(hd,), k_norm=(hd,))
    if cfg.post_norms:
        layer.update(post_attn_norm=(h,), post_ffn_norm=(h,))
    shapes = {"embed": (cfg.vocab_size, h), "final_norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    shapes.update({f"layers.{i}.{n}": s for i in range(cfg.num_layers) for n, s in layer.items()})
    return shapes


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], names: dict[str, str],
                  source: str) -> None:
    """Every weight a model of ``cfg`` reads is present with the shape the config implies
    (:func:`weight_shapes`): checked at load, not at the first forward. ``names``: each
    weight's name in the file, for the error; ``source``: where the config came from
    (``config.json``). Raises ValueError naming the tensor (the first few if missing)."""
    check_shapes(weight_shapes(cfg), weights, names, source)


def check_shapes(shapes: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor],
                 names: dict[str, str], source: str) -> None:
    """Every weight of ``shapes`` (name -> the shape the config implies) is in ``weights``
    with that shape (:func:`check_weights`; DeepSeek's loader with its own shapes)."""
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise ValueError(f"model: tensors missing (as {source} implies): {missing[:5]}")
    for key, shape in shapes.items():
        if tuple(weights[key].shape) != shape:
            raise ValueError(f"{names.get(key, key)}: expected shape {shape} from {source}, "
                             f"got {tuple(weights[key].shape)}")


def read_checkpoint(path: str | os.PathLike, check_config=None) -> tuple[dict, dict]:
    """``(config.json as a dict, every tensor of its *.safetensors files)`` of a Hugging Face
    checkpoint directory (one file or shards), on the CPU as stored. ``check_config`` (a
    function of the dict that raises on a bad config) runs before any tensor is read.
    Raises FileNotFoundError without the directory, its ``config.json`` or any safetensors
    file; ValueError for a ``config.json`` that is not JSON."""
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {str(d)!r}")
    try:
        raw = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config.json: not JSON ({e})") from None
    if check_config is not None:
        check_config(raw)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors file in {str(d)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return raw, tensors


def load_hf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and fp32 CPU weights (the names of this module's docstring) of a Hugging Face
    checkpoint directory: ``config.json`` and its ``*.safetensors`` (one file or shards). An
    FP8 checkpoint (a ``quantization_config`` of transformers' FP8 formats) is dequantized
    (:mod:`pagedattn.serving.fp8_weights`).

    Raises FileNotFoundError without the directory, its ``config.json`` or any safetensors
    file; ValueError naming the field or the tensor for an unsupported ``model_type`` or a
    malformed ``config.json`` (see :func:`hf_config`), another quantization (named:
    ``quantization_config``, or the tensor of integer or unscaled weights), a missing tensor
    or one whose shape contradicts ``config.json``.
    """
    from pagedattn.serving.fp8_weights import dequantized

    raw, tensors = read_checkpoint(path, hf_config)
    cfg = hf_config(raw)
    spec = family(raw["model_type"])
    weights: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for name, t in dequantized(tensors, raw).items():
        key = TENSORS.get(name)
        if key is None and name.startswith(LAYER_PREFIX):
            idx, _, suffix = name[len(LAYER_PREFIX):].partition(".")
            short = spec.layer_tensors.get(suffix)
            key = None if short is None else f"layers.{int(idx)}.{short}"
        if key is None:
            continue
        t = t.float()
        if spec.norm_offset and key.endswith("norm"):
            t = t + spec.norm_offset  # Gemma's RMSNorm scales by (1 + w)
        weights[key], names[key] = t, name
    if cfg.tie_word_embeddings:
        weights.pop("lm_head", None)
    check_weights(cfg, weights, names, "config.json")
    return cfg, weights
