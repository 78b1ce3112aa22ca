"""The public surface: :func:`paged_decode`, its validation and its dispatch over ``impl=``.

Imports go one way: ``api -> launch -> kernels``. The launchers (and so Triton) are imported
lazily, on the first call, so ``import pagedattn`` never imports Triton: the CLI may still set
``TRITON_INTERPRET`` for itself on a machine without a GPU.
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import torch

from pagedattn import _validation as V

#: impl name -> (launcher module, function). The five study stages, then the production kernel.
IMPLS: dict[str, tuple[str, str]] = {
    "baseline": ("pagedattn.launch.stages", "baseline"),
    "fused_v1": ("pagedattn.launch.stages", "fused_v1"),
    "vectorized_v2": ("pagedattn.launch.stages", "vectorized_v2"),
    "gqa_reuse_v3": ("pagedattn.launch.stages", "gqa_reuse_v3"),
    "split_kv_v4": ("pagedattn.launch.stages", "split_kv_v4"),
    "auto": ("pagedattn.launch.decode", "paged_decode_auto"),
}
STAGES = ("baseline", "fused_v1", "vectorized_v2", "gqa_reuse_v3", "split_kv_v4")


@functools.cache
def _launcher_module(module: str):
    """A launcher module, imported on first use (Triton loads then); cached, since
    ``import_module`` costs microseconds on every decode step."""
    return importlib.import_module(module)


def _launcher(impl: str):
    """The launcher function of ``impl``, looked up on each call (tests patch it)."""
    module, fn = IMPLS[impl]
    return getattr(_launcher_module(module), fn)


class DecodeOutput(NamedTuple):
    """``paged_decode(..., return_lse=True)`` result."""

    out: torch.Tensor  # [batch, num_q_heads, head_dim], the query's dtype
    lse: torch.Tensor  # [batch, num_q_heads] float32, natural log; -inf where context_len == 0


def _check_stage_support(impl: str, key_cache, kv_layout, k_scale, v_scale, return_lse) -> None:
    """The study's stages serve fp32/fp16/bf16 NHD caches without LSE or fp8 scales."""
    if key_cache.dtype in V.FP8_DTYPES:
        raise ValueError(f"key_cache: impl={impl!r} supports float32/float16/bfloat16 caches, "
                         f"got {key_cache.dtype}; use impl='auto' for fp8")
    if kv_layout != "NHD":
        raise ValueError(f"kv_layout: impl={impl!r} supports 'NHD' only, got {kv_layout!r}; "
                         "use impl='auto' for HND")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None:
            raise ValueError(f"{name}: impl={impl!r} takes no cache scales; use impl='auto'")
    if return_lse:
        raise ValueError(f"return_lse: impl={impl!r} does not return the LSE; use impl='auto'")


def _run_value_checks(query, block_tables, context_lens, num_pages, page_size, validate) -> None:
    on_cpu = query.device.type == "cpu"
    if validate is False or (validate is None and not on_cpu):
        return
    if validate and not on_cpu and torch.cuda.is_current_stream_capturing():
        raise ValueError("validate: True needs a device-to-host sync, which CUDA-graph capture "
                         "forbids; validate eagerly before capturing, or pass validate=None")
    V.check_values(block_tables, context_lens, num_pages, page_size)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    impl: str = "auto",
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    kv_layout: str = "NHD",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
) -> torch.Tensor | DecodeOutput:
    """One decode step of paged attention: ``softmax(q·Kᵀ·scale)·V`` per sequence and head.

    Grouped-query attention: query head ``h`` reads kv head ``h // (num_q_heads //
    num_kv_heads)``. Only the first ``context_lens[b]`` tokens of sequence ``b`` count; they
    live in pages ``block_tables[b, :ceil(context_lens[b] / page_size)]``. Entries past that
    are never read (they may hold -1 or garbage), and cache slots past the length are masked
    before the softmax *and* before ``P·V`` (NaN there cannot leak).

    Args:
        query: ``[batch, num_q_heads, head_dim]``, float32/float16/bfloat16. Any strides.
        key_cache: ``[num_pages, page_size, num_kv_heads, head_dim]`` ("NHD") or
            ``[num_pages, num_kv_heads, page_size, head_dim]`` ("HND"). The query's dtype, or
            float8_e4m3fn/float8_e5m2 (``impl="auto"`` only). Any strides: a combined
            ``[num_pages, 2, ...]`` cache can be passed as two views.
        value_cache: same shape, dtype and layout as ``key_cache``.
        block_tables: ``[batch, max_pages]`` int32 (the norm) or int64 physical page ids.
        context_lens: ``[batch]`` int32 or int64, tokens per sequence, in
            ``[0, max_pages * page_size]``.
        scale: softmax scale applied to ``q·k``; default ``head_dim ** -0.5``.
        impl: ``"auto"`` (the production kernel) or one of the study's stages
            ``"baseline"``, ``"fused_v1"``, ``"vectorized_v2"``, ``"gqa_reuse_v3"``,
            ``"split_kv_v4"`` (fp32/fp16/bf16 NHD caches, no LSE, no fp8 scales).
        num_splits: ``None`` lets the impl decide; an int forces the number of context splits
            per sequence for the impls that split (``split_kv_v4``, ``auto``); the others
            ignore it.
        out: optional ``[batch, num_q_heads, head_dim]`` output in the query's dtype, any
            strides.
        kv_layout: ``"NHD"`` (default) or ``"HND"``.
        k_scale, v_scale: dequantization scales (``cache_value = stored * scale``): a Python
            float, a 0-d tensor or a ``[num_kv_heads]`` tensor. For fp8 caches; ``auto`` only.
        return_lse: also return the log-sum-exp of the scaled scores, ``[batch, num_q_heads]``
            float32, natural log, ``-inf`` for a row with context length 0.
        validate: ``None`` (default) runs the value checks (lengths and used page ids in
            range) only for CPU tensors; ``True`` runs them on any device (one host sync;
            refused under CUDA-graph capture); ``False`` skips them.

    Returns:
        ``out`` ``[batch, num_q_heads, head_dim]`` in the query's dtype (a row with context
        length 0 is all zeros), or ``DecodeOutput(out, lse)`` with ``return_lse=True``.

    Raises:
        TypeError: a non-tensor argument, or a wrong dtype (mixed query/cache dtypes, non-integer
            ``block_tables``/``context_lens``, an fp8 query).
        ValueError: a wrong rank or shape, mixed devices, ``num_q_heads % num_kv_heads != 0``,
            ``head_dim`` outside [16, 256], an unknown ``impl``/``kv_layout``, ``num_splits < 1``,
            a bad scale shape, an option the impl cannot honour, or (when value checks run)
            a length outside ``[0, max_pages * page_size]`` or a used page id outside
            ``[0, num_pages)``. The message names the argument.

    Sources: the study in ``shared/seed`` (stages ``baseline`` .. ``split_kv_v4``); split-KV
    with a log-sum-exp merge as in Flash-Decoding (Dao et al., 2023); paging as in vLLM
    (Kwon et al., SOSP 2023).
    """
    V.check_metadata(
        query, key_cache, value_cache, block_tables, context_lens, scale=scale, impl=impl,
        impls=tuple(IMPLS), num_splits=num_splits, out=out, kv_layout=kv_layout,
        k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, validate=validate,
    )
    if impl in STAGES:
        _check_stage_support(impl, key_cache, kv_layout, k_scale, v_scale, return_lse)
    num_pages, page_size, num_kv_heads, head_dim = V.cache_dims(key_cache, kv_layout)
    _run_value_checks(query, block_tables, context_lens, num_pages, page_size, validate)

    if kv_layout == "HND":  # the kernels see NHD-shaped views; strides carry the layout
        key_cache = key_cache.transpose(1, 2)
        value_cache = value_cache.transpose(1, 2)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    batch, num_q_heads, _ = query.shape
    lse = (torch.empty(batch, num_q_heads, dtype=torch.float32, device=query.device)
           if return_lse else None)
    sm_scale = head_dim**-0.5 if scale is None else float(scale)

    launcher = _launcher(impl)
    if batch > 0 and num_q_heads > 0:
        if impl in STAGES:
            launcher(query, key_cache, value_cache, block_tables, context_lens, out,
                     scale=sm_scale, num_splits=num_splits)
        else:
            launcher(query, key_cache, value_cache, block_tables, context_lens, out, lse,
                     scale=sm_scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    return DecodeOutput(out, lse) if lse is not None else out
