"""Where a serving decode step's time goes: wall time per step, GPU kernel time per step, kernels
per step and the top kernels, for one fixed batch through the engine (eager or CUDA graphs).

The engine decodes ``--batch`` copies of a prompt; after its warm-up and ``--skip`` untimed
steps, ``--steps`` decode steps run under ``torch.profiler`` (CPU and CUDA activities). A step's
wall time minus its GPU kernel time bounds what the host adds (metadata, the token copy, the
replay call, ``argmax().tolist()``). Prints a table and writes JSON with ``--json``.

Usage (repo root)::

    PYTHONPATH=src python scripts/profile_serving_step.py --gguf .model/smollm2.gguf --batch 1
    PYTHONPATH=src python scripts/profile_serving_step.py --random --batch 1   # no GGUF needed
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/profile_serving_step.py --tiny --no-graphs
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from pagedattn.serving import baselines
from pagedattn.serving.bench_model import TINY_CFG
from pagedattn.serving.engine import Engine
from pagedattn.serving.gguf_loader import LlamaConfig, find_gguf, load_gguf
from pagedattn.serving.model import Transformer

#: SmolLM2-135M's shapes (its GGUF's ``llama.*`` metadata): ``--random`` builds them with random
#: weights, so a step's time is measured without carrying the 98 MB file to the device
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_q_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                    rms_eps=1e-5, max_position=8192, tie_word_embeddings=True,
                    bos_token_id=None, eos_token_id=None)


def build_model(args: argparse.Namespace, device: torch.device) -> Transformer:
    if args.tiny:
        cfg = LlamaConfig(**TINY_CFG)  # type: ignore[arg-type]
        weights = baselines.random_weights(cfg)
    elif args.random:
        cfg = LlamaConfig(**SMOLLM2_135M)  # type: ignore[arg-type]
        weights = baselines.random_weights(cfg)
    else:
        cfg, weights = load_gguf(find_gguf(args.gguf))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Transformer(cfg, weights, dtype=dtype, device=device)


def _bucket(engine: Engine, args: argparse.Namespace) -> int:
    from pagedattn.serving.runner import bucket_for

    return bucket_for(args.batch, engine.runner.buckets)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: find the SmolLM2 one)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke test)")
    ap.add_argument("--random", action="store_true",
                    help="SmolLM2-135M's shapes with random weights (no GGUF)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="profiled decode steps")
    ap.add_argument("--skip", type=int, default=5, help="untimed decode steps before them")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps (the CPU's only mode)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.batch < 1 or args.steps < 1 or args.skip < 0:
        ap.error("--batch and --steps must be >= 1, --skip >= 0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    graphs = device.type == "cuda" and not args.no_graphs
    model = build_model(args, device)
    prompt = list(range(1, 17))
    new_tokens = args.skip + 2 * args.steps + 1  # the prefill gives the first token
    pages = args.batch * (-(-(len(prompt) + new_tokens) // 16) + 1)
    cache = model.make_cache(pages, page_size=16)
    engine = Engine(model, cache, max_batch_size=args.batch, graphs=graphs,
                    max_model_len=len(prompt) + new_tokens)
    engine.warmup()
    for _ in range(args.batch):
        engine.add_request(prompt, new_tokens)
    engine.step()  # the prefill
    for _ in range(args.skip):
        engine.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()  # the same steps without the profiler's own overhead
    for _ in range(args.steps):
        engine.step()
    sync()
    wall_plain = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        wall = time.perf_counter() - t0
    replay_ms = None
    if graphs:  # the bucket's graph replayed back to back: GPU time with no host in between
        graph = engine.runner._graphs[_bucket(engine, args)][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(args.steps):
            graph.replay()
        end.record()
        end.synchronize()
        replay_ms = start.elapsed_time(end) / args.steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels)  # µs
    by_name: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for e in kernels:
        by_name[e.name] += e.device_time
        count[e.name] += 1
    res = {"device": str(device), "graphs": graphs, "batch": args.batch, "steps": args.steps,
           "wall_ms_per_step": wall / args.steps * 1e3,
           "wall_ms_per_step_unprofiled": wall_plain / args.steps * 1e3,
           "tokens_per_s": args.batch * args.steps / wall_plain,
           "gpu_kernel_ms_per_step": gpu_us / args.steps / 1e3,
           # one replay of the step's graph with replays back to back (kernels plus the gaps
           # between them inside the graph); the rest of a step's wall time is the host's
           "graph_replay_ms": replay_ms,
           "kernels_per_step": len(kernels) / args.steps,
           "top_kernels": [{"name": n, "us_per_step": t / args.steps,
                            "per_step": count[n] / args.steps}
                           for n, t in by_name.most_common(args.top)],
           # host side: the CPU ops with the most self time (what the engine's step adds)
           "top_cpu_ops": [{"name": e.key, "self_us_per_step": e.self_cpu_time_total / args.steps,
                            "per_step": e.count / args.steps}
                           for e in sorted(prof.key_averages(),
                                           key=lambda e: -e.self_cpu_time_total)[:args.top]]}
    print(f"{res['device']} graphs={graphs} batch={args.batch}: "
          f"{res['wall_ms_per_step']:.3f} ms/step wall ({res['tokens_per_s']:,.0f} tokens/s), "
          f"{res['gpu_kernel_ms_per_step']:.3f} ms/step in {res['kernels_per_step']:.0f} "
          f"GPU kernels; unprofiled {res['wall_ms_per_step_unprofiled']:.3f} ms/step"
          + (f"; graph replays back to back {replay_ms:.3f} ms" if replay_ms else ""))
    for k in res["top_kernels"]:
        print(f"  {k['us_per_step']:9.1f} µs/step  x{k['per_step']:5.1f}  {k['name'][:90]}")
    print("  host ops by self time:")
    for k in res["top_cpu_ops"]:
        print(f"  {k['self_us_per_step']:9.1f} µs/step  x{k['per_step']:5.1f}  {k['name'][:90]}")
    if not kernels:
        print("  (no GPU: CPU ops only; the kernel columns need a CUDA device)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
