"""The production kernel's plan: :class:`DecodePlan` (built by ``plan_decode``, run once per
layer), the value checks it holds (:class:`ValueChecks`) and its result type
(:class:`DecodeOutput`).

Below :mod:`pagedattn.api` (which re-exports these names) and :mod:`pagedattn.one_shot`
(whose cached templates are plans), above ``_validation``, ``options`` and ``_env``. The
launcher (and so Triton) is imported lazily, on a plan's first launch.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import NamedTuple

import torch

from pagedattn import _errors
from pagedattn import _validation as V
from pagedattn import options as O
from pagedattn._env import num_devices, on_device
from pagedattn.options import DecodeOptions
from pagedattn.spec import LaunchSpec

#: the largest scale the kernels take (they multiply it by log2(e) in float32)
_SMAX = V.KERNEL_SCALAR_MAX
_STRIDED = torch.strided  # the dense layout, tested by identity on the fast path
_CALL_NAMES = frozenset(O.CALL)  # the per-call options' keywords of DecodePlan.run
_NO_GUARD = contextlib.nullcontext()  # stateless: one for every launch without a device guard


def _auto_launcher_class():
    from pagedattn.launch.decode import AutoLauncher

    return AutoLauncher


def _one_shot_launcher():
    from pagedattn.launch.decode import one_shot_launcher

    return one_shot_launcher


class DecodeOutput(NamedTuple):
    """``paged_decode(..., return_lse=True)`` result."""

    out: torch.Tensor  # the query's shape and dtype
    # [batch, num_q_heads] (or [batch, q_len, num_q_heads]) float32, natural log; -inf for
    # a row that saw no key (the sink with sinks)
    lse: torch.Tensor


def nhd_views(key_cache, value_cache, kv_layout):
    """The caches as the kernels see them: NHD-shaped views (``[num_pages, page_size,
    num_kv_heads, head_dim]``) whose strides carry an HND layout; NHD caches as they are."""
    if kv_layout == "HND":
        return key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    return key_cache, value_cache


class PlanBase(ABC):
    """What the decode, attention and MLA plans share (:class:`DecodePlan`,
    :class:`pagedattn.attention.AttentionPlan`, :class:`pagedattn.mla.MLADecodePlan`).

    * the :class:`~pagedattn.spec.LaunchSpec` (``spec``), its fields also attributes of the
      plan (read on the host path of every run);
    * the metadata tensors read on the device at every run (attributes by their names) and
      the shapes they were planned with (:meth:`check_tables`: the entry counts the kernels
      index);
    * the launchers, built on first use under a device guard (:meth:`_engine`: importing
      Triton waits for a real launch) and kept per key (an attention plan's query row
      count; ``None`` for the others);
    * the caches as the kernels see them (:meth:`kernel_views`), the outputs
      (:meth:`outputs`) and the device guard (:meth:`guard`).

    A subclass builds its launcher in :meth:`_build_launcher`.
    """

    def __init__(self, spec: LaunchSpec, tables: dict, shapes: dict[str, tuple], *,
                 kv_layout: str = "NHD", contiguous: tuple[str, ...] = ()):
        self.spec = spec
        for name, value in spec.as_dict().items():
            setattr(self, name, value)
        for name, t in tables.items():
            setattr(self, name, t)
        #: (name, planned shape, whether it must be contiguous) of each metadata tensor
        self._table_checks = tuple((name, torch.Size(shape), name in contiguous)
                                   for name, shape in shapes.items())
        self.kv_layout = kv_layout
        self.on_cpu = spec.device.type == "cpu"
        # a device guard is needed only where another GPU may be current, and the
        # interpreter's lock on the CPU
        self._guarded = self.on_cpu or spec.device.type == "cuda" and num_devices() > 1
        self._launchers: dict = {}
        self.last_compiled: dict[str, object] = {}

    @abstractmethod
    def _build_launcher(self, key):
        """The launcher of ``key``, new (called once a key, by :meth:`_engine`)."""

    def _engine(self, key=None):
        """The launcher of ``key`` (built now, under the device guard, if new)."""
        launcher = self._launchers.get(key)
        if launcher is None:
            with on_device(self.device):
                launcher = self._launchers[key] = self._build_launcher(key)
        return launcher

    def guard(self):
        """The plan's device made current for a launch (nothing where only one GPU is)."""
        return on_device(self.device) if self._guarded else _NO_GUARD

    def check_tables(self) -> None:
        """The metadata tensors still have the shapes the plan was built for: a
        ``ValueError`` naming the one that does not (resized in place after the plan was
        built: the kernels would read past it)."""
        for name, shape, contiguous in self._table_checks:
            t = getattr(self, name)
            if t.shape != shape or (contiguous and t.stride(0) != 1):
                V.fail(ValueError, name, f"the planned shape {list(shape)}"
                       f"{', contiguous' if contiguous else ''} (resized after the plan was "
                       "built?)", f"{list(t.shape)}" + (f", strides {t.stride()}"
                                                         if contiguous else ""))

    def kernel_views(self, key_cache, value_cache):
        """The caches as the kernels see them (:func:`nhd_views`)."""
        if self.kv_layout != "NHD":
            return nhd_views(key_cache, value_cache, self.kv_layout)
        return key_cache, value_cache

    def outputs(self, query, out, return_lse: bool, lse_shape: tuple, *,
                padded: bool = False):
        """``(out, lse)`` of a run: ``out`` as given, else new of the query's shape and
        dtype (contiguous; zeros when ``padded``: rows the kernels leave), and the float32
        LSE of ``lse_shape`` (``-inf`` when ``padded``) or ``None``."""
        if out is None:
            if padded:
                out = torch.zeros_like(query, memory_format=torch.contiguous_format)
            elif type(query) is torch.Tensor:  # checked: no size to parse
                out = torch.empty_like(query, memory_format=torch.contiguous_format)
            else:
                out = torch.empty(query.shape, dtype=self.q_dtype, device=self.device)
        if not return_lse:
            return out, None
        if padded:
            return out, torch.full(lse_shape, float("-inf"), dtype=torch.float32,
                                   device=self.device)
        return out, torch.empty(lse_shape, dtype=torch.float32, device=self.device)


class ValueChecks:
    """The checks of a decode call that read its data: lengths in ``[0, max_pages *
    page_size]`` (and 2^30), used page ids in ``[0, num_pages)``, tensor fp8 scales and
    per-call variants in range, and the float32 bounds of
    ``_validation.check_value_ranges``. Built once with the facts a plan fixes (page size,
    window, query length, layout); :meth:`check` takes the call's tensors.

    They run for CPU tensors under ``validate=None`` and on any device under
    ``validate=True`` (one host sync, refused under CUDA-graph capture); a failure is a
    ValueError naming the argument, raised before any launch."""

    __slots__ = ("page_size", "window_left", "q_len", "kv_layout")

    def __init__(self, page_size: int, window_left: int, q_len: int, kv_layout: str):
        self.page_size, self.q_len, self.kv_layout = page_size, q_len, kv_layout
        # the kernels hold an int32 window: a wider one sees every key, as -1 does
        self.window_left = min(int(window_left), O.INT32_MAX)

    def check(self, query, key_cache, value_cache, block_tables, context_lens, validate=None,
              *, scale=None, k_scale=None, v_scale=None, calls=None) -> None:
        """Run the checks when ``validate`` and the query's device call for them.
        ``calls``: the per-call variant tensors that are on
        (:func:`pagedattn.options.call_options`)."""
        on_cpu = query.device.type == "cpu"
        if not V.value_checks_due(validate, query.device):
            return
        if validate and not on_cpu and torch.cuda.is_current_stream_capturing():
            raise ValueError("validate: True needs a device-to-host sync, which CUDA-graph "
                             "capture forbids; validate eagerly before capturing, or pass "
                             "validate=None")
        V.check_values(block_tables, context_lens, key_cache.shape[0], self.page_size,
                       window_left=self.window_left, q_len=self.q_len)
        V.check_scalar_values((("k_scale", k_scale), ("v_scale", v_scale)))
        if calls:
            O.check_values(calls)
        V.check_value_ranges(query, key_cache, value_cache, block_tables, context_lens,
                             kv_layout=self.kv_layout, scale=scale, k_scale=k_scale,
                             v_scale=v_scale, window_left=self.window_left, q_len=self.q_len)


class DecodePlan(PlanBase):
    """A decode step's launch plan for the production kernel: built once per step by
    :func:`plan_decode`, run once per layer with :meth:`run`.

    The plan owns its workspace and launch configuration, all decided from shapes. It keeps
    references to ``block_tables`` and ``context_lens`` and reads them on the device at every
    run, so a CUDA graph captured around :meth:`run` replays correctly after the caller updates
    them in place (same shapes, lengths within ``max_pages * page_size``). One plan serves one
    stream at a time (its workspace is reused by each run, and so are the arrival counters
    in it through which a 16-bit cache's plan merges split rows inside its main kernel).
    """

    def __init__(self, block_tables, context_lens, *, num_q_heads, num_kv_heads, head_dim,
                 page_size, q_dtype, kv_dtype, kv_layout, num_splits, ragged=False, q_len=1,
                 options: DecodeOptions = O.DEFAULT, one_shot=False, table_shape=None,
                 device=None):
        # a one-shot template (pagedattn.one_shot.TEMPLATES) holds no tensor: it is built
        # from the table's ``table_shape`` and ``device``, and each call passes its own tables
        batch, max_pages = block_tables.shape if table_shape is None else table_shape
        # numpy integers pass validation (numbers.Integral); the launcher takes Python ints
        spec = LaunchSpec(
            batch=batch, max_pages=max_pages, num_q_heads=int(num_q_heads),
            num_kv_heads=int(num_kv_heads), head_dim=int(head_dim), page_size=int(page_size),
            q_dtype=q_dtype, kv_dtype=kv_dtype,
            device=block_tables.device if device is None else device, q_len=int(q_len),
            options=options, num_splits=None if num_splits is None else int(num_splits),
            ragged=ragged)
        super().__init__(spec, dict(block_tables=block_tables, context_lens=context_lens),
                         dict(block_tables=(batch, max_pages), context_lens=(batch,)),
                         kv_layout=kv_layout)
        # a one-shot plan (paged_decode) runs once, through the launcher that every one-shot
        # call of its spec shares (launch.decode.one_shot_launcher), which takes a fresh
        # workspace per launch
        self._one_shot = one_shot
        # the metadata's shapes, compared at every run (a caller may resize them in place)
        self._table_shape = torch.Size((batch, max_pages))
        self._lens_shape = torch.Size((batch,))
        head_dim, num_q_heads = self.head_dim, self.num_q_heads
        # a multi-token plan takes 4-D queries [batch, q_len, num_q_heads, head_dim]
        self.q_shape = torch.Size((batch, num_q_heads, head_dim) if self.q_len == 1
                                  else (batch, self.q_len, num_q_heads, head_dim))
        self._lse_shape = tuple(self.q_shape[:-1])  # a tuple parses faster than a Size
        # FlashAttention's one-token query [batch, 1, num_q_heads, head_dim] (run_4d)
        self._q_shape_4d = (torch.Size((batch, 1, num_q_heads, head_dim)) if self.q_len == 1
                            else None)
        self._cache_tail = torch.Size(
            (self.page_size, self.num_kv_heads, head_dim) if kv_layout == "NHD"
            else (self.num_kv_heads, self.page_size, head_dim))
        self._default_scale = head_dim**-0.5
        # the checks that read the data (CPU tensors, or validate=True)
        self.checks = ValueChecks(self.page_size, options.window_left, self.q_len, kv_layout)

    def _build_launcher(self, key):
        if self._one_shot:  # shared by every one-shot call of the spec: no workspace
            return _one_shot_launcher()(replace(self.spec, ragged=False))
        return _auto_launcher_class()(self.spec)

    def run(self, query, key_cache, value_cache, *, scale=None, k_scale=None, v_scale=None,
            out=None, return_lse=False, validate=None, **variants):
        """One layer's decode: ``softmax(q·Kᵀ·scale)·V`` over each sequence's tokens (with
        the plan's variants and query length).

        Args:
            query: ``[batch, num_q_heads, head_dim]`` of the plan's ``q_dtype`` (``[batch,
                q_len, num_q_heads, head_dim]`` for a plan with ``q_len > 1``); any strides.
            key_cache, value_cache: the plan's layout and ``kv_dtype``, ``num_kv_heads``,
                ``page_size`` and ``head_dim`` (see :func:`paged_decode`).
            scale, k_scale, v_scale, out, return_lse, validate: as in :func:`paged_decode`.
            variants: the per-call options of :mod:`pagedattn.options`, per-layer
                ``[num_q_heads]`` float32 tensors on the plan's device, or ``None``; as in
                :func:`paged_decode`:
<variant options>

        Returns:
            ``out`` or ``DecodeOutput(out, lse)`` as :func:`paged_decode`.

        Raises:
            TypeError, ValueError: an input that does not match the plan (the message names
                the argument), or what :func:`paged_decode` refuses.
        """
        if (self.block_tables.shape != self._table_shape
                or self.context_lens.shape != self._lens_shape):
            self.check_tables()
        variants = self.check_call(query, key_cache, value_cache, scale, k_scale, v_scale,
                                   out, return_lse, validate, variants)
        if self.on_cpu or validate or V.DEBUG_CHECKS:
            self.checks.check(query, key_cache, value_cache, self.block_tables,
                              self.context_lens, validate, scale=scale, k_scale=k_scale,
                              v_scale=v_scale, calls=variants)
        return self.launch(query, key_cache, value_cache, scale, k_scale, v_scale, out,
                           return_lse, variants)

    def check_call(self, query, key_cache, value_cache, scale, k_scale, v_scale, out,
                   return_lse, validate, variants: dict) -> dict:
        """:meth:`run`'s metadata checks of a call (no data read): the serving call in one
        expression (:meth:`is_plain_call`), anything else through ``check_run`` and the
        per-call variants' checks. Returns the per-call variant tensors that are on
        (``pagedattn.options.call_options``; empty for none), as :meth:`launch` takes them.
        ``compat.flash_attn`` runs it before it writes the caller's cache."""
        if variants and all(v is None for v in variants.values()) \
                and variants.keys() <= _CALL_NAMES:  # every per-call option spelled off
            variants = {}
        if variants or not self.is_plain_call(query, key_cache, value_cache, scale, k_scale,
                                              v_scale, out, return_lse, validate):
            V.check_run(self, query, key_cache, value_cache, scale=scale, k_scale=k_scale,
                        v_scale=v_scale, out=out, return_lse=return_lse, validate=validate)
            variants = O.call_options(variants, self.num_q_heads, self.device)
        return variants

    def run_4d(self, query, key_cache, value_cache, scale, return_lse):
        """FlashAttention's repeated decode call (``compat.flash_attn``'s fast path): a
        ``[batch, 1, num_q_heads, head_dim]`` query on a one-token plan, the same memory as the
        3-D one, launched as it is (no view either way); the output is ``[batch, 1,
        num_q_heads, head_dim]``, the LSE ``[batch, num_q_heads]``. ``None`` for any call that
        is not the plain one: the caller then goes through :meth:`run`, whose checks name the
        argument."""
        q_shape = self._q_shape_4d
        if (self.block_tables.shape != self._table_shape
                or self.context_lens.shape != self._lens_shape):
            self.check_tables()
        if q_shape is None or not self.is_plain_call(query, key_cache, value_cache, scale,
                                                     None, None, None, return_lse, None,
                                                     q_shape):
            return None
        if self.on_cpu:  # as run: the value checks (on a 3-D view; the CPU only)
            self.checks.check(query[:, 0], key_cache, value_cache, self.block_tables,
                              self.context_lens, scale=scale)
        return self.launch(query, key_cache, value_cache, scale, None, None, None, return_lse)

    def is_plain_call(self, query, key_cache, value_cache, scale, k_scale, v_scale, out,
                      return_lse, validate, q_shape=None) -> bool:
        """The serving call, checked in one expression (the host path is the eager time of a
        small batch): plain tensors of the plan's shapes, dtypes and device, float or absent
        scales, ``validate=None``. Anything else goes through the full check, which raises
        the error naming the argument. ``q_shape``: the query's shape when not the plan's
        (:meth:`run_4d`)."""
        device, strided = self.device, _STRIDED
        q_shape = self.q_shape if q_shape is None else q_shape
        # a sparse tensor is a torch.Tensor too: the layout test keeps it off the fast path
        return (type(query) is torch.Tensor and query.shape == q_shape
                and query.dtype == self.q_dtype and query.device == device
                and query.layout is strided
                and type(key_cache) is torch.Tensor and key_cache.dtype == self.kv_dtype
                and key_cache.dim() == 4 and key_cache.shape[1:] == self._cache_tail
                and key_cache.device == device and key_cache.layout is strided
                and type(value_cache) is torch.Tensor and value_cache.shape == key_cache.shape
                and value_cache.dtype == self.kv_dtype and value_cache.device == device
                and value_cache.layout is strided
                and (out is None or (type(out) is torch.Tensor and out.shape == q_shape
                                     and out.dtype == self.q_dtype and out.device == device
                                     and out.layout is strided
                                     and out.is_contiguous()
                                     and ((o := out.untyped_storage().data_ptr())
                                          != query.untyped_storage().data_ptr()
                                          or out.data_ptr() == query.data_ptr()
                                          and out.stride() == query.stride())
                                     and o != key_cache.untyped_storage().data_ptr()
                                     and o != value_cache.untyped_storage().data_ptr()))
                # in range (a NaN fails every comparison): the full check names the argument
                and (scale is None or (type(scale) is float and -_SMAX <= scale <= _SMAX))
                and (k_scale is None or (type(k_scale) is float and 0.0 < k_scale <= _SMAX
                                         and (scale is None or abs(scale * k_scale) <= _SMAX)))
                and (v_scale is None or (type(v_scale) is float and 0.0 < v_scale <= _SMAX))
                and (return_lse is False or return_lse is True) and validate is None)

    def launch(self, query, key_cache, value_cache, scale, k_scale, v_scale, out,
               return_lse, calls=None, tables=None):
        """The run after validation: it checks nothing, so only a caller that has run
        :meth:`check_call` (or ``paged_decode``'s checks) and the value checks comes here
        (the one-shot path, ``compat.flash_attn``).
        ``calls``: the per-call variant tensors that are on, contiguous
        (:func:`pagedattn.options.call_options`).
        ``tables``: a one-shot call's ``(block_tables, context_lens)`` for a template plan;
        the call then returns ``(result, compiled)`` (a shared template keeps no
        ``last_compiled``)."""
        # (PlanBase's outputs, kernel_views and guard, inlined: this is the host path of
        # every decode call, where each Python call is a measurable share)
        _errors.raise_pending(self.device)  # what an earlier launch found (no sync)
        if out is None:  # the query's shape, dtype and device (checked): no size to parse
            out = (torch.empty_like(query, memory_format=torch.contiguous_format)
                   if type(query) is torch.Tensor
                   else torch.empty(self.q_shape, dtype=self.q_dtype, device=self.device))
        lse = (torch.empty(self._lse_shape, dtype=torch.float32, device=self.device)
               if return_lse else None)
        if self.batch > 0 and self.num_q_heads > 0:
            if self.kv_layout != "NHD":
                key_cache, value_cache = nhd_views(key_cache, value_cache, self.kv_layout)
            sm_scale = self._default_scale if scale is None else float(scale)
            engine = self._launchers.get(None) or self._engine()
            block_tables, context_lens = tables or (self.block_tables, self.context_lens)
            with on_device(self.device) if self._guarded else _NO_GUARD:
                compiled = engine.launch(
                    query, key_cache, value_cache, block_tables, context_lens, out,
                    lse, scale=sm_scale, k_scale=k_scale, v_scale=v_scale, calls=calls)
        else:
            compiled = {}
        result = DecodeOutput(out, lse) if lse is not None else out
        if tables is not None:
            return result, compiled
        self.last_compiled = compiled
        return result


O.with_variants(DecodePlan.run, O.CALL, indent=16)
