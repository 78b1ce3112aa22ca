"""The MLA kernel's launcher (:mod:`pagedattn.kernels.mla`): the grid ``(parts, head
blocks)`` of balanced parts, the workspace of cut sequences' partials, and the merge.

Everything is decided from shapes at plan time (:func:`pagedattn.launch.policy_mla.
mla_kernel_config`); a launch reads ``context_lens`` and ``block_tables`` on the device only,
so a CUDA graph captured around it replays for any lengths within the table.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pagedattn import _errors
from pagedattn._env import is_interpreter
from pagedattn._validation import FP8_DTYPES, kernel_max_pages
from pagedattn.kernels.mla import _mla_decode_kernel, _mla_merge_kernel, _mla_schedule_kernel
from pagedattn.launch import _triton_compat as tc
from pagedattn.launch._common import LOG2E, block_d, cdiv, named_strides
from pagedattn.launch.flags import BLOCK_B, dot_dtype, dot_precision
from pagedattn.launch.policy_mla import (
    MLAKernelConfig,
    gluon_applies,
    mla_block_dr,
    mla_kernel_config,
)
from pagedattn.spec import LaunchSpec

#: workspace rows a merge program combines
MERGE_ROWS = 16


def _rows_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's rows are 16-byte vectors for ``cp.async`` (the Gluon kernel's
    copies): a unit last stride, every other stride a multiple of 16 bytes and a 16-byte
    aligned start; otherwise the plain kernel runs."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
               for t in tensors)


#: the Gluon kernel's cache dtypes (its ``KV_DTYPE``): a 16-bit latent is its dots' dtype,
#: an fp8 one is converted in shared memory to the query's
_GLUON_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                 torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class MLALauncher:
    """One MLA plan's launches (see the module docstring).

    Args:
        spec: the step's :class:`~pagedattn.spec.LaunchSpec`: ``head_dim`` the latent's
            dims, ``rope_dim`` the rope key's, one kv head (the latent), ``kv_dtype`` the
            latent cache's, ``options`` the plan-time variants (only ``logits_soft_cap``
            applies to MLA).
        num_parts: programs a head block (``None``: one per SM, :func:`mla_kernel_config`).
        config: an :class:`MLAKernelConfig` instead of the policy's (tuning).
        workspace: allocate the partials' workspace once, here (a plan), or per launch
            (``False``: a one-shot call's launcher, shared between calls).
    """

    def __init__(self, spec: LaunchSpec, *, num_parts: int | None = None,
                 config: MLAKernelConfig | None = None, workspace: bool = True):
        interpret = is_interpreter()
        batch, max_pages, num_q_heads = spec.batch, spec.max_pages, spec.num_q_heads
        latent_dim, rope_dim, page_size = spec.head_dim, spec.rope_dim, spec.page_size
        q_dtype, kv_dtype, device = spec.q_dtype, spec.kv_dtype, spec.device
        q_len, options = spec.q_len, spec.options
        self.config = cfg = config or mla_kernel_config(
            num_heads=num_q_heads, q_len=q_len, latent_dim=latent_dim, kv_dtype=kv_dtype,
            num_sms=_num_sms(device), interpret=interpret, num_parts=num_parts)
        self.batch, self.num_q_heads, self.q_len = batch, num_q_heads, q_len
        self.latent_dim, self.device, self.page_size = latent_dim, device, page_size
        self.max_pages = kernel_max_pages(max_pages, page_size)
        self.grid = (cfg.num_parts, cfg.head_blocks(num_q_heads), 1)
        self.rows = q_len * num_q_heads
        self.merge_grid = (max(batch, 1), cdiv(self.rows, MERGE_ROWS), 1)
        self.softcap = options.logits_soft_cap
        bd = block_d(latent_dim)
        fp8 = kv_dtype in FP8_DTYPES
        # the dots' dtype: the cache's, and for an fp8 latent the query's 16-bit dtype (fp8
        # converts exactly to either; a bf16 query then dots as it is, from shared memory,
        # where fp16 dots would need it scaled into fp16's range in registers: 128
        # registers a thread at 64 rows, and the token loop spilled)
        dots = q_dtype if fp8 and q_dtype in (torch.float16, torch.bfloat16) else kv_dtype
        self.ws_shape = ((cfg.num_parts * 2 * self.rows * bd,), (cfg.num_parts * 2 * self.rows,),
                         (max(batch, 1) * 2,))
        self.workspace = self._workspace() if workspace else None
        shared = dict(LATENT_DIM=latent_dim, BLOCK_D=bd, Q_LEN=q_len)
        self.constexprs = dict(
            shared, BLOCK_N=cfg.block_n, PAGE_SIZE=page_size, NUM_PARTS=cfg.num_parts,
            OVERHEAD=cfg.overhead, BLOCK_B=BLOCK_B, ROPE_DIM=rope_dim,
            BLOCK_DR=mla_block_dr(rope_dim), HEADS=cfg.heads,
            BLOCK_H=cfg.block_h, DOT_DTYPE=dot_dtype(dots, interpret),
            DOT_PRECISION=dot_precision(dots, interpret),
            Q_POW2_SCALE=fp8 and dots == torch.float16 and q_dtype != torch.float16,
            HAS_SOFTCAP=self.softcap is not None)
        self.merge_constexprs = dict(shared, BLOCK_R=MERGE_ROWS)
        # the Gluon kernel where the config asks for it and it applies (else the plain one)
        self.gluon = cfg.gluon and gluon_applies(
            q_dtype=q_dtype, kv_dtype=kv_dtype, latent_dim=latent_dim, rope_dim=rope_dim,
            device=device, interpret=interpret)
        if self.gluon:
            self.sched = torch.empty(cfg.num_parts * 8, dtype=torch.int32, device=device)
            self.gluon_constexprs = dict(
                LATENT_DIM=latent_dim, BLOCK_D=bd, ROPE_DIM=rope_dim,
                BLOCK_DR=mla_block_dr(rope_dim), Q_LEN=q_len, HEADS=cfg.heads,
                BLOCK_H=64, BLOCK_N=64, PAGE_SIZE=page_size, OVERHEAD=cfg.overhead,
                DTYPE=dot_dtype(dots, interpret), KV_DTYPE=_GLUON_DTYPES[kv_dtype],
                HAS_SOFTCAP=self.softcap is not None)

    def _workspace(self):
        o_shape, lse_shape, pieces_shape = self.ws_shape
        return (torch.empty(o_shape, dtype=torch.float32, device=self.device),
                torch.empty(lse_shape, dtype=torch.float32, device=self.device),
                torch.empty(pieces_shape, dtype=torch.int32, device=self.device))

    def launch(self, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, context_lens, out, lse,
               *, scale: float, kv_scale=None, calls=None):
        """Launch the kernel and the merge on the current stream. Inputs are validated by
        the API; ``calls``: the per-call variant tensors that are on (``sinks``)."""
        calls = calls or {}
        part_o, part_lse, pieces = self.workspace or self._workspace()
        tensor_scale = isinstance(kv_scale, torch.Tensor)
        scale_val = 1.0 if tensor_scale or kv_scale is None else float(kv_scale)
        word = _errors.error_word(self.device)
        dummy = out  # an unused pointer (its flag is off): never read
        sinks = calls.get("sinks")
        q_str = self._tokens_strides(q_nope)
        qr_str = self._tokens_strides(q_pe)
        o_str = self._tokens_strides(out)
        common = dict(num_q_heads=self.num_q_heads,
                      kv_scale_ptr=kv_scale if tensor_scale else dummy,
                      kv_scale_val=scale_val, sinks_ptr=sinks if sinks is not None else dummy,
                      out_ptr=out, lse_ptr=lse if lse is not None else dummy,
                      part_o_ptr=part_o, part_lse_ptr=part_lse, pieces_ptr=pieces,
                      **{f"stride_o_{k}": v for k, v in zip("bthd", o_str, strict=True)},
                      SCALE_FROM_PTR=tensor_scale, HAS_SINKS=sinks is not None,
                      HAS_LSE=lse is not None)
        compiled = {}
        if self.gluon and _rows_aligned(q_nope, q_pe, ckv_cache, kpe_cache, out):
            compiled["mla_schedule"], main = self._launch_gluon(
                q_nope, q_pe, ckv_cache, kpe_cache, block_tables, context_lens, word, scale,
                q_str, qr_str, common)
        else:
            main = _mla_decode_kernel[self.grid](
                q_ptr=q_nope, qpe_ptr=q_pe, ckv_ptr=ckv_cache, kpe_ptr=kpe_cache,
                block_tables_ptr=block_tables, context_lens_ptr=context_lens, errors_ptr=word,
                batch=block_tables.shape[0], num_pages=ckv_cache.shape[0],
                max_pages=self.max_pages, stride_ctx=context_lens.stride(0),
                scale_log2=scale * LOG2E, softcap=1.0 if self.softcap is None else self.softcap,
                **{f"stride_q_{k}": v for k, v in zip("bthd", q_str, strict=True)},
                **{f"stride_qr_{k}": v for k, v in zip("bthd", qr_str, strict=True)},
                **named_strides("c", ckv_cache, "page tok d"),
                **named_strides("r", kpe_cache, "page tok d"),
                **named_strides("bt", block_tables, "b p"),
                **common, **self.constexprs,
                num_warps=self.config.num_warps, num_stages=self.config.num_stages,
                **tc.KERNEL_OPTIONS)
        merge = _mla_merge_kernel[self.merge_grid](
            **common, **self.merge_constexprs, num_warps=4,
            **tc.KERNEL_OPTIONS)
        return {**compiled, "mla_decode": main, "mla_merge": merge}

    def _launch_gluon(self, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, context_lens,
                      word, scale, q_str, qr_str, common):
        """The schedule kernel (each part's share, written to ``self.sched``), then the Gluon
        kernel over it (:mod:`pagedattn.kernels.mla_gluon`; imported here: the interpreter
        never runs it). Returns both launches' compiled kernels."""
        from pagedattn.kernels.mla_gluon import (
            _mla_decode_gluon_kernel,
            _mla_decode_gluon_ws_kernel,
        )

        batch, num_pages = block_tables.shape[0], ckv_cache.shape[0]
        sched = _mla_schedule_kernel[(self.config.num_parts,)](
            context_lens_ptr=context_lens, sched_ptr=self.sched, errors_ptr=word, batch=batch,
            num_pages=num_pages, max_pages=self.max_pages,
            stride_ctx=context_lens.stride(0), PAGE_SIZE=self.page_size, BLOCK_N=64,
            NUM_PARTS=self.config.num_parts, OVERHEAD=self.config.overhead, BLOCK_B=BLOCK_B,
            num_warps=4)
        kernel, extra = _mla_decode_gluon_kernel, {}
        if self.config.ws:  # 80 registers a producer thread (its address math), 216 a consumer
            kernel, extra = _mla_decode_gluon_ws_kernel, {"PRODUCER_REGS": 80,
                                                          "LAND": bool(self.config.land)}
        return sched, kernel[self.grid](
            q_ptr=q_nope, qpe_ptr=q_pe, ckv_ptr=ckv_cache, kpe_ptr=kpe_cache,
            block_tables_ptr=block_tables, context_lens_ptr=context_lens,
            sched_ptr=self.sched, errors_ptr=word, batch=batch, num_pages=num_pages,
            capacity=self.max_pages * self.page_size * (num_pages > 0),
            scale_log2=scale * LOG2E, softcap=1.0 if self.softcap is None else self.softcap,
            **{f"stride_q_{k}": v for k, v in zip("bthd", q_str, strict=True)},
            **{f"stride_qr_{k}": v for k, v in zip("bthd", qr_str, strict=True)},
            stride_c_page=ckv_cache.stride(0), stride_c_tok=ckv_cache.stride(1),
            stride_r_page=kpe_cache.stride(0), stride_r_tok=kpe_cache.stride(1),
            **named_strides("bt", block_tables, "b p"), stride_ctx=context_lens.stride(0),
            **common, **self.gluon_constexprs, **extra, num_warps=8)

    def _tokens_strides(self, t: torch.Tensor) -> tuple[int, int, int, int]:
        """``(b, t, h, d)`` strides of a ``[batch, heads, d]`` (q_len 1) or ``[batch, q_len,
        heads, d]`` tensor."""
        if t.dim() == 3:
            return t.stride(0), 0, t.stride(1), t.stride(2)
        return tuple(t.stride())
