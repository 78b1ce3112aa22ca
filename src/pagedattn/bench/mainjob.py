"""``pagedattn run``: the main job. Every impl on one real-trace decode batch, checked.

It draws the batch's KV lengths from a packaged request trace (``API.md``'s recipe), builds a
paged cache with pages in shuffled order (unused slots poisoned with NaN), runs every impl,
and checks each output against the float64 oracle (relative L2 error against the tolerance
of ``pagedattn.testing``). On a GPU it also times each impl (median µs on cold L2, GB/s of
minimal bytes). Without a GPU, the kernels run in Triton's interpreter, so the batch is shrunk
(fewer sequences, lengths scaled down; the model's heads and head_dim are kept), the run
checks correctness only, and the output says so. Exit status 1 if any impl fails.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from pagedattn.bench import report
from pagedattn.bench.shapes import MODELS, build_batch, make_shape
from pagedattn.bench.traces import TRACES, sample_context_lens

#: CPU interpreter defaults: the stages loop token by token (about 0.1 s per token for 32
#: heads), so the whole default command takes under a minute on 2 cores
CPU_BATCH, CPU_MAX_CONTEXT = 6, 32
GPU_BATCH = 64
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS),
                        help="model shape from the registry (default: %(default)s)")
    parser.add_argument("--trace", default="azure", choices=sorted(TRACES),
                        help="request trace the lengths come from (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"sequences (default {GPU_BATCH} on a GPU, {CPU_BATCH} on the CPU)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="scale the lengths down so the longest is this many tokens "
                             f"(default: none on a GPU, {CPU_MAX_CONTEXT} on the CPU)")
    parser.add_argument("--impls", default="all",
                        help="comma list of impls, or 'all' (default)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="query/cache dtype (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="trace draw and K/V/q seed")
    parser.add_argument("--reps", type=int, default=50, help="timed repetitions on a GPU")
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")


def scale_lengths(lens: list[int], max_context: int) -> list[int]:
    """Scale lengths by ``max_context / max(lens)`` (never up), rounding, at least 1 token:
    keeps the batch's raggedness at a size the interpreter can run."""
    longest = max(lens, default=0)
    if longest <= max_context:
        return list(lens)
    return [max(1, round(n * max_context / longest)) for n in lens]


def _impls(text: str) -> list[str]:
    import pagedattn.api as api

    names = list(api.IMPLS) if text == "all" else [s.strip() for s in text.split(",") if s]
    unknown = [n for n in names if n not in api.IMPLS]
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; known: {', '.join(api.IMPLS)}")
    return names


def run_impl(impl: str, shape, b, ref, *, timer=None) -> dict[str, Any]:
    """One row: call ``paged_decode(impl=impl)``, compare with ``ref`` (float64), time it."""
    import pagedattn.api as api
    from pagedattn.testing import rel_l2_error, tolerance_for

    row: dict[str, Any] = {"shape": shape.name, "impl": impl, "kind": "ours",
                           "batch": shape.batch, "num_tokens": shape.num_tokens,
                           "kv_bytes": shape.kv_bytes, "minimal_bytes": shape.minimal_bytes,
                           "tolerance": tolerance_for(shape.cache_dtype), "error": ""}
    fn = lambda: api.paged_decode(*b.tensors, impl=impl, **b.scales)
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a failing impl is a row and a non-zero exit
        return {**row, "status": "error", "error": f"{type(e).__name__}: {e}"[:300]}
    row["rel_l2_error"] = rel_l2_error(out, ref)  # type: ignore[arg-type]  # no return_lse
    row["status"] = "ok" if row["rel_l2_error"] <= row["tolerance"] else "FAIL"
    if timer is not None:
        t = timer(fn)
        row.update(median_us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us,
                   gbps=shape.minimal_bytes / (t.median_us * 1e-6) / 1e9)
    return row


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pagedattn.reference import paged_decode_reference

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    model = MODELS[args.model]
    batch = args.batch or (GPU_BATCH if on_gpu else CPU_BATCH)
    drawn = sample_context_lens(args.trace, batch, args.seed)
    max_context = args.max_context or (None if on_gpu else CPU_MAX_CONTEXT)
    lens = scale_lengths(drawn, max_context) if max_context else drawn
    dtype = DTYPES[args.dtype] if args.dtype else model.dtype
    shape = make_shape(f"{args.trace}-b{batch}-{model.name}", model, lens, dtype=dtype)
    impls = _impls(args.impls)

    print(f"{args.trace} trace, seed {args.seed}: {batch} requests, "
          f"{sum(drawn):,} KV tokens drawn (longest {max(drawn):,}).")
    if lens != drawn:
        print(f"Shrunk for {'the CPU interpreter' if not on_gpu else '--max-context'}: "
              f"lengths scaled by {max_context}/{max(drawn)} to {sum(lens):,} tokens "
              f"(longest {max(lens)}). Batch {batch}; heads {model.num_q_heads}/"
              f"{model.num_kv_heads} and head_dim {model.head_dim} are {model.name}'s. "
              "Use --batch/--max-context to change this.")
    if not on_gpu:
        print("No GPU: the kernels run in Triton's interpreter on the CPU. This run checks "
              "correctness only; interpreter times are not performance.")
    print(shape.describe())

    b = build_batch(shape, device, args.seed, poison=True)
    ref = paged_decode_reference(*b.tensors, **b.scales).out
    timer = None
    if on_gpu:
        import functools

        from pagedattn.bench.timing import time_cold

        timer = functools.partial(time_cold, reps=args.reps, device=device)
    rows = []
    t0 = time.perf_counter()
    for impl in (bar := tqdm(impls, unit="impl", desc="impls")):
        bar.set_postfix_str(impl)
        rows.append(run_impl(impl, shape, b, ref, timer=timer))
    print(report.terminal_table(rows))
    print(f"tolerance (rel L2 vs the float64 oracle): {rows[0]['tolerance'] if rows else '-'}; "
          f"{len(impls)} impls in {time.perf_counter() - t0:.1f} s"
          + ("" if on_gpu else " (interpreter: not performance)"))
    if args.csv:
        meta: dict[str, Any] = report.environment_meta(device)
        for r in rows:
            r.update({k: meta[k] for k in report.META_KEYS})
        print(f"rows written to {report.write_csv(rows, args.csv)}")
    failed = [r["impl"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0
