"""The production kernel's ``tl.constexpr`` flags, decided in one place.

:func:`kernel_flags` returns every constexpr parameter of ``_paged_decode_kernel``
(:mod:`pagedattn.kernels.decode`) as one frozen :class:`KernelFlags`, its fields grouped by
who sets them:

* **shape and tile**: the model's shapes (head dims, page size, query tokens per sequence) and
  the policy's tiles (:func:`pagedattn.launch.policy.plan_launch`);
* **dtype**: the query's and the caches' dtypes (the dots' operand dtype and precision);
* **variant**: ``VARIANTS``, every option's flag in one bundle (:data:`pagedattn.options.
  Variants`, made from the declarations: a new option adds its flag there by itself; the
  plan-time options' flags are the plan's, the per-call options' the binding's);
* **policy**: the schedule and the token loop's fast forms that the launch plan chose (one
  unit, folded merge, PDL, lean softmax), and inline PTX off the interpreter;
* **binding**: what one call's tensors decide (:class:`Binding`: tensor scales, LSE, the
  caches' strides; the per-call options that are on, in ``VARIANTS``). Each is part of the
  launcher's binding key, so a recorded launch never recomputes them.

An :class:`~pagedattn.launch.decode.AutoLauncher` calls it once at plan time with no binding
(:data:`UNBOUND`) and once for each binding it launches through ``kernel[grid]``, caching the
result per binding, so no call rebuilds it. Every flag changes the compiled code, so each is
off (or 1 / 0) unless its setter turns it on. ``DESIGN.md`` ("Kernel flags") tabulates each
flag's setter and source; ``tests/plans/test_flags.py`` checks that the fields are exactly the
kernel's constexpr parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass

import torch
import triton.language as tl

from pagedattn._validation import FP8_DTYPES
from pagedattn.launch._common import block_d
from pagedattn.launch.policy import LaunchPlan
from pagedattn.options import variants
from pagedattn.spec import LaunchSpec

# sequences scanned per vector step of the device-side split planner (context_lens loads)
BLOCK_B = 128


def dot_dtype(cache_dtype: torch.dtype, interpret: bool):
    """The dots' operand dtype (``DOT_DTYPE``) for a cache dtype."""
    if cache_dtype in FP8_DTYPES:
        return tl.float16  # fp8 -> fp16 converts in hardware; the query is range-scaled first
    if cache_dtype == torch.bfloat16:
        return tl.float32 if interpret else tl.bfloat16  # interpreter bf16 dots are garbage
    return {torch.float16: tl.float16}.get(cache_dtype, tl.float32)


def dot_precision(cache_dtype: torch.dtype, interpret: bool) -> str:
    """fp32 operands (``DOT_PRECISION``): split-bf16 on the GPU (``bf16x3``: each operand
    split into two bf16 terms, three tensor-core passes at twice TF32's rate, fp32-level
    accuracy: measured in ``docs/perf-notes.md``), split-TF32 (``tf32x3``) in the
    interpreter, which has no bf16x3. Plain tf32 would miss the 1e-4 contract."""
    if cache_dtype != torch.float32:
        return "tf32"  # unused: 16-bit and fp8 dots
    return "tf32x3" if interpret else "bf16x3"


@dataclass(frozen=True, slots=True)
class Binding:
    """The facts of one call's tensors that set flags; each is part of the launcher's binding
    key (:meth:`pagedattn.launch.decode.AutoLauncher.launch`)."""

    scale_from_ptr: bool = False  # fp8 scales given as tensors (graph-safe), not floats
    has_lse: bool = False  # the call writes the LSE
    calls: frozenset[str] = frozenset()  # the per-call options that are on (by name)
    # both caches' in-page offsets fit in int32 (launch.decode.slot_offsets_fit_int32)
    slot_offsets_fit_int32: bool = False
    fp8_v_pairs: int = 0  # the value cache as 16-bit dim pairs (launch.decode.fp8_v_pairs)


#: the binding of a launcher before any call: every binding flag off
UNBOUND = Binding()


#: the kernel's constexpr parameters by setter, in the order of :class:`KernelFlags`
GROUPS: dict[str, tuple[str, ...]] = {
    "shape and tile": ("HEAD_DIM", "BLOCK_D", "BLOCK_H", "BLOCK_N", "BLOCK_B", "PAGE_SIZE",
                       "Q_LEN"),
    "dtype": ("DOT_DTYPE", "DOT_PRECISION", "Q_POW2_SCALE"),
    "variant": ("VARIANTS",),
    "policy": ("ONE_UNIT", "FOLD_MERGE", "PDL", "LEAN_SOFTMAX", "ASM"),
    "binding": ("SCALE_FROM_PTR", "HAS_LSE", "SLOT_OFFSETS_I32", "FP8_V_PAIRS"),
}
#: the kernel's constexpr parameters, in the order of :class:`KernelFlags`
FLAG_NAMES = tuple(name for group in GROUPS.values() for name in group)


def _as_kwargs(self) -> dict[str, object]:
    """The flags as the kernel's keyword arguments."""
    return {name: getattr(self, name) for name in FLAG_NAMES}


#: Every ``tl.constexpr`` of the main kernel, one field each, by setter (:data:`GROUPS`; see
#: the module docstring); frozen. Made from :data:`FLAG_NAMES`, so an option's flag is a
#: field as soon as :mod:`pagedattn.options` declares it.
KernelFlags = make_dataclass(
    "KernelFlags", [(name, object) for name in FLAG_NAMES], frozen=True, slots=True,
    namespace={"as_kwargs": _as_kwargs, "__module__": __name__,
               "__doc__": "Every ``tl.constexpr`` of the main kernel, by setter "
                          "(:data:`GROUPS`)."})


def kernel_flags(plan: LaunchPlan, spec: LaunchSpec, binding: Binding = UNBOUND, *,
                 interpret: bool, pdl: bool) -> KernelFlags:
    """Every constexpr of the main kernel for a launch plan (the policy's
    :class:`~pagedattn.launch.policy.LaunchPlan`), the launcher's
    :class:`~pagedattn.spec.LaunchSpec` (the shapes, the dtypes and the
    plan-time ``options``, their ``window_left`` as the plan has it: no window where the
    table fits in one), the device facts (``interpret``; ``pdl``: the per-group merge
    launched as a programmatic dependent, which the launcher decides from the device) and
    one call's ``binding``."""
    cfg = plan.config
    options, kv_dtype = spec.options, spec.kv_dtype
    head_dim, q_len = spec.head_dim, spec.q_len
    return KernelFlags(
        # shape and tile
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_H=plan.block_h,
        BLOCK_N=cfg.block_n, BLOCK_B=BLOCK_B, PAGE_SIZE=spec.page_size, Q_LEN=q_len,
        # dtype
        DOT_DTYPE=dot_dtype(kv_dtype, interpret),
        DOT_PRECISION=dot_precision(kv_dtype, interpret),
        Q_POW2_SCALE=kv_dtype in FP8_DTYPES and spec.q_dtype != torch.float16,
        # variant: every option's flag (pagedattn.options.Variants; the per-call ones: on
        # when the binding's call holds the option)
        VARIANTS=variants(options, binding.calls),
        # policy
        ONE_UNIT=plan.one_unit, FOLD_MERGE=plan.fold_merge, PDL=pdl,
        # the lean online softmax needs every row of every tile to see a key (so the running
        # max is finite from the first tile on) and a score whose last operation is the exact
        # product: one query token (no causal rows), no window (no masked first keys) and no
        # soft-cap (its tanh follows the product)
        LEAN_SOFTMAX=(cfg.lean_softmax and q_len == 1 and plan.window_left < 0
                      and options.logits_soft_cap is None),
        ASM=not interpret,
        # binding
        SCALE_FROM_PTR=binding.scale_from_ptr, HAS_LSE=binding.has_lse,
        SLOT_OFFSETS_I32=cfg.slot_offsets_i32 and binding.slot_offsets_fit_int32,
        FP8_V_PAIRS=binding.fp8_v_pairs,
    )
