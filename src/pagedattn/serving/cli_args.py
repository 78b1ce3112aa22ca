"""Argument checks shared by ``pagedattn generate`` and ``pagedattn bench-model``: argparse
type functions that reject bad values at parse time (exit 2), a one-line parser error, and the
device check. All of it runs before any model is loaded."""

from __future__ import annotations

import argparse
import types

import torch


def int_in(lo: int, hi: int | None = None):
    """An argparse type: an int in ``[lo, hi]`` (``hi`` None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {v}")
        return v
    parse.__name__ = "int"  # argparse names the type in some messages
    return parse


def _one_line_error(self: argparse.ArgumentParser, message: str):
    self.exit(2, f"{self.prog}: error: {message}\n")


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` report a bad argument as one line (no usage block), exit status 2."""
    parser.error = types.MethodType(_one_line_error, parser)  # type: ignore[method-assign]


def resolve_device(name: str | None) -> torch.device:
    """``name`` (``cpu``, ``cuda``, ``cuda:N``; None: CUDA when present) as a usable device.
    Raises ValueError naming ``--device`` for an unknown name or an absent GPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device: {name!r} asked for, but no CUDA GPU is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device: {name!r}, but only {torch.cuda.device_count()} GPU(s)")
    return dev
