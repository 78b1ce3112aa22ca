"""Launcher of the production kernel (``impl="auto"``): tiles, persistent grid, workspace.

Everything here is decided from shapes and dtypes (metadata), never from the values of
``context_lens``: no host sync, and a CUDA graph captured once replays correctly for any new
lengths and block tables (the kernel re-plans its splits on the device every launch). The
workspace is bounded by shapes: ``rows_max = batch + programs · UNITS_PER_PROGRAM /
num_kv_heads`` split rows (or ``batch · num_splits`` when forced).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedattn._env import is_interpreter, sm_count_for
from pagedattn._validation import FP8_DTYPES
from pagedattn.kernels.decode import _paged_decode_kernel, _paged_decode_merge_kernel
from pagedattn.launch._common import LOG2E, block_d, decode_strides, record


# split rows merged per vector step: covers the usual split counts in one load round
_MERGE_BLOCK_R = 32


@dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch choices for one (head_dim, group, cache dtype, page_size)."""

    block_h: int  # query rows per tile (the group, padded; >= 16 for tensor cores)
    block_n: int  # tokens per tile (may span several pages)
    num_warps: int
    num_stages: int
    use_dot: bool
    ctas_per_sm: int  # persistent programs per SM
    min_chunk: int  # fewest tokens per split
    units_per_program: int  # target split units per program (balance vs merge cost)


@functools.lru_cache(maxsize=None)
def choose_config(head_dim: int, group: int, cache_dtype: torch.dtype, page_size: int,
                  interpret: bool) -> DecodeConfig:
    """The heuristic table. Keyed on shapes and dtype only, so a new batch size or context
    length never recompiles (Triton caches one binary per constexpr set)."""
    bd = block_d(head_dim)
    use_dot = cache_dtype != torch.float32  # fp32: ieee FMA path (tf32 would break 1e-4)
    if use_dot:
        block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16
        # two [BLOCK_N, BLOCK_D] tiles per stage; keep a stage near 32 KB at 16-bit
        block_n = 64 if bd <= 128 else 32
        num_warps, num_stages, ctas_per_sm = 4, 3, 2
    else:
        block_h = triton.next_power_of_2(group)
        # [BLOCK_H, BLOCK_N, BLOCK_D] products live in registers: cap them at 8K elements
        block_n = max(16, min(64, 8192 // (block_h * bd)))
        num_warps, num_stages, ctas_per_sm = 4, 2, 2
    if interpret:  # the interpreter runs programs one by one: fewer, smaller is faster
        ctas_per_sm, num_stages = 1, 1
        block_n = min(block_n, 32)
    return DecodeConfig(block_h=block_h, block_n=block_n, num_warps=num_warps,
                        num_stages=num_stages, use_dot=use_dot, ctas_per_sm=ctas_per_sm,
                        min_chunk=4 * block_n, units_per_program=2)


def _dot_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype, interpret: bool):
    if cache_dtype in FP8_DTYPES:
        return tl.float16  # fp8 -> fp16 converts natively; fp16 dots are exact in the interpreter
    if cache_dtype == torch.bfloat16:
        return tl.float32 if interpret else tl.bfloat16  # interpreter bf16 dots are garbage
    return {torch.float16: tl.float16}.get(cache_dtype, tl.float32)


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


def num_programs(query: torch.Tensor, config: DecodeConfig) -> int:
    return sm_count_for(query) * config.ctas_per_sm


def paged_decode_auto(query, key_cache, value_cache, block_tables, context_lens, out, lse, *,
                      scale, num_splits=None, k_scale=None, v_scale=None):
    """Production decode: see ``pagedattn.kernels.decode``. Inputs are validated by the API;
    caches arrive as NHD-shaped views (HND is a stride permutation)."""
    batch, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    interpret = is_interpreter()
    cfg = choose_config(head_dim, group, key_cache.dtype, page_size, interpret)
    bd = block_d(head_dim)
    programs = num_programs(query, cfg)
    forced = int(num_splits or 0)
    if forced:
        rows_max = batch * forced
    else:
        rows_max = batch + triton.cdiv(programs * cfg.units_per_program, num_kv_heads)
    device = query.device
    part_ml = torch.empty(rows_max, num_q_heads, 2, dtype=torch.float32, device=device)
    part_acc = torch.empty(rows_max, num_q_heads, bd, dtype=torch.float32, device=device)
    seq_rows = torch.empty(batch, 2, dtype=torch.int32, device=device)
    kp, vp, ks, vs, kv_, vv_, from_ptr = _scale_args(k_scale, v_scale, device)
    lse_arg = lse if lse is not None else out
    max_pages = block_tables.shape[1]
    compiled = _paged_decode_kernel[(programs,)](
        query, key_cache, value_cache, block_tables, context_lens, out, lse_arg,
        part_ml, part_acc, seq_rows,
        kp if from_ptr else part_ml, vp if from_ptr else part_ml, ks, vs, kv_, vv_,
        scale * LOG2E,
        batch, num_kv_heads, group, page_size, max_pages, forced, programs,
        cfg.min_chunk, cfg.units_per_program,
        *decode_strides(query, key_cache, value_cache, block_tables, context_lens),
        *out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_B=128,
        USE_DOT=cfg.use_dot, DOT_DTYPE=_dot_dtype(query.dtype, key_cache.dtype, interpret),
        KV_FP8=key_cache.dtype in FP8_DTYPES, SCALE_FROM_PTR=from_ptr,
        HAS_LSE=lse is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    record("paged_decode", compiled)
    compiled = _paged_decode_merge_kernel[(batch, num_q_heads)](
        context_lens, part_ml, part_acc, seq_rows, out, lse_arg,
        num_q_heads, page_size, max_pages,
        context_lens.stride(0), *out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_R=_MERGE_BLOCK_R,
        HAS_LSE=lse is not None, num_warps=4,
    )
    record("paged_decode_merge", compiled)
