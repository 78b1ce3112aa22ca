"""Metadata errors that the kernels find on the device, reported without a host sync.

The value checks of :mod:`pagedattn._validation` read lengths, page ids and slots on the host:
they run for CPU tensors and under ``validate=True`` (one sync). On a GPU with ``validate=None``
(the serving default, CUDA-graph safe) nothing is read back, so the kernels guard themselves:
they clamp what they read to their tables (a length to ``max_pages * page_size``, a page id to
``[0, num_pages)``, a query row to ``[0, num_tokens]``; ``append_kv`` drops a slot past the
cache) and **report** what they clamped in one 64-bit word per device, the *error word*. The
next call of pagedattn on that device (a plan, a run, a one-shot call, an append) or an
explicit :func:`check_errors` raises one ``ValueError`` naming the argument, the row and the
value, and clears the word. A launch that found nothing writes nothing.

The word is pinned host memory that the GPU writes through its unified address (no copy, no
sync: the host reads it with one load); on the CPU (Triton's interpreter) it is a plain tensor.
A kernel packs one report as ``code << 56 | row << 32 | value`` (row in 24 bits, value as
int32) and stores it with one 64-bit store, so a report is never torn. A report replaces a
pending one only when its code is lower: the codes are ordered from cause to consequence (a
length past the table makes the kernel read table entries that hold no page; a wrong
``query_start_loc`` makes a sequence look longer than its ``seq_lens``).

This module is a leaf (torch only); the launchers pass :func:`error_word` to the kernels and
the plans call :func:`raise_pending`.
"""

from __future__ import annotations

import ctypes
import threading

import torch

#: code -> (argument, what was expected): the kernels' report codes (``kernels/errors.py``
#: holds the same numbers as constexprs)
CODES = {
    1: ("context_lens", "a length within [0, max_pages * page_size] (the block table's capacity)"),
    2: ("seq_lens", "a length within [0, max_pages * page_size] (the block table's capacity)"),
    3: ("query_start_loc", "entries from 0, non-decreasing, at most the query's rows"),
    4: ("seq_lens", "at least the sequence's new tokens (query_start_loc[b + 1] - "
                    "query_start_loc[b])"),
    5: ("block_tables", "page ids within [0, num_pages) in the entries a length uses"),
    6: ("slot_mapping", "a slot below num_pages * page_size (negative: skipped)"),
}

_LOCK = threading.Lock()
_WORDS: dict[tuple[str, int | None], torch.Tensor] = {}


def _key(device: torch.device) -> tuple[str, int | None]:
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def error_word(device: torch.device) -> torch.Tensor:
    """The device's error word: a one-element int64 tensor that every kernel launched on
    ``device`` may write (pinned host memory for a GPU, zero until a kernel reports)."""
    key = _key(device)
    word = _WORDS.get(key)
    if word is None:
        with _LOCK:
            word = _WORDS.get(key)
            if word is None:
                word = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
                _WORDS[key] = word
    return word


def _decode(value: int) -> tuple[int, int, int]:
    code = (value >> 56) & 0xFF
    row = (value >> 32) & 0xFFFFFF
    val = value & 0xFFFFFFFF
    return code, row, val - (1 << 32) if val >= 1 << 31 else val


def describe(value: int) -> str:
    """The error message of a reported word."""
    code, row, val = _decode(value)
    name, expected = CODES.get(code, ("metadata", f"a valid value (report code {code})"))
    return (f"{name}[{row}]: expected {expected}, got {val} (found on the device by an "
            f"earlier launch, which read its table clamped; pagedattn.check_errors)")


def raise_pending(device: torch.device) -> None:
    """Raise the ``ValueError`` a kernel reported on ``device``, clearing the word; nothing
    when none did (one host load, no sync: a report from a launch still running is seen by
    a later call)."""
    word = _WORDS.get(_key(device))
    if word is None:
        return
    value = ctypes.c_int64.from_address(word.data_ptr()).value
    if value:
        ctypes.c_int64.from_address(word.data_ptr()).value = 0
        raise ValueError(describe(value))


def check_errors(device: torch.device | str | None = None, *, sync: bool = True) -> None:
    """Raise what the kernels reported on ``device`` (the current CUDA device by default; a
    string such as ``"cuda:1"`` or ``"cpu"`` too) since the last check: a ``ValueError``
    naming the argument (``context_lens``, ``seq_lens``, ``query_start_loc``,
    ``block_tables``, ``slot_mapping``), the row and the value that the kernels clamped.

    Args:
        device: the device whose word to read.
        sync: synchronize the device first (the default), so every launch issued before
            this call has reported; ``False`` reads what has arrived (no sync: usable while
            a CUDA graph is being captured).

    Raises:
        ValueError: a kernel reported bad metadata (the word is cleared).
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if sync and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize(device)
    raise_pending(device)
