"""Run a tiny model through vLLM offline and write what it generated, for
``test_vllm_backend.py`` (which compares pagedattn's backend with vLLM's own, each in a
process of its own, as a user runs them).

    python tests/_vllm_run.py make DIR llama|mistral       # a tiny random model + tokenizer
    python tests/_vllm_run.py run DIR OUT.json [--tp N] [--kv-cache-dtype D]

``run`` generates greedily, with logprobs, through three scenarios in one engine
(fp32, ``block_size=32``, ``max_num_batched_tokens=64``, chunked prefill and prefix caching
on): ``chunked`` (one long prompt alone: prefilled in chunks of at most 64 tokens),
``mixed`` (short prompts beside a long one: steps that mix decodes and a prefill chunk),
``prefix`` (a prompt whose first blocks are ``chunked``'s prompt, found in the prefix
cache). The backend is whichever vLLM picks: pagedattn's when the environment has
``PAGEDATTN_VLLM_CPU=1`` (and pagedattn is installed, so its entry point is found).

The test also puts ``_vllm_test_plugin.py`` in every process of the engine, as a vLLM
plugin: it counts whose attention kernels run (see there).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROMPT_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]


def make_model(path: str, family: str) -> None:
    """A tiny random Llama (GQA: 4 heads, 2 KV heads, head_dim 32, 2 layers) or Mistral (the
    same with a 48-token sliding window) and a byte-level BPE tokenizer trained here."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(PROMPT_WORDS[(i * 7 + j) % 9] for j in range(12)) + f" {i}"
              for i in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed({"llama": 0, "mistral": 1}[family])
    shapes = dict(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
                  torch_dtype="float32")
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes))
    else:
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**shapes, sliding_window=48))
    # random weights of std 0.02 give near-uniform logits; larger ones give the greedy path
    # clear winners and make attention matter
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)


def prompts() -> dict[str, list[str]]:
    words = PROMPT_WORDS
    text = lambda n, k: " ".join(words[(i * k) % len(words)] for i in range(n))
    long_a, long_b = text(150, 4), text(120, 5)
    return {"chunked": [long_a],
            "mixed": [text(3, 2), long_b, text(9, 7), text(5, 1)],
            # the first ~128 tokens of `chunked`'s prompt (whole 32-token blocks), then others
            "prefix": [long_a.rsplit(" ", 40)[0] + " " + text(12, 2)]}


def run(model: str, out: str, tp: int, kv_cache_dtype: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
              block_size=32, max_num_batched_tokens=64, max_num_seqs=8,
              enable_chunked_prefill=True, enable_prefix_caching=True, seed=0,
              tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype)
    results = {}
    for scenario, texts in prompts().items():
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5,
                                prompt_logprobs=None if scenario == "prefix" else 1)
        outputs = llm.generate(texts, params, use_tqdm=False)
        results[scenario] = [{
            "prompt_tokens": len(o.prompt_token_ids),
            "num_cached_tokens": o.num_cached_tokens,
            "token_ids": list(o.outputs[0].token_ids),
            # per generated token: {token id: logprob} of the top 5 (and the chosen one)
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                         for step in o.outputs[0].logprobs],
            # per prompt token after the first: the logprob of the prompt's own token
            "prompt_logprobs": None if o.prompt_logprobs is None else [
                lp[tok].logprob for tok, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:],
                                                   strict=True)],
        } for o in outputs]
    Path(out).write_text(json.dumps(results))


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make")
    make.add_argument("dir")
    make.add_argument("family", choices=("llama", "mistral"))
    go = sub.add_parser("run")
    go.add_argument("model")
    go.add_argument("out")
    go.add_argument("--tp", type=int, default=1)
    go.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args(argv)
    if args.command == "make":
        make_model(args.dir, args.family)
    else:
        run(args.model, args.out, args.tp, args.kv_cache_dtype)


if __name__ == "__main__":
    main(sys.argv[1:])
