"""Input validation for absorbed multi-head latent attention (:mod:`pagedattn.mla`), in the
manner of :mod:`pagedattn._validation` (whose helpers it uses): metadata checks always, before
any launch and any write, each error a ``TypeError``/``ValueError`` naming the argument;
value checks (lengths, used page ids, scales, sinks, the float32 bounds of the data) where
the tensors live on the CPU or ``validate=True``.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from pagedattn import _validation as V

#: the latent dims a tile holds (DeepSeek-V2/V3 and Kimi K2: 512); the rope dims
MIN_LATENT_DIM, MAX_LATENT_DIM = 16, 512
MIN_ROPE_DIM, MAX_ROPE_DIM = 0, 256
#: query tokens per sequence (speculative decoding): the tile's rows are q_len x heads, at
#: most 64 (launch.policy_mla.mla_kernel_config), so 64 tokens of one head at the most
MAX_Q_LEN = 64
_FLOATS = "float32, float16 or bfloat16"
_CACHES = _FLOATS + ", float8_e4m3fn or float8_e5m2"


def _dims(latent_dim: Any, rope_dim: Any, names=("latent_dim", "rope_dim")) -> None:
    V.check_int(names[0], latent_dim, MIN_LATENT_DIM, MAX_LATENT_DIM)
    V.check_int(names[1], rope_dim, MIN_ROPE_DIM, MAX_ROPE_DIM)


def check_mla_plan(block_tables, context_lens, *, num_q_heads, latent_dim, rope_dim,
                   page_size, q_dtype, kv_dtype, q_len) -> None:
    """:func:`pagedattn.plan_mla_decode`'s checks: metadata only (no host sync)."""
    V.check_plan(block_tables, context_lens, num_q_heads=num_q_heads, num_kv_heads=1,
                 head_dim=64, page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
                 kv_layout="NHD", num_splits=None)
    _dims(latent_dim, rope_dim)
    V.check_int("q_len", q_len, 1, MAX_Q_LEN)


def check_mla_call(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, context_lens) -> None:
    """:func:`pagedattn.mla_decode`'s checks of its tensors before it plans (the plan and its
    run check the rest): types, ranks, dtypes, shapes and devices."""
    table = (("q_nope", q_nope, (3, 4), V.FLOAT_DTYPES, _FLOATS),
             ("q_pe", q_pe, (3, 4), V.FLOAT_DTYPES, _FLOATS),
             ("ckv_cache", ckv_cache, 3, V.FLOAT_DTYPES + V.FP8_DTYPES, _CACHES),
             ("kpe_cache", kpe_cache, 3, V.FLOAT_DTYPES + V.FP8_DTYPES, _CACHES),
             ("block_tables", block_tables, 2, V.INDEX_DTYPES, "int32 or int64"),
             ("context_lens", context_lens, 1, V.INDEX_DTYPES, "int32 or int64"))
    for name, t, rank, dtypes, words in table:
        V.check_tensor(name, t, rank, dtypes, words)
    if q_nope.dim() == 4:
        V.check_int("q_nope", q_nope.shape[1], 1, MAX_Q_LEN)  # q_len
    if q_pe.dim() != q_nope.dim() or q_pe.shape[:-1] != q_nope.shape[:-1]:
        V.fail(ValueError, "q_pe", f"shape [{', '.join(map(str, q_nope.shape[:-1]))}, "
               "rope_dim] (q_nope's but its last dim)", tuple(q_pe.shape))
    if q_pe.dtype != q_nope.dtype:
        V.fail(TypeError, "q_pe", f"q_nope's dtype {q_nope.dtype}", q_pe.dtype)
    if ckv_cache.dtype in V.FLOAT_DTYPES and ckv_cache.dtype != q_nope.dtype:
        V.fail(TypeError, "ckv_cache", f"q_nope's dtype {q_nope.dtype} (or an fp8 dtype)",
               ckv_cache.dtype)
    if kpe_cache.dtype != ckv_cache.dtype:
        V.fail(TypeError, "kpe_cache", f"ckv_cache's dtype {ckv_cache.dtype}",
               kpe_cache.dtype)
    if ckv_cache.shape[-1] != q_nope.shape[-1]:
        V.fail(ValueError, "ckv_cache", f"latent_dim {q_nope.shape[-1]} (q_nope's) in the "
               "last dim", ckv_cache.shape[-1])
    if kpe_cache.shape[:2] != ckv_cache.shape[:2] or kpe_cache.shape[-1] != q_pe.shape[-1]:
        V.fail(ValueError, "kpe_cache", f"shape [{ckv_cache.shape[0]}, {ckv_cache.shape[1]}, "
               f"{q_pe.shape[-1]}] (ckv_cache's pages and page size, q_pe's rope_dim)",
               tuple(kpe_cache.shape))
    V.check_same_device("q_nope", q_nope.device, (
        ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache),
        ("block_tables", block_tables), ("context_lens", context_lens)))
    if block_tables.shape[0] != q_nope.shape[0]:
        V.fail(ValueError, "block_tables", f"{q_nope.shape[0]} rows (the batch)",
               block_tables.shape[0])


def check_mla_run(plan, q_nope, q_pe, ckv_cache, kpe_cache, *, scale, kv_scale, out,
                  return_lse, validate) -> None:
    """:meth:`pagedattn.mla.MLADecodePlan.run`'s checks: the tensors match the plan
    (metadata only)."""
    q_shape = plan.q_shape
    words = f"{plan.q_dtype} (the plan's q_dtype)"
    V.check_tensor("q_nope", q_nope, len(q_shape), (plan.q_dtype,), words)
    if tuple(q_nope.shape) != q_shape:
        V.fail(ValueError, "q_nope", f"shape {q_shape} (the plan's batch, "
               f"{'q_len, ' if len(q_shape) == 4 else ''}num_q_heads, latent_dim)",
               tuple(q_nope.shape))
    V.check_tensor("q_pe", q_pe, len(q_shape), (plan.q_dtype,), words)
    pe_shape = (*q_shape[:-1], plan.rope_dim)
    if tuple(q_pe.shape) != pe_shape:
        V.fail(ValueError, "q_pe", f"shape {pe_shape} (q_nope's but rope_dim last)",
               tuple(q_pe.shape))
    words = f"{plan.kv_dtype} (the plan's kv_dtype)"
    for name, cache, dim in (("ckv_cache", ckv_cache, plan.latent_dim),
                             ("kpe_cache", kpe_cache, plan.rope_dim)):
        V.check_tensor(name, cache, 3, (plan.kv_dtype,), words)
        if tuple(cache.shape[1:]) != (plan.page_size, dim):
            V.fail(ValueError, name, f"shape [num_pages, page_size={plan.page_size}, {dim}]",
                   tuple(cache.shape))
    if kpe_cache.shape[0] != ckv_cache.shape[0]:
        V.fail(ValueError, "kpe_cache", f"{ckv_cache.shape[0]} pages (ckv_cache's)",
               kpe_cache.shape[0])
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache),
                    ("kpe_cache", kpe_cache)):
        if t.device != plan.device:
            V.fail(ValueError, name, f"a tensor on the plan's device {plan.device}", t.device)
    V.check_device_runnable("q_nope", q_nope)
    if scale is None:
        V.fail(TypeError, "scale", "a Python float (MLA's softmax scale, 1 / sqrt(qk_nope + "
               "qk_rope head dims) in DeepSeek-V3: no default)", "None")
    V.check_softmax_scale(scale)
    if out is not None:
        V.check_out(out, q_nope, ckv_cache, kpe_cache)
        V.check_out_aliasing(out, q_pe)
    V.check_scale_arg("kv_scale", kv_scale, 1, q_nope.device)
    if isinstance(kv_scale, numbers.Real) and abs(float(scale) * float(kv_scale)) \
            > V.KERNEL_SCALAR_MAX:  # the kernels fold scale * kv_scale * log2(e) into one
        V.fail(ValueError, "kv_scale", f"scale * kv_scale {V.WITHIN}",
               f"{kv_scale!r} with scale {scale!r}")
    if not isinstance(return_lse, bool):
        V.fail(TypeError, "return_lse", "a Python bool", V.type_name(return_lse))
    if validate is not None and not isinstance(validate, bool):
        V.fail(TypeError, "validate", "None, True or False", V.type_name(validate))
    if validate and q_nope.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        V.fail(ValueError, "validate", "None or False under CUDA-graph capture (True needs a "
               "device-to-host sync)", True)


def check_mla_values(plan, q_nope, q_pe, ckv_cache, kpe_cache, *, scale, kv_scale) -> None:
    """The value checks of a run (reads the data: a host sync on CUDA): lengths and used
    page ids (:func:`pagedattn._validation.check_values`), the cache scale, and the float32
    bounds of :func:`pagedattn._validation.check_value_ranges` with the keys ``[latent |
    rope]`` and the values the latent."""
    V.check_values(plan.block_tables, plan.context_lens, ckv_cache.shape[0], plan.page_size,
                   q_len=plan.q_len)
    V.check_scalar_values((("kv_scale", kv_scale),))
    if plan.batch == 0 or q_nope.numel() == 0:
        return
    try:  # one kv head: keys [latent | rope], values the latent
        V.check_value_ranges(torch.cat([q_nope.detach(), q_pe.detach()], dim=-1),
                             torch.cat([ckv_cache, kpe_cache], dim=-1).unsqueeze(2),
                             ckv_cache.unsqueeze(2), plan.block_tables, plan.context_lens,
                             scale=scale, k_scale=kv_scale, v_scale=kv_scale)
    except ValueError as e:  # in the MLA arguments' names
        msg = str(e).replace("query:", "q_nope:", 1).replace("value_cache:", "ckv_cache:", 1)
        raise ValueError(msg) from None
