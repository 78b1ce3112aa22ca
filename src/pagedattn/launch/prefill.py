"""The paged prefill kernel's policy and launcher (:mod:`pagedattn.kernels.prefill`).

**Policy** (:func:`prefill_config`, a pure function of shapes, dtypes and the interpreter
flag). A long chunk is bound by the tensor cores, so the tiles are wgmma-sized: 128 query rows
a program at eight warps (two warpgroups of 64 rows), 16-bit caches in pages of 16 tokens or
more on 128-key tiles two deep through Triton's software pipeliner (the K/V gathers become
``cp.async``; fp8 caches and smaller pages on 64-key tiles three deep), the scale folded into
``exp2``.
Chunks shorter than the tile pack the GQA group into the rows (``g_pack``: each program then
reads its kv head's keys once for the whole group, as FA3's PackGQA). Head dims of 256 and
fp32 caches (split-bf16 dots, three passes) halve the rows to stay within the registers. The
interpreter runs 16-row tiles (it runs a tile's rows one program after another).

**Launcher** (:class:`PrefillLauncher`): the grid ``(block rows, num_q_heads // g_pack)``,
sized from shapes alone (``ceil(num_tokens / tokens) + batch`` block rows bound every batch of
``num_tokens`` rows), and one ``kernel[grid]`` call per launch with every constexpr decided at
plan time but the binding's (tensor scales, LSE, the per-call variants).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedattn import _errors
from pagedattn._env import is_interpreter
from pagedattn._validation import FP8_DTYPES, kernel_max_pages
from pagedattn.kernels.prefill import _paged_prefill_kernel, _prefill_schedule_kernel
from pagedattn.launch import _triton_compat as tc
from pagedattn.launch._common import LOG2E, block_d, cdiv, named_strides
from pagedattn.launch.flags import BLOCK_B, dot_dtype, dot_precision
from pagedattn.options import variants
from pagedattn.spec import LaunchSpec


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles and launch options of the prefill kernel."""

    block_m: int  # query rows a program (tokens x g_pack)
    block_n: int  # keys a tile
    g_pack: int  # query heads packed into the rows: 1, or the GQA group
    num_warps: int
    num_stages: int
    #: the Gluon kernel (kernels/prefill_gluon.py: a producer warpgroup, two consumer
    #: warpgroups, P in registers) where it applies (:func:`gluon_applies`), else the plain
    #: one; opt-in: correct on an H100, slower than the plain kernel there (perf-notes step
    #: 54); step 56's producer correct on an H100, not yet timed
    gluon: bool = False
    #: the Gluon kernel's consumers issue tile j + 1's scores before tile j's softmax
    #: (FA3's intra-warpgroup overlap; one score tile more in registers: 64-key tiles)
    overlap: bool = False
    #: the Gluon kernel's two consumer warpgroups as partitions of their own, each releasing
    #: a stage itself, so they drift apart (one's softmax under the other's dots; perf-notes
    #: step 58); opt-in, correct on an H100 (the gate's prefill-gluon family), not yet timed
    split: bool = False
    #: with ``split`` (and without ``overlap``): the two consumer partitions take turns
    #: issuing their scores' dots (FA3's ping-pong, perf-notes step 59); opt-in, not yet run
    ping_pong: bool = False

    @property
    def tokens(self) -> int:
        """New tokens a program takes."""
        return self.block_m // self.g_pack


def prefill_config(*, head_dim: int, group: int, kv_dtype: torch.dtype, page_size: int,
                   max_query_len: int | None, interpret: bool) -> PrefillConfig:
    """The tiles for one model's shapes (see the module docstring). ``max_query_len``: the
    longest chunk a step brings, when the caller knows it (``None``: assume long)."""
    bd = block_d(head_dim)
    if interpret:
        block_m, block_n, warps, stages = max(16, _pow2_at_least(group)), 16, 4, 1
    elif bd > 128 or kv_dtype == torch.float32:
        block_m, block_n, warps, stages = 64, 32 if bd > 128 else 64, 4, 2
    elif kv_dtype in FP8_DTYPES or page_size < 16:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        # 128-key tiles two deep: 10-15 % faster than 64 x 3 for bf16 on pages of 16 and 64
        # on an H100; 21 % slower on pages of 1 (docs/perf-notes.md step 51)
        block_m, block_n, warps, stages = 128, 128, 8, 2
    # short chunks: the group's heads share the rows (one read of the kv head's keys)
    short = max_query_len is not None and max_query_len * group <= block_m
    g_pack = group if (short or interpret) and group <= block_m else 1
    return PrefillConfig(block_m, block_n, g_pack, warps, stages)


def gluon_applies(config: PrefillConfig, *, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                  head_dim: int, device: torch.device, options, interpret: bool) -> bool:
    """Whether the Gluon prefill kernel can run a plan: a Hopper GPU (sm_90; the interpreter
    runs no Gluon), a 16-bit query and a cache of its dtype, a head dim of 64 or 128, 128
    rows of one head a program (``g_pack`` 1) on 64- or 128-key tiles, and no plan-time
    variant (window, soft-cap; per-call sinks or ALiBi fall back at the launch)."""
    if interpret or device.type != "cuda" or q_dtype not in (torch.float16, torch.bfloat16):
        return False
    if kv_dtype != q_dtype or head_dim not in (64, 128) or any(variants(options)):
        return False
    if (config.block_m, config.g_pack, config.num_warps) != (128, 1, 8):
        return False
    if config.block_n not in (64, 128) or config.num_stages not in (2, 3):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class PrefillLauncher:
    """Everything one prefill launch decides from shapes (see the module docstring).

    Args:
        spec: the shapes, dtypes, device and plan-time variants
            (:class:`~pagedattn.spec.LaunchSpec`; ``batch``: the sequences after the
            decodes).
        num_tokens: the query's rows (the grid's bound).
        max_query_len: the most new tokens a sequence brings, or ``None``.
        config: a :class:`PrefillConfig` instead of :func:`prefill_config` (tuning).
    """

    def __init__(self, spec: LaunchSpec, *, num_tokens: int, max_query_len: int | None,
                 config: PrefillConfig | None = None):
        interpret = is_interpreter()
        batch, max_pages, num_q_heads = spec.batch, spec.max_pages, spec.num_q_heads
        num_kv_heads, head_dim, page_size = spec.num_kv_heads, spec.head_dim, spec.page_size
        q_dtype, kv_dtype, device = spec.q_dtype, spec.kv_dtype, spec.device
        options = spec.options
        group = num_q_heads // num_kv_heads
        self.config = cfg = config or prefill_config(
            head_dim=head_dim, group=group, kv_dtype=kv_dtype, page_size=page_size,
            max_query_len=max_query_len, interpret=interpret)
        self.batch, self.num_q_heads, self.group = batch, num_q_heads, group
        self.head_dim, self.page_size, self.device = head_dim, page_size, device
        self.max_pages = kernel_max_pages(max_pages, page_size)
        self.num_tokens = num_tokens
        rows = min(num_tokens, cdiv(num_tokens, cfg.tokens) + batch)
        self.grid = (max(rows, 1), num_q_heads // cfg.g_pack, 1)
        window = options.window_left
        if window >= self.max_pages * page_size:  # wider than the table: no window
            options = replace(options, window_left=-1)
        self.options = options
        self.variant_args = options.kernel_args()
        fp8 = kv_dtype in FP8_DTYPES
        self.constexprs = dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, G_PACK=cfg.g_pack, PAGE_SIZE=page_size, BLOCK_B=BLOCK_B,
            DOT_DTYPE=dot_dtype(kv_dtype, interpret),
            DOT_PRECISION=dot_precision(kv_dtype, interpret),
            Q_POW2_SCALE=fp8 and q_dtype != torch.float16, ASM=not interpret)
        self.gluon = bool(cfg.gluon) and gluon_applies(
            cfg, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, device=device,
            options=options, interpret=interpret)
        # the Gluon kernel's schedule: eight int32 a block row (written at every launch)
        self.schedule = torch.empty(self.grid[0] * 8, dtype=torch.int32, device=device) \
            if self.gluon else None
        self.last_compiled = None

    def launch(self, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
               out, lse, *, scale: float, k_scale=None, v_scale=None, calls=None,
               first_row: int = 0):
        """Launch on the current stream. Caches arrive as NHD-shaped views; inputs are
        validated by the API. ``calls``: the per-call variant tensors that are on.
        ``first_row``: the query row where ``query_start_loc``'s first entry must point (the
        rows before it belong to a mixed step's decodes)."""
        calls = calls or {}
        tensor_scales = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
        k_t = v_t = None
        if tensor_scales:
            k_t, v_t = (s if isinstance(s, torch.Tensor) else torch.full(
                (), 1.0 if s is None else float(s), device=self.device)
                for s in (k_scale, v_scale))
        word = _errors.error_word(self.device)
        dummy = out  # an unused pointer (its flag is off): never read
        cfg = self.config
        if self.gluon and not calls and scale >= 0 \
                and _gluon_strides_ok(query, key_cache, value_cache, out):
            return self._launch_gluon(query, key_cache, value_cache, block_tables, seq_lens,
                                      query_start_loc, out, lse, word, scale=scale,
                                      k_scale=k_scale, v_scale=v_scale, k_t=k_t, v_t=v_t,
                                      tensor_scales=tensor_scales, first_row=first_row)
        compiled = _paged_prefill_kernel[self.grid](
            query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
            block_tables_ptr=block_tables, seq_lens_ptr=seq_lens,
            query_start_loc_ptr=query_start_loc, out_ptr=out,
            lse_ptr=lse if lse is not None else dummy, errors_ptr=word,
            k_scale_ptr=k_t if tensor_scales else dummy,
            v_scale_ptr=v_t if tensor_scales else dummy,
            stride_k_scale=k_t.stride(0) if tensor_scales and k_t.dim() == 1 else 0,
            stride_v_scale=v_t.stride(0) if tensor_scales and v_t.dim() == 1 else 0,
            k_scale_val=1.0 if tensor_scales or k_scale is None else float(k_scale),
            v_scale_val=1.0 if tensor_scales or v_scale is None else float(v_scale),
            scale_log2=scale * LOG2E,
            sinks_ptr=calls.get("sinks", dummy), alibi_ptr=calls.get("alibi_slopes", dummy),
            **self.variant_args,
            batch=block_tables.shape[0], first_row=first_row, num_tokens=query.shape[0],
            num_pages=key_cache.shape[0], max_pages=self.max_pages, group=self.group,
            **named_strides("q", query, "t h d"),
            **named_strides("k", key_cache, "page tok head d"),
            **named_strides("v", value_cache, "page tok head d"),
            **named_strides("bt", block_tables, "b p"), stride_sl=seq_lens.stride(0),
            **named_strides("o", out, "t h d"),
            **self.constexprs, SCALE_FROM_PTR=tensor_scales, HAS_LSE=lse is not None,
            VARIANTS=variants(self.options, frozenset(calls)), SCALE_NONNEG=scale >= 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **tc.KERNEL_OPTIONS)
        self.last_compiled = compiled
        return {"paged_prefill": compiled}

    def _launch_gluon(self, query, key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc, out, lse, word, *, scale, k_scale, v_scale, k_t, v_t,
                      tensor_scales, first_row):
        """The schedule kernel, then the Gluon kernel (:mod:`pagedattn.kernels.prefill_gluon`)."""
        from pagedattn.kernels.prefill_gluon import _paged_prefill_gluon_kernel  # noqa: PLC0415

        cfg = self.config
        schedule = _prefill_schedule_kernel[(self.grid[0],)](
            query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens, sched_ptr=self.schedule,
            errors_ptr=word, batch=block_tables.shape[0], first_row=first_row,
            num_tokens=query.shape[0], num_pages=key_cache.shape[0], max_pages=self.max_pages,
            stride_sl=seq_lens.stride(0), TOKENS=cfg.tokens, PAGE_SIZE=self.page_size,
            BLOCK_B=BLOCK_B, num_warps=1)
        dummy = out  # an unused pointer (its flag is off): never read
        main = _paged_prefill_gluon_kernel[self.grid[:2]](
            query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
            block_tables_ptr=block_tables, out_ptr=out,
            lse_ptr=lse if lse is not None else dummy, sched_ptr=self.schedule,
            errors_ptr=word, k_scale_ptr=k_t if tensor_scales else dummy,
            v_scale_ptr=v_t if tensor_scales else dummy,
            stride_k_scale=k_t.stride(0) if tensor_scales and k_t.dim() == 1 else 0,
            stride_v_scale=v_t.stride(0) if tensor_scales and v_t.dim() == 1 else 0,
            k_scale_val=1.0 if tensor_scales or k_scale is None else float(k_scale),
            v_scale_val=1.0 if tensor_scales or v_scale is None else float(v_scale),
            scale_log2=scale * LOG2E, num_pages=key_cache.shape[0], group=self.group,
            stride_q_t=query.stride(0), stride_q_h=query.stride(1),
            stride_k_page=key_cache.stride(0), stride_k_tok=key_cache.stride(1),
            stride_k_head=key_cache.stride(2), stride_v_page=value_cache.stride(0),
            stride_v_tok=value_cache.stride(1), stride_v_head=value_cache.stride(2),
            stride_bt_b=block_tables.stride(0), stride_bt_p=block_tables.stride(1),
            stride_o_t=out.stride(0), stride_o_h=out.stride(1),
            HEAD_DIM=self.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PAGE_SIZE=self.page_size, STAGES=cfg.num_stages,
            DTYPE=self.constexprs["DOT_DTYPE"], SCALE_FROM_PTR=tensor_scales,
            HAS_LSE=lse is not None, OVERLAP=bool(cfg.overlap), SPLIT=bool(cfg.split),
            num_warps=4 if cfg.split else 8, PING_PONG=bool(cfg.ping_pong))
        self.last_compiled = main
        return {"prefill_schedule": schedule, "paged_prefill_gluon": main}


def _gluon_strides_ok(query, key_cache, value_cache, out) -> bool:
    """The Gluon kernel's copies are 16-byte vectors along the head dim, which Triton proves
    from its specialization (a stride divisible by 16 elements): unit strides there, the
    others divisible by 16, 16-byte aligned bases (else the plain kernel runs)."""
    for t in (query, key_cache, value_cache, out):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st % 16 for st in t.stride()[:-1]):
            return False
    return True
