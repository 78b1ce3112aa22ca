"""One home for the attention variants of the production kernel (``impl="auto"``).

:class:`DecodeOptions` declares each variant once, as a dataclass field whose metadata (an
:class:`Option`) says everything the rest of the package needs: when it is fixed (``"plan"``:
part of a plan's and the one-shot launcher's static key, a kernel argument fixed by the
launcher; ``"call"``: a per-call ``[num_q_heads]`` float32 tensor, a slot of the recorded
launch), the flag it switches on (a field of the kernel's ``VARIANTS`` constexpr,
:data:`Variants`), the kernel argument that carries its value (and what that argument holds
when the flag is off), whether the merge kernels take it too, its check, its exact types for
the one-shot fast path, its op-schema type and its docstring. The keywords of
:func:`pagedattn.paged_decode`, :func:`pagedattn.plan_decode` (plan-time fields) and
:meth:`pagedattn.DecodePlan.run` (per-call fields), the stages' refusal
(``ImplSpec.variants``), the launcher's constexprs, kernel arguments, slots and key, and the
custom ops' schemas (``serving/ops.py``) all come from these fields; the oracle
(``pagedattn.reference``) takes the same keywords (``tests/plans/test_variants.py`` checks it).

A variant is off at its default, and off it costs nothing: the flag is ``False`` and the
kernel's code is unchanged. ``q_len`` (the 4-D query's token count) and the scales
(``scale``, ``k_scale``, ``v_scale``) are no variants: every call has them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch

from pagedattn import _validation as V

#: the widest window the kernels hold (int32); a wider one sees every key, as -1 does
INT32_MAX = (1 << 31) - 1


class Option(NamedTuple):
    """The declaration of one variant (a :class:`DecodeOptions` field's metadata)."""

    when: str  # "plan" (fixed per plan, a constexpr specialization) or "call" (per call)
    flag: str  # its field of the kernel's VARIANTS, on when the value is not the default
    arg: str | None  # the kernel argument holding the value (None: the flag alone)
    off: Any  # a plan-time arg's value when the flag is off (a per-call one: a dummy pointer)
    schema: str  # its type in a torch.library schema
    exact: tuple  # the exact types a one-shot call's fast path accepts (plan-time)
    check: Callable[[str, Any], None]  # metadata check (a per-call one: of the tensor)
    doc: str  # its line(s) in paged_decode's Args
    # a value that switches it on, for the tests and scripts/compile_sm90.py (a per-call
    # one: the (low, high) range of its per-head values)
    example: Any
    merge: bool = False  # the merge kernels take the arg and the flag too
    # the constexpr holds the value itself (``arg`` None): no runtime argument, so the
    # kernel's parameters are unchanged, and each value compiles its own kernel
    flag_value: bool = False
    normalize: Callable[[Any], Any] = lambda v: v  # the value the launcher sees
    check_values: Callable[[str, torch.Tensor], None] | None = None  # reads the data


def _check_window(name, value) -> None:
    V.check_int(name, value, -1)


def _check_soft_cap(name, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        V.fail(TypeError, name, "a float or None", type(value).__name__)
    if V.check_float32(name, value, f"a finite float > 0 {V.WITHIN}") < V.SOFTCAP_MIN:
        # the kernels take ln(2) / cap too, which must stay finite in float32
        V.fail(ValueError, name, f"a finite float >= {V.SOFTCAP_MIN:.3g}", value)


def _check_bool(name, value) -> None:
    if not isinstance(value, bool):
        V.fail(TypeError, name, "a Python bool", V.type_name(value))


def _sink_values(name, t) -> None:
    v = t.detach().double()
    V.first_bad(name, v, v.isnan() | (v > V.KERNEL_SCALAR_MAX)
                | ((v < -V.KERNEL_SCALAR_MAX) & v.isfinite()),
                f"sink logits {V.WITHIN}, or -inf for none")


def _finite_slopes(name, t) -> None:
    v = t.detach().double()
    V.first_bad(name, v, ~(v.abs() <= V.KERNEL_SCALAR_MAX), f"finite slopes {V.WITHIN}")


def _plan(default, **meta):
    return field(default=default, metadata={"option": Option("plan", **meta)})


def _call(**meta):
    """A per-call ``[num_q_heads]`` float32 tensor (``None``: off), checked by
    ``_validation.check_head_tensor``; its kernel argument points at the workspace when off."""
    return field(default=None, metadata={"option": Option(
        "call", schema="Tensor?", exact=(), off=None, check=lambda n, v: None, **meta)})


@dataclass(frozen=True)
class DecodeOptions:
    """The attention variants of one decode, each off at its default (see the module
    docstring). A plan and a launcher hold one with its per-call fields at ``None``
    (:func:`plan_options`); the per-call tensors travel beside it (:func:`call_options`)."""

    window_left: int = _plan(
        -1, flag="HAS_WINDOW", arg="window_left", off=0, schema="int", exact=(int,),
        check=_check_window, normalize=lambda v: min(int(v), INT32_MAX), example=7,
        doc="sliding window (Mistral; Gemma 2/3's local layers): the query token at "
            "position ``i`` sees keys ``p`` with ``i - window_left <= p <= i``; ``-1`` "
            "(default) is no window (as is any window at least as wide as the context). "
            "Pages wholly before the window are never read, and the splits balance the "
            "visible tokens, so time scales with the window, not the context. An int >= -1.")
    logits_soft_cap: float | None = _plan(
        None, flag="HAS_SOFTCAP", arg="softcap", off=1.0, schema="float?",
        exact=(float, type(None)), check=_check_soft_cap, example=3.0,
        normalize=lambda v: None if v is None else float(v),
        doc="a finite float > 0 (Gemma 2: 50.0 for attention), within float32's range / "
            "log2(e): the logits ``s = scale·q·k`` become ``cap·tanh(s / cap)`` before any "
            "bias and the softmax.")
    sinks: torch.Tensor | None = _call(
        flag="HAS_SINKS", arg="sinks_ptr", merge=True, check_values=_sink_values,
        example=(-2.0, 3.0),
        doc="``[num_q_heads]`` float32 on the query's device, one logit per head added to "
            "the softmax denominator only (gpt-oss's attention sinks): ``out = Σ "
            "exp(s_p)·v_p / (exp(sink) + Σ exp(s_p))``; the LSE is the log of that whole "
            "denominator (a row with no key: out 0, LSE = sink). ``-inf`` is no sink.")
    alibi_slopes: torch.Tensor | None = _call(
        flag="HAS_ALIBI", arg="alibi_ptr", check_values=_finite_slopes, example=(0.0, 0.3),
        doc="``[num_q_heads]`` float32 on the query's device, finite: ALiBi (Press et al., "
            "ICLR 2022; BLOOM, MPT, Falcon) adds ``slope_h · (p - i)`` to the logit of key "
            "``p`` for the query at ``i``, after the soft-cap.")
    batch_invariant: bool = _plan(
        False, flag="BATCH_INVARIANT", arg=None, off=None, schema="bool", exact=(bool,),
        check=_check_bool, example=True,
        doc="``True`` makes each sequence's output bitwise identical whatever else is in the "
            "batch and whatever the batch size (a fixed split size in tokens; the vLLM "
            "batch-invariant / SGLang deterministic modes). Costs some speed on batches "
            "that a batch-wide split count would balance better. A Python bool.")

    def __post_init__(self):
        # the values the kernels take (a checked int soft-cap becomes a float, a window past
        # int32 is clamped): a launcher's specialization never depends on how they were typed
        for name in PLAN:
            value = getattr(self, name)
            normal = OPTIONS[name].normalize(value)
            if normal is not value:
                object.__setattr__(self, name, normal)

    def key(self) -> tuple:
        """The plan-time values, in field order (a part of the launchers' static key)."""
        return tuple(getattr(self, n) for n in PLAN)

    def constexprs(self, merge: bool = False) -> dict[str, bool]:
        """The plan-time flags of the main kernel (``merge``: of the merge kernels): on when
        the value is not the default (an option with ``flag_value``: the value)."""
        return {o.flag: getattr(self, n) if o.flag_value else getattr(self, n) != DEFAULTS[n]
                for n, o in OPTIONS.items() if o.when == "plan" and (o.merge or not merge)}

    def kernel_args(self, merge: bool = False) -> dict[str, Any]:
        """The plan-time runtime arguments of the main kernel (``merge``: of the merges):
        the value when on, the option's ``off`` value when off."""
        return {o.arg: getattr(self, n) if getattr(self, n) != DEFAULTS[n] else o.off
                for n, o in OPTIONS.items()
                if o.when == "plan" and o.arg is not None and (o.merge or not merge)}


#: name -> declaration, in field order
OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(DecodeOptions)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(DecodeOptions)}
PLAN = tuple(n for n, o in OPTIONS.items() if o.when == "plan")
CALL = tuple(n for n, o in OPTIONS.items() if o.when == "call")
#: (name, kernel argument, flag, in the merge) of the per-call options: a recorded launch's
#: slots
CALL_ARGS = tuple((n, OPTIONS[n].arg, OPTIONS[n].flag, OPTIONS[n].merge) for n in CALL)
DEFAULT = DecodeOptions()

#: The main kernel's ``VARIANTS`` constexpr: every option's flag, one field each in field
#: order (``Variants(HAS_WINDOW=..., HAS_SOFTCAP=..., HAS_SINKS=..., ...)``). The kernel and
#: its steps read ``VARIANTS.<FLAG>``, so a new option's flag reaches the token loop
#: (``kernels/steps.py``) without a new parameter in the kernels that pass it on.
Variants = NamedTuple("Variants", [(o.flag, Any) for o in OPTIONS.values()])


def variants(options: DecodeOptions, calls=frozenset()) -> Variants:
    """The kernel's ``VARIANTS`` for plan-time ``options`` and the names of the per-call
    options that are on (``calls``)."""
    return Variants(**options.constexprs(), **{o.flag: n in calls for n, o in OPTIONS.items()
                                               if o.when == "call"})


def _unexpected(where: str, name: str) -> None:
    raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")


def is_default(name: str, value: Any) -> bool:
    default = DEFAULTS[name]
    return value is None if default is None else (value is not None and value == default)


def plan_options(kw: dict, where: str = "plan_decode") -> DecodeOptions:
    """The plan-time options of keywords ``kw``, checked (TypeError/ValueError naming the
    argument; an unknown or per-call keyword is a TypeError, as Python's own) and
    normalized."""
    if not kw:
        return DEFAULT
    for name, value in kw.items():
        option = OPTIONS.get(name)
        if option is None or option.when != "plan":
            _unexpected(where, name)
        option.check(name, value)
    return DecodeOptions(**kw)


def call_options(kw: dict, num_q_heads: int, device: torch.device,
                 where: str = "run") -> dict[str, torch.Tensor]:
    """The per-call options of keywords ``kw`` that are on, in field order, checked as
    ``[num_q_heads]`` float32 tensors on ``device`` and made contiguous (the kernels index
    them by head)."""
    on = {}
    for name in kw:
        option = OPTIONS.get(name)
        if option is None or option.when != "call":
            _unexpected(where, name)
    for name in CALL:
        t = kw.get(name)
        if t is not None:
            V.check_head_tensor(name, t, num_q_heads, device)
            on[name] = t if t.stride(0) == 1 else t.contiguous()
    return on


def split(kw: dict, num_q_heads: int, device: torch.device,
          where: str = "paged_decode") -> tuple[DecodeOptions, dict[str, torch.Tensor]]:
    """``paged_decode``'s variant keywords as (plan-time options, per-call tensors that are
    on), each checked."""
    plan = {n: v for n, v in kw.items() if n not in CALL}
    calls = {n: v for n, v in kw.items() if n in CALL}
    return plan_options(plan, where), call_options(calls, num_q_heads, device, where)


def fast_key(kw: dict) -> tuple | None:
    """The plan-time part of a one-shot call's static key, without checks: ``None`` unless
    every keyword is a plan-time option of an exact type or a per-call one at ``None`` (a
    per-call tensor, a bool ``window_left`` or a numpy value goes through the full check)."""
    if not kw:
        return DEFAULT_KEY
    for name, value in kw.items():
        option = OPTIONS.get(name)
        if option is None or (type(value) not in option.exact if option.when == "plan"
                              else value is not None):
            return None
    return tuple(kw.get(n, DEFAULTS[n]) for n in PLAN)


DEFAULT_KEY = DEFAULT.key()


def refused(kw: dict) -> str | None:
    """The first option of ``kw`` not at its default (what an impl without variants
    refuses), or ``None``."""
    return next((n for n, v in kw.items() if n in OPTIONS and not is_default(n, v)), None)


def check_values(calls: dict[str, torch.Tensor]) -> None:
    """The value checks of the per-call tensors that are on (a host sync on CUDA)."""
    for name, t in calls.items():
        check = OPTIONS[name].check_values
        if check is not None:
            check(name, t)


def schema() -> str:
    """The options as a torch.library schema fragment, ``"int window_left=-1, ..."``."""
    def literal(v):
        return "None" if v is None else ("True" if v is True else "False" if v is False
                                         else repr(v))
    return ", ".join(f"{o.schema} {n}={literal(DEFAULTS[n])}" for n, o in OPTIONS.items())


def docs(indent: int = 8, names: tuple = tuple(OPTIONS)) -> str:
    """The Args entries of ``names`` for a docstring (from each field's ``doc``)."""
    import textwrap

    lines = []
    for n in names:
        lines += textwrap.wrap(f"{n}: {OPTIONS[n].doc}", width=95, break_on_hyphens=False,
                               break_long_words=False, initial_indent=" " * indent,
                               subsequent_indent=" " * (indent + 4))
    return "\n".join(lines)


def signature_params(names: tuple = tuple(OPTIONS)) -> list:
    """``inspect.Parameter``s (keyword-only, with their defaults and annotations) of
    ``names``, for the ``__signature__`` of a function that takes them as ``**kwargs``."""
    import inspect

    hints = {f.name: f.type for f in fields(DecodeOptions)}
    return [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[n],
                              annotation=hints[n]) for n in names]



def with_variants(fn, names: tuple, indent: int = 0):
    """``fn`` takes the options ``names`` as ``**variants``: its ``__signature__`` lists them
    (keyword-only, with their defaults and types, from :class:`DecodeOptions`), and with an
    ``indent`` its docstring's ``<variant options>`` line becomes their Args entries."""
    import inspect

    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    fn.__signature__ = sig.replace(parameters=params + signature_params(names))
    if indent:
        fn.__doc__ = fn.__doc__.replace("<variant options>", docs(indent, names))
    return fn
