"""One attention layer in pagedattn's terms, shared by the serving frameworks' backends
(``vllm``, ``sglang``): :class:`LayerOptions`, and the checks that refuse, when the framework
configures the layer, any value the kernels would refuse later at serving time.

Pure Python over torch: nothing here imports a framework. A refusal is a ``TypeError`` or
``ValueError`` whose message starts with the backend's name and then the framework's own
option name (``pagedattn's vLLM attention backend: scale: expected ...``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from pagedattn import _validation as V
from pagedattn.options import OPTIONS

#: the fp8 dtypes a cache may hold (per-tensor ``k_scale`` / ``v_scale``)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: the query (model) dtypes the kernels take
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_SIZES = range(V.MIN_HEAD_DIM, V.MAX_HEAD_DIM + 1)


@dataclass(frozen=True)
class LayerOptions:
    """One layer's attention in pagedattn's terms: the shapes and dtypes a plan needs, the
    plan-time variants (:attr:`variant`) and what is passed at each run (``scale``, ALiBi).
    Sinks and fp8 scales are the framework's tensors, read at each call."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype  # the cache's dtype: q_dtype or an fp8 dtype
    window_left: int = -1
    logits_soft_cap: float | None = None
    alibi_slopes: torch.Tensor | None = None

    @property
    def variant(self) -> tuple[int, float | None]:
        """The plan-time variants: layers that share them share a step's plan."""
        return self.window_left, self.logits_soft_cap

    @property
    def fp8(self) -> bool:
        return self.kv_dtype in FP8_DTYPES


class Refusals:
    """The checks of one backend, each naming the framework's option after ``who``
    (``"pagedattn's vLLM attention backend"``)."""

    def __init__(self, who: str) -> None:
        self.who = who

    def refuse(self, exc: type[Exception], option: str, expected: str, got: Any) -> NoReturn:
        raise exc(f"{self.who}: {option}: expected {expected}, got {got!r}")

    def int_at_least(self, option: str, value: Any, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            self.refuse(TypeError, option, "an int", type(value).__name__)
        if value < low:
            self.refuse(ValueError, option, f"an int >= {low}", value)
        return int(value)

    def real(self, option: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            self.refuse(TypeError, option, "a float", type(value).__name__)
        if not math.isfinite(value):
            self.refuse(ValueError, option, "a finite float", value)
        return float(value)

    def _as_kernels(self, option: str, check, *args) -> None:
        """Run one of the kernels' own checks, its message renamed to ``option``."""
        try:
            check(*args)
        except (TypeError, ValueError) as e:
            name, _, rest = str(e).partition(": ")
            raise type(e)(f"{self.who}: {option}: {rest if rest else name}") from None

    def scale(self, option: str, value: Any) -> float:
        """The softmax scale: a finite float the kernels hold once multiplied by log2(e)
        (``|scale| <= 2.36e38``, the check :func:`pagedattn.plan_decode`'s ``run`` makes)."""
        scale = self.real(option, value)
        self._as_kernels(option, V.check_softmax_scale, scale)
        return scale

    def soft_cap(self, option: str, value: Any) -> float | None:
        """``None`` or 0: no soft-cap; else a float in ``[ln 2 / FLOAT32_MAX, 2.36e38]`` (the
        kernels take ``cap`` and ``ln 2 / cap``, both finite in float32: the check of the
        ``logits_soft_cap`` option)."""
        if value is None or self.real(option, value) == 0:
            return None
        if value < 0:
            self.refuse(ValueError, option, "None, 0 or a positive float", value)
        self._as_kernels(option, OPTIONS["logits_soft_cap"].check, "logits_soft_cap",
                         float(value))
        return float(value)

    def window(self, option: str, window: Any, counts_the_token: bool) -> int:
        """``window_left`` for a framework's window: ``None`` (or -1 where the framework
        says so) is no window. ``counts_the_token``: the framework's window ``w`` counts the
        token itself (vLLM: ``window_left = w - 1``), else it is ``window_left`` already."""
        if window is None:
            return -1
        if counts_the_token:
            return self.int_at_least(option, window, 1) - 1
        return self.int_at_least(option, window, -1)

    def head_floats(self, option: str, values: Any, num_q_heads: int) -> torch.Tensor:
        """ALiBi slopes: ``num_q_heads`` floats the kernels hold (``|slope| <= 2.36e38``), as
        a float32 tensor."""
        try:
            t = torch.as_tensor(values, dtype=torch.float32).flatten()
        except (TypeError, ValueError, RuntimeError):
            self.refuse(TypeError, option, f"{num_q_heads} floats (one per head)",
                        type(values).__name__)
        if t.numel() != num_q_heads:
            self.refuse(ValueError, option, f"{num_q_heads} finite floats (one per head)",
                        values)
        # float32's range: a float64 slope past it is inf here, and refused
        self._as_kernels(option, OPTIONS["alibi_slopes"].check_values, "alibi_slopes", t)
        return t

    def heads(self, num_q_heads: Any, num_kv_heads: Any, head_dim: Any,
              names: tuple[str, str, str]) -> tuple[int, int, int]:
        """The head counts and size: ``num_q_heads`` a multiple of ``num_kv_heads``, a head
        size the kernels take (16 to 256); ``names``: the framework's names of the three."""
        q_name, kv_name, dim_name = names
        num_q_heads = self.int_at_least(q_name, num_q_heads, 1)
        head_dim = self.int_at_least(dim_name, head_dim, 1)
        if head_dim not in HEAD_SIZES:
            self.refuse(ValueError, dim_name, f"{V.MIN_HEAD_DIM} to {V.MAX_HEAD_DIM}",
                        head_dim)
        num_kv_heads = self.int_at_least(kv_name, num_kv_heads, 1)
        if num_q_heads % num_kv_heads:
            self.refuse(ValueError, kv_name, f"a divisor of {q_name}={num_q_heads}",
                        num_kv_heads)
        return num_q_heads, num_kv_heads, head_dim

