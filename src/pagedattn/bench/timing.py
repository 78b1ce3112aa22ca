"""Cold-L2 timing of CUDA work (eager and CUDA-graph replays), host time per call, the read
roofline, and the one GB/s formula every report uses.

Every repetition first overwrites a flush buffer of at least twice the L2 (the H200's L2 is
60 MB; the size is read from the device when torch exposes it), so each timed call starts with
a cold L2, then times the call alone with a pair of CUDA events. Results are in microseconds:
the median and the 20th/80th percentiles over the repetitions, after a warm-up that keeps the
GPU busy for at least ``WARMUP_S`` of wall time (flush + call back to back): an idle H200 sits
at ~400 MHz and needs tens of milliseconds of load to reach its boost clock, and a warm-up of
ten calls of a short kernel left the first timed calls of small shapes at the idle clock
(eager medians of small shapes far above their graph medians in the same run; see
``docs/perf-notes.md``, step 6). The host never syncs between repetitions (one sync at the
end), so Python launch overhead overlaps the flush, as in ``triton.testing.do_bench``.

Host time (:func:`host_us`) is the submission cost of one eager call: ``calls`` back-to-back
calls with no sync between them, after a warm-up and a sync, divided by ``calls``. ``calls``
stays far below CUDA's launch queue (about a thousand launches), so the host never waits for
the GPU and the figure is Python + launch overhead, not kernel time. Under the CPU interpreter a
call runs the kernel itself, so host time is not measured there (reports say n/a).

CUDA only: timing never happens in pytest, and interpreter times are not performance.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch

H200_L2_BYTES = 60 * 2**20
MIN_FLUSH_BYTES = 256 * 2**20
T = TypeVar("T")
WARMUP_S = 0.2  # wall time of back-to-back flush + call before timing (GPU clock ramp)


class Timing(NamedTuple):
    """Per-call times in microseconds over ``reps`` cold-L2 repetitions."""

    median_us: float
    p20_us: float
    p80_us: float
    reps: int


def l2_cache_bytes(device: torch.device | str | int | None = None) -> int:
    """The device's L2 size in bytes (``L2_cache_size`` when torch exposes it, else 60 MB)."""
    props = torch.cuda.get_device_properties(torch.device("cuda", 0) if device is None
                                             else device)
    return int(getattr(props, "L2_cache_size", 0) or H200_L2_BYTES)


def _flush_buffer(device) -> torch.Tensor:
    nbytes = max(2 * l2_cache_bytes(device), MIN_FLUSH_BYTES)
    return torch.empty(nbytes // 4, dtype=torch.int32, device=device)


def _summarize(times_ms: list[float]) -> Timing:
    us = sorted(t * 1e3 for t in times_ms)
    q = statistics.quantiles(us, n=5, method="inclusive") if len(us) > 1 else us * 4
    return Timing(statistics.median(us), q[0], q[3], len(us))


def _warm_up(launch: Callable[[], object], calls: int, flush: torch.Tensor, device) -> None:
    """At least ``calls`` calls and ``WARMUP_S`` seconds of flush + call, then a sync."""
    t0, n = time.perf_counter(), 0
    while n < calls or time.perf_counter() - t0 < WARMUP_S:
        flush.zero_()
        launch()
        n += 1
        if n % 16 == 0:  # keep the queue short: the loop's wall time is the GPU's busy time
            torch.cuda.synchronize(device)
    torch.cuda.synchronize(device)


def _timed_reps(launch: Callable[[], object], reps: int, flush: torch.Tensor,
                device) -> Timing:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        flush.zero_()  # evict the L2: the next call reads its bytes from HBM
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize(device)
    return _summarize([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


def time_cold(fn: Callable[[], object], *, reps: int = 100, warmup: int = 10,
              device: torch.device | str | None = None) -> Timing:
    """Time ``fn()`` eagerly (launch overhead included) on cold L2; returns :class:`Timing`."""
    device = torch.device("cuda") if device is None else torch.device(device)
    flush = _flush_buffer(device)
    _warm_up(fn, warmup, flush, device)
    return _timed_reps(fn, reps, flush, device)


def capture_graph(fn: Callable[[], T], *, warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture one call of ``fn`` into a CUDA graph (after ``warmup`` calls on a side stream,
    as capture requires; they compile the kernels). Returns the graph and what the captured
    call returned (its tensors are the graph's outputs, rewritten by every replay). ``fn``
    must not sync with the host (``validate=None`` on CUDA)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def time_graph(fn: Callable[[], object], *, reps: int = 100, warmup: int = 10,
               device: torch.device | str | None = None) -> Timing:
    """Capture ``fn`` once, then time ``graph.replay()`` on cold L2. The flush runs between
    replays, outside the graph and outside the events around each replay."""
    device = torch.device("cuda") if device is None else torch.device(device)
    graph, _ = capture_graph(fn)
    flush = _flush_buffer(device)
    _warm_up(graph.replay, warmup, flush, device)
    try:
        return _timed_reps(graph.replay, reps, flush, device)
    finally:
        del graph


def host_us(fn: Callable[[], object], *, calls: int = 50, warmup: int = 5) -> float:
    """Mean host microseconds per eager call of ``fn`` (see the module docstring); CUDA only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


#: (chunk, block, num_warps) tried by the roofline; the fastest counts (a roofline must not
#: under-read the card because one tile shape suits it poorly)
READ_CONFIGS: tuple[tuple[int, int, int], ...] = (
    (65536, 4096, 4), (131072, 8192, 8), (262144, 8192, 8), (32768, 2048, 4),
)


def stream_read(x: torch.Tensor, partial: torch.Tensor | None = None, *, chunk: int = 65536,
                block: int = 4096, num_warps: int = 4) -> torch.Tensor:
    """Launch the streaming read (:mod:`pagedattn.kernels.readbw`) over contiguous ``x`` (any
    float dtype); returns the ``[ceil(numel / chunk)]`` float32 partial sums (their total is
    ``x.sum()``)."""
    from pagedattn.kernels.readbw import _stream_read_kernel  # lazy: Triton

    n = x.numel()
    num_programs = -(-n // chunk)
    if partial is None:
        partial = torch.empty(num_programs, dtype=torch.float32, device=x.device)
    _stream_read_kernel[(num_programs,)](x, partial, n, CHUNK=chunk, BLOCK=block,
                                         num_warps=num_warps)
    return partial


def measure_read_bandwidth(device: torch.device | str | None = None, *, nbytes: int = 2**31,
                           reps: int = 30, warmup: int = 5) -> float:
    """Read roofline in GB/s (1e9 bytes/s): a streaming-read Triton kernel summing ``nbytes``
    (default 2 GiB) of bf16, timed like the decode calls (median, cold L2), the fastest of its
    tile shapes (:data:`READ_CONFIGS`). Measure it in the same run as the kernels it is
    compared with (``API.md``)."""
    device = torch.device("cuda") if device is None else torch.device(device)
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    best = 0.0
    for chunk, block, warps in READ_CONFIGS:
        partial = stream_read(x, chunk=chunk, block=block, num_warps=warps)  # compile first
        if partial.double().sum().item() != x.numel():  # every element must have been read
            raise RuntimeError("measure_read_bandwidth: the streaming read missed elements")

        def call(p=partial, c=chunk, bl=block, w=warps) -> torch.Tensor:
            return stream_read(x, p, chunk=c, block=bl, num_warps=w)

        timing = time_cold(call, reps=reps, warmup=warmup, device=device)
        best = max(best, gb_per_s(nbytes, timing.median_us))
    return best


def gb_per_s(nbytes: int, time_us: float | None) -> float | None:
    """``nbytes`` moved in ``time_us`` microseconds, in GB/s (1e9 bytes per second); ``None``
    when nothing was timed. The one GB/s formula of the bench package."""
    return nbytes / (time_us * 1e-6) / 1e9 if time_us else None


def pct_of(value: float | None, roofline: float | None) -> float | None:
    """``value`` as a percentage of ``roofline`` (``None`` when either is unknown)."""
    return 100.0 * value / roofline if value is not None and roofline else None
