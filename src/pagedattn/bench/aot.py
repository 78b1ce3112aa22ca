"""Compile metadata for a CUDA target without a GPU: registers, spills, shared memory.

Triton compiles a kernel to PTX and a cubin on any machine (``ptxas`` ships in its wheel); only
loading the cubin needs a GPU. ``compile_for_target`` runs a launcher on CPU tensors with a
stand-in driver that reports the chosen target (default ``sm_90``, the H100/H200) and turns
every launch into a compile-only warm-up; ``resource_usage`` reads registers, spills and
shared memory out of each cubin with the ``cuobjdump`` that ships with Triton.

These are *compiler* figures for the target, not measurements: the profiling fallback labels
them so. Use them where a GPU is absent (``pagedattn profile`` on the CPU) and to check
register pressure of a tile choice before spending device time.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as _driver
from triton.runtime.jit import JITFunction


class _CompileOnlyDriver:
    """Just enough of a Triton driver to compile for ``target`` on a machine without one."""

    def __init__(self, target: GPUTarget):
        self._target = target

    def get_current_target(self) -> GPUTarget:
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(arch: int = 90, warp_size: int = 32) -> Iterator[None]:
    """Within this block, ``kernel[grid](...)`` compiles for ``sm_{arch}`` and launches
    nothing; the call returns the compiled kernel (its ``asm`` holds ``ptx`` and ``cubin``)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_only needs TRITON_INTERPRET unset (the interpreter "
                           "replaces the compiler)")
    previous_run = JITFunction.run
    _driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", arch, warp_size)))

    def run(self, *args, grid, warmup, **kwargs):
        return previous_run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = previous_run
        _driver.reset_active() if _driver._default is not None else setattr(
            _driver, "_active", None)


def resource_usage(compiled) -> dict[str, object]:
    """``{"registers", "spill_stores", "spill_loads", "stack_bytes", "shared_bytes",
    "num_warps", "num_stages"}`` of a compiled kernel, from its cubin (cuobjdump) and
    metadata. Values that cannot be read are None."""
    info: dict[str, object] = {
        "shared_bytes": getattr(compiled.metadata, "shared", None),
        "num_warps": getattr(compiled.metadata, "num_warps", None),
        "num_stages": getattr(compiled.metadata, "num_stages", None),
        "registers": None, "spill_stores": None, "spill_loads": None, "stack_bytes": None,
    }
    ptx = compiled.asm.get("ptx")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptx or not ptxas.exists():
        return info
    arch = re.search(r"\.target\s+(sm_\w+)", ptx)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([str(ptxas), "-v", "--gpu-name", arch.group(1) if arch else "sm_90a",
                               str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True, check=False)
    text = proc.stderr
    patterns = {"registers": r"Used (\d+) registers",
                "spill_stores": r"(\d+) bytes spill stores",
                "spill_loads": r"(\d+) bytes spill loads",
                "stack_bytes": r"(\d+) bytes stack frame"}
    for key, pat in patterns.items():
        m = re.search(pat, text)
        info[key] = int(m.group(1)) if m else None
    return info


def compile_for_target(launch: Callable[[], object], arch: int = 90) -> dict[str, dict]:
    """Run ``launch()`` (a call of a pagedattn launcher on CPU tensors) in compile-only mode
    and return ``{kernel name: resource_usage}`` for every kernel it launched."""
    from pagedattn.launch import LAST_COMPILED

    LAST_COMPILED.clear()
    with compile_only(arch):
        launch()
    return {name: resource_usage(k) for name, k in LAST_COMPILED.items()}
