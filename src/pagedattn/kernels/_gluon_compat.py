"""Gluon's names across Triton 3.6-3.9 for the Hopper kernels (``kernels/mla_gluon.py``,
``kernels/prefill_gluon.py``), and the two small helpers they share (:func:`landed`,
:func:`report_block_tables`).

Read from the triton 3.6.0, 3.8.0 and 3.9.0 wheels: ``cp.async`` lives in
``nvidia.hopper.async_copy`` (a re-export of Ampere's) with ``async_copy_global_to_shared``
in 3.6 (3.8 adds the alias ``async_load``); the CTA barrier is ``gl.thread_barrier`` in 3.6
and ``gl.barrier`` from 3.8 on (3.9 drops ``thread_barrier``); ``warpgroup_mma``,
``warpgroup_mma_wait`` and ``fence_async_shared`` have the same signatures in all three, as
have ``mbarrier.init``, ``wait`` and ``arrive(count=)`` (``nvidia.hopper.mbarrier``) and
``warp_specialize(functions_and_args, worker_num_warps, worker_num_regs)``.
"""

from triton.experimental import gluon
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
#: ``cp.async.mbarrier.arrive``: an arrival on an mbarrier once the calling thread's earlier
#: copies have landed, ``(bar, increment_count=True)`` (``False``: ``.noinc``, the arrival
#: counts toward the barrier's expected count); the same name and signature in 3.6-3.9
mbarrier_arrive = async_copy.mbarrier_arrive



@gluon.jit
def landed(bar):
    """A producer's copies for ``bar`` have landed in each of its threads (the caller waited
    for their group): fence them for the async proxy (wgmma reads there), then one arrival on
    ``bar`` once every thread of the partition has (its barrier)."""
    fence_async_shared()
    thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def report_block_tables(errors_ptr, row):
    """The error word's ``BLOCK_TABLES`` report (code 5, :mod:`pagedattn.kernels.errors`) for
    ``row``, value -1, unless a report of a lower code is pending (a plain load and store, as
    ``_report``: of two racing reports either is kept)."""
    word = (row.to(gl.int64) & 0xFFFFFF) * 4294967296 + 360287974484606975  # 5 << 56 | -1
    pending = gl.load(errors_ptr, volatile=True)
    if (pending == 0) | ((pending >> 56) > 5):
        gl.store(errors_ptr, word)


__all__ = ["async_copy_global_to_shared", "commit_group", "fence_async_shared", "landed",
           "mbarrier", "mbarrier_arrive", "report_block_tables", "thread_barrier", "wait_group",
           "warpgroup_mma", "warpgroup_mma_wait"]
