"""Cold-L2 timing of CUDA work (eager and CUDA-graph replays), host time per call, the read
rate and the size-matched limit, and the one GB/s formula every report uses.

Every repetition first flushes the L2 with a buffer of at least twice its size (the H200's L2
is 60 MB; the size is read from the device when torch exposes it, and the buffer is at least
``MIN_FLUSH_BYTES``), then times the call alone with a pair of CUDA events. Two flushes
(:func:`flush_plan`):

* ``"clean"`` (the default, used for every % figure): a streaming read of the buffer into a
  sink of one float32 per chunk (:func:`stream_read`). The L2 is left holding clean lines,
  which the timed call evicts for free.
* ``"dirty"``: ``buffer.zero_()``, as ``triton.testing.do_bench`` does. The L2 is left full
  of dirty lines, and the timed call pays their write-back to DRAM out of its own time: on
  an H200 about 8 µs, which is most of what separates a 134 MB contiguous read timed this
  way (43.6 µs) from the same read after the clean flush (35.9 µs). Kept for continuity with
  the runs timed before the clean flush (every run up to commit 5dd1f26).

Results are in microseconds: the median and the 20th/80th percentiles over the repetitions,
after a warm-up that keeps the
GPU busy for at least ``WARMUP_S`` of wall time (flush + call back to back): an idle H200 sits
at ~400 MHz and needs tens of milliseconds of load to reach its boost clock, and a warm-up of
ten calls of a short kernel left the first timed calls of small shapes at the idle clock
(eager medians of small shapes far above their graph medians in the same run). The host
never syncs between repetitions (one sync at the end), so Python launch overhead overlaps the
flush, as in ``triton.testing.do_bench``.

The read rate (:func:`measure_read_bandwidth`, 2 GiB) and the size-matched limit
(:func:`time_read` of a row's minimal bytes) time the same streaming read over a buffer of
exactly the bytes asked for (:func:`read_buffer`), the fastest of its tile shapes
(:func:`read_configs`). A clean contiguous read of 67 / 134 / 268 / 335 MB reaches only 75 /
86 / 92 / 94 % of the 2 GiB rate on an H200 (launch, ramp and tail are a larger share of a
short read), so a row is compared with the read of its own size.

Host time (:func:`host_us`) is the submission cost of one eager call: ``calls`` back-to-back
calls with no sync between them, after a warm-up and a sync, divided by ``calls``. ``calls``
stays far below CUDA's launch queue (about a thousand launches), so the host never waits for
the GPU and the figure is Python + launch overhead, not kernel time. Under the CPU interpreter a
call runs the kernel itself, so host time is not measured there (reports say n/a).

CUDA only, but for the flushes and the streaming read themselves (they run on any tensor the
kernels can run on): timing never happens in pytest, and interpreter times are not
performance.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch

H200_L2_BYTES = 60 * 2**20
MIN_FLUSH_BYTES = 256 * 2**20
#: the L2 flushes (see the module docstring); the first is the default
FLUSHES = ("clean", "dirty")
FLUSH_CHUNK = 65536  # bf16 elements a program of the clean flush reads (one float32 each)
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


class FlushPlan(NamedTuple):
    """What one flush does: ``op`` ``"read"`` (the buffer is read, never written) or
    ``"write"`` (the buffer is zeroed), over a buffer of ``nbytes`` bytes."""

    mode: str  # "clean" or "dirty"
    op: str
    nbytes: int


def flush_plan(mode: str = "clean", l2_bytes: int = H200_L2_BYTES, *,
               min_bytes: int = MIN_FLUSH_BYTES) -> FlushPlan:
    """The flush of ``mode`` for an L2 of ``l2_bytes``: a buffer of ``max(2 * l2_bytes,
    min_bytes)`` bytes rounded up to 4, read (``"clean"``) or zeroed (``"dirty"``). Raises
    ValueError for another mode."""
    if mode not in FLUSHES:
        raise ValueError(f"flush: expected one of {', '.join(FLUSHES)}, got {mode!r}")
    nbytes = -(-max(2 * l2_bytes, min_bytes) // 4) * 4
    return FlushPlan(mode, "read" if mode == "clean" else "write", nbytes)


class Flush:
    """A :class:`FlushPlan`'s buffers on a device; calling it flushes once (no host sync).

    ``buffer``: ``[nbytes / 2]`` bfloat16 ones (clean: read into ``sink``, ``[ceil(numel /
    FLUSH_CHUNK)]`` float32 partial sums, 8 KB for 256 MB) or ``[nbytes / 4]`` int32 (dirty:
    zeroed, no sink)."""

    def __init__(self, plan: FlushPlan, device) -> None:
        self.plan = plan
        self.sink: torch.Tensor | None = None
        if plan.op == "read":
            self.buffer = torch.ones(plan.nbytes // 2, dtype=torch.bfloat16, device=device)
            self.sink = torch.empty(-(-self.buffer.numel() // FLUSH_CHUNK), dtype=torch.float32,
                                    device=device)
        else:
            self.buffer = torch.empty(plan.nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        if self.sink is None:
            self.buffer.zero_()
        else:
            stream_read(self.buffer, self.sink, chunk=FLUSH_CHUNK)


def make_flush(mode: str = "clean", device: torch.device | str | None = None, *,
               l2_bytes: int | None = None, min_bytes: int = MIN_FLUSH_BYTES) -> Flush:
    """The :class:`Flush` of ``mode`` on ``device`` (the device's L2 unless ``l2_bytes``)."""
    device = torch.device("cuda") if device is None else torch.device(device)
    l2 = l2_cache_bytes(device) if l2_bytes is None else l2_bytes
    return Flush(flush_plan(mode, l2, min_bytes=min_bytes), device)


def _summarize(times_ms: list[float]) -> Timing:
    us = sorted(t * 1e3 for t in times_ms)
    q = statistics.quantiles(us, n=5, method="inclusive") if len(us) > 1 else us * 4
    return Timing(statistics.median(us), q[0], q[3], len(us))


def _warm_up(launch: Callable[[], object], calls: int, flush: Flush, device) -> None:
    """At least ``calls`` calls and ``WARMUP_S`` seconds of flush + call, then a sync."""
    t0, n = time.perf_counter(), 0
    while n < calls or time.perf_counter() - t0 < WARMUP_S:
        flush()
        launch()
        n += 1
        if n % 16 == 0:  # keep the queue short: the loop's wall time is the GPU's busy time
            torch.cuda.synchronize(device)
    torch.cuda.synchronize(device)


def _timed_reps(launch: Callable[[], object], reps: int, flush: Flush, device) -> Timing:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        flush()  # evict the L2: the next call reads its bytes from HBM
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize(device)
    return _summarize([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


def time_cold(fn: Callable[[], object], *, reps: int = 100, warmup: int = 10,
              device: torch.device | str | None = None, flush: str = "clean") -> Timing:
    """Time ``fn()`` eagerly (launch overhead included) on cold L2, after the ``flush``
    (``"clean"`` or ``"dirty"``, :func:`flush_plan`); returns :class:`Timing`."""
    device = torch.device("cuda") if device is None else torch.device(device)
    flusher = make_flush(flush, device)
    _warm_up(fn, warmup, flusher, device)
    return _timed_reps(fn, reps, flusher, device)


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
               device: torch.device | str | None = None, flush: str = "clean") -> Timing:
    """Capture ``fn`` once, then time ``graph.replay()`` on cold L2. The ``flush`` runs
    between replays, outside the graph and outside the events around each replay."""
    device = torch.device("cuda") if device is None else torch.device(device)
    graph, _ = capture_graph(fn)
    flusher = make_flush(flush, device)
    _warm_up(graph.replay, warmup, flusher, device)
    try:
        return _timed_reps(graph.replay, reps, flusher, device)
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


#: (chunk, block, num_warps) tried by every streaming read; the fastest counts (a roofline
#: must not under-read the card because one tile shape suits it poorly)
READ_CONFIGS: tuple[tuple[int, int, int], ...] = (
    (65536, 4096, 4), (131072, 8192, 8), (262144, 8192, 8), (32768, 2048, 4),
)
#: programs per SM of the size-fitted configs of :func:`read_configs`
READ_PROGRAMS_PER_SM = (2, 4, 8)


def read_configs(numel: int, num_sms: int) -> list[tuple[int, int, int]]:
    """The tile shapes a streaming read of ``numel`` elements tries: :data:`READ_CONFIGS`,
    and for each of :data:`READ_PROGRAMS_PER_SM` a chunk (a power of two, at least the
    block, so that few chunks compile) that cuts the buffer into about that many programs
    per SM (a short read in 64 K-element chunks would leave most SMs idle)."""
    configs = list(READ_CONFIGS)
    for per_sm in READ_PROGRAMS_PER_SM:
        want = -(-max(numel, 1) // (num_sms * per_sm))
        for block, warps in ((2048, 4), (4096, 8)):
            chunk = max(block, 1 << (want - 1).bit_length())
            if (chunk, block, warps) not in configs:
                configs.append((chunk, block, warps))
    return configs


def stream_read(x: torch.Tensor, partial: torch.Tensor | None = None, *, chunk: int = 65536,
                block: int = 4096, num_warps: int = 4) -> torch.Tensor:
    """Launch the streaming read (:mod:`pagedattn.kernels.readbw`) over contiguous ``x`` (any
    dtype, read as float32); returns the ``[ceil(numel / chunk)]`` float32 partial sums
    (their total is ``x.sum()``). ``x`` is only read."""
    from pagedattn.kernels.readbw import _stream_read_kernel  # lazy: Triton

    n = x.numel()
    num_programs = -(-n // chunk)
    if partial is None:
        partial = torch.empty(num_programs, dtype=torch.float32, device=x.device)
    _stream_read_kernel[(num_programs,)](x, partial, n, CHUNK=chunk, BLOCK=block,
                                         num_warps=num_warps)
    return partial


def read_buffer(nbytes: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A contiguous buffer of exactly ``nbytes`` bytes holding ones: ``[nbytes / 2]`` bfloat16
    when ``nbytes`` is even, else ``[nbytes]`` uint8 (a view of one ``nbytes``-byte storage).
    Raises ValueError for ``nbytes < 1``."""
    if nbytes < 1:
        raise ValueError(f"nbytes: expected >= 1, got {nbytes}")
    storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
    x = storage.view(torch.bfloat16) if nbytes % 2 == 0 else storage
    return x.fill_(1)


def time_read(nbytes: int, device: torch.device | str | None = None, *, reps: int = 30,
              warmup: int = 5, flush: str = "clean") -> Timing:
    """The fastest streaming read of exactly ``nbytes`` contiguous bytes
    (:func:`read_buffer`), timed like the decode calls (:func:`time_cold`, cold L2 after
    ``flush``): the :class:`Timing` of the tile shape (:func:`read_configs`) with the lowest
    median. A row's size-matched limit is this read of its minimal bytes. CUDA only; raises
    RuntimeError if the read missed an element."""
    from pagedattn._env import num_sms

    device = torch.device("cuda") if device is None else torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    x = read_buffer(nbytes, device)
    timings = []
    for chunk, block, warps in read_configs(x.numel(), num_sms(index)):
        partial = stream_read(x, chunk=chunk, block=block, num_warps=warps)  # compile first
        if partial.double().sum().item() != x.numel():  # every element must have been read
            raise RuntimeError("time_read: the streaming read missed elements")

        def call(p=partial, c=chunk, bl=block, w=warps) -> torch.Tensor:
            return stream_read(x, p, chunk=c, block=bl, num_warps=w)

        timings.append(time_cold(call, reps=reps, warmup=warmup, device=device, flush=flush))
    return min(timings, key=lambda t: t.median_us)


def measure_read_bandwidth(device: torch.device | str | None = None, *, nbytes: int = 2**31,
                           reps: int = 30, warmup: int = 5, flush: str = "clean") -> float:
    """The read rate in GB/s (1e9 bytes/s): :func:`time_read` of ``nbytes`` (default 2 GiB),
    the fastest of its tile shapes, after the ``flush``. Measure it in the same run as the
    kernels it is compared with."""
    timing = time_read(nbytes, device, reps=reps, warmup=warmup, flush=flush)
    return gb_per_s(nbytes, timing.median_us) or 0.0  # a median is never 0


def gb_per_s(nbytes: int, time_us: float | None) -> float | None:
    """``nbytes`` moved in ``time_us`` microseconds, in GB/s (1e9 bytes per second); ``None``
    when nothing was timed. The one GB/s formula of the bench package."""
    return nbytes / (time_us * 1e-6) / 1e9 if time_us else None


def pct_of(value: float | None, roofline: float | None) -> float | None:
    """``value`` as a percentage of ``roofline`` (``None`` when either is unknown)."""
    return 100.0 * value / roofline if value is not None and roofline else None
