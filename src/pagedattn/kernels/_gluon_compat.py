"""Gluon's names across Triton 3.6-3.9 for the Hopper kernels (``kernels/mla_gluon.py``,
``kernels/prefill_gluon.py``).

Read from the triton 3.6.0, 3.8.0 and 3.9.0 wheels: ``cp.async`` lives in
``nvidia.hopper.async_copy`` (a re-export of Ampere's) with ``async_copy_global_to_shared``
in 3.6 (3.8 adds the alias ``async_load``); the CTA barrier is ``gl.thread_barrier`` in 3.6
and ``gl.barrier`` from 3.8 on (3.9 drops ``thread_barrier``); ``warpgroup_mma``,
``warpgroup_mma_wait`` and ``fence_async_shared`` have the same signatures in all three, as
have ``mbarrier.init``, ``wait`` and ``arrive(count=)`` (``nvidia.hopper.mbarrier``) and
``warp_specialize(functions_and_args, worker_num_warps, worker_num_regs)``.
"""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

#: the CTA-wide barrier (``bar.sync``)
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
#: ``cp.async`` of a pointer tensor into shared memory, ``(smem, pointer, mask=None)``: 3.8's
#: ``async_load`` where it exists (3.9's ``async_copy_global_to_shared`` raises "has been
#: removed"), 3.6's name before it
async_copy_global_to_shared = (getattr(async_copy, "async_load", None)
                               or async_copy.async_copy_global_to_shared)
commit_group = async_copy.commit_group
wait_group = async_copy.wait_group

__all__ = ["async_copy_global_to_shared", "commit_group", "fence_async_shared", "mbarrier",
           "thread_barrier", "wait_group", "warpgroup_mma", "warpgroup_mma_wait"]
