"""Model-level benchmark and agreement check (for the GPU): SmolLM2 decode through the paged
path vs a dense-KV SDPA path, and vs transformers on the same weights.

* Throughput: ``batch`` copies of one chat-templated prompt, greedy, ``new_tokens`` steps.
  Decode tokens/s counts ``batch * (new_tokens - 1)`` tokens over the decode loop (prefill
  excluded), timed between CUDA synchronizations, after an untimed run of ``warmup`` steps.
  Both paths run eagerly and keep the next tokens on the device (no per-step host sync).
* Agreement: transformers (``LlamaForCausalLM`` loaded from the same GGUF with its own loader
  when ``gguf``+``accelerate`` are installed, else built from our dequantized weights) runs the
  same greedy loop with its own KV cache. Reported: the first step where the paged tokens
  differ from transformers' (``None`` if none), and the relative L2 error
  ``‖ours − hf‖ / ‖hf‖`` (fp32) of the logits over the steps before that.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pagedattn.serving.generate import encode, load_tokenizer
from pagedattn.serving.gguf_loader import find_gguf, load_gguf
from pagedattn.serving.model import Llama


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def paged_greedy(model: Llama, ids: list[int], batch: int, steps: int, *, page_size: int = 16):
    """``batch`` copies of ``ids`` through prefill + ``steps - 1`` paged decode steps.

    Returns ``(tokens [steps] of row 0, logits [steps, vocab] fp32 of row 0, decode seconds)``.
    """
    dev, t = model.device, len(ids)
    cache = model.make_cache(batch * (-(-(t + steps) // page_size)) + 1, page_size=page_size)
    seqs = list(range(batch))
    for s in seqs:
        cache.add_sequence(s)
    meta = cache.prepare_step(seqs, [t] * batch)
    logits = model.prefill(torch.tensor(ids * batch, device=dev), meta, cache)
    toks, rows = [logits.argmax(-1)], [logits[0].float()]
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        meta = cache.prepare_step(seqs, [1] * batch)
        logits = model.decode(toks[-1], meta, cache)
        toks.append(logits.argmax(-1))
        rows.append(logits[0].float())
    _sync(dev)
    elapsed = time.perf_counter() - t0
    return torch.stack(toks)[:, 0].cpu(), torch.stack(rows).cpu(), elapsed


@torch.inference_mode()
def dense_greedy(model: Llama, ids: list[int], batch: int, steps: int):
    """Same as :func:`paged_greedy` through the dense-KV SDPA path: ``(tokens, seconds)``."""
    dev, t = model.device, len(ids)
    kv = model.new_dense_cache(batch, t + steps)
    logits = model.forward_dense(torch.tensor([ids] * batch, device=dev), kv, 0)[:, -1]
    toks = [logits.argmax(-1)]
    _sync(dev)
    t0 = time.perf_counter()
    for pos in range(t, t + steps - 1):
        logits = model.forward_dense(toks[-1][:, None], kv, pos)[:, -1]
        toks.append(logits.argmax(-1))
    _sync(dev)
    return torch.stack(toks)[:, 0].cpu(), time.perf_counter() - t0


def load_hf_model(path, dtype: torch.dtype, device):
    """transformers' ``LlamaForCausalLM`` on the GGUF, by its own loader when possible."""
    import transformers

    m: Any
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype)
        how = "transformers GGUF loader"
    except (ImportError, ValueError) as e:  # no gguf/accelerate: our dequantized weights
        cfg, w = load_gguf(path)
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_q_heads, num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
            max_position_embeddings=cfg.max_position,
            tie_word_embeddings=True)  # type: ignore[call-arg]  # rope_theta: 4.x and 5.x
        m = transformers.LlamaForCausalLM(hf_cfg)
        names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                 "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                 "w_down": "mlp.down_proj"}
        sd = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"],
              "lm_head.weight": w.get("lm_head", w["embed"])}
        for k, v in w.items():
            if k.startswith("layers."):
                _, i, n = k.split(".")
                sd[f"model.layers.{i}.{names[n]}.weight"] = v
        m.load_state_dict(sd, strict=False)
        m = m.to(dtype)
        how = f"our weights in LlamaForCausalLM ({type(e).__name__}: {e})"
    return m.to(device).eval(), how


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


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if len(diff) else None


def logits_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm())


def run_benchmark(gguf=None, *, batch=32, prompt="What is the capital of France?",
                  new_tokens=128, dtype=torch.bfloat16, device="cuda", impl="auto",
                  page_size=16, compare_hf=True, warmup=8) -> dict:
    """See the module docstring. Returns a dict of results (and prints nothing)."""
    dev = torch.device(device)
    path = find_gguf(gguf)
    tokenizer = load_tokenizer(path)
    ids = encode(tokenizer, prompt, chat=True)
    model = Llama.from_gguf(path, dtype=dtype, device=dev, impl=impl)
    if warmup:  # compile the Triton kernels, warm cuBLAS and the allocators
        paged_greedy(model, ids, batch, warmup + 1, page_size=page_size)
        dense_greedy(model, ids, batch, warmup + 1)
    p_tok, p_logits, p_s = paged_greedy(model, ids, batch, new_tokens, page_size=page_size)
    d_tok, d_s = dense_greedy(model, ids, batch, new_tokens)
    n_dec = batch * (new_tokens - 1)
    res = {
        "model": path.name, "dtype": str(dtype), "device": str(dev), "impl": impl,
        "batch": batch, "prompt_tokens": len(ids), "new_tokens": new_tokens,
        "paged_tokens_per_s": n_dec / p_s if p_s else None,
        "dense_tokens_per_s": n_dec / d_s if d_s else None,
        "paged_vs_dense_first_divergence": first_divergence(p_tok, d_tok),
        "paged_text": tokenizer.decode(p_tok.tolist(), skip_special_tokens=True),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if compare_hf:
        hf, how = load_hf_model(path, dtype, dev)
        h_tok, h_logits = hf_greedy(hf, ids, new_tokens, dev)
        div = first_divergence(p_tok, h_tok)
        upto = new_tokens if div is None else div + 1  # logits at div still share a prefix
        res.update({
            "hf_loader": how,
            "hf_first_divergence": div,
            "hf_logits_rel_l2": logits_rel_error(p_logits[:upto], h_logits[:upto]),
            "hf_text": tokenizer.decode(h_tok.tolist(), skip_special_tokens=True),
        })
    return res


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedattn.serving.bench_model [--gguf PATH] [--batch N] ...``: one JSON line."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--impl", default="auto")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    a = p.parse_args(argv)
    res = run_benchmark(a.gguf, batch=a.batch, new_tokens=a.new_tokens,
                        dtype=getattr(torch, a.dtype), device=a.device, impl=a.impl,
                        compare_hf=not a.no_hf)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
