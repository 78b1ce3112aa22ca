"""Launcher of the production kernel (``impl="auto"``): the engine behind a decode plan.

:class:`AutoLauncher` is built once per decode step from shapes and dtypes (never from the
values of ``context_lens``: no host sync) and launched once per layer. It asks
:mod:`pagedattn.launch.policy` for the tiles and the split rules
(:func:`~pagedattn.launch.policy.plan_launch`), builds the grid, the workspace and the argument
lists, and owns them; the kernel plans its token-balanced splits on the device every launch, so
a CUDA graph captured around a launch replays correctly for any new lengths and block tables
within the table's capacity.

Grid and workspace. Each program is one split unit (row ``r``, kv head). The device picks
``chunk = roundup(max(min_chunk, ceil(total_tokens · num_kv_heads / target_units)), BLOCK_N)``
with ``target_units = SMs · ctas_per_sm`` (about one wave of resident programs), so
``Σ_b ceil(len_b / chunk) ≤ target_units / num_kv_heads + batch``: the grid is
``rows_max · num_kv_heads`` programs with ``rows_max = batch + ceil(target_units /
num_kv_heads)`` (``batch · num_splits`` when forced), and programs past the last real row exit
after the scan of ``context_lens``.

One unit per sequence. When the shapes rule out any split (``num_splits=1``, or a table whose
capacity ``max_pages · page_size`` is at most the smallest chunk), the grid is ``batch ·
num_kv_heads`` programs, one per (sequence, kv head), the kernel skips its scans of
``context_lens`` (``ONE_UNIT``) and no merge is launched.

The merge. A launcher that owns its workspace (a plan's) folds the merge into the main kernel
where the policy says so (``LaunchPlan.fold_merge``: 16-bit caches, a per-group merge or a
per-head one of at most ``fold_max_rows`` rows per sequence, then merged per group)
(``FOLD_MERGE``): the
workspace's ``seq_rows`` part holds one int32 arrival counter per (sequence, kv head) instead,
zeroed once by :meth:`AutoLauncher.new_workspace` and left at zero by every launch (the last
unit of each pair resets its own), so a launch is the main kernel alone. Otherwise the merge
kernel follows the main one (the one-shot launcher: a fresh workspace per launch, whose
counters would need a fill).

Launching. :meth:`AutoLauncher.kernel_args` builds both kernels' keyword arguments (a pure
function of the call). The first launch of a binding (the tensors' dtypes, strides and
16-byte alignment, LSE on or off, the per-call variants that are on:
see :meth:`AutoLauncher.launch`) goes through Triton's own ``kernel[grid](**kwargs)``; on
the Tritons whose launch path was read (3.6-3.9), later launches of the binding go through its
record (:mod:`pagedattn.launch.recorded`: the argument list with every per-call argument a
slot, handed to Triton's C launch). Everything else Triton specializes on (constexprs,
integers, launch options) is fixed by the launcher, so the records live in the launcher
object (one per plan). A one-shot ``paged_decode`` launches through the launcher that
:func:`one_shot_launcher` keeps per :class:`~pagedattn.spec.LaunchSpec` (a bounded LRU
cache), with a fresh workspace per call, so its repeats take the recorded path too. On any
other Triton version or under the interpreter every launch goes through ``kernel[grid]``;
launch hooks (profilers) are honoured on both paths. Calls with tensor scales always launch
through ``kernel[grid]``; the per-call variants of :mod:`pagedattn.options` (``sinks``,
``alibi_slopes``: per-layer tensors, validated as ``[num_q_heads]`` float32) are per-call
slots of the record.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

import torch

from pagedattn import _errors
from pagedattn._env import device_name_for, is_interpreter, num_sms
from pagedattn._validation import FP8_DTYPES
from pagedattn.kernels.decode import (
    _merge_per_group_kernel,
    _merge_per_head_kernel,
    _paged_decode_kernel,
)
from pagedattn.launch import _triton_compat as tc
from pagedattn.launch import policy
from pagedattn.launch._common import LOG2E, block_d
from pagedattn.launch.flags import UNBOUND, Binding, KernelFlags, kernel_flags
from pagedattn.launch.policy import DecodeConfig
from pagedattn.launch.recorded import RecordedLaunch
from pagedattn.options import CALL_ARGS
from pagedattn.spec import LaunchSpec


def fp8_v_pairs(value_cache: torch.Tensor, head_dim: int) -> int:
    """The ``FP8_V_PAIRS`` constexpr of a launch: 1 (e4m3) or 2 (e5m2) when an fp8 value cache
    can be read as 16-bit pairs of dims (unit dim stride, the other strides multiples of 16
    bytes, an even head_dim, a 16-byte aligned base: all part of a launch's binding), else 0
    (bytes, as before). Pairs transpose through shared memory like fp16 (docs/perf-notes.md)."""
    if (value_cache.dtype not in FP8_DTYPES or head_dim % 2 or value_cache.stride(-1) != 1
            or any(st % 16 for st in value_cache.stride()[:-1])
            or value_cache.data_ptr() % 16):
        return 0
    return 1 if value_cache.dtype == torch.float8_e4m3fn else 2


def slot_offsets_fit_int32(cache: torch.Tensor, page_size: int, num_kv_heads: int) -> bool:
    """The ``SLOT_OFFSETS_I32`` test of one NHD-shaped cache view (HND is a stride
    permutation): every token's offset within its page, ``slot · stride_tok + kv_head ·
    stride_head``, is below 2^31 elements, so the kernel forms it in int32 and only the
    page's ``page_id · stride_page`` in 64-bit. Strides are part of a launch's binding."""
    return (page_size - 1) * cache.stride(1) + (num_kv_heads - 1) * cache.stride(2) < 2**31


#: the per-call arguments of each kernel, in the order :meth:`AutoLauncher.launch` fills them
#: into a recorded launch (everything else is fixed by the binding and the launcher), then
#: those of the per-call variants (``pagedattn.options.CALL_ARGS``: one pointer each)
_MAIN_SLOTS = ("query_ptr", "key_cache_ptr", "value_cache_ptr", "block_tables_ptr",
               "context_lens_ptr", "out_ptr", "lse_ptr",
               "scale_log2", "k_scale_val", "v_scale_val", "part_ml_ptr", "part_acc_ptr",
               "seq_rows_ptr", "k_scale_ptr", "v_scale_ptr", "errors_ptr", "num_pages")
_MERGE_SLOTS = ("context_lens_ptr", "out_ptr", "lse_ptr", "part_ml_ptr",
                "part_acc_ptr", "seq_rows_ptr")
#: (option name, kernel argument) of the per-call variants each kernel takes
_MAIN_CALLS = tuple((name, arg, flag) for name, arg, flag, _ in CALL_ARGS)
_MERGE_CALLS = tuple((name, arg, flag) for name, arg, flag, merge in CALL_ARGS if merge)
#: bindings kept per launcher (a plan sees one or two in practice: with and without LSE)
_MAX_BINDINGS = 16


class BindingRecord(NamedTuple):
    """A launcher's recorded launches for one binding (:mod:`pagedattn.launch.recorded`)."""

    main: RecordedLaunch
    merge: RecordedLaunch | None  # None: a launch without a merge kernel
    compiled: dict[str, object]  # what launch() returns: the compiled kernels by name


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """Programmatic dependent launch (``griddepcontrol``): compute capability 9.0 and up."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


class AutoLauncher:
    """Everything one decode step launches, decided from shapes: see the module docstring.

    Args:
        spec: the shapes, dtypes, device and plan-time variants of the step
            (:class:`~pagedattn.spec.LaunchSpec`: ``num_splits`` forced splits per sequence
            or ``None``, token-balanced on the device; ``ragged``: the caller knows the batch
            is ragged, from a host copy of the lengths; ``q_len``: query tokens per sequence,
            a constexpr of the kernels; ``options``' per-call fields off).
        config: a :class:`~pagedattn.launch.policy.DecodeConfig` to use instead of
            :func:`~pagedattn.launch.policy.choose_config` (tuning).
        record: record each binding's launch for the direct path of later launches (see the
            module docstring); ``False`` for a launcher that launches once, which saves the
            record's host time.
        workspace: own a workspace, used by every launch (a plan's launcher); ``False`` for a
            launcher shared by one-shot calls (:func:`one_shot_launcher`): each of its
            launches takes a fresh :meth:`new_workspace`. A one-unit launcher's kernels never
            read or write the workspace (its pointers only fill the argument list), so it
            always owns a 16-byte one, shared by every launch, and allocates nothing per call.
    """

    def __init__(self, spec: LaunchSpec, *, config: DecodeConfig | None = None,
                 record: bool = True, workspace: bool = True):
        interpret = is_interpreter()
        device, options = spec.device, spec.options
        on_gpu = device.type == "cuda"
        batch_invariant = options.batch_invariant
        batch, num_q_heads, num_kv_heads = spec.batch, spec.num_q_heads, spec.num_kv_heads
        head_dim, page_size, q_len = spec.head_dim, spec.page_size, spec.q_len
        # the device facts the policy reads: the SM count (4 off a GPU: the interpreter runs
        # programs one by one) and, for its tuned table, the GPU's name
        sms = num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
            if on_gpu else 4
        self.plan = plan = policy.plan_launch(
            spec, config=config, interpret=interpret, sms=sms,
            device_name=device_name_for(device) if on_gpu and config is None else None,
            owns_workspace=workspace)
        self.config = cfg = plan.config
        group = num_q_heads // num_kv_heads
        bd = block_d(head_dim)
        if plan.window_left != options.window_left:  # a window the table fits in: none
            options = replace(options, window_left=plan.window_left)
            spec = replace(spec, options=options)
        #: the spec the kernels see (the plan's window)
        self.spec = spec
        self.q_len, self.options, self.window_left = q_len, options, plan.window_left
        self.batch_invariant = batch_invariant
        self.batch, self.num_q_heads, self.num_kv_heads = batch, num_q_heads, num_kv_heads
        self.group, self.page_size, self.max_pages = group, page_size, plan.max_pages
        self.device = device
        self.block_d = bd
        self.head_dim = head_dim
        self.forced_splits, self.window_unit = plan.forced_splits, plan.window_unit
        self.target_units, self.target_units_ragged = plan.target_units, plan.target_units_ragged
        self.min_chunk, self.one_unit, self.rows_max = plan.min_chunk, plan.one_unit, plan.rows_max
        self.grid = (self.rows_max * num_kv_heads, 1, 1)
        # the plan-time variants' runtime values (fixed for the launcher)
        self.main_variant_args = options.kernel_args()
        self.merge_variant_args = options.kernel_args(merge=True)
        per_group = plan.per_group_merge
        # the per-group merge as a programmatic dependent launch: its programs start during
        # the main kernel's tail and wait in griddepcontrol.wait; the per-head merge (b1, b8)
        # lost in graph replays with it, so it launches as before (docs/perf-notes.md). Off
        # without a merge, under the interpreter and before sm_90: the code is unchanged
        # a folded merge (policy.plan_launch decides): the last unit of each (sequence, kv
        # head) to arrive merges the pair's rows (FOLD_MERGE), counted in the owned
        # workspace, which a launcher that takes a fresh workspace per launch (one-shot
        # calls) cannot keep zeroed without a fill: those launch the merge kernel
        self.fold_merge = plan.fold_merge
        #: whether a launch runs a merge kernel after the main one
        self.launches_merge = not (self.one_unit or self.fold_merge)
        self.pdl = bool(cfg.pdl) and per_group and on_gpu and not interpret and (
            self.launches_merge) and pdl_supported(device.index if device.index is not None
                                                   else torch.cuda.current_device())
        # the main kernel's constexprs (launch.flags): those of the plan now, with every
        # binding flag off; launch() binds them, once per binding (self._bound_flags)
        self._flag_facts = dict(interpret=interpret, pdl=self.pdl)
        #: the plan's flags (:func:`~pagedattn.launch.flags.kernel_flags`, no binding)
        self.flags: KernelFlags = kernel_flags(plan, spec, UNBOUND, **self._flag_facts)
        self._bound_flags: dict[Binding, dict[str, object]] = {}
        self.merge_kernel = _merge_per_group_kernel if per_group else _merge_per_head_kernel
        self.merge_grid = (batch, num_kv_heads if per_group else num_q_heads, 1)
        self.merge_constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=bd,
                                     **options.constexprs(merge=True))
        if per_group:
            self.merge_constexprs.update(BLOCK_H=plan.merge_block, Q_LEN=q_len, PDL=self.pdl)
        else:
            self.merge_constexprs["BLOCK_R"] = plan.merge_block
        # the workspace, one fp32 tensor: per split row and query head and query token
        # (m, l) then acc (fp32), then the [batch, 2] int32 (start_b, n_b) or, for a folded
        # merge, the [batch, num_kv_heads] int32 arrival counters in their place (the
        # kernel's seq_rows_ptr); one unit per sequence: 16 bytes that no kernel touches
        part_rows = plan.part_rows
        self._n_ml = -(-part_rows * 2 // 4) * 4  # acc starts 16-byte aligned
        self._n_acc = part_rows * bd
        self._n_rows = batch * num_kv_heads if self.fold_merge else 2 * batch
        self._n_work = 4 if self.one_unit else self._n_ml + self._n_acc + self._n_rows
        # byte offsets of acc and seq_rows from the base (multiples of 16)
        self._acc_offset, self._rows_offset = 4 * self._n_ml, 4 * (self._n_ml + self._n_acc)
        # a plan's launcher owns one (reused by each run), and so does a one-unit launcher
        # (never touched); a shared split launcher (one-shot calls) takes one per launch
        self.workspace = self.new_workspace() if workspace or self.one_unit else None
        # recorded launches of this launcher, one per binding (see launch): every integer,
        # constexpr and launch option is fixed by the launcher, so the binding is the
        # tensors' dtypes, strides and 16-byte alignment and whether LSE is written; the
        # records hold no tensor and no address (the workspace's are per-call slots too)
        self._direct = (record and on_gpu and device.index is not None
                        and tc.direct_launch_supported())
        self._records: dict[tuple, BindingRecord] = {}
        self._get_stream = tc.current_stream if self._direct else None
        #: the device's error word (pagedattn._errors): the main kernel reports a length
        #: it clamped there
        self._error_word = _errors.error_word(device)
        self._error_ptr = self._error_word.data_ptr()

    def new_workspace(self) -> torch.Tensor:
        """A fresh workspace for this launcher's shapes (:meth:`workspace_parts` names its
        parts): one allocation on the current stream (the caching allocator's, so a CUDA
        graph captured around the launch keeps its own), no fill: the main kernel writes
        every entry a merge reads (the ``seq_rows`` of an empty sequence included). A folded
        merge's arrival counters are zeroed here, once."""
        work = torch.empty(self._n_work, dtype=torch.float32, device=self.device)
        if self.fold_merge:  # the counters start at 0, and each launch leaves them at 0
            work[self._n_work - self._n_rows:].view(torch.int32).zero_()
        return work

    @property
    def seq_rows(self) -> torch.Tensor | None:
        """The owned workspace's ``[batch, 2]`` int32 merge rows (flat), or ``None``."""
        return None if self.workspace is None else self.workspace_parts(self.workspace)[2]

    def workspace_parts(self, work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
        """``(part_ml, part_acc, seq_rows)``: views of a :meth:`new_workspace` (for a one-unit
        launcher, whose kernels never touch them, the whole 16 bytes each). A folded
        merge's ``seq_rows`` are its ``[batch, num_kv_heads]`` arrival counters (flat)."""
        if self.one_unit:
            return work, work, work.view(torch.int32)
        n_ml, n_acc = self._n_ml, self._n_acc
        return (work[:n_ml], work[n_ml:n_ml + n_acc],
                work[n_ml + n_acc:].view(torch.int32))

    def _flags_for(self, binding: Binding) -> dict[str, object]:
        """The main kernel's constexprs for one call's ``binding``, as keyword arguments
        (:func:`~pagedattn.launch.flags.kernel_flags`, computed once per binding)."""
        kwargs = self._bound_flags.get(binding)
        if kwargs is None:
            if len(self._bound_flags) >= _MAX_BINDINGS:
                self._bound_flags.clear()
            kwargs = self._bound_flags[binding] = kernel_flags(
                self.plan, self.spec, binding, **self._flag_facts).as_kwargs()
        return kwargs

    def launch(self, query, key_cache, value_cache, block_tables, context_lens, out, lse, *,
               scale: float, k_scale=None, v_scale=None, calls=None) -> dict[str, object]:
        """Launch the main kernel and the merge on the current stream. Caches arrive as
        NHD-shaped views (HND is a stride permutation); inputs are validated by the API.
        ``query``/``out`` are ``[batch, q_len, num_q_heads, head_dim]`` when ``q_len > 1``.
        ``calls``: the per-call variants that are on (``pagedattn.options``: name ->
        contiguous ``[num_q_heads]`` float32, as the API makes them), or ``None``.
        The workspace is the launcher's own, or a fresh :meth:`new_workspace` when it owns
        none. A binding's first launch goes through ``kernel[grid]`` with the arguments of
        :meth:`kernel_args`; later ones through its record (the module docstring). Returns
        the compiled kernels launched, by name (compile metadata for the tools)."""
        work = self.workspace if self.workspace is not None else self.new_workspace()
        tensor_scales = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
        key = None
        if self._direct and not tensor_scales:
            # the recorded path, inline (the host path of every call): the binding, then the
            # record's slots in _MAIN_SLOTS' (and _MERGE_SLOTS') order; pointers of unused
            # arguments (flags off: never read) at the workspace
            q_ptr, k_ptr, v_ptr = query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr()
            bt_ptr, cl_ptr, out_ptr = (block_tables.data_ptr(), context_lens.data_ptr(),
                                       out.data_ptr())
            ml_ptr = work.data_ptr()
            # the binding: what Triton specializes on beyond the launcher's fixed choices (the
            # workspace's parts are aligned with its base: their offsets are multiples of 16
            # bytes); of the query and out, the strides the kernels take (a single-token
            # query binds the same as 3-D [batch, heads, dim] or 4-D [batch, 1, heads, dim])
            key = (lse is None, query.dtype, _kernel_strides(query), key_cache.dtype,
                   key_cache.stride(), value_cache.dtype, value_cache.stride(), out.dtype,
                   _kernel_strides(out), block_tables.dtype, block_tables.stride(),
                   context_lens.dtype, context_lens.stride(), q_ptr % 16 == 0,
                   k_ptr % 16 == 0, v_ptr % 16 == 0, bt_ptr % 16 == 0, cl_ptr % 16 == 0,
                   out_ptr % 16 == 0, ml_ptr % 16 == 0,
                   tuple((n, t.dtype, t.data_ptr() % 16 == 0) for n, t in calls.items())
                   if calls else None)
            record = self._records.get(key)
            if record is not None:
                lse_ptr = lse.data_ptr() if lse is not None else ml_ptr
                acc_ptr, rows_ptr = ml_ptr + self._acc_offset, ml_ptr + self._rows_offset
                values = (q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, out_ptr, lse_ptr, scale * LOG2E,
                          1.0 if k_scale is None else float(k_scale),
                          1.0 if v_scale is None else float(v_scale), ml_ptr, acc_ptr,
                          rows_ptr, ml_ptr, ml_ptr, self._error_ptr, key_cache.shape[0])
                stream = self._get_stream(self.device.index)
                enter, leave = tc.launch_hooks()
                record.main.run(self.grid, stream, values, calls, ml_ptr, enter, leave)
                if record.merge is not None:
                    record.merge.run(self.merge_grid, stream,
                                     (cl_ptr, out_ptr, lse_ptr, ml_ptr, acc_ptr, rows_ptr),
                                     calls, ml_ptr, enter, leave)
                return record.compiled
        main_args, merge_args = self.kernel_args(
            query, key_cache, value_cache, block_tables, context_lens, out, lse, work,
            scale=scale, k_scale=k_scale, v_scale=v_scale, calls=calls)
        cfg = self.config
        main = _paged_decode_kernel[self.grid](**main_args, num_warps=cfg.num_warps,
                                               num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
                                               **tc.KERNEL_OPTIONS)
        compiled = {"paged_decode": main}
        merge = None
        if merge_args is not None:
            merge = self.merge_kernel[self.merge_grid](
                **merge_args, num_warps=4, **tc.KERNEL_OPTIONS,
                **({"launch_pdl": True} if self.pdl else {}))
            compiled["paged_decode_merge"] = merge
        if key is not None:
            if len(self._records) >= _MAX_BINDINGS:
                self._records.clear()
            self._records[key] = BindingRecord(
                RecordedLaunch.record(_paged_decode_kernel, main, main_args, _MAIN_SLOTS,
                                      _MAIN_CALLS),
                None if merge is None else RecordedLaunch.record(
                    self.merge_kernel, merge, merge_args, _MERGE_SLOTS, _MERGE_CALLS),
                compiled)
        return compiled

    def kernel_args(self, query, key_cache, value_cache, block_tables, context_lens, out, lse,
                    work, *, scale: float, k_scale=None, v_scale=None, calls=None
                    ) -> tuple[dict[str, object], dict[str, object] | None]:
        """The keyword arguments of the main kernel (``_paged_decode_kernel``'s signature:
        tensors, strides, launcher integers, constexprs) and of the merge kernel (``None``
        for a launch without one) for one :meth:`launch` (its arguments, ``work`` the
        workspace). Launches nothing, writes nothing."""
        tensor_scales = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
        part_ml, part_acc, seq_rows = self.workspace_parts(work)
        multi = self.q_len > 1  # a 4-D query and out
        k_t = v_t = None
        if tensor_scales:  # both as tensors: one specialization for the pair
            k_t, v_t = (s if isinstance(s, torch.Tensor) else torch.full(
                (), 1.0 if s is None else float(s), device=self.device)
                for s in (k_scale, v_scale))
        main_args = dict(
            query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
            block_tables_ptr=block_tables, context_lens_ptr=context_lens, out_ptr=out,
            lse_ptr=lse if lse is not None else part_ml, errors_ptr=self._error_word,
            part_ml_ptr=part_ml, part_acc_ptr=part_acc,
            seq_rows_ptr=seq_rows,
            k_scale_ptr=k_t if tensor_scales else part_ml,
            v_scale_ptr=v_t if tensor_scales else part_ml,
            stride_k_scale=k_t.stride(0) if tensor_scales and k_t.dim() == 1 else 0,
            stride_v_scale=v_t.stride(0) if tensor_scales and v_t.dim() == 1 else 0,
            k_scale_val=1.0 if tensor_scales or k_scale is None else float(k_scale),
            v_scale_val=1.0 if tensor_scales or v_scale is None else float(v_scale),
            scale_log2=scale * LOG2E,
            # the variants: per-call tensors (the workspace when off), plan-time values
            **{arg: calls.get(name, part_ml) if calls else part_ml
               for name, arg, _ in _MAIN_CALLS},
            **self.main_variant_args,
            stride_q_t=query.stride(1) if multi else 0,
            stride_o_t=out.stride(1) if multi else 0,
            batch=self.batch, num_kv_heads=self.num_kv_heads, group=self.group,
            max_pages=self.max_pages, forced_splits=self.forced_splits,
            min_chunk=self.min_chunk, target_units=self.target_units,
            target_units_ragged=self.target_units_ragged,
            stride_q_b=query.stride(0), stride_q_h=query.stride(-2),
            stride_q_d=query.stride(-1),
            stride_k_page=key_cache.stride(0), stride_k_tok=key_cache.stride(1),
            stride_k_head=key_cache.stride(2), stride_k_d=key_cache.stride(3),
            stride_v_page=value_cache.stride(0), stride_v_tok=value_cache.stride(1),
            stride_v_head=value_cache.stride(2), stride_v_d=value_cache.stride(3),
            stride_bt_b=block_tables.stride(0), stride_bt_p=block_tables.stride(1),
            stride_ctx=context_lens.stride(0),
            stride_o_b=out.stride(0), stride_o_h=out.stride(-2), stride_o_d=out.stride(-1),
            num_pages=key_cache.shape[0],
            **self._flags_for(Binding(
                scale_from_ptr=tensor_scales, has_lse=lse is not None,
                calls=frozenset(calls) if calls else frozenset(),
                slot_offsets_fit_int32=all(
                    slot_offsets_fit_int32(c, self.page_size, self.num_kv_heads)
                    for c in (key_cache, value_cache)),
                fp8_v_pairs=fp8_v_pairs(value_cache, self.head_dim))),
        )
        if not self.launches_merge:  # a folded or one-unit launch has no merge kernel
            return main_args, None
        merge_args = dict(
            context_lens_ptr=context_lens, part_ml_ptr=part_ml,
            part_acc_ptr=part_acc, seq_rows_ptr=seq_rows, out_ptr=out,
            lse_ptr=main_args["lse_ptr"],
            **{arg: main_args[arg] for _, arg, _ in _MERGE_CALLS}, **self.merge_variant_args,
            num_q_heads=self.num_q_heads, group=self.group,
            page_size=self.page_size, max_pages=self.max_pages,
            stride_ctx=context_lens.stride(0), stride_o_b=out.stride(0),
            stride_o_h=out.stride(-2), stride_o_d=out.stride(-1),
            stride_o_t=main_args["stride_o_t"],
            HAS_LSE=lse is not None,
            **{flag: getattr(main_args["VARIANTS"], flag) for _, _, flag in _MERGE_CALLS},
            **self.merge_constexprs,
        )
        return main_args, merge_args


#: shared one-shot launchers kept, at most (least recently used dropped first): each holds its
#: launch configuration and at most ``_MAX_BINDINGS`` records, no tensor and no address
ONE_SHOT_CACHE_SIZE = 64


def _kernel_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of a query or output that the kernels take: batch, heads and dim, and the
    token stride of a multi-token 4-D tensor (dim 1 of a single-token 4-D view is never
    read)."""
    s = t.stride()
    return (s[0], s[1], s[-2], s[-1]) if t.dim() == 4 and t.shape[1] > 1 else (s[0], *s[-2:])


@functools.lru_cache(maxsize=ONE_SHOT_CACHE_SIZE)
def one_shot_launcher(spec: LaunchSpec) -> AutoLauncher:
    """The launcher that every one-shot ``paged_decode`` of this
    :class:`~pagedattn.spec.LaunchSpec` shares: the spec is the key
    (``ragged`` off, as a one-shot call has no host copy of the lengths).

    What it caches is a pure function of the key: the launch configuration (tiles, grid,
    merge, constexprs) and, per binding, the recorded launch (the compiled kernels and their
    argument list with every tensor argument a per-call slot). It owns no workspace: each
    launch takes a fresh one (:meth:`AutoLauncher.new_workspace`, through the caching
    allocator on the current stream), so calls on different streams, or captured in
    different CUDA graphs, never share scratch (a one-unit launcher's 16 bytes are never
    touched, so it keeps them). Context lengths, block tables, queries and
    caches are per call and never part of the key."""
    return AutoLauncher(spec, workspace=False)
