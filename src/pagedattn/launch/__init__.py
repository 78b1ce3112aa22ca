"""Host launchers: take shapes, choose tiles, splits and the grid, allocate, launch.

``LAST_COMPILED`` maps a kernel name to the object its last launch returned (on a GPU it
carries ``n_regs``, ``n_spills`` and ``metadata``); the benchmark and profiling tools read it
for Triton's compile metadata.
"""

LAST_COMPILED: dict[str, object] = {}
