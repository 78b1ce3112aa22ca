"""``launch.flags.kernel_flags``: the one setter of the main kernel's constexprs."""

import dataclasses
import inspect

import pytest
import torch
import triton.language as tl

import pagedattn
from pagedattn.kernels.decode import _paged_decode_kernel
from pagedattn.launch.decode import AutoLauncher
from pagedattn.launch.flags import FLAG_NAMES, UNBOUND, Binding, KernelFlags, kernel_flags
from pagedattn.options import OPTIONS, Variants, plan_options, variants
from pagedattn.spec import LaunchSpec
from pagedattn.testing import make_paged_inputs

SHAPE = dict(batch=4, max_pages=8, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
             q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device=torch.device("cpu"))


def test_fields_are_the_kernels_constexprs():
    """Every ``tl.constexpr`` parameter of the main kernel is a field of :class:`KernelFlags`
    and nothing else is: a new constexpr without a setter fails here."""
    params = inspect.signature(_paged_decode_kernel.fn).parameters.values()  # jit or interpreted
    constexprs = [p.name for p in params if p.annotation in (tl.constexpr, "tl.constexpr")]
    assert len(constexprs) >= 20  # the signature was read (20 since MLA's three went)
    assert sorted(FLAG_NAMES) == sorted(constexprs)
    assert len(set(FLAG_NAMES)) == len(FLAG_NAMES)
    flags = AutoLauncher(LaunchSpec(**SHAPE)).flags
    assert list(flags.as_kwargs()) == list(FLAG_NAMES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        flags.HAS_LSE = True


def test_plan_and_binding_set_their_groups():
    """The plan's flags (no binding) have every binding flag off; a binding turns on its
    own and leaves the plan's as they were; the plan-time options set theirs."""
    launcher = AutoLauncher(LaunchSpec(**SHAPE, options=plan_options(dict(logits_soft_cap=30.0))))
    plan = launcher.flags
    assert plan.HEAD_DIM == 64 and plan.BLOCK_D == 64 and plan.PAGE_SIZE == 16
    assert plan.Q_LEN == 1 and plan.VARIANTS.HAS_SOFTCAP and not plan.VARIANTS.HAS_WINDOW
    assert not plan.LEAN_SOFTMAX  # the soft-cap's tanh follows the product
    assert not (plan.HAS_LSE or plan.SCALE_FROM_PTR or plan.VARIANTS.HAS_SINKS
                or plan.VARIANTS.HAS_ALIBI or plan.SLOT_OFFSETS_I32 or plan.FP8_V_PAIRS)
    binding = Binding(scale_from_ptr=True, has_lse=True, calls=frozenset({"sinks"}),
                      slot_offsets_fit_int32=True, fp8_v_pairs=1)
    bound = kernel_flags(launcher.plan, launcher.spec, binding, **launcher._flag_facts)
    assert bound.HAS_LSE and bound.SCALE_FROM_PTR
    # the binding's per-call options in VARIANTS, beside the plan's own
    assert plan.VARIANTS._replace(HAS_SINKS=True) == bound.VARIANTS
    assert bound.SLOT_OFFSETS_I32 is launcher.config.slot_offsets_i32
    assert bound.FP8_V_PAIRS == 1
    binding_fields = {"HAS_LSE", "SCALE_FROM_PTR", "VARIANTS", "SLOT_OFFSETS_I32",
                      "FP8_V_PAIRS"}
    assert {n: getattr(bound, n) for n in FLAG_NAMES if n not in binding_fields} == \
        {n: getattr(plan, n) for n in FLAG_NAMES if n not in binding_fields}
    assert kernel_flags(launcher.plan, launcher.spec, UNBOUND,
                        **launcher._flag_facts) == plan


def test_a_binding_is_decided_once(device):
    """Launches of one binding reuse its flags; a new binding (LSE on) adds one entry."""
    x = make_paged_inputs([0, 5, 40], num_q_heads=4, num_kv_heads=2, head_dim=16,
                          page_size=8, dtype=torch.float16, seed=1, device=device)
    plan = pagedattn.plan_decode(x.block_tables, x.context_lens, num_q_heads=4,
                                 num_kv_heads=2, head_dim=16, page_size=8,
                                 q_dtype=torch.float16, kv_dtype=torch.float16)
    plan.run(*x[:3])
    plan.run(*x[:3])
    engine = plan._engine()
    assert len(engine._bound_flags) == 1
    plan.run(*x[:3], return_lse=True)
    assert len(engine._bound_flags) == 2
    assert sorted(b.has_lse for b in engine._bound_flags) == [False, True]
    assert isinstance(engine.flags, KernelFlags)


def test_variants_hold_every_options_flag():
    """``VARIANTS`` has one field per declared option, named by its flag, in field order: a
    new option's flag reaches the kernel's steps by itself. Off at the defaults; a plan-time
    option's flag is on when its value is not the default (the value itself with
    ``flag_value``), a per-call one's when the call holds it."""
    assert Variants._fields == tuple(o.flag for o in OPTIONS.values())
    off = variants(plan_options({}))
    assert not any(off)
    on = variants(plan_options(dict(window_left=7, batch_invariant=True)),
                  frozenset({"alibi_slopes"}))
    assert on == off._replace(HAS_WINDOW=True, BATCH_INVARIANT=True, HAS_ALIBI=True)
