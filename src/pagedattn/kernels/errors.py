"""Reporting bad metadata from a kernel: ``@triton.jit`` helpers that write one report into
the device's error word (:mod:`pagedattn._errors`, which turns it into a ``ValueError`` at the
next call or at ``pagedattn.check_errors()``).

A kernel never trusts what its metadata says: it clamps each value to its tables and keeps
going (no trap, no partial launch), and reports the first value it clamped. A report is one
64-bit store of ``code << 56 | row << 32 | value`` (row in 24 bits, the value saturated to
int32), so it is never torn. The codes are :data:`pagedattn._errors.CODES`'.

Nothing here imports another kernels module.
"""

import triton
import triton.language as tl

# the report codes (pagedattn._errors.CODES holds their argument names and messages)
# (ordered from cause to consequence: a report replaces a pending one of a higher code only)
CONTEXT_LENS = tl.constexpr(1)  # a decode length outside [0, max_pages * page_size]
SEQ_LENS = tl.constexpr(2)  # a varlen length outside [0, max_pages * page_size]
QUERY_START_LOC = tl.constexpr(3)  # decreasing, negative or past the query's rows
SEQ_LENS_SHORT = tl.constexpr(4)  # a varlen length below the sequence's new tokens
BLOCK_TABLES = tl.constexpr(5)  # a used page id outside [0, num_pages)
SLOT_MAPPING = tl.constexpr(6)  # an append slot at or past the cache's capacity


@triton.jit
def _report(errors_ptr, bad, code: tl.constexpr, row, value):
    """Store one report when the scalar ``bad`` holds: ``code``, the offending ``row`` (its
    low 24 bits) and ``value`` (saturated to int32), unless a report of a lower code is
    pending (a plain load and store, no atomic: the word may be host memory; of two
    reports racing, either is kept)."""
    if bad:
        zero = tl.zeros([], tl.int64)
        v = tl.minimum(tl.maximum(zero + value, -2147483648), 2147483647)
        word = (((zero + code) << 56) | (((zero + row) & 0xFFFFFF) << 32)
                | (v & 0xFFFFFFFF))
        pending = tl.load(errors_ptr, volatile=True)
        if (pending == 0) | ((pending >> 56) > code):
            tl.store(errors_ptr, word)


@triton.jit
def _kept_page_ids(raw, num_pages):
    """``(ids int64, inside)``: page ids read from a block table (int32 or int64) with those
    outside ``[0, num_pages)`` replaced by page 0, and which lay inside. One unsigned
    compare at the table's own width (a negative id wraps past every page) and one select an
    id; the signed pair at 64 bits took two compares and four selects (docs/perf-notes.md,
    issue 68). An int32 id kept is not negative, so it widens by zero-extension."""
    if raw.dtype.primitive_bitwidth == 32:
        pages = tl.minimum(num_pages, 2147483647).to(tl.uint32)  # an int32 id's range
        inside = raw.to(tl.uint32, bitcast=True) < pages
        ids = tl.where(inside, raw, 0).to(tl.uint32, bitcast=True).to(tl.int64)
    else:
        inside = raw.to(tl.uint64, bitcast=True) < num_pages.to(tl.uint64)
        ids = tl.where(inside, raw, 0).to(tl.int64)
    return ids, inside


@triton.jit
def _clamped_page_ids(raw, num_pages):
    """Page ids read from a block table, clamped to ``[0, num_pages)`` (an id outside reads
    page 0; with no page at all, the caller's lengths are clamped to 0), int64."""
    return _kept_page_ids(raw, num_pages)[0]


@triton.jit
def _checked_page_ids(raw, num_pages):
    """Page ids read from a block table, clamped to ``[0, num_pages)`` (an id outside reads
    page 0), and whether any was outside: ``(ids int64, bad int1 [...])``."""
    ids, inside = _kept_page_ids(raw, num_pages)
    return ids, ~inside
