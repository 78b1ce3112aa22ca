"""Host launchers: take shapes, choose tiles, splits and the grid, allocate, launch.

Each launcher returns ``{kernel name: what its launch returned}`` (on a GPU, Triton's
``CompiledKernel``: ``n_regs``, ``n_spills``, ``metadata``); ``pagedattn.compiled_kernels``
hands that to the profiling tools.
"""
