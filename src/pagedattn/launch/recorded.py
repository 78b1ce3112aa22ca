"""Recorded launches: a kernel launched again without Triton's per-call host path.

The first launch of a **binding** (what one call's tensors fix beyond the launcher: their
dtypes, strides and 16-byte alignment, LSE on or off, the per-call variants that are on) goes
through Triton's own ``kernel[grid](**kwargs)``, which compiles or finds the binary.
:meth:`RecordedLaunch.record` then keeps that launch's argument list in parameter order with
every per-call argument left as a **slot** (every tensor pointer, the workspace's included,
the scales and the page count), and :meth:`RecordedLaunch.run` fills the slots of a later
call and hands the list to ``CompiledKernel.run``, or, with no launch hook set, to the C
launch behind it (:func:`pagedattn.launch._triton_compat.c_launch`: what
``CudaLauncher.__call__`` would pass it). The host path of ``kernel[grid]`` re-derives the
specialization from every argument each call; a record reads nothing but the slots.

A record holds no tensor and no address: it is a function of the launcher's spec and the
binding alone, so a launcher keeps one per binding it has seen. Only the Tritons whose launch
path was read (3.6-3.9) record (``_triton_compat.direct_launch_supported``); everything
private to Triton is in :mod:`pagedattn.launch._triton_compat`. ``scripts/compile_sm90.py
--bindings`` checks, on the CPU, that each record hands Triton's C launch exactly what
``kernel[grid]`` hands it.
"""

from __future__ import annotations

import torch

from pagedattn.launch import _triton_compat as tc


class RecordedLaunch:
    """One kernel's recorded launch for one binding (see the module docstring).

    Attributes:
        compiled: the ``CompiledKernel`` the first launch returned.
        c: its C launch (``_triton_compat.c_launch``), or ``None`` where it is not reached.
        args: the argument list in parameter order, ``None`` in every slot.
        slots: the positions of the per-call arguments, in the order :meth:`run` takes them.
        variant_slots: ``(position, option name)`` of the per-call variants' pointers.
    """

    __slots__ = ("compiled", "c", "args", "slots", "variant_slots")

    def __init__(self, compiled, c, args: list, slots: tuple[int, ...],
                 variant_slots: tuple[tuple[int, str], ...]):
        self.compiled, self.c, self.args = compiled, c, args
        self.slots, self.variant_slots = slots, variant_slots

    @classmethod
    def record(cls, kernel, compiled, kwargs: dict, slots: tuple[str, ...],
               calls: tuple) -> RecordedLaunch:
        """Record the launch of ``kernel`` (a ``@triton.jit`` function) that
        ``kernel[grid](**kwargs)`` made and returned as ``compiled``: ``slots`` names the
        per-call parameters, ``calls`` the per-call variants (``(option name, parameter,
        flag)``, :data:`pagedattn.options.CALL_ARGS`)."""
        names = kernel.arg_names
        variant_params = {param for _, param, _ in calls}
        args = [None if n in slots or n in variant_params else kwargs[n] for n in names]
        assert not any(isinstance(a, torch.Tensor) for a in args), "a tensor argument is no slot"
        return cls(compiled, tc.c_launch(compiled), args, tuple(names.index(n) for n in slots),
                   tuple((names.index(param), name) for name, param, _ in calls))

    def run(self, grid: tuple[int, int, int], stream: int, values: tuple, calls: dict | None,
            unused_ptr: int, enter, leave) -> None:
        """Launch with ``values`` in the slots (in :attr:`slots`' order) and each per-call
        variant's pointer (``calls``: option name -> tensor, the ones that are on), or
        ``unused_ptr`` for a variant that is off (its flag is off: never read). ``enter`` and
        ``leave``: Triton's launch hooks (``_triton_compat.launch_hooks``)."""
        args = self.args.copy()
        for pos, value in zip(self.slots, values, strict=True):
            args[pos] = value
        for pos, name in self.variant_slots:
            args[pos] = calls[name].data_ptr() if calls and name in calls else unused_ptr
        tc.launch_recorded(self.compiled, self.c, grid, stream, args, enter, leave)
