"""GPU int32 arithmetic in Triton's interpreter, and a record of every overflow.

Triton's interpreter computes in numpy, which is not what a GPU does with 32-bit integers:
``tl.sum`` and ``tl.cumsum`` of int32 values accumulate in int64 (numpy's default), and the
result then fails to convert back (``OverflowError: Python integer ... out of bounds for
int32``: an interpreter traceback where a GPU silently wraps), while elementwise int32
``+ - *`` wrap as a GPU does, without a word. :func:`gpu_int32` patches the interpreter so
that all of them wrap in two's complement as on a GPU, and records each operation whose exact
result left int32, with the kernel source line, so a test can assert that none did.

Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as ti

_WRAPPED = {np.add: "+", np.subtract: "-", np.multiply: "*"}


def _kernel_line() -> str:
    """``file:line`` of the innermost frame in ``pagedattn/kernels`` (the kernel's source)."""
    f = sys._getframe(1)
    while f is not None:
        if "pagedattn/kernels/" in f.f_code.co_filename:
            return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _narrow(wide: np.ndarray, what: str, overflows: list) -> np.ndarray:
    narrow = wide.astype(np.int32)  # two's complement, as a GPU register holds it
    bad = narrow != wide
    if np.any(bad):
        overflows.append(f"{_kernel_line()}: int32 {what} = {wide[bad].reshape(-1)[0]} wrapped")
    return narrow


@contextlib.contextmanager
def gpu_int32():
    """Within the block, the interpreter's int32 ``+ - *``, ``tl.sum`` and ``tl.cumsum`` wrap
    like a GPU's; yields the list of overflows seen (``"file:line: ..."`` strings)."""
    overflows: list[str] = []
    binary_op = ti.InterpreterBuilder.binary_op
    reduce_sum = ti.ReduceOps.sum
    cumsum = ti.ScanOps.cumsum

    def wrapping_binary_op(self, lhs, rhs, op):
        if op in _WRAPPED and lhs.dtype.scalar == tl.int32 and rhs.dtype.scalar == tl.int32:
            wide = op(lhs.data.astype(np.int64), rhs.data.astype(np.int64))
            return ti.TensorHandle(_narrow(wide, _WRAPPED[op], overflows), lhs.dtype.scalar)
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
