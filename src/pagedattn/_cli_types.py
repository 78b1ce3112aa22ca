"""argparse type functions and the parser class shared by every ``pagedattn`` subcommand.

A type function turns one command-line string into a checked value or raises
``argparse.ArgumentTypeError``; argparse then reports ``argument --batch: expected a positive
integer, got '-3'`` and exits with status 2. :class:`OneLineParser` prints that report as one
line (no usage block, no traceback), so every user mistake reads the same way::

    pagedattn run: error: argument --batch: expected a positive integer, got '-3' (see --help)

Subparsers created from a :class:`OneLineParser` are of the same class, so a subcommand module
(``bench``, ``serving.generate``, ...) only needs ``type=positive_int`` and friends.

:func:`output_file` and :func:`output_dir` check an output path before any work starts (an
unwritable ``--csv`` fails at once, not after the run); they create nothing. Give such an option
a non-string default (``None``, a ``Path``): argparse runs ``type`` on string defaults too. The
path a subcommand will really write (a default, or a file derived from a prefix) goes through
:func:`checked_output` at the top of its ``main``, the same check: symlinks are followed (a
loop or a dangling link is refused), then the nearest existing directory must take a new file.

A value that can only be judged after parsing (a model file, a device: :func:`resolve_device`)
is reported by raising :class:`ArgumentError` from the subcommand's ``main``:
:func:`pagedattn.cli.main` prints it as one line and exits with status 2, the same way.

The dtype tables (:data:`DTYPES`, :data:`CACHE_DTYPES`) and :data:`MAX_BATCH` are the values
the options of several subcommands share (``run``, ``generate``, ``bench-model``).
"""

from __future__ import annotations

import argparse
import errno
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import torch

__all__ = ["CACHE_DTYPES", "CPU_LIMIT_S", "DTYPES", "DTYPE_SHORT", "INT_MAX", "MAX_BATCH",
           "ArgumentError", "OneLineParser", "checked_output", "dtype_name", "int_in",
           "int_list_in", "name_list", "nonneg_float", "nonneg_int", "output_dir", "output_file",
           "positive_float", "positive_int", "refuse_unless_yes", "resolve_device",
           "say_duration"]


class ArgumentError(ValueError):
    """A bad command-line value found after parsing. Its text names the option (``--gguf: ...``);
    :func:`pagedattn.cli.main` prints ``pagedattn <command>: error: <text>`` and returns 2."""


#: the largest int an option takes: torch holds counts and seeds in 64 bits (a larger one
#: raised "Overflow when unpacking long long" deep in a run)
INT_MAX = (1 << 63) - 1


def _number(text: str, kind: type, what: str, ok: Callable[[float], bool]):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or not ok(value):  # NaN, inf
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    if kind is int and abs(value) > INT_MAX:
        raise argparse.ArgumentTypeError(f"expected {what} below 2^63, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a batch, a count of repetitions)."""
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def nonneg_int(text: str) -> int:
    """An integer >= 0 (a seed, a number of warm-up calls)."""
    return _number(text, int, "a non-negative integer", lambda v: v >= 0)


def positive_float(text: str) -> float:
    """A finite float > 0."""
    return _number(text, float, "a positive number", lambda v: v > 0)


def nonneg_float(text: str) -> float:
    """A finite float >= 0."""
    return _number(text, float, "a non-negative number", lambda v: v >= 0)


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


def name_list(known: Iterable[str], *, what: str,
              presets: Mapping[str, Sequence[str]] | None = None,
              allow_none: bool = False) -> Callable[[str], list[str]]:
    """A type function for a comma list of names out of ``known`` (in the order given).

    ``presets`` maps a single word (``"all"``) to its list; with ``allow_none`` the word
    ``"none"`` gives ``[]``. An unknown name, or an empty list otherwise, is an error that
    lists the known names.
    """
    known = tuple(known)
    presets = dict(presets or {})

    def parse(text: str) -> list[str]:
        word = text.strip()
        if word in presets:
            return list(presets[word])
        if allow_none and word == "none":
            return []
        names = [s.strip() for s in text.split(",") if s.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            choices = ", ".join([*presets, *(["none"] if allow_none else []), *known])
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, unknown)) or repr(text)}; "
                f"expected a comma list of: {choices}")
        return names

    parse.__name__ = f"{what}_list"  # argparse names the type in some messages
    return parse


#: the short spelling of each float dtype beside torch's name: ``run`` took the short ones,
#: ``generate``/``bench-model`` torch's; every dtype option takes both (:func:`dtype_name`)
DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
#: a ``--dtype`` name -> its torch dtype (the model's, or the run's)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: a ``--cache-dtype`` name -> its torch dtype: a model dtype or an fp8 KV cache
CACHE_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: the most sequences a serving option takes (``--max-batch-size``, ``--batches``): the
#: largest decode bucket, :data:`pagedattn.serving.runner.BUCKETS`' last
MAX_BATCH = 256


def dtype_name(known: Iterable[str]) -> Callable[[str], str]:
    """A type function for a dtype option whose table is keyed by ``known`` (torch's names,
    ``float32``/``float16``/``bfloat16``, and any others such as ``fp8_e4m3``): a name of
    ``known`` or a float dtype's short spelling (``fp32``, ``fp16``, ``bf16``), in any case,
    returned as the name in ``known``. Anything else is an error listing both spellings."""
    known = tuple(known)
    words = {k.lower(): k for k in known}
    words.update({DTYPE_SHORT[k]: k for k in known if k in DTYPE_SHORT})
    listed = ", ".join(f"{k} ({DTYPE_SHORT[k]})" if k in DTYPE_SHORT else k for k in known)

    def parse(text: str) -> str:
        name = words.get(text.strip().lower())
        if name is None:
            raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; expected one of: {listed}")
        return name

    parse.__name__ = "dtype"  # argparse names the type in some messages
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


def _symlink_problem(path: Path) -> str | None:
    """Why a symlink on ``path`` or one of its ancestors cannot be written through (a loop, a
    target that does not exist, a target under a file), or None. ``Path.exists`` is False for
    all three, so without this check the nearest existing ancestor passed and the write failed
    after the work (``mkdir`` of a dangling link raises FileExistsError, ``open`` ENOENT)."""
    for p in (path, *path.parents):
        if not p.is_symlink():
            continue
        try:
            p.stat()
        except OSError as e:
            target = os.readlink(p)
            if e.errno == errno.ELOOP:
                return f"{str(p)!r} is a symlink loop"
            return (f"{str(p)!r} is a symlink to {target!r}, which "
                    + ("does not exist" if e.errno == errno.ENOENT else
                       f"cannot be reached ({e.strerror or e})"))
    return None


def _check_writable(text: str, *, directory: bool) -> Path:
    """The resolved path of ``text`` if a file (``directory`` False) or a directory could be
    written there: no symlink loop or dangling symlink on the way, and the nearest existing
    ancestor of the resolved path is a directory that takes a new file (probed with a temporary
    file, removed at once). Raises ArgumentTypeError saying why not."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("expected a path, got ''")
    given = Path(text).expanduser().absolute()
    why = _symlink_problem(given)
    if why is not None:
        raise argparse.ArgumentTypeError(f"cannot write {str(text)!r}: {why}")
    path = given.resolve()  # every symlink on the way exists now
    if path.exists() and not directory and path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {str(text)!r}: it is a directory")
    if path.exists() and directory and not path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write into {str(text)!r}: it is not a "
                                         "directory")
    if path.is_file() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {str(text)!r}: the file is read-only")
    base = path if directory else path.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {str(text)!r}: {str(base)!r} is not a "
                                         "directory")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot write {str(text)!r}: {str(base)!r} does not take new files "
            f"({e.strerror or e})") from None
    return path


def checked_output(path: str | os.PathLike, option: str, *, directory: bool = False) -> Path:
    """The one check of an output path, for the path a subcommand will really write (its
    default included, which argparse does not type-check) before any work: ``path`` as a
    Path if it can be written (see :func:`output_file`/:func:`output_dir`), else
    :class:`ArgumentError` naming ``option`` (one line, exit status 2)."""
    try:
        _check_writable(os.fspath(path), directory=directory)
    except argparse.ArgumentTypeError as e:
        raise ArgumentError(f"{option}: {e}") from None
    return Path(path)


def output_file(text: str) -> str:
    """A path a file can be written to (missing parent directories are made when written):
    ``text`` as given, once checked."""
    _check_writable(text, directory=False)
    return text


def output_dir(text: str) -> str:
    """A directory that exists or can be made, and that takes new files: ``text`` as given,
    once checked."""
    _check_writable(text, directory=True)
    return text


#: on the CPU, settings estimated above this many seconds of Triton's interpreter need
#: ``--yes`` (``run``, ``bench-model``)
CPU_LIMIT_S = 15 * 60


def refuse_unless_yes(yes: bool, hint: str, *, seconds: float | None = None,
                      need_bytes: int | None = None, free_bytes: int | None = None) -> None:
    """Before any work: :class:`ArgumentError` (one line, exit status 2) when the settings are
    estimated past :data:`CPU_LIMIT_S` of the interpreter (``seconds``) or past the memory
    the job can have (``need_bytes`` > ``free_bytes``), unless ``--yes`` (``yes``); the line
    ends with ``hint``, the smaller settings to ask for."""
    if yes:
        return
    if seconds is not None and seconds > CPU_LIMIT_S:
        raise ArgumentError(f"--yes not given: on the CPU these settings take "
                            f"{say_duration(seconds)} in Triton's interpreter (estimated); add "
                            f"--yes to run them anyway, or {hint}")
    if need_bytes is not None and free_bytes is not None and need_bytes > free_bytes:
        raise ArgumentError(f"--yes not given: these settings need about "
                            f"{need_bytes / 1e9:.1f} GB of memory (estimated), more than the "
                            f"{free_bytes / 1e9:.1f} GB free; add --yes to run them anyway, or "
                            f"{hint}")


def say_duration(seconds: float) -> str:
    """``"about 40 s"``, ``"about 12 min"``, ``"about 3.5 h"``."""
    if seconds < 90:
        return f"about {max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        first = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {first} (see --help)\n")
