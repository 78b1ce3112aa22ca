"""Launcher of the production kernel (``impl="auto"``): tiles, persistent grid, workspace.

Everything here is decided from shapes and dtypes (metadata), never from the values of
``context_lens``: no host sync, and a CUDA graph captured once replays correctly for any new
lengths and block tables (the kernel re-plans its splits on the device every launch). The
workspace is bounded by shapes: ``rows_max = batch + target_units / num_kv_heads`` split rows
(or ``batch · num_splits`` when forced), with ``target_units = resident programs ·
units_per_program`` (resident programs: SMs × how many fit per SM, read off the compiled
kernel).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from pagedattn._env import is_interpreter, sm_count_for
from pagedattn._validation import FP8_DTYPES
from pagedattn.kernels.decode import (
    _merge_per_group_kernel,
    _merge_per_head_kernel,
    _paged_decode_kernel,
)
from pagedattn.launch._common import LOG2E, block_d, decode_strides, record

# split rows merged per vector step by the per-head merge: the usual split counts, one round
_MERGE_BLOCK_R = 32


@dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch choices for one (head_dim, group, cache dtype, page_size)."""

    block_n: int  # tokens per tile (may span several pages)
    num_warps: int
    num_stages: int
    use_dot: bool  # tl.dot (tensor cores; ieee FMA for fp32) or broadcast-reduce on CUDA cores
    ctas_per_sm: int  # cap on resident programs per SM counted in the split target
    min_chunk: int  # fewest tokens per split
    units_per_program: int  # split units per resident program (balance vs merge cost)
    persistent: bool = False  # grid = resident programs looping over units, else one per unit


#: tuned entries (``scripts/tune_decode.py`` on the H200), keyed by :func:`config_key`; the
#: file is data, read once. ``PAGEDATTN_TUNED_TABLE`` points at another table (tuning runs).
_TUNED_TABLE = Path(__file__).with_name("tuned_h200.json")


def config_key(head_dim: int, group: int, cache_dtype: torch.dtype, page_size: int) -> str:
    return f"hd{head_dim}-g{group}-{str(cache_dtype).removeprefix('torch.')}-ps{page_size}"


@functools.lru_cache(maxsize=1)
def _tuned_table() -> dict[str, dict]:
    path = Path(os.environ.get("PAGEDATTN_TUNED_TABLE", _TUNED_TABLE))
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("configs", {})


def heuristic_config(head_dim: int, group: int, cache_dtype: torch.dtype) -> DecodeConfig:
    """The untuned rule, read off the H200 sweeps (``docs/results/tune-h200-step3.csv``,
    ``docs/perf-notes.md``) for keys the tuned table lacks:

    * 16-bit caches: 32-token tiles 4 stages deep at head_dim 128-256 (many small programs
      hide latency best), 128-token tiles 2 deep at head_dim <= 64 (per-tile costs dominate
      there: 1.8x faster than 32-token tiles);
    * fp8 caches: 128-token tiles, 2 stages (half the bytes per token);
    * fp32 caches: 64-token tiles, 2 stages (twice the bytes per token), persistent grid;
    * one program per split unit, splits sized for two units per resident program.
    """
    bd = block_d(head_dim)
    if cache_dtype == torch.float32:
        return DecodeConfig(block_n=64 if bd <= 128 else 32, num_warps=4, num_stages=2,
                            use_dot=True, ctas_per_sm=2, min_chunk=128, units_per_program=1,
                            persistent=True)
    if cache_dtype in FP8_DTYPES:
        block_n, stages = (128, 2) if bd <= 128 else (64, 2)
    elif bd <= 64:
        block_n, stages = 128, 2
    else:
        block_n, stages = 32, 4 if bd <= 128 else 3
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=stages, use_dot=True,
                        ctas_per_sm=4, min_chunk=256, units_per_program=2)


@functools.cache
def choose_config(head_dim: int, group: int, cache_dtype: torch.dtype, page_size: int,
                  interpret: bool) -> DecodeConfig:
    """Tuned entry when the table has this key, else the heuristic. Keyed on shapes and dtype
    only, so a new batch size or context length never recompiles (Triton caches one binary per
    constexpr set; split sizing is a runtime argument)."""
    cfg = heuristic_config(head_dim, group, cache_dtype)
    tuned = _tuned_table().get(config_key(head_dim, group, cache_dtype, page_size))
    if tuned and not interpret:
        cfg = replace(cfg, **{k: v for k, v in tuned.items() if k in cfg.__dataclass_fields__})
    if interpret:  # the interpreter runs programs one by one: fewer, smaller is faster
        cfg = replace(cfg, ctas_per_sm=1, num_stages=1, block_n=min(cfg.block_n, 32),
                      min_chunk=128, persistent=True)
    return cfg


def _dot_dtype(cache_dtype: torch.dtype, interpret: bool):
    if cache_dtype in FP8_DTYPES:
        return tl.float16  # fp8 -> fp16 converts natively; fp16 dots are exact in the interpreter
    if cache_dtype == torch.bfloat16:
        return tl.float32 if interpret else tl.bfloat16  # interpreter bf16 dots are garbage
    return {torch.float16: tl.float16}.get(cache_dtype, tl.float32)


def _dot_precision(cache_dtype: torch.dtype) -> str:
    """fp32 operands use exact ieee products (tf32 would miss the 1e-4 contract)."""
    return "ieee" if cache_dtype == torch.float32 else "tf32"


def _scale_args(k_scale, v_scale, device):
    """``(k_ptr, v_ptr, k_stride, v_stride, k_val, v_val, from_ptr)``; tensors stay on the
    device (graph-safe), floats become kernel arguments."""
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        def as_tensor(s):
            if isinstance(s, torch.Tensor):
                return s.to(torch.float32)
            return torch.full((), 1.0 if s is None else float(s), dtype=torch.float32,
                              device=device)
        kt, vt = as_tensor(k_scale), as_tensor(v_scale)
        k_stride = kt.stride(0) if kt.dim() == 1 else 0
        v_stride = vt.stride(0) if vt.dim() == 1 else 0
        return kt, vt, k_stride, v_stride, 1.0, 1.0, True
    k_val = 1.0 if k_scale is None else float(k_scale)
    v_val = 1.0 if v_scale is None else float(v_scale)
    return None, None, 0, 0, k_val, v_val, False


def _resident_ctas(compiled, num_warps: int, device: torch.device) -> int:
    """How many programs of ``compiled`` fit on one SM at once (shared memory, registers,
    warps). A persistent grid larger than this would run in waves and lose its balance."""
    compiled._init_handles()  # loads the binary: fills n_regs
    props = torch.cuda.get_device_properties(device)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem = compiled.metadata.shared + 1024  # the driver reserves 1 KB per block
    regs = -(-max(compiled.n_regs, 1) * 32 // 256) * 256 * num_warps  # 256-register granules
    by_smem = smem_sm // smem if compiled.metadata.shared else 32
    return max(1, min(by_smem, regs_sm // regs, 64 // num_warps, 32))


_RESIDENT: dict[tuple, int] = {}


def resident_programs(query: torch.Tensor, config: DecodeConfig, compile_kernel,
                      variant: tuple = ()) -> int:
    """SMs x min(config cap, resident programs per SM). The occupancy comes from the compiled
    kernel (``compile_kernel()`` compiles without launching), cached per (device, config,
    query dtype, ``variant``): ``variant`` names what else selects the binary (cache dtype,
    head_dim, group, page_size, flags), since one config can serve several binaries (an fp8
    key and a 16-bit head_dim-64 key share tiles but not registers)."""
    if query.device.type != "cuda":
        return sm_count_for(query) * config.ctas_per_sm
    key = (query.device.index, config, query.dtype, variant)
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident_ctas(compile_kernel(), config.num_warps, query.device)
    return sm_count_for(query) * min(config.ctas_per_sm, _RESIDENT[key])


@dataclass(frozen=True)
class _Plan:
    """What one call signature launches, kept so that repeats skip Triton's per-call binding.

    A signature (:func:`_signature`) fixes every value Triton specializes the kernels on
    (dtypes, shapes, strides, 16-byte alignment of each pointer) and every launch choice
    (config, grid, workspace size), so the compiled kernels found by the first call are the
    ones Triton itself would pick for a repeat. Repeats only allocate the workspace and call
    Triton's C launcher with the new pointers, scale values and stream."""

    main: object  # CompiledKernel of _paged_decode_kernel
    merge: object  # CompiledKernel of _merge_per_group_kernel or _merge_per_head_kernel
    merge_grid: tuple[int, int, int]
    programs: int
    target_units: int
    rows_max: int
    min_chunk: int
    block_d: int
    main_constexprs: tuple  # constexpr values in the kernel's parameter order
    merge_constexprs: tuple


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256  # signatures are few in serving (one per batch-size bucket); bound anyway


def _signature(query, key_cache, value_cache, block_tables, context_lens, out, lse, num_splits,
               k_scale, v_scale) -> tuple:
    """What a plan depends on: dtypes, 16-byte alignment of every pointer, the values of the
    integers Triton specializes on (strides but the runtime ones: batch strides of the query,
    block table and output, which vary freely, like ``max_pages`` and the number of pages),
    and the shapes the grid and workspace are sized from."""
    def scale_key(x):
        if isinstance(x, torch.Tensor):
            return (x.dtype, x.shape, x.stride(), x.data_ptr() % 16 == 0)
        return x is None
    return (
        query.device, query.dtype, query.shape, query.stride()[1:], query.data_ptr() % 16 == 0,
        key_cache.dtype, key_cache.shape[1:], key_cache.stride(), key_cache.data_ptr() % 16 == 0,
        value_cache.stride(), value_cache.data_ptr() % 16 == 0,
        block_tables.dtype, block_tables.stride(1), block_tables.data_ptr() % 16 == 0,
        context_lens.dtype, context_lens.stride(), context_lens.data_ptr() % 16 == 0,
        out.dtype, out.stride()[1:], out.data_ptr() % 16 == 0,
        lse is None or lse.data_ptr() % 16 == 0, lse is None,
        num_splits, scale_key(k_scale), scale_key(v_scale),
        # the runtime integers stay unspecialized but Triton still types them i32 or i64
        max(query.stride(0), block_tables.stride(0), block_tables.shape[1], out.stride(0))
        < 2**31,
        # the config source itself: the tuner and tests swap ``choose_config`` to try configs,
        # and each swap must plan afresh (the key holds the function, so its id is not reused)
        choose_config,
    )


def _fast_launch_ok() -> bool:
    """Direct launches skip Triton's launch hooks: only when none is installed (profilers such
    as proton install them), and never under the interpreter."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return not is_interpreter() and not any(getattr(h, "calls", h) for h in hooks)


def _run(compiled, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
    """Triton's C launcher called directly (what ``kernel[grid](...)`` ends with)."""
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args)


def paged_decode_auto(query, key_cache, value_cache, block_tables, context_lens, out, lse, *,
                      scale, num_splits=None, k_scale=None, v_scale=None):
    """Production decode: see ``pagedattn.kernels.decode``. Inputs are validated by the API;
    caches arrive as NHD-shaped views (HND is a stride permutation). The first call of a
    signature goes through Triton's launch path (compiling if needed) and records a
    :class:`_Plan`; repeats launch the recorded kernels directly (host time ~2x lower)."""
    fast = _fast_launch_ok()
    key = None
    if fast:
        key = _signature(query, key_cache, value_cache, block_tables, context_lens, out, lse,
                         num_splits, k_scale, v_scale)
        plan = _PLANS.get(key)
        if plan is not None:
            _launch_plan(plan, query, key_cache, value_cache, block_tables, context_lens, out,
                         lse, scale, num_splits, k_scale, v_scale)
            return
    plan = _launch_first(query, key_cache, value_cache, block_tables, context_lens, out, lse,
                         scale, num_splits, k_scale, v_scale)
    if fast and plan is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan


def _main_args(query, key_cache, value_cache, block_tables, context_lens, out, lse, scale,
               num_splits, k_scale, v_scale, programs, target_units, min_chunk, part_ml,
               part_acc, seq_rows) -> tuple:
    """The main kernel's runtime arguments, in its parameter order."""
    kp, vp, ks, vs, kv_, vv_, from_ptr = _scale_args(k_scale, v_scale, query.device)
    num_kv_heads = key_cache.shape[2]
    return (
        query, key_cache, value_cache, block_tables, context_lens, out,
        lse if lse is not None else out,
        part_ml, part_acc, seq_rows,
        kp if from_ptr else part_ml, vp if from_ptr else part_ml, ks, vs, kv_, vv_,
        scale * LOG2E,
        query.shape[0], num_kv_heads, query.shape[1] // num_kv_heads, block_tables.shape[1],
        int(num_splits or 0), programs, min_chunk, target_units,
        *decode_strides(query, key_cache, value_cache, block_tables, context_lens),
        *out.stride(),
    )


def _merge_args(context_lens, part_ml, part_acc, seq_rows, out, lse, group, page_size,
                max_pages):
    return (context_lens, part_ml, part_acc, seq_rows, out, lse if lse is not None else out,
            out.shape[1], group, page_size, max_pages, context_lens.stride(0), *out.stride())


def _workspace(rows_max: int, num_q_heads: int, bd: int, batch: int, device):
    """One allocation: per split row and query head ``(m, l)`` and ``acc`` (fp32), then the
    ``[batch, 2]`` int32 ``(start_b, n_b)`` of each sequence."""
    n_ml = -(-rows_max * num_q_heads * 2 // 4) * 4  # acc starts 16-byte aligned
    n_acc = rows_max * num_q_heads * bd
    work = torch.empty(n_ml + n_acc + 2 * batch, dtype=torch.float32, device=device)
    return work[:n_ml], work[n_ml:n_ml + n_acc], work[n_ml + n_acc:].view(torch.int32)


def _launch_plan(plan: _Plan, query, key_cache, value_cache, block_tables, context_lens, out,
                 lse, scale, num_splits, k_scale, v_scale) -> None:
    batch, num_q_heads, _ = query.shape
    part_ml, part_acc, seq_rows = _workspace(plan.rows_max, num_q_heads, plan.block_d, batch,
                                             query.device)
    stream = driver.active.get_current_stream(query.device.index)
    _run(plan.main, (plan.programs, 1, 1), stream,
         _main_args(query, key_cache, value_cache, block_tables, context_lens, out, lse, scale,
                    num_splits, k_scale, v_scale, plan.programs, plan.target_units,
                    plan.min_chunk, part_ml, part_acc, seq_rows) + plan.main_constexprs)
    num_kv_heads = key_cache.shape[2]
    _run(plan.merge, plan.merge_grid, stream,
         _merge_args(context_lens, part_ml, part_acc, seq_rows, out, lse,
                     num_q_heads // num_kv_heads, key_cache.shape[1], block_tables.shape[1])
         + plan.merge_constexprs)
    record("paged_decode", plan.main)
    record("paged_decode_merge", plan.merge)


def merge_per_group(batch: int, num_kv_heads: int, query: torch.Tensor) -> bool:
    """One merge program per (sequence, kv head) when those fill the SMs (H200: a batch of 64
    merged 5 µs faster than with one per query head, 2,048 mostly idle programs), else one
    per (sequence, query head) with split rows vectorized (batch 1: 12 µs faster)."""
    return batch * num_kv_heads >= sm_count_for(query)


def _launch_first(query, key_cache, value_cache, block_tables, context_lens, out, lse, scale,
                  num_splits, k_scale, v_scale) -> _Plan | None:
    """Choose the config, grid and workspace; launch through Triton (compiling on first use).
    Returns the :class:`_Plan` of this signature (``None`` under the interpreter)."""
    batch, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    interpret = is_interpreter()
    cfg = choose_config(head_dim, group, key_cache.dtype, page_size, interpret)
    bd = block_d(head_dim)
    device = query.device
    forced = int(num_splits or 0)
    from_ptr = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
    max_pages = block_tables.shape[1]
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_N=cfg.block_n, BLOCK_B=128,
        # the query group is the tile's rows: tl.dot needs >= 16 (padding rows are masked)
        BLOCK_H=max(16 if cfg.use_dot else 1, triton.next_power_of_2(group)),
        PAGE_SIZE=page_size,
        USE_DOT=cfg.use_dot, DOT_DTYPE=_dot_dtype(key_cache.dtype, interpret),
        DOT_PRECISION=_dot_precision(key_cache.dtype),
        SCALE_FROM_PTR=from_ptr,
        HAS_LSE=lse is not None,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # the merge grid: one program per (sequence, kv head) when that fills the SMs, else one
    # per (sequence, query head) with split rows vectorized (few sequences, many rows each)
    per_group = merge_per_group(batch, num_kv_heads, query)
    merge_kernel = _merge_per_group_kernel if per_group else _merge_per_head_kernel
    merge_grid = (batch, num_kv_heads if per_group else num_q_heads, 1)
    merge_constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=bd)
    if per_group:
        merge_constexprs["BLOCK_H"] = max(2, triton.next_power_of_2(group))
    else:
        merge_constexprs["BLOCK_R"] = _MERGE_BLOCK_R
    merge_constexprs["HAS_LSE"] = lse is not None

    def args(programs, target_units, part_ml, part_acc, seq_rows):
        return _main_args(query, key_cache, value_cache, block_tables, context_lens, out, lse,
                          scale, num_splits, k_scale, v_scale, programs, target_units,
                          cfg.min_chunk, part_ml, part_acc, seq_rows)

    def compile_kernel():  # the dtypes of the real launch: the same binary is compiled
        dummy = torch.empty(4, dtype=torch.float32, device=device)
        rows = torch.empty(4, dtype=torch.int32, device=device)
        return _paged_decode_kernel.warmup(*args(1, 1, dummy, dummy, rows), grid=(1,),
                                           **constexprs, **options)

    resident = resident_programs(query, cfg, compile_kernel,
                                 (key_cache.dtype, tuple(sorted(constexprs.items()))))
    target_units = resident * cfg.units_per_program
    # Σ ceil(len_b / chunk) <= total / chunk + batch <= target / num_kv_heads + batch
    rows_max = batch * forced if forced else batch + triton.cdiv(target_units, num_kv_heads)
    programs = resident if cfg.persistent else rows_max * num_kv_heads
    part_ml, part_acc, seq_rows = _workspace(rows_max, num_q_heads, bd, batch, device)
    main = _paged_decode_kernel[(programs,)](
        *args(programs, target_units, part_ml, part_acc, seq_rows), **constexprs, **options)
    record("paged_decode", main)
    merge = merge_kernel[merge_grid[:2]](
        *_merge_args(context_lens, part_ml, part_acc, seq_rows, out, lse, group, page_size,
                     max_pages),
        **merge_constexprs, num_warps=4)
    record("paged_decode_merge", merge)
    if interpret:
        return None
    return _Plan(main, merge, merge_grid, programs, target_units, rows_max, cfg.min_chunk, bd,
                 _in_order(_paged_decode_kernel, constexprs),
                 _in_order(merge_kernel, merge_constexprs))


def _in_order(kernel, constexprs: dict) -> tuple:
    """Constexpr values in the kernel's parameter order (they end its signature; the C
    launcher skips their slots)."""
    names = kernel.arg_names[len(kernel.arg_names) - len(constexprs):]
    if set(names) != set(constexprs):
        raise RuntimeError(f"{kernel.__name__}: constexprs {sorted(constexprs)} do not end "
                           f"its signature {names}")
    return tuple(constexprs[n] for n in names)
