"""The roofline's streaming-read kernel: a sum over a large buffer, read exactly once.

Grid ``(num_programs,)``; program ``p`` owns the contiguous chunk
``[p * CHUNK, (p + 1) * CHUNK)`` of the flat input, reads it in ``BLOCK``-element tiles with
fp32 accumulation, and writes one partial sum. The work per byte is one add, so the time is
the time to stream the buffer from HBM: ``bytes / time`` is the read roofline of ``API.md``.
Imported lazily (by :mod:`pagedattn.bench.timing`) so that importing the bench package does not
import Triton.
"""

from __future__ import annotations

import torch
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


#: (chunk, block, num_warps) tried by the roofline; the fastest counts (a roofline must not
#: under-read the card because one tile shape suits it poorly)
READ_CONFIGS: tuple[tuple[int, int, int], ...] = (
    (65536, 4096, 4), (131072, 8192, 8), (262144, 8192, 8), (32768, 2048, 4),
)


def stream_read(x: torch.Tensor, partial: torch.Tensor | None = None, *, chunk: int = 65536,
                block: int = 4096, num_warps: int = 4) -> torch.Tensor:
    """Launch the streaming read over contiguous ``x`` (any float dtype); returns the
    ``[ceil(numel / chunk)]`` float32 partial sums (their total is ``x.sum()``)."""
    n = x.numel()
    num_programs = triton.cdiv(n, chunk)
    if partial is None:
        partial = torch.empty(num_programs, dtype=torch.float32, device=x.device)
    _stream_read_kernel[(num_programs,)](x, partial, n, CHUNK=chunk, BLOCK=block,
                                         num_warps=num_warps)
    return partial
