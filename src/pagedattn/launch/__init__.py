"""Host launchers: take shapes, choose tiles, splits and the grid, allocate, launch.

Each launcher returns ``{kernel name: what its launch returned}`` (on a GPU, Triton's
``CompiledKernel``: ``n_regs``, ``n_spills``, ``metadata``); ``pagedattn.compiled_kernels``
hands that to the profiling tools. Under Triton's interpreter, loading them needs numpy (one
error naming the fix otherwise: :func:`pagedattn._env.check_interpreter_numpy`).
"""

from pagedattn._env import check_interpreter_numpy

check_interpreter_numpy()  # before any launcher imports Triton
