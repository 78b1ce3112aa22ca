"""The version seam: every use of Triton's private API in pagedattn, in this one module.

The kernels use Triton's public language only. The host path reaches under Triton where
Triton's own ``kernel[grid](**kwargs)`` costs host time (a recorded launch) or where a tool
needs what Triton keeps to itself. Each private path is named below with the Triton versions
whose source it was read from, and each has a fallback that public API (or doing without)
provides; a version outside :data:`LAUNCH_FORMS` takes every fallback.

=====================  ================================================  ==================
private path           versions read                                     fallback
=====================  ================================================  ==================
launch hooks           ``triton.knobs.runtime.launch_enter_hook`` /      none needed: the
(:func:`launch_hooks`) ``launch_exit_hook``, ``knobs.HookChain`` (3.6-    value is passed on
                       3.9); an empty chain reads as no hook             as Triton holds it
recorded launch        ``CompiledKernel.run(gx, gy, gz, stream,          ``kernel[grid]
(:func:`launch_        function, packed_metadata, launch_metadata,       (**kwargs)``
compiled`)             enter, exit, *args)``, ``args`` every parameter   (:func:`direct_
                       in order, constexprs included (3.6-3.9)           launch_supported`)
C launch               ``CudaLauncher.launch``: 3.6 spreads the          the recorded launch
(:func:`c_launch`)     arguments after the scratch buffers               through
                       (``"spread"``); 3.7-3.9 take the metadata and     ``CompiledKernel.
                       hooks first, then the launcher's                  run``
                       ``arg_annotations``, ``kernel_signature`` and the
                       arguments as one tuple (``"packed"``)
current stream         ``triton.runtime.driver.active.                   (same call: the
(:func:`current_       get_current_stream`` (3.6-3.9)                    tutorials' API)
stream`)
interpreter            ``triton.runtime.interpreter._patch_lang`` and    unpatched (slower
(:func:`patch_         ``_LangPatchScope`` (3.6-3.9): the language is    CPU tests)
interpreter_lang`)     patched once per launch, not per helper call
ptxas, nvdisasm        ``triton.backends.nvidia.compiler.get_ptxas``,    ``TRITON_PTXAS_
(:func:`ptxas`,        ``triton.knobs.nvidia.nvdisasm`` (3.6-3.9: 3.9    PATH``, then the
:func:`nvdisasm`)      assembles sm_90 with ``ptxas-blackwell``): what   system's
                       Triton itself runs
interpreter int32      ``interpreter.InterpreterBuilder.binary_op``,     ``NotImplementedError``
(:func:`gpu_int32`)    ``ReduceOps.sum``, ``ScanOps.cumsum``,            (the tests that need
                       ``TensorHandle`` (3.6-3.9)                        it say so)
env as Triton reads    ``triton._C.libtriton.getenv_bool`` (3.6-3.9)     none (a test oracle)
sm_90 compile          ``triton.compile(ASTSource(...), target=          none (scripts/
(:func:`compile_for`)  GPUTarget("cuda", 90, 32))`` and Triton's         compile_sm90.py)
                       specialization rules (3.6-3.9)
=====================  ================================================  ==================

The last section, a CUDA launch without a GPU (:func:`cpu_driver`,
:func:`recording_launcher`, :func:`recording_compiles`), lets the CPU tests and
``scripts/compile_sm90.py --bindings`` check that the recorded launch hands Triton's C
launch what ``kernel[grid](**kwargs)`` hands it, on whichever Triton is installed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import triton

from pagedattn._env import is_interpreter


def _minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string (``"3.9.0"``, ``"3.7.1+git..."``)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


#: the installed Triton's ``(major, minor)``
VERSION = _minor(triton.__version__)

#: the form of ``CudaLauncher``'s C launch in each Triton whose launch path was read (see the
#: module docstring); the recorded launch is on for these versions only
LAUNCH_FORMS = {(3, 6): "spread", (3, 7): "packed", (3, 8): "packed", (3, 9): "packed"}

#: launch options fixed for every launch of the production kernels (a binding's part, so the
#: recorded launch fixes them too): FMA contraction on, Triton 3.6's default and the one
#: measured; Triton 3.10 turns the default off (3.9 warns when it is left unset)
KERNEL_OPTIONS = {"enable_fp_fusion": True}


def direct_launch_supported() -> bool:
    """Whether a recorded launch may call ``CompiledKernel.run`` with the argument list it
    recorded (:func:`launch_compiled`): on the Tritons of :data:`LAUNCH_FORMS`, never under
    the interpreter. Elsewhere every launch binds through ``kernel[grid](**kwargs)``."""
    return VERSION in LAUNCH_FORMS and not is_interpreter()


# --- launching ----------------------------------------------------------------------------

def launch_hooks() -> tuple:
    """Triton's launch hooks (profilers), ``None`` for a chain with no hook: Triton's hooks
    are ``HookChain`` objects, never ``None``, so without this every launch would build launch
    metadata and make two calls into empty chains."""
    from triton import knobs

    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    chain = getattr(knobs, "HookChain", None)
    if chain is not None and type(enter) is chain and not enter.calls:
        enter = None
    if chain is not None and type(leave) is chain and not leave.calls:
        leave = None
    return enter, leave


def current_stream(device_index: int) -> int:
    """The current CUDA stream of a device, as Triton's launch path reads it."""
    from triton.runtime import driver

    return driver.active.get_current_stream(device_index)


def launch_compiled(compiled, grid: tuple[int, int, int], stream: int, args: list,
                    enter, leave) -> None:
    """What ``kernel[grid](...)`` ends with (``CompiledKernel.__getitem__``'s runner, without
    building a closure per call): ``args`` are every parameter of the kernel in order;
    ``enter``/``leave`` are Triton's launch hooks (:func:`launch_hooks`), honoured as Triton
    does."""
    metadata = (compiled.launch_metadata(grid, stream, *args)
                if enter is not None or leave is not None else None)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 leave, *args)


def c_launch(compiled) -> tuple | None:
    """``(form, launch, function, cooperative, pdl, packed_metadata, annotations,
    signature)``: the C launch of ``compiled`` and what ``CudaLauncher.__call__`` passes it
    besides the grid, the stream, the hooks and the arguments, for a kernel that needs no
    scratch memory (then that call only allocates nothing and repacks the arguments); ``None``
    otherwise (scratch, a sanitizer's launcher, an unread Triton), and the launch goes
    through ``compiled.run`` (:func:`launch_compiled`)."""
    run = compiled.run
    form = LAUNCH_FORMS.get(VERSION)
    scratch = getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
    if (form is None or type(run).__name__ != "CudaLauncher" or scratch
            or getattr(run, "gsan_enabled", False)):
        return None
    if form == "packed":
        if not (hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature")):
            return None
        return (form, run.launch, compiled.function, run.launch_cooperative_grid,
                run.launch_pdl, compiled.packed_metadata, run.arg_annotations,
                run.kernel_signature)
    return (form, run.launch, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
            compiled.packed_metadata, None, None)


def launch_c(c: tuple, grid: tuple[int, int, int], stream: int, args: list) -> None:
    """Launch through ``c`` (:func:`c_launch`) with no hook: the call ``CudaLauncher.__call__``
    makes (no scratch, no launch metadata)."""
    form, launch, function, cooperative, pdl, packed, annotations, signature = c
    if form == "packed":
        launch(grid[0], grid[1], grid[2], stream, function, cooperative, pdl, packed, None,
               None, None, None, None, annotations, signature, tuple(args))
    else:
        launch(grid[0], grid[1], grid[2], stream, function, cooperative, pdl, None, None,
               packed, None, None, None, *args)


def launch_recorded(compiled, c: tuple | None, grid: tuple[int, int, int], stream: int,
                    args: list, enter, leave) -> None:
    """A recorded launch: Triton's C launch itself (:func:`launch_c`) when ``c`` holds it and
    no hook is set, else :func:`launch_compiled`."""
    if c is None or enter is not None or leave is not None:
        launch_compiled(compiled, grid, stream, args, enter, leave)
    else:
        launch_c(c, grid, stream, args)


# --- the interpreter ----------------------------------------------------------------------

def patch_interpreter_lang() -> bool:
    """Make Triton's interpreter patch ``triton.language`` once per launch; returns whether it
    did (Triton 3.6-3.9, whose interpreter this was read from; any other runs unpatched).

    The interpreter patches the language at the start of a launch (its ``GridExecutor``,
    restored when the launch ends) and again at every call of a nested ``@triton.jit``
    helper (``InterpretedFunction.__call__``), although the launch's patch is still in
    place then: an ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and ``tl.math`` per
    helper call, about a third of an interpreted decode call (cProfile of ``gqa_reuse_v3``
    at batch 4). The production kernel is a chain of named helpers, so every CPU test paid
    it. Here a helper's call inside a launch skips the repeat (it would set the same
    attributes to equivalent wrappers, and its scope is never restored); the launch's own
    patch and restore are Triton's; a helper from a module the launch did not patch
    (``triton.language.standard`` sees ``tl.core`` only) is patched as Triton does, once
    per launch. Call it once, before the first launch (``tests/conftest.py``)."""
    from triton.runtime import interpreter

    if VERSION not in LAUNCH_FORMS or not hasattr(interpreter, "_patch_lang") or not hasattr(
            interpreter, "_LangPatchScope") or getattr(interpreter._patch_lang,
                                                       "_pagedattn", False):
        return False
    import inspect

    import triton.language as tl

    real = interpreter._patch_lang
    active: list[tuple] = []  # per open launch: its scope and the modules it patched

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values()
                 if inspect.ismodule(v) and v in (tl, tl.core)}
        if active and langs <= active[-1][1]:  # a helper whose modules the launch patched
            return interpreter._LangPatchScope()
        scope = real(fn)
        if active:  # a helper of another module (triton.language.standard): patched as
            active[-1][1].update(langs)  # Triton does, never restored (as Triton does)
            return scope
        restore = scope.restore

        def restore_and_close():
            active.pop()
            restore()

        scope.restore = restore_and_close
        active.append((scope, langs))
        return scope

    patch_lang._pagedattn = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    return True


def on_interpreter_launch(callback) -> None:
    """Call ``callback(kernel)`` (the ``@triton.jit`` function) at the start of every launch
    Triton's interpreter runs from now on (a test's launch counter: ``tests/_vllm_test_plugin
    .py``). Wraps the interpreter's ``GridExecutor.__call__``, read in Triton 3.6-3.9."""
    import functools

    from triton.runtime import interpreter

    grid_call = interpreter.GridExecutor.__call__

    @functools.wraps(grid_call)
    def counted(self, *args, **kwargs):
        callback(self.fn)
        return grid_call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = counted


# the interpreter's int32: the tests' GPU arithmetic (tests/kernels/test_numerics.py)
#
# GPU int32 arithmetic in Triton's interpreter, and a record of every overflow.
#
# Triton's interpreter computes in numpy, which is not what a GPU does with 32-bit integers:
# ``tl.sum`` and ``tl.cumsum`` of int32 values accumulate in int64 (numpy's default), and the
# result then fails to convert back (``OverflowError: Python integer ... out of bounds for
# int32``: an interpreter traceback where a GPU silently wraps), while elementwise int32
# ``+ - *`` wrap as a GPU does, without a word. :func:`gpu_int32` patches the interpreter so
# that all of them wrap in two's complement as on a GPU, and records each operation whose exact
# result left int32, with the kernel source line, so a test can assert that none did.


def _kernel_line() -> str:
    """``file:line`` of the innermost frame in ``pagedattn/kernels`` (the kernel's source)."""
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        if "pagedattn/kernels/" in f.f_code.co_filename:
            return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _narrow(wide, what: str, overflows: list):
    import numpy as np

    narrow = wide.astype(np.int32)  # two's complement, as a GPU register holds it
    bad = narrow != wide
    if np.any(bad):
        overflows.append(f"{_kernel_line()}: int32 {what} = {wide[bad].reshape(-1)[0]} wrapped")
    return narrow


@contextlib.contextmanager
def gpu_int32() -> Iterator[list[str]]:
    """GPU int32 arithmetic in Triton's interpreter (tests; Triton 3.6-3.9, else
    ``NotImplementedError``): within the block, the interpreter's int32 ``+ - *``,
    ``tl.sum`` and ``tl.cumsum`` wrap like a GPU's; yields the list of overflows seen
    (``"file:line: ..."`` strings)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    if VERSION not in LAUNCH_FORMS:
        raise NotImplementedError(f"gpu_int32: Triton {triton.__version__}'s interpreter is "
                                  "unread (its int32 ops may have moved)")
    wrapped = {np.add: "+", np.subtract: "-", np.multiply: "*"}
    overflows: list[str] = []
    binary_op = ti.InterpreterBuilder.binary_op
    reduce_sum = ti.ReduceOps.sum
    cumsum = ti.ScanOps.cumsum

    def wrapping_binary_op(self, lhs, rhs, op):
        if op in wrapped and lhs.dtype.scalar == tl.int32 and rhs.dtype.scalar == tl.int32:
            wide = op(lhs.data.astype(np.int64), rhs.data.astype(np.int64))
            return ti.TensorHandle(_narrow(wide, wrapped[op], overflows), lhs.dtype.scalar)
        return binary_op(self, lhs, rhs, op)

    def wrapping_sum(self, input):
        if input.dtype.scalar == tl.int32:
            wide = np.sum(input.handle.data.astype(np.int64), axis=self.axis,
                          keepdims=self.keep_dims)
            return self.to_tensor(_narrow(np.asarray(wide), "sum", overflows), input.dtype)
        return reduce_sum(self, input)

    def wrapping_cumsum(self, input):
        if input.dtype.scalar == tl.int32:
            wide = np.cumsum(input.handle.data.astype(np.int64), axis=self.axis)
            return [self.to_tensor(_narrow(wide, "cumsum", overflows), input.dtype)]
        return cumsum(self, input)

    ti.InterpreterBuilder.binary_op = wrapping_binary_op
    ti.ReduceOps.sum = wrapping_sum
    ti.ScanOps.cumsum = wrapping_cumsum
    try:
        yield overflows
    finally:
        ti.InterpreterBuilder.binary_op = binary_op
        ti.ReduceOps.sum = reduce_sum
        ti.ScanOps.cumsum = cumsum


def triton_reads_true(name: str) -> bool:
    """Whether Triton reads the environment variable ``name`` as true (its own C++
    ``getenv_bool``): the oracle of :func:`pagedattn._env.is_interpreter` in the tests."""
    from triton._C.libtriton import getenv_bool

    return getenv_bool(name, False)


# --- the tools: ptxas, nvdisasm, an sm_90 compile -------------------------------------------

def _tool(env: str, triton_own, system: str) -> Path | None:
    """The tool Triton itself runs (``triton_own()``: its path, honouring Triton's own
    variable for it, or an error where it finds none), else ``$env`` if it names a file, else
    ``system`` on ``PATH`` or in ``$CUDA_HOME/bin`` (``/usr/local/cuda/bin``)."""
    try:
        own = triton_own()
    except (RuntimeError, AttributeError, ImportError, OSError):
        own = None
    if own and Path(own).is_file():
        return Path(own)
    named = os.environ.get(env)
    if named and Path(named).is_file():
        return Path(named)
    found = shutil.which(system) or shutil.which(
        system, path=str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")))
    return Path(found) if found else None


def ptxas(arch: int = 90) -> Path | None:
    """The ``ptxas`` for ``sm_<arch>``: the one the installed Triton assembles with
    (``get_ptxas(arch)``, which reads ``TRITON_PTXAS_PATH``, or on 3.9 for sm_90
    ``TRITON_PTXAS_BLACKWELL_PATH``, before its bundled one: 3.9 writes PTX ``.version 9.4``
    for sm_90, which the bundled ``ptxas`` of CUDA 12.9 refuses, and assembles it with
    ``ptxas-blackwell``), else ``$TRITON_PTXAS_PATH``, else the system's; ``None`` if there
    is none (a Triton stripped of its tools, no CUDA)."""

    def triton_own():
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path

    return _tool("TRITON_PTXAS_PATH", triton_own, "ptxas")


def nvdisasm() -> Path | None:
    """The installed Triton's ``nvdisasm`` (``TRITON_NVDISASM_PATH``, else its bundled one),
    else the system's; ``None`` if there is none."""

    def triton_own():
        from triton import knobs

        return knobs.nvidia.nvdisasm.path

    return _tool("TRITON_NVDISASM_PATH", triton_own, "nvdisasm")


_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32",
          "int64": "i64", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def compile_for(kernel, kwargs: dict, *, arch: int = 90, num_warps: int = 4,
                num_stages: int = 1, maxnreg: int | None = None, **options):
    """Compile ``kernel`` (a ``@triton.jit`` function, interpreter off) for ``sm_<arch>``
    with the arguments ``kernel[grid](**kwargs)`` would bind, without a GPU: Triton's own
    specialization (16-byte aligned pointers and integers divisible by 16 get
    ``tt.divisibility``, an integer equal to 1 becomes a constant and ``None`` a constexpr;
    ``do_not_specialize`` parameters get neither). Returns Triton's ``CompiledKernel``
    (``asm["ptx"]``, ``asm["cubin"]``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    if any(p.name == "num_warps" for p in kernel.params):  # a Gluon kernel's own parameter
        num_warps = kwargs["num_warps"]
    for i, p in enumerate(kernel.params):
        v = kwargs[p.name]
        if p.is_constexpr or v is None:  # Triton makes a None argument a constexpr
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif hasattr(v, "data_ptr"):
            signature[p.name] = "*" + _TYPES[str(v.dtype).removeprefix("torch.")]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, int) and not p.do_not_specialize and v == 1:
            signature[p.name], constexprs[p.name] = "constexpr", 1
        else:
            signature[p.name] = "i32" if isinstance(v, int) else "fp32"
            if isinstance(v, int) and not p.do_not_specialize and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel: its own front end
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(kernel, signature, constexprs, attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       maxnreg=maxnreg, **options))


# --- a CUDA launch without a GPU (tests, scripts) -------------------------------------------

@contextlib.contextmanager
def launch_hook(hook) -> Iterator[None]:
    """Within the block ``hook(metadata)`` is one of Triton's launch-enter hooks (a
    profiler's place)."""
    from triton import knobs

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a HookChain
        chain.add(hook)
        try:
            yield
        finally:
            chain.remove(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
        try:
            yield
        finally:
            knobs.runtime.launch_enter_hook = chain


class _CpuDriver:
    """Stands in for Triton's active CUDA driver on a machine without one: device 0, one
    stream (``stream``), an sm_90 target."""

    def __init__(self, stream: int):
        self.stream = stream

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return self.stream

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_interface(self):
        import torch

        return torch.cuda


@contextlib.contextmanager
def cpu_driver(stream: int = 7) -> Iterator[None]:
    """Within the block Triton's active driver is a stand-in (:class:`_CpuDriver`), so its
    launch path (``CudaLauncher.__call__``, ``JITFunction.run``) runs on a CPU; the driver
    that was active (or none yet) is back after it."""
    from triton.runtime import driver

    previous = driver._active
    driver.set_active(_CpuDriver(stream))
    try:
        yield
    finally:
        driver._active = previous


def _empty_chain(hook) -> bool:
    from triton import knobs

    chain = getattr(knobs, "HookChain", None)
    return hook is None or (chain is not None and type(hook) is chain and not hook.calls)


def recording_launcher(seen: list, *, cooperative: bool = False, pdl: bool = False,
                       global_scratch: int = 0, profile_scratch: int = 0):
    """A real ``CudaLauncher`` of the installed Triton (its ``__call__`` as on a GPU) whose C
    launch appends its arguments to ``seen`` instead of launching. What is recorded is what
    the C launch acts on: a tensor as its address (``data_ptr()``, as the C launch reads
    it), the packed form's argument tuple as a list, an empty ``HookChain`` as ``None`` (the
    C launch calls neither) and, with both hooks ``None``, no launch metadata (only a hook
    reads it)."""
    from triton.backends.nvidia.driver import CudaLauncher

    form = LAUNCH_FORMS.get(VERSION, "packed")
    md, enter = (8, 9) if form == "packed" else (10, 11)

    def normal(a):
        if hasattr(a, "data_ptr"):
            return a.data_ptr()
        return [normal(x) for x in a] if isinstance(a, tuple) else a

    def record(*args):
        call = [normal(a) for a in args]
        for i in (enter, enter + 1):
            call[i] = None if _empty_chain(call[i]) else call[i]
        if call[enter] is None and call[enter + 1] is None:
            call[md] = None
        seen.append(call)

    run = object.__new__(CudaLauncher)
    run.launch = record
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, cooperative, pdl
    run.global_scratch_size, run.profile_scratch_size = global_scratch, profile_scratch
    run.global_scratch_align = run.profile_scratch_align = 1
    if form == "packed":
        run.arg_annotations, run.kernel_signature = ("annotations",), b"signature"
        run.gsan_enabled = False
    return run


class _RecordingCompiled:
    """A compiled kernel whose launch runs :func:`recording_launcher` (no binary)."""

    def __init__(self, name: str, seen: list):
        self.name, self.function, self.packed_metadata = name, 1234, (4, 1, 0)
        self.run = recording_launcher(seen)
        self.asm: dict = {}

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", self.name, tuple(grid), stream)


@contextlib.contextmanager
def recording_compiles(seen: list, stream: int = 7) -> Iterator[None]:
    """Within the block, ``kernel[grid](**kwargs)`` of any ``@triton.jit`` kernel (interpreter
    off) binds and specializes its arguments as Triton does, then, instead of compiling,
    launches a :class:`_RecordingCompiled` whose C launch appends to ``seen``; the driver is
    :func:`cpu_driver`'s."""
    from triton.runtime.jit import JITFunction

    real = JITFunction._do_compile

    def fake_compile(self, key, *args, **kwargs):
        return _RecordingCompiled(getattr(self, "__name__", "kernel"), seen)

    JITFunction._do_compile = fake_compile
    try:
        with cpu_driver(stream):
            yield
    finally:
        JITFunction._do_compile = real
