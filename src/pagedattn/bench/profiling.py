"""Profile impls on one shape: Nsight Compute when it works, the labelled fallback otherwise.

:func:`profile_impls` is the machinery behind ``pagedattn profile`` and ``pagedattn ladder``.

- **ncu** (a GPU and ``ncu`` found): one ncu process per impl profiles a child Python process
  (:mod:`pagedattn.bench.profile_target`) that builds the batch, warms the impl up (Triton
  compiles) outside the profiled range, then runs it ``repeat`` times between
  cudaProfilerStart/Stop. Every kernel launched in that range is profiled, the split-KV merge
  included. The ``.ncu-rep`` and its raw and details CSV exports stay in ``out_dir``.
- **fallback** (no ncu, or ncu failed or was refused the counters for that impl): Triton's
  compile metadata of each kernel the impl launched (registers, spills, shared memory,
  num_warps, num_stages; from ``pagedattn.launch.LAST_COMPILED``), plus cold-L2 CUDA-event
  timing on a GPU. On the CPU interpreter nothing is timed (times there are not performance)
  and the interpreter gives no compile metadata: those values stay ``None`` ("n/a"). No hardware
  counter is ever estimated.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedattn.api import paged_decode
from pagedattn.bench import ncu
from pagedattn.bench.ncu import METRIC_KEYS, KernelCounters
from pagedattn.bench.report import compile_metadata, last_compiled
from pagedattn.bench.shapes import BenchShape, ModelShape, build_batch, get_shape

SOURCE_NCU = "ncu"
SOURCE_EVENTS = "fallback: CUDA events + Triton compile metadata (no hardware counters)"
SOURCE_INTERPRETER = ("fallback: Triton interpreter on the CPU, nothing timed "
                      "(times there are not performance); compile metadata only")
#: per-kernel keys beyond ncu's METRICS, from Triton's compile metadata
META_KEYS = ("spills", "num_warps", "num_stages")
#: our key -> the key of :func:`pagedattn.bench.report.compile_metadata` (Triton's shared
#: memory is all dynamic)
_META_FIELDS = {"regs": "n_regs", "spills": "n_spills", "smem_dynamic": "shared_bytes",
                "num_warps": "num_warps", "num_stages": "num_stages"}
WARP_SIZE = 32


def shrink(shape: BenchShape, *, max_batch: int = 2, max_kv_heads: int = 1,
           max_context: int = 17) -> BenchShape:
    """A CPU-interpreter-sized copy of ``shape`` named ``<name>-small``: the same group size,
    head_dim, page_size and dtypes; at most ``max_batch`` sequences and ``max_kv_heads`` kv
    heads; contexts scaled so the longest is ``max_context`` tokens (by default one page plus
    one token: a page boundary; ragged stays ragged; 0 stays 0)."""
    m = shape.model
    lens = list(shape.context_lens[:max_batch]) or [1]
    top = max(max(lens), 1)
    lens = [max(1, math.ceil(n * max_context / top)) if n else 0 for n in lens]
    kv = min(m.num_kv_heads, max_kv_heads)
    model = ModelShape(f"{m.name}-small", m.num_q_heads // m.num_kv_heads * kv, kv,
                       m.head_dim, m.dtype)
    return BenchShape(f"{shape.name}-small", model, tuple(lens), shape.dtype,
                      shape.cache_dtype, shape.page_size, shape.k_scale, shape.v_scale)


def resolve_shape(name: str, small: bool = False) -> BenchShape:
    """A registered shape (:mod:`pagedattn.bench.shapes`), shrunk with ``small``."""
    shape = get_shape(name)
    return shrink(shape) if small else shape


def decode_call(impl: str, shape: BenchShape, device, num_splits: int | None = None):
    """A no-argument callable: one decode step of ``impl`` on a fresh batch, into a fixed out."""
    batch = build_batch(shape, device)
    out = torch.empty_like(batch.query)
    return lambda: paged_decode(*batch.tensors, impl=impl, num_splits=num_splits, out=out,
                                **batch.scales)


def _as_counters(key: str, handle: object) -> KernelCounters:
    """Triton's compile metadata of one launched kernel as table values (None when absent)."""
    md = compile_metadata(handle)
    values: dict[str, float | None] = {k: None for k in (*METRIC_KEYS, *META_KEYS)}
    for ours, theirs in _META_FIELDS.items():
        v = md.get(theirs)
        values[ours] = float(v) if isinstance(v, (int, float)) else None
    if values["num_warps"] is not None:  # Triton launches num_warps * 32 threads per block
        values["block"] = values["num_warps"] * WARP_SIZE
    return KernelCounters(str(md.get("name") or key), values)


def run_and_collect(call) -> list[KernelCounters]:
    """Run ``call`` once; the compile metadata of the kernels it launched. ``LAST_COMPILED``
    is cleared first, so only this call's kernels are attributed to it."""
    handles = last_compiled()
    handles.clear()
    call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [_as_counters(k, h) for k, h in handles.items()]


@dataclass
class ImplProfile:
    """The profile of one impl on one shape."""

    impl: str
    shape: str
    source: str  # SOURCE_NCU, SOURCE_EVENTS or SOURCE_INTERPRETER
    kernels: list[KernelCounters] = field(default_factory=list)
    total_us: float | None = None  # one call: sum of kernel durations (ncu) or event median
    minimal_bytes: int = 0
    note: str = ""  # e.g. why ncu was not used
    files: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float | None:
        """Achieved bandwidth over the minimal bytes, in GB/s (1e9 bytes/s), if timed."""
        return self.minimal_bytes / (self.total_us * 1e3) if self.total_us else None

    @property
    def is_ncu(self) -> bool:
        return self.source == SOURCE_NCU

    @property
    def main_kernel(self) -> KernelCounters | None:
        """The longest kernel (the first one when durations are unknown): an impl's call may
        also launch small helpers (a merge, a torch fill), which ncu profiles too."""
        if not self.kernels:
            return None
        return max(self.kernels, key=lambda k: k.values.get("duration_us") or 0.0)


def _child_env() -> dict[str, str]:
    """The child's environment, with this ``pagedattn`` importable (its ``src`` first)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def target_command(impl: str, shape_name: str, small: bool, *, warmup: int = 3,
                   repeat: int = 1, meta_out: Path | None = None) -> list[str]:
    """The child command that ncu profiles (see :mod:`pagedattn.bench.profile_target`)."""
    cmd = [sys.executable, "-m", "pagedattn.bench.profile_target", "--impl", impl,
           "--shape", shape_name, "--warmup", str(warmup), "--repeat", str(repeat)]
    return cmd + (["--small"] if small else []) + (["--meta-out", str(meta_out)] if meta_out
                                                   else [])


def profile_with_ncu(ncu_path: str, impl: str, shape_name: str, out_dir: Path, *,
                     small: bool = False, warmup: int = 3, repeat: int = 1,
                     timeout: float = 600.0) -> ImplProfile:
    """One ncu process for ``impl`` on a registered shape; raises :class:`ncu.NcuError`."""
    shape = resolve_shape(shape_name, small)
    paths = {ext: out_dir / f"{shape.name}_{impl}{ext}"
             for ext in (".ncu-rep", ".raw.csv", ".details.csv", ".meta.json")}
    target = target_command(impl, shape_name, small, warmup=warmup, repeat=repeat,
                            meta_out=paths[".meta.json"])
    raw, details = ncu.run_profile(ncu_path, paths[".ncu-rep"], target, timeout=timeout,
                                   env=_child_env())
    paths[".raw.csv"].write_text(raw, encoding="utf-8")
    paths[".details.csv"].write_text(details, encoding="utf-8")
    kernels = ncu.parse_ncu_exports(raw, details)
    if not kernels or any(k.values.get("duration_us") is None for k in kernels):
        raise ncu.NcuError(f"{paths['.ncu-rep']} lacks a kernel duration (counters refused?)")
    meta = paths[".meta.json"]
    by_name = {m["name"]: m["values"] for m in json.loads(meta.read_text())} \
        if meta.exists() else {}
    for k in kernels:  # Triton's spills/num_warps/num_stages, which ncu does not report
        for key in META_KEYS:
            k.values.setdefault(key, by_name.get(k.name, {}).get(key))
    total = sum(k.values["duration_us"] or 0.0 for k in kernels)  # each checked above
    files = [str(paths[ext]) for ext in (".ncu-rep", ".raw.csv", ".details.csv")]
    return ImplProfile(impl, shape.name, SOURCE_NCU, kernels, total, shape.minimal_bytes,
                       files=files)


def profile_fallback(impl: str, shape: BenchShape, note: str = "") -> ImplProfile:
    """Compile metadata of the kernels ``impl`` launches; cold-L2 event time on a GPU only."""
    on_gpu = torch.cuda.is_available()
    call = decode_call(impl, shape, "cuda" if on_gpu else "cpu")
    kernels = run_and_collect(call)  # the first call also compiles
    total = None
    if on_gpu:
        from pagedattn.bench.timing import time_cold

        total = time_cold(call, reps=30, warmup=3).median_us
    source = SOURCE_EVENTS if on_gpu else SOURCE_INTERPRETER
    return ImplProfile(impl, shape.name, source, kernels, total, shape.minimal_bytes, note=note)


def profile_impls(impls: list[str], shape_name: str, out_dir: str | os.PathLike, *,
                  small: bool = False, use_ncu: bool = True, warmup: int = 3, repeat: int = 1,
                  log=print) -> list[ImplProfile]:
    """Profile each impl on a registered shape (shrunk with ``small``): ncu when found and
    ``use_ncu``; otherwise, or when ncu fails for an impl, the fallback, with the reason in
    ``note``. Reports and CSV exports go to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    ncu_path = ncu.find_ncu() if use_ncu and on_gpu else None
    why = ("ncu not requested (--no-ncu)" if not use_ncu else "no CUDA GPU" if not on_gpu
           else "ncu not found" if ncu_path is None else "")
    shape = resolve_shape(shape_name, small)
    results = []
    for impl in impls:
        note = why
        if ncu_path is not None:
            log(f"[profile] ncu: {impl} on {shape.name}")
            try:
                results.append(profile_with_ncu(ncu_path, impl, shape_name, out, small=small,
                                                warmup=warmup, repeat=repeat))
                continue
            except ncu.NcuError as exc:
                note = f"ncu failed: {exc}"
                log(f"[profile] {note}; falling back for {impl}")
        log(f"[profile] fallback: {impl} on {shape.name}")
        results.append(profile_fallback(impl, shape, note=note))
    return results
