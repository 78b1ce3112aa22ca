"""The streaming-read kernel: a sum over a buffer, read exactly once.

Grid ``(num_programs,)``; program ``p`` owns the contiguous chunk
``[p * CHUNK, (p + 1) * CHUNK)`` of the flat input, reads it in ``BLOCK``-element tiles with
fp32 accumulation, and writes one partial sum. The work per byte is one add, so the time is
the time to stream the buffer from HBM: ``bytes / time`` is the read rate (of 2 GiB: the
roofline), and over a row's minimal bytes its size-matched limit; it is also the clean L2
flush between timed calls (a read: no dirty line left in the L2).
The host side (tile configs, launch, timing) lives in :mod:`pagedattn.bench.timing`, which
imports this module lazily so that importing the bench package does not import Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _stream_read_kernel(x_ptr, partial_ptr, n_elements, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CHUNK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)  # [BLOCK]
    for start in range(0, CHUNK, BLOCK):
        idx = base + start + offs
        acc += tl.load(x_ptr + idx, mask=idx < n_elements, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))
