"""The model families the serving layer reads from Hugging Face checkpoints, as data: one
:class:`FamilySpec` per ``model_type`` in :data:`FAMILIES`.

A family differs from Llama only in the options a spec names: QKV bias, per-head Q/K norms,
the norms after attention and FFN, the offset folded into norm weights, the embedding scale,
which layers use the sliding window, which ``config.json`` keys hold the activation, the
soft-caps and the softmax scale, and the names of its tensors.
:func:`pagedattn.serving.config.hf_config` and :func:`~pagedattn.serving.config.load_hf` read
the spec of a checkpoint's ``model_type`` and nothing else about its family; the model
(:mod:`pagedattn.serving.model`) reads only the resulting
:class:`~pagedattn.serving.config.ModelConfig`.

The CLI's help (:func:`family_names`), the error for an unsupported ``model_type`` and
``docs/models.md`` (:func:`families_markdown`; ``python -m pagedattn.serving.families``
prints it) are generated from this table, so a new family is one entry here, one test entry
in ``tests/serving/test_model_families.py`` and ``docs/models.md`` regenerated (DESIGN.md's
worked example). This module imports nothing heavy: the CLI reads it to build its help.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

#: Hugging Face's names of the tensors outside the layers -> ours (every family's)
TENSORS = MappingProxyType({"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
                            "lm_head.weight": "lm_head"})
#: the prefix of a layer's tensors in Hugging Face's names: ``model.layers.{i}.<suffix>``
LAYER_PREFIX = "model.layers."

_LLAMA_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_QKV_BIAS = {"self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
             "self_attn.v_proj.bias": "bv"}
_QK_NORM = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
#: Gemma 2's four norms a layer: HF's post_attention_layernorm is its attention output's
_POST_NORMS = {"post_attention_layernorm.weight": "post_attn_norm",
               "pre_feedforward_layernorm.weight": "ffn_norm",
               "post_feedforward_layernorm.weight": "post_ffn_norm"}


def layer_names(*extra: Mapping[str, str]) -> Mapping[str, str]:
    """A family's per-layer tensor names (HF suffix -> ours): Llama's, updated by ``extra``
    in order (a later map wins on a shared HF name)."""
    names = dict(_LLAMA_LAYER)
    for more in extra:
        names.update(more)
    return MappingProxyType(names)


#: :attr:`FamilySpec.embed_scale` rules: the factor of the embeddings for a hidden size
EMBED_SCALES = {"none": lambda hidden: None, "sqrt(hidden_size)": math.sqrt}
#: :attr:`FamilySpec.windows` patterns: does layer ``i`` slide, without ``layer_types``
WINDOW_PATTERNS = {"none": lambda i: False, "every layer": lambda i: True,
                   "even layers": lambda i: i % 2 == 0}


@dataclass(frozen=True)
class FamilySpec:
    """What sets one model family apart from Llama, read from its ``config.json`` by
    :func:`pagedattn.serving.config.hf_config`.

    ``name``: as people write it; ``example``: a checkpoint of the family (documentation).
    ``qkv_bias``: biases on the Q/K/V projections (their ``attention_bias`` key is then not
    refused). ``qk_norm``: an RMSNorm over ``head_dim`` of each Q and K head before RoPE.
    ``post_norms``: norms of the attention and FFN outputs before each residual add.
    ``norm_offset``: added to every norm weight at load (Gemma's RMSNorm scales by
    ``1 + w``; the model then computes ``w * x / rms(x)`` for every family).
    ``embed_scale``: a rule of :data:`EMBED_SCALES`, the embeddings' factor.
    ``windows``: a pattern of :data:`WINDOW_PATTERNS`, the layers with the sliding window
    (``sliding_window`` of ``config.json``) when it has no ``layer_types``;
    ``window_switch``: a ``config.json`` key that must be true for any window (Qwen's
    ``use_sliding_window``); ``window_from``: ``(key, default)``, the first layer the
    pattern applies to, without ``layer_types`` (Qwen's ``max_window_layers``: transformers
    slides layer ``i`` when ``i >= max_window_layers``; None: layer 0).
    ``activation``: ``(key, default)``, the ``config.json`` key transformers reads the FFN's
    activation from and its value when absent; ``legacy_gelu``: ``"gelu"`` there means
    the tanh approximation (transformers' reading of Gemma 1's released configs).
    ``attn_soft_cap_key`` / ``final_soft_cap_key``: the keys of the attention logits' and
    the final logits' soft-caps (None: no soft-cap).
    ``attn_scalar``: ``(key, default)`` whose value ``s`` makes the softmax scale
    ``s ** -0.5`` (None: ``head_dim ** -0.5``). ``tied``: ``tie_word_embeddings``'s default.
    ``layer_tensors``: HF's per-layer tensor names (after ``model.layers.{i}.``) -> ours
    (:func:`layer_names`); a tensor not named is not read.
    """

    name: str
    example: str
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    norm_offset: float = 0.0
    embed_scale: str = "none"
    windows: str = "none"
    window_switch: str | None = None
    window_from: tuple[str, int] | None = None
    activation: tuple[str, str] = ("hidden_act", "silu")
    legacy_gelu: bool = False
    attn_soft_cap_key: str | None = None
    final_soft_cap_key: str | None = None
    attn_scalar: tuple[str, float] | None = None
    tied: bool = False
    layer_tensors: Mapping[str, str] = field(default_factory=layer_names)

    def __post_init__(self):
        for what, value, known in (("embed_scale", self.embed_scale, EMBED_SCALES),
                                   ("windows", self.windows, WINDOW_PATTERNS)):
            if value not in known:
                raise ValueError(f"{self.name}: {what}: expected one of {', '.join(known)}, "
                                 f"got {value!r}")

    def embed_factor(self, hidden_size: int) -> float | None:
        """The embeddings' factor for ``hidden_size`` (None: none)."""
        return EMBED_SCALES[self.embed_scale](hidden_size)

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` slides when ``config.json`` has no ``layer_types``."""
        return WINDOW_PATTERNS[self.windows](layer)


#: Qwen's first sliding layer without ``layer_types``: ``max_window_layers``, transformers'
#: default 28 (Qwen2Config, Qwen3Config)
_QWEN_WINDOW_FROM = ("max_window_layers", 28)

#: Hugging Face ``model_type`` -> its family's spec: every family ``load_hf`` reads
FAMILIES: Mapping[str, FamilySpec] = MappingProxyType({
    "llama": FamilySpec("Llama", "SmolLM2-135M, TinyLlama-1.1B"),
    "mistral": FamilySpec("Mistral", "Mistral 7B v0.1", windows="every layer"),
    "qwen2": FamilySpec("Qwen2", "Qwen2.5-0.5B", qkv_bias=True, windows="every layer",
                        window_switch="use_sliding_window", window_from=_QWEN_WINDOW_FROM,
                        layer_tensors=layer_names(_QKV_BIAS)),
    "qwen3": FamilySpec("Qwen3", "Qwen3-0.6B", qk_norm=True, windows="every layer",
                        window_switch="use_sliding_window", window_from=_QWEN_WINDOW_FROM,
                        layer_tensors=layer_names(_QK_NORM)),
    "gemma": FamilySpec("Gemma", "gemma-2b", norm_offset=1.0, embed_scale="sqrt(hidden_size)",
                        activation=("hidden_act", "gelu_pytorch_tanh"), legacy_gelu=True,
                        tied=True),
    "gemma2": FamilySpec("Gemma 2", "gemma-2-2b", post_norms=True, norm_offset=1.0,
                         embed_scale="sqrt(hidden_size)", windows="even layers",
                         activation=("hidden_activation", "gelu_pytorch_tanh"),
                         attn_soft_cap_key="attn_logit_softcapping",
                         final_soft_cap_key="final_logit_softcapping",
                         attn_scalar=("query_pre_attn_scalar", 256.0), tied=True,
                         layer_tensors=layer_names(_POST_NORMS)),
})

#: model types with a model of their own (multi-head latent attention,
#: :mod:`pagedattn.serving.deepseek`), outside :data:`FAMILIES`
MLA_FAMILIES: Mapping[str, str] = MappingProxyType({"deepseek_v3": "DeepSeek-V3",
                                                    "deepseek_v2": "DeepSeek-V2"})


def family(model_type) -> FamilySpec:
    """The spec of ``model_type`` (``config.json``'s). Raises ValueError listing the
    supported ones for any other."""
    spec = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported "
                         f"(expected one of {', '.join(FAMILIES)})")
    return spec


def family_names() -> str:
    """The families as a phrase for help text: ``"Llama, Mistral, ... or Gemma 2"``."""
    names = [s.name for s in FAMILIES.values()]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _mark(on: bool) -> str:
    return "yes" if on else ""


def families_markdown() -> str:
    """``docs/models.md``: the families of :data:`FAMILIES` as Markdown tables (options,
    config keys, tensor names). A test keeps the file equal to this text."""
    rows = ["| `model_type` | family | e.g. | QKV bias | Q/K norm | post-norms | norm weight "
            "| embeddings × | activation | sliding window (no `layer_types`) | soft-caps "
            "| softmax scale | tied by default |",
            "|" + " --- |" * 13]
    for mt, s in FAMILIES.items():
        act_key, act_default = s.activation
        act = f"`{act_key}` (default `{act_default}`" + (
            "; `gelu` read as `gelu_pytorch_tanh`)" if s.legacy_gelu else ")")
        window = s.windows + (f" from `{s.window_from[0]}` on (default {s.window_from[1]})"
                              if s.window_from else "") + (
            f" (any window only with `{s.window_switch}`)" if s.window_switch else "")
        caps = ", ".join(f"`{k}`" for k in (s.attn_soft_cap_key, s.final_soft_cap_key) if k)
        scale = (f"`{s.attn_scalar[0]} ** -0.5` (default {s.attn_scalar[1]:g})"
                 if s.attn_scalar else "`head_dim ** -0.5`")
        norm = f"{s.norm_offset:g} + w" if s.norm_offset else "w"
        rows.append(f"| `{mt}` | {s.name} | {s.example} | {_mark(s.qkv_bias)} "
                    f"| {_mark(s.qk_norm)} | {_mark(s.post_norms)} | {norm} | {s.embed_scale} "
                    f"| {act} | {window} | {caps} | {scale} | {_mark(s.tied)} |")
    names: dict[tuple[str, str], list[str]] = {}
    for mt, s in FAMILIES.items():
        for hf, ours in s.layer_tensors.items():
            names.setdefault((hf, ours), []).append(f"`{mt}`")
    tensors = ["| Hugging Face | ours | families |", "| --- | --- | --- |"]
    tensors += [f"| `{hf}` | `{ours}` | all |" for hf, ours in TENSORS.items()]
    tensors += [f"| `{LAYER_PREFIX}{{i}}.{hf}` | `layers.{{i}}.{ours}` | "
                f"{'all' if len(mts) == len(FAMILIES) else ', '.join(mts)} |"
                for (hf, ours), mts in names.items()]
    mla = ", ".join(f"{name} (`{mt}`)" for mt, name in MLA_FAMILIES.items())
    return "\n".join([
        "# Model families",
        "",
        "<!-- generated by `python -m pagedattn.serving.families` from "
        "src/pagedattn/serving/families.py: edit the table there, not this file -->",
        "",
        "The Hugging Face checkpoints `pagedattn generate --model DIR` and "
        "`Transformer.from_hf(DIR)` serve, by `config.json`'s `model_type`. Each family is "
        "Llama plus the options of its row; the sliding window's size is `sliding_window` "
        "(the kernel's `window_left` is one less), and `layer_types`, where `config.json` has "
        "it, says which layers use it. The activation is SiLU or tanh-GELU (`silu`, "
        "`gelu_pytorch_tanh`), read from the key of the family's row; any other is refused. "
        "RoPE is the default one or, in any family, Llama 3's scaling (`rope_type` `llama3`, "
        "as Llama 3.1-3.3's `config.json` has it; a GGUF's `rope_freqs.weight`); any other "
        "scaling is refused (a GGUF's `llama.rope.scaling.*` too).",
        "",
        *rows,
        "",
        "## Tensor names",
        "",
        "Hugging Face's tensor names and the loader's (`nn.Linear`'s out × in, fp32); a "
        "tensor not listed for the family is not read.",
        "",
        *tensors,
        "",
        "## Other models",
        "",
        f"{mla}: multi-head latent attention, a model of their own "
        "(`pagedattn.serving.deepseek`).",
        "",
    ])


if __name__ == "__main__":
    print(families_markdown(), end="")
