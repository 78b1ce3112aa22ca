"""The drop-ins' errors in their callers' vocabulary: an error of the API underneath names
pagedattn's argument first (``block_tables: expected ...``); a drop-in raises it again under
the name its caller passed (FlashAttention's ``page_table``, FlashInfer's ``indices``)."""

from __future__ import annotations


def renamed(e: Exception, names: dict[str, str]) -> Exception:
    """``e`` (a TypeError or ValueError whose message starts with ``name: ``) with
    ``names[name]`` in its place, or ``e`` itself when it names nothing in ``names``."""
    name, sep, rest = str(e).partition(": ")
    if type(e) not in (TypeError, ValueError) or not sep or name not in names:
        return e
    return type(e)(f"{names[name]}: {rest}")
