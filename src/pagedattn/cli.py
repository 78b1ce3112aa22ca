"""``pagedattn`` command line: a thin argparse shell over the library.

Every subcommand lives in a module (or an object of one) with ``add_arguments(parser)`` and
``main(args) -> int``; a loader function per subcommand imports it, with a real import
statement, only when that subcommand runs. Parsers are
:class:`pagedattn._cli_types.OneLineParser`: a bad value is one line on stderr and exit status 2,
and an output path that cannot be written is one line and exit status 2 too (checked by the
option's type before any work, see :func:`pagedattn._cli_types.output_file`; a write that still
fails later is reported the same way), and so is a value a subcommand finds bad after parsing
(it raises :class:`pagedattn._cli_types.ArgumentError`): never a traceback. Every argument's
error ends with ``(see --help)``, whichever the subcommand and whenever it is found. Without a
CUDA GPU the CLI sets ``TRITON_INTERPRET=1`` for itself before anything imports Triton (the
library never does), so the kernels run on the CPU through Triton's interpreter; a subcommand
then runs inside :func:`pagedattn._env.quiet_interpreter_warnings`, which hides that
interpreter's known, harmless warnings. ``TRITON_INTERPRET=0`` (or another false value) without
a GPU leaves the kernels nowhere to run: one line, exit status 2, before anything loads
(``bench --list``, which runs no kernel, still works). A subcommand whose extra of
pyproject.toml (``bench``, ``serve``: :data:`EXTRA_OF`) is not installed is refused in one line
naming it, exit status 2, before its module loads.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from pagedattn._cli_types import ArgumentError, OneLineParser
from pagedattn._env import DependencyError, interpreter_refused, quiet_interpreter_warnings


def _run() -> Any:
    from pagedattn.bench import harness
    return harness.RUN


def _bench() -> Any:
    from pagedattn.bench import harness
    return harness


def _profile() -> Any:
    from pagedattn.bench import profile
    return profile


def _ladder() -> Any:
    from pagedattn.bench import ladder
    return ladder


def _generate() -> Any:
    from pagedattn.serving import generate
    return generate


def _bench_model() -> Any:
    from pagedattn.serving import bench_model
    return bench_model


#: subcommand -> (loader of the object with add_arguments/main, one-line help)
COMMANDS: dict[str, tuple[Callable[[], Any], str]] = {
    "run": (_run, "run every impl on a real trace batch and check it"),
    "bench": (_bench, "benchmark impls and peers against the roofline"),
    "profile": (_profile, "Nsight Compute profile of impls on one shape"),
    "ladder": (_ladder, "the study's stage ladder: table, charts, report"),
    "generate": (_generate, "generate text through the kernel (SmolLM2, or --model DIR)"),
    "bench-model": (_bench_model,
                    "SmolLM2 serving throughput: eager vs CUDA graphs vs transformers"),
}


#: the extra of pyproject.toml each subcommand needs, and the modules of it that they import
#: (tests/package/test_deps.py checks them against pyproject.toml): without one, the subcommand is
#: refused in one line naming the extra, before it loads
EXTRA_OF = {"run": "bench", "bench": "bench", "profile": "bench", "ladder": "bench",
            "generate": "serve", "bench-model": "serve"}
EXTRA_MODULES = {"bench": ("numpy", "tqdm", "tabulate", "matplotlib"),
                 "serve": ("numpy", "gguf", "transformers")}


def _not_installed(module: str) -> bool:
    """True when ``import module`` would fail for want of it (a ``None`` in ``sys.modules``
    blocks it); nothing is imported."""
    if module in sys.modules:
        return sys.modules[module] is None
    return importlib.util.find_spec(module) is None


def missing_extra(command: str) -> str | None:
    """The one line refusing ``command`` when a module of its extra is not installed, naming
    the extra and the module(s); ``None`` when all are."""
    extra = EXTRA_OF[command]
    missing = [m for m in EXTRA_MODULES[extra] if _not_installed(m)]
    if not missing:
        return None
    return (f"'pagedattn {command}' needs the {extra} extra ({', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed): "
            f'pip install "pagedattn[{extra}]"')


#: the one line for ``TRITON_INTERPRET`` set to a false value on a machine without a CUDA GPU
NO_BACKEND = ("TRITON_INTERPRET={!r} turns Triton's interpreter off, but there is no CUDA GPU, so "
              "the kernels cannot run: unset TRITON_INTERPRET (pagedattn then sets it to 1 for "
              "itself) or set TRITON_INTERPRET=1")


def _use_interpreter_without_gpu() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: Python's ``MemoryError``, torch's CUDA ``OutOfMemoryError``
    (a ``RuntimeError``), or its CPU allocator's ``RuntimeError`` ("can't allocate", or a size
    past 2^63 bytes: "Storage size calculation overflowed")."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and ("can't allocate" in text or "out of memory" in text
                                         or "size calculation overflowed" in text))


def _command(name: str):
    """The object with ``add_arguments``/``main`` for subcommand ``name``."""
    return COMMANDS[name][0]()


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="pagedattn",  # the docstring's first line, without reST
                           description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    if chosen is not None and (missing := missing_extra(chosen)):  # before its module loads
        print(f"pagedattn {chosen}: error: {missing}", file=sys.stderr)
        return 2
    if chosen is not None:  # before the subcommand's module imports Triton
        _use_interpreter_without_gpu()
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the chosen subcommand's module is imported
            _command(name).add_arguments(p)
    args = parser.parse_args(argv)
    if interpreter_refused() and not getattr(args, "list", False):  # --list runs no kernel
        why = NO_BACKEND.format(os.environ["TRITON_INTERPRET"])
        print(f"pagedattn {args.command}: error: {why}", file=sys.stderr)
        return 2
    try:
        with quiet_interpreter_warnings():  # the interpreter's known, harmless noise (CPU only)
            return int(_command(args.command).main(args) or 0)
    except DependencyError as e:  # numpy too new for Triton 3.6's interpreter
        print(f"pagedattn {args.command}: error: {str(e).removeprefix('pagedattn: ')}",
              file=sys.stderr)
        return 2
    except (ArgumentError, OSError) as e:  # a bad --gguf/--device; an unwritable output path
        # an argument's error ends as a parser's does, whatever the subcommand
        see = " (see --help)" if isinstance(e, ArgumentError) else ""
        print(f"pagedattn {args.command}: error: {e}{see}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:  # a batch or context too large for this machine
        if type(e).__name__ == "CacheFullError":  # the engine's pages (serving)
            print(f"pagedattn {args.command}: error: {e} (--num-pages)", file=sys.stderr)
            return 2
        if not _out_of_memory(e):
            raise
        why = (str(e) or type(e).__name__).splitlines()[0][:200]
        print(f"pagedattn {args.command}: error: out of memory ({why}); ask for a smaller "
              "--batch or --max-context", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pagedattn {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
