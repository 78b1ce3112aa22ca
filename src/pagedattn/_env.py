"""Environment predicates, the supported versions and provenance, as functions: nothing here
runs at import time."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import subprocess
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

#: the lowest torch and triton that pagedattn's tests have passed on (README's support table;
#: pyproject.toml's bounds): torch 2.11 with triton 3.6 on the H200, triton 3.6-3.9 on the CPU
MIN_TORCH, MIN_TRITON = (2, 11), (3, 6)
#: the distributions that install the ``triton`` module, in the order they are looked for
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-rocm")


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string (``"2.13.0+cpu"`` -> ``(2, 13, 0)``)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def installed_triton() -> str | None:
    """The installed Triton's version, read from its package metadata (``triton`` is not
    imported), or ``None`` where no distribution of it is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for name in TRITON_DISTRIBUTIONS:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def version_problem(torch_version: str, triton_version: str | None) -> str | None:
    """What is below the supported bounds (:data:`MIN_TORCH`, :data:`MIN_TRITON`), in one
    sentence naming the version found, or ``None``. No Triton at all is no problem here:
    ``import pagedattn`` and the oracle need torch only (a launch needs Triton)."""
    low = [(name, found, need) for name, found, need in (
        ("torch", torch_version, MIN_TORCH), ("triton", triton_version, MIN_TRITON))
        if found is not None and _release(found)[:2] < need]
    if not low:
        return None
    return "pagedattn needs " + " and ".join(
        f"{name} >= {need[0]}.{need[1]} (found {name} {found})" for name, found, need in low) \
        + ": pip install -U " + " ".join(f"'{n}>={m[0]}.{m[1]}'" for n, _, m in low)


def check_versions() -> None:
    """Raise one ``ImportError`` naming the version found when torch or triton is below the
    supported bounds (``import pagedattn`` calls it)."""
    problem = version_problem(torch.__version__, installed_triton())
    if problem:
        raise ImportError(problem)


#: the values Triton's ``getenv_bool`` reads as true (case-insensitive); any other value, an
#: empty one included, is false (``TRITON_INTERPRET=false`` must not read as on)
TRUE_WORDS = ("1", "true", "on", "yes", "y")


def is_interpreter() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET``
    set to ``1``, ``true``, ``on``, ``yes`` or ``y``, read as Triton reads it).

    The variable must be set before ``triton`` is imported; this library never sets it.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in TRUE_WORDS


class DependencyError(ImportError):
    """An installed package that the path taken cannot run with; the message is one line
    naming the fix."""


def interpreter_numpy_problem(triton_version: str | None,
                              numpy_version: str | None) -> str | None:
    """What keeps Triton's interpreter from running the kernels, in one line naming the fix,
    or ``None``: no numpy (the interpreter imports it, and so does ``import triton`` under
    it, but triton does not declare it: the ``interpret`` extra does), or Triton 3.6 with
    numpy >= 2.4: 3.6's interpreter converts 1-element arrays to scalars, which numpy 2.3
    deprecates (a warning; a decode runs) and 2.4 refuses inside a launch ("only
    0-dimensional arrays can be converted to Python scalars"). The fix named is the pair CI
    tests, numpy < 2.3."""
    if numpy_version is None:
        return ("pagedattn: Triton's interpreter (TRITON_INTERPRET=1) needs numpy, which is "
                "not installed: pip install \"pagedattn[interpret]\"")
    if (triton_version is not None and _release(triton_version)[:2] == (3, 6)
            and _release(numpy_version)[:2] >= (2, 4)):
        return (f"pagedattn: Triton 3.6's interpreter (TRITON_INTERPRET=1) fails with numpy "
                f">= 2.4 (found numpy {numpy_version}): pip install \"numpy<2.3\"")
    return None


def check_interpreter_numpy() -> None:
    """Under the interpreter, raise one ``ImportError`` naming the fix where numpy cannot run
    it (:func:`interpreter_numpy_problem`): a ``ModuleNotFoundError`` for numpy when it is
    missing, a :class:`DependencyError` when its version cannot serve. ``pagedattn.launch``
    calls it when it loads, before anything imports Triton (whose own import would fail deep
    inside it; the API reaches the kernels through it only); off the interpreter it does
    nothing."""
    if not is_interpreter():
        return
    try:
        import numpy
    except ImportError:
        found = None
    else:
        found = numpy.__version__
    problem = interpreter_numpy_problem(installed_triton(), found)
    if problem is None:
        return
    if found is None:
        raise ModuleNotFoundError(problem, name="numpy")
    raise DependencyError(problem, name="numpy")


#: Triton's interpreter keeps a launch's state (the grid, the program ids, its patches of
#: ``triton.language``) in process-wide objects, so two launches in two threads corrupt each
#: other (``InterpreterError: ValueError('y >= grid_dim[1]')``): every CPU launch of this
#: library runs under this lock (``launch_guard``), one at a time. Reentrant: a launch path
#: may nest (a plan built inside a guarded call). GPU launches never take it.
INTERPRETER_LOCK = threading.RLock()


def launch_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a launch on ``device`` runs in: :data:`INTERPRETER_LOCK` for the CPU (the
    interpreter), else nothing (a CUDA device guard is the caller's)."""
    return INTERPRETER_LOCK if device.type == "cpu" else contextlib.nullcontext()


def interpreter_refused() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a false value (``0``, ``false``, ...) on a
    machine without a CUDA GPU: the kernels can then run nowhere (Triton has no CPU backend
    besides its interpreter). Unset, the ``pagedattn`` command sets it for itself."""
    return ("TRITON_INTERPRET" in os.environ and not is_interpreter()
            and not torch.cuda.is_available())


@contextlib.contextmanager
def quiet_interpreter_warnings() -> Iterator[None]:
    """Under Triton's interpreter, hide two kinds of known, harmless warnings while the block
    runs (nothing is filtered on a GPU, and nothing outside the block).
    :func:`pagedattn.cli.main` runs every subcommand inside it:

    * numpy's ``RuntimeWarning: divide by zero encountered in log2`` / ``in divide``, raised
      by ``triton.runtime.interpreter``: the interpreter evaluates both sides of a kernel's
      ``tl.where`` with numpy, so the discarded side of a guard such as the fp8 query's
      power-of-two scale ``where(amax > 0, 14 - ceil(log2(amax)), 0)`` or the final
      ``where(l > 0, v_scale / l, 0)`` is computed for padding rows (all-zero query, empty
      context) too. The kept values are right; a GPU computes the same without a warning.
    * torch's ``UserWarning: flex_attention called without torch.compile()``: the
      flex_attention peers run eagerly off CUDA on purpose (see
      :func:`pagedattn.bench.peers._flex_callable`).
    """
    with warnings.catch_warnings():
        if is_interpreter():
            warnings.filterwarnings("ignore", r"divide by zero encountered in (log2|divide)",
                                    RuntimeWarning, r"triton\.runtime\.interpreter")
            warnings.filterwarnings("ignore", r"flex_attention called without torch\.compile",
                                    UserWarning, r"torch\.nn\.attention\.flex_attention")
        yield


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached; metadata only, no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count_for(tensor: torch.Tensor) -> int:
    """SM count of the tensor's device; a small stand-in under the interpreter (CPU)."""
    if tensor.device.type == "cuda":
        return num_sms(tensor.device.index if tensor.device.index is not None else 0)
    return 4


@functools.cache
def device_name(device_index: int) -> str:
    """The CUDA device's model name (``torch.cuda.get_device_name``; cached, metadata only)."""
    return torch.cuda.get_device_name(device_index)


def device_name_for(device: torch.device) -> str:
    return device_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def free_memory(device: torch.device) -> int | None:
    """Bytes a job on ``device`` can still allocate: the GPU's free memory, or the host's
    ``MemAvailable`` (Linux's ``/proc/meminfo``); ``None`` where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def num_devices() -> int:
    """CUDA devices visible to this process (cached: a launch needs no device guard when
    there is one)."""
    return torch.cuda.device_count()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a launch on ``device`` runs in: the tensors' GPU made current (Triton
    launches on the current device), a no-op when it already is; on the CPU, one interpreted
    launch at a time (:data:`INTERPRETER_LOCK`, through :func:`launch_guard`)."""
    if device.type != "cuda" or device.index is None or num_devices() == 1 or \
            device.index == torch.cuda.current_device():
        return launch_guard(device)
    return torch.cuda.device(device)


def _git(*args: str) -> str:
    here = Path(__file__).resolve().parent
    return subprocess.run(["git", *args], cwd=here, check=True, capture_output=True, text=True,
                          timeout=10).stdout.strip()


def git_state() -> dict[str, str]:
    """``{"git_commit": sha, "src_dirty": "yes"/"no"}`` of this checkout: ``src_dirty`` says
    whether ``src/`` differs from the commit (what was measured is then not that commit).
    ``$PAGEDATTN_GIT_SHA`` names the commit of a copied tree (a remote GPU machine gets the
    working tree, not its history): it wins, and ``src_dirty`` then says ``unknown``; with
    neither a checkout nor the variable, both say ``unknown``."""
    if os.environ.get("PAGEDATTN_GIT_SHA"):
        return {"git_commit": os.environ["PAGEDATTN_GIT_SHA"], "src_dirty": "unknown"}
    try:
        sha = _git("rev-parse", "HEAD")
        top = _git("rev-parse", "--show-toplevel")
        dirty = _git("status", "--porcelain", "--", str(Path(top) / "src"))
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "src_dirty": "unknown"}
    return {"git_commit": sha, "src_dirty": "yes" if dirty else "no"}
