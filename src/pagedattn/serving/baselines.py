"""The benchmark's references: a dense-KV SDPA attention backend for the same
:class:`Transformer` weights, and transformers' ``LlamaForCausalLM`` on the same GGUF.

* :class:`DenseAttention`: K/V of an equal-length batch in one contiguous ``[num_layers, 2,
  batch, num_kv_heads, max_len, head_dim]`` tensor, attention by SDPA (causal for a prompt
  chunk from position 0, full for one new token). :func:`dense_model` puts it under a paged
  model's weights (shared, not copied); :func:`dense_logits` runs it.
* :func:`load_hf_model` / :func:`hf_greedy`: transformers with its own KV cache.
* :func:`first_divergence` / :func:`logits_rel_error`: how two greedy runs compare.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from pagedattn.serving.gguf_loader import LlamaConfig, load_gguf
from pagedattn.serving.model import Transformer, sdpa_gqa


class DenseStep(NamedTuple):
    kv: torch.Tensor | None  # [num_layers, 2, batch, Hkv, max_len, D], or None: no cache
    start: int  # position of the first new token
    batch: int


class DenseAttention:
    """Dense backend: ``[batch * T]`` tokens of an equal-length batch at ``[start, start+T)``.

    With ``step.kv`` the new K/V are stored there and attention reads positions ``[0,
    start+T)``; without it, attention over the given tokens only (a full recompute from 0).
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 step: DenseStep) -> torch.Tensor:
        b, d = step.batch, q.shape[-1]
        t = q.shape[0] // b
        q, k, v = (y.reshape(b, t, -1, d).transpose(1, 2) for y in (q, k, v))
        if step.kv is not None:
            s = step.start
            step.kv[layer, 0, :, :, s:s + t] = k
            step.kv[layer, 1, :, :, s:s + t] = v
            k, v = step.kv[layer, 0, :, :, :s + t], step.kv[layer, 1, :, :, :s + t]
        o = sdpa_gqa(q, k, v, causal=t > 1)  # one new token sees everything
        return o.transpose(1, 2).reshape(b * t, -1, d)


def dense_model(model: Transformer) -> Transformer:
    """``model``'s weights (shared) over :class:`DenseAttention`."""
    return model.with_attention(DenseAttention())


def new_dense_cache(model: Transformer, batch: int, max_len: int) -> torch.Tensor:
    c = model.cfg
    return torch.zeros(c.num_layers, 2, batch, c.num_kv_heads, max_len, c.head_dim,
                       dtype=model.dtype, device=model.device)


def dense_logits(model: Transformer, token_ids: torch.Tensor, kv: torch.Tensor | None = None,
                 start: int = 0) -> torch.Tensor:
    """``token_ids`` ``[batch, T]`` at positions ``[start, start+T)`` through a dense model:
    logits ``[batch, T, vocab]``. Raises ValueError for a multi-token chunk with ``start > 0``."""
    batch, t = token_ids.shape
    if t > 1 and start > 0:
        raise ValueError("start: a multi-token chunk must start at position 0")
    pos = torch.arange(start, start + t, device=token_ids.device).repeat(batch)
    x = model(token_ids.reshape(-1), pos, DenseStep(kv, start, batch))
    return model.logits(x).view(batch, t, -1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def dense_greedy(model: Transformer, ids: list[int], batch: int, steps: int):
    """``batch`` copies of ``ids``, greedy through a dense model with a dense KV cache:
    ``(tokens [steps] of row 0, decode seconds)``."""
    dev, t = model.device, len(ids)
    kv = new_dense_cache(model, batch, t + steps)
    logits = dense_logits(model, torch.tensor([ids] * batch, device=dev), kv)[:, -1]
    toks = [logits.argmax(-1)]
    _sync(dev)
    t0 = time.perf_counter()
    for pos in range(t, t + steps - 1):
        logits = dense_logits(model, toks[-1][:, None], kv, pos)[:, -1]
        toks.append(logits.argmax(-1))
    _sync(dev)
    return torch.stack(toks)[:, 0].cpu(), time.perf_counter() - t0


def load_hf_model(path, dtype: torch.dtype, device):
    """transformers' ``LlamaForCausalLM`` on the GGUF, by its own loader when possible:
    ``(model, how it was loaded)``."""
    import transformers

    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype)
        return m.to(device).eval(), "transformers GGUF loader"
    except (ImportError, ValueError) as e:  # no gguf/accelerate: our dequantized weights
        cfg, w = load_gguf(path)
        how = f"our weights in LlamaForCausalLM ({type(e).__name__}: {e})"
        return hf_from_weights(cfg, w, dtype, device), how


def hf_from_weights(cfg: LlamaConfig, w: dict[str, torch.Tensor], dtype: torch.dtype, device):
    """transformers' ``LlamaForCausalLM`` holding :func:`load_gguf`-style weights."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_q_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings="lm_head" not in w)  # type: ignore[call-arg]  # rope_theta: 4.x, 5.x
    m: Any = transformers.LlamaForCausalLM(hf_cfg)
    m.load_state_dict(hf_state_dict(w), strict=False)
    if cfg.rope_inv_freq:  # Llama 3's scaled frequencies (a GGUF's rope_freqs), as ours
        with torch.no_grad():
            m.model.rotary_emb.inv_freq.copy_(cfg.inv_freq())
    return m.to(dtype=dtype, device=device).eval()


def random_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights for ``cfg`` in :func:`load_gguf`'s names (tests, tiny benchmark)."""
    g = torch.Generator().manual_seed(seed)
    c = cfg
    shapes = {"attn_norm": (c.hidden_size,), "ffn_norm": (c.hidden_size,),
              "wq": (c.num_q_heads * c.head_dim, c.hidden_size),
              "wk": (c.num_kv_heads * c.head_dim, c.hidden_size),
              "wv": (c.num_kv_heads * c.head_dim, c.hidden_size),
              "wo": (c.hidden_size, c.num_q_heads * c.head_dim),
              "w_gate": (c.intermediate_size, c.hidden_size),
              "w_up": (c.intermediate_size, c.hidden_size),
              "w_down": (c.hidden_size, c.intermediate_size)}
    w = {"embed": torch.randn(c.vocab_size, c.hidden_size, generator=g),
         "final_norm": 1 + 0.1 * torch.randn(c.hidden_size, generator=g)}
    for i in range(c.num_layers):
        for name, shape in shapes.items():
            if len(shape) == 1:
                w[f"layers.{i}.{name}"] = 1 + 0.1 * torch.randn(shape, generator=g)
            else:
                w[f"layers.{i}.{name}"] = torch.randn(shape, generator=g) * shape[1] ** -0.5
    return w


#: our per-layer weight names -> transformers' LlamaDecoderLayer names
HF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
            "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
            "w_down": "mlp.down_proj"}


def hf_state_dict(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`load_gguf` weights under transformers' ``LlamaForCausalLM`` names."""
    sd = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"],
          "lm_head.weight": w.get("lm_head", w["embed"])}
    for k, v in w.items():
        if k.startswith("layers."):
            _, i, n = k.split(".")
            sd[f"model.layers.{i}.{HF_NAMES[n]}.weight"] = v
    return sd


@torch.inference_mode()
def hf_greedy(hf, ids: list[int], steps: int, device):
    """transformers greedy with its own KV cache: ``(tokens [steps], logits [steps, vocab])``."""
    out = hf(torch.tensor([ids], device=device), use_cache=True)
    toks, rows = [], []
    for i in range(steps):
        logits = out.logits[0, -1].float()
        nxt = int(logits.argmax())
        toks.append(nxt)
        rows.append(logits.cpu())
        if i + 1 < steps:
            out = hf(torch.tensor([[nxt]], device=device), past_key_values=out.past_key_values,
                     use_cache=True)
    return torch.tensor(toks), torch.stack(rows)


@torch.inference_mode()
def hf_generate_tokens_per_s(hf, ids: list[int], batch: int, new_tokens: int, device) -> float:
    """transformers' plain ``generate()`` (greedy, no EOS stop): new tokens per second."""
    x = torch.tensor([ids] * batch, device=device)
    dev = torch.device(device)
    _sync(dev)
    t0 = time.perf_counter()
    hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(dev)
    return batch * new_tokens / (time.perf_counter() - t0)


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First index where two token sequences differ (over the shorter), else None."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if len(diff) else None


def logits_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖ours − ref‖ / ‖ref‖`` in float64."""
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm())
