"""The Triton kernels. Under Triton's interpreter, loading them needs numpy (one error naming
the fix otherwise: :func:`pagedattn._env.check_interpreter_numpy`)."""

from pagedattn._env import check_interpreter_numpy

check_interpreter_numpy()  # before any kernel module imports Triton
