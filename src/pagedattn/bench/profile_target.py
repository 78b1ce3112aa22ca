"""The process Nsight Compute profiles: ``python -m pagedattn.bench.profile_target``.

It builds one registered shape's batch on the GPU, runs one impl ``--warmup`` times (Triton
compiles on the first call; none of this is profiled, because ncu runs with
``--profile-from-start off``), then runs it ``--repeat`` times between
``torch.cuda.profiler.start()`` and ``stop()`` (cudaProfilerStart/Stop): exactly those launches
are profiled. With ``--meta-out`` it also writes Triton's compile metadata of the kernels it
launched (JSON), which the report adds to ncu's counters.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedattn.bench.profile_target")
    parser.add_argument("--impl", required=True)
    parser.add_argument("--shape", required=True, help="a name from pagedattn.bench.shapes")
    parser.add_argument("--small", action="store_true", help="the shrunken shape")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--num-splits", type=int, default=None)
    parser.add_argument("--meta-out", default=None, help="write compile metadata JSON here")
    args = parser.parse_args(argv)

    from pagedattn.bench.profiling import decode_call, resolve_shape, run_and_collect

    if not torch.cuda.is_available():
        print("profile_target: needs a CUDA GPU", file=sys.stderr)
        return 2
    call = decode_call(args.impl, resolve_shape(args.shape, args.small), "cuda",
                       args.num_splits)
    kernels = run_and_collect(call)  # warm-up 1: compiles
    for _ in range(max(args.warmup - 1, 0)):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.repeat):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    if args.meta_out:
        with open(args.meta_out, "w", encoding="utf-8") as f:
            json.dump([{"name": k.name, "values": k.values} for k in kernels], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
