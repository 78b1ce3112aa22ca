"""``pagedattn`` command line: a thin argparse shell over the library.

Every subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``main(args) -> int``; they are imported only when their subcommand runs. Without a CUDA GPU
the CLI sets ``TRITON_INTERPRET=1`` for itself before anything imports Triton (the library
never does), so the kernels run on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("pagedattn.bench.mainjob", "run every impl on a real trace batch and check it"),
    "bench": ("pagedattn.bench.harness", "benchmark impls and peers against the roofline"),
    "profile": ("pagedattn.bench.profile", "Nsight Compute profile of impls on one shape"),
    "ladder": ("pagedattn.bench.ladder", "the study's stage ladder: table, charts, report"),
    "generate": ("pagedattn.serving.generate", "generate text with SmolLM2 through the kernel"),
    "bench-model": ("pagedattn.serving.bench_model",
                    "SmolLM2 serving throughput: eager vs CUDA graphs vs transformers"),
}


def _use_interpreter_without_gpu() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the chosen subcommand's module is imported
            importlib.import_module(module).add_arguments(p)
    if chosen is not None:
        _use_interpreter_without_gpu()
    args, _ = parser.parse_known_args(argv) if chosen is None else (parser.parse_args(argv), None)
    return int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
