"""Small host helpers shared by the launchers."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch

from pagedattn._env import launch_guard

LOG2E = 1.0 / math.log(2.0)

F = TypeVar("F", bound=Callable)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` called from Python goes through
    Triton's JIT-function wrapper, slower than a launch path can afford)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for ``n`` ≤ 1), for host integers (see
    :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block_d(head_dim: int) -> int:
    """Head dims are padded to a power of two; the tail lanes are masked."""
    return next_power_of_2(head_dim)


def decode_strides(query, key_cache, value_cache, block_tables, context_lens) -> tuple:
    """Strides in the kernels' argument order (caches as NHD-shaped views)."""
    return (
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        context_lens.stride(0),
    )


def named_strides(short: str, t: torch.Tensor, dims: str) -> dict[str, int]:
    """``{"stride_<short>_<dim>": stride}`` for each dim name in ``dims`` (space-separated),
    the kernels' stride-argument names: ``named_strides("q", query, "b h d")``."""
    names = dims.split()
    if len(names) != t.dim():
        raise ValueError(f"named_strides: {len(names)} names for a rank-{t.dim()} tensor")
    return {f"stride_{short}_{n}": s for n, s in zip(names, t.stride(), strict=True)}


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The tensor's CUDA device made current for the launches inside (Triton launches on the
    current device and its current stream); for CPU tensors the interpreter's lock (one
    interpreted launch at a time: ``pagedattn._env.INTERPRETER_LOCK``); a no-op context for
    a non-tensor (which the launcher's validation then names)."""
    if isinstance(t, torch.Tensor) and t.device.type == "cuda":
        return torch.cuda.device(t.device)
    if isinstance(t, torch.Tensor):
        return launch_guard(t.device)
    return contextlib.nullcontext()


def on_tensor_device(launcher: F) -> F:
    """Decorator: run ``launcher`` under :func:`device_guard` of its first argument (passed by
    position or by keyword), so tensors on ``cuda:1`` launch on ``cuda:1`` whatever the current
    device. The launcher's validation checks that every tensor shares that device."""
    @functools.wraps(launcher)
    def guarded(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()), None)
        with device_guard(first):
            return launcher(*args, **kwargs)
    return guarded  # type: ignore[return-value]
