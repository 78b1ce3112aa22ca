"""CPU exploration (not a GPU figure): the Python host path of ``paged_decode`` and
``plan.run`` with every kernel launch replaced by a no-op (Triton's C launch: its Python
launcher runs), on CPU tensors, without the interpreter, as a GPU with the installed Triton
(3.6-3.9) would take it (recorded launches on, value checks off as under ``validate=None``
on CUDA). Triton's own
``kernel[grid]`` binding is stubbed too, so a path that goes through it costs more on a GPU
than shown here. Prints the minimum of ``REPEATS`` (default 5) timings of 500 calls, µs per
call. Usage (repo root, no GPU needed)::

    PYTHONPATH=src python scripts/host_path_cpu.py [REPEATS] [--profile]
"""
import cProfile
import functools
import pstats
import sys
import time

import torch

import pagedattn
from pagedattn import _validation as V
from pagedattn.launch import _triton_compat as tc
from pagedattn.launch import decode as L
from pagedattn.plan import ValueChecks
from pagedattn.testing import make_paged_inputs


def _launcher():
    """The installed Triton's Python launcher (``CudaLauncher``, its ``__call__`` as on a GPU:
    the version seam's recording launcher) around a C launch that does nothing."""
    run = tc.recording_launcher([])
    run.launch = lambda *args: None
    return run


class FakeCompiled:
    """A compiled kernel whose launch does nothing."""

    function = packed_metadata = None

    def __init__(self):
        self.run = _launcher()

    def launch_metadata(self, *args):
        return None


class FakeKernel:
    """A ``@triton.jit`` kernel whose ``kernel[grid](...)`` binds nothing and launches nothing."""

    def __init__(self, real):
        self.arg_names = real.arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: FakeCompiled()


V.check_device_runnable = lambda *args: None
ValueChecks.check = lambda *args, **kwargs: None  # validate=None on a GPU skips them
for _name in ("_paged_decode_kernel", "_merge_per_group_kernel", "_merge_per_head_kernel"):
    setattr(L, _name, FakeKernel(getattr(L, _name)))
tc.cpu_driver(stream=0).__enter__()  # Triton's driver: a stand-in for the whole run
_init = L.AutoLauncher.__init__


def _init_as_on_a_gpu(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self._direct = kwargs.get("record", True)  # what a GPU with Triton 3.6-3.9 does
    self._get_stream = lambda index: 0


L.AutoLauncher.__init__ = _init_as_on_a_gpu
BATCHES = [("b1-32/8-hd128-ctx16", [16], 32, 8, 128, torch.bfloat16),
           ("b64-9/3-hd64-ctx32", [32] * 64, 9, 3, 64, torch.bfloat16),
           ("b8-32/8-hd128-ctx300-fp16", [300] * 8, 32, 8, 128, torch.float16)]


def per_call(fn, n):
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


repeats = int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 5
for name, lens, hq, hkv, hd, dt in BATCHES:
    x = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=hd, page_size=16,
                          dtype=dt, poison=False)
    plan = pagedattn.plan_decode(x.block_tables, x.context_lens, num_q_heads=hq,
                                 num_kv_heads=hkv, head_dim=hd, page_size=16, q_dtype=dt)
    plan.on_cpu = False  # a CPU plan would run the value checks
    out = torch.empty_like(x.query)
    fns = dict(plan_run=functools.partial(plan.run, *x[:3]),
               plan_run_out=functools.partial(plan.run, *x[:3], out=out),
               paged_decode=functools.partial(pagedattn.paged_decode, *x))
    r = {k: min(per_call(f, 500) for _ in range(repeats)) for k, f in fns.items()}
    print(name, " ".join(f"{k}={v:.1f}" for k, v in r.items()), flush=True)
    if "--profile" in sys.argv and name == BATCHES[0][0]:
        for k in ("paged_decode", "plan_run"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                fns[k]()
            prof.disable()
            print("----", k)
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
