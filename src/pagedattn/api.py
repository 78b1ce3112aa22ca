"""The public surface: :func:`paged_decode`, :func:`plan_decode`, :func:`append_kv`,
:func:`merge_states` and the impl table :data:`IMPLS`.

Imports go one way: ``api`` on top, :mod:`pagedattn.plan` (``DecodePlan``, re-exported here
with ``DecodeOutput``) and :mod:`pagedattn.one_shot` (the one-shot template cache) below it,
``_validation``, ``options`` and ``_env`` below those, then ``launch -> kernels``. The
launchers (and so Triton) are imported lazily, inside functions, on the first call, so
``import pagedattn`` never imports Triton: the CLI may still set ``TRITON_INTERPRET`` for
itself on a machine without a GPU.

Dispatch is a table: :data:`IMPLS` maps each ``impl=`` name to an :class:`ImplSpec` (its
launcher, its capabilities, its study stage). ``paged_decode`` checks the capabilities from
the table, then either runs a :class:`DecodePlan` (the production kernel, through
:mod:`pagedattn.one_shot`) or calls the stage's launcher; every stage launcher has one
signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedattn import _validation as V
from pagedattn import one_shot
from pagedattn import options as O
from pagedattn._env import on_device
from pagedattn.one_shot import TEMPLATES, runnable, static_key
from pagedattn.options import DecodeOptions
from pagedattn.plan import DecodeOutput, DecodePlan, ValueChecks, nhd_views

__all__ = ["IMPLS", "STAGES", "DecodeOutput", "DecodePlan", "ImplSpec", "append_kv",
           "check_decode", "compiled_kernels", "merge_states", "paged_decode", "plan_decode"]


def _stages():
    from pagedattn.launch import stages

    return stages


def _append_kv_launcher():
    from pagedattn.launch.append_kv import append_kv

    return append_kv


@dataclass(frozen=True)
class ImplSpec:
    """One ``impl=`` choice: how to launch it and what it supports.

    ``launcher`` returns the launch function (importing Triton on first use) for the study's
    stages, whose signature is ``(query, key_cache, value_cache, block_tables, context_lens,
    out, *, scale, num_splits=None)``; ``planned`` impls run through :class:`DecodePlan`."""

    name: str
    stage: int | None  # position in the study's ladder (0 = baseline), None for production
    launcher: Callable[[], Callable] | None = None
    planned: bool = False  # launched through a DecodePlan (the production kernel)
    fp8: bool = False  # fp8 caches with k_scale / v_scale
    hnd: bool = False  # the HND cache layout
    lse: bool = False  # return_lse=True
    splits: bool = False  # honours num_splits (the others have no context split)
    # every pagedattn.options field off its default, and 4-D queries
    variants: bool = False


#: impl name -> spec: the five study stages in ladder order, then the production kernel
IMPLS: dict[str, ImplSpec] = {
    "baseline": ImplSpec("baseline", 0, lambda: _stages().baseline),
    "fused_v1": ImplSpec("fused_v1", 1, lambda: _stages().fused_v1),
    "vectorized_v2": ImplSpec("vectorized_v2", 2, lambda: _stages().vectorized_v2),
    "gqa_reuse_v3": ImplSpec("gqa_reuse_v3", 3, lambda: _stages().gqa_reuse_v3),
    "split_kv_v4": ImplSpec("split_kv_v4", 4, lambda: _stages().split_kv_v4, splits=True),
    "auto": ImplSpec("auto", None, planned=True, fp8=True, hnd=True, lse=True, splits=True,
                     variants=True),
}
STAGES = tuple(name for name, spec in IMPLS.items() if spec.stage is not None)


def _check_capabilities(spec: ImplSpec, key_cache, kv_layout, k_scale, v_scale,
                        return_lse, query=None, variants=None) -> None:
    """What the spec cannot honour is a ValueError naming the argument and the impl.
    ``variants``: ``{name: value}`` of the variant arguments (:mod:`pagedattn.options`),
    refused unless at default."""
    impl = spec.name
    if not spec.variants:
        if query is not None and query.dim() == 4:
            raise ValueError(f"query: impl={impl!r} takes a 3-D query [batch, num_q_heads, "
                             "head_dim]; multi-token (4-D) queries need impl='auto'")
        name = O.refused(variants or {})
        if name is not None:
            raise ValueError(f"{name}: impl={impl!r} does not support attention "
                             "variants; use impl='auto'")
    if key_cache.dtype in V.FP8_DTYPES and not spec.fp8:
        raise ValueError(f"key_cache: impl={impl!r} supports float32/float16/bfloat16 caches, "
                         f"got {key_cache.dtype}; use impl='auto' for fp8")
    if kv_layout != "NHD" and not spec.hnd:
        raise ValueError(f"kv_layout: impl={impl!r} supports 'NHD' only, got {kv_layout!r}; "
                         "use impl='auto' for HND")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and not spec.fp8:
            raise ValueError(f"{name}: impl={impl!r} takes no cache scales; use impl='auto'")
    if return_lse and not spec.lse:
        raise ValueError(f"return_lse: impl={impl!r} does not return the LSE; use impl='auto'")


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, *, num_q_heads: int,
                num_kv_heads: int, head_dim: int, page_size: int, q_dtype: torch.dtype,
                kv_dtype: torch.dtype | None = None, kv_layout: str = "NHD",
                num_splits: int | None = None,
                host_context_lens=None, q_len: int = 1, schedule: str | None = None,
                num_programs: int | None = None, **variants) -> DecodePlan:
    """Plan one decode step of the production kernel (``impl="auto"``) for every layer.

    Args:
        block_tables: ``[batch, max_pages]`` int32/int64 physical page ids, read at each run.
        context_lens: ``[batch]`` int32/int64 tokens per sequence, read at each run.
        num_q_heads, num_kv_heads, head_dim, page_size: the attention shapes (``num_q_heads``
            a multiple of ``num_kv_heads``; ``head_dim`` in [16, 256]; ``page_size`` ≥ 1).
        q_dtype: float32, float16 or bfloat16.
        kv_dtype: the caches' dtype: ``q_dtype`` (default) or float8_e4m3fn/float8_e5m2.
        kv_layout: ``"NHD"`` or ``"HND"``.
        num_splits: ``None`` (token-balanced splits planned on the device) or an int ≥ 1.
        host_context_lens: optional host copy of this step's lengths (a list of ints or a CPU
            tensor; schedulers have one). It only refines the tile choice (a ragged batch,
            mean under half the longest, pipelines deeper); the kernel still reads
            ``context_lens`` on the device, so a later in-place update stays correct.
        q_len: query tokens per sequence (≥ 1); with ``q_len > 1`` :meth:`DecodePlan.run`
            takes ``[batch, q_len, num_q_heads, head_dim]`` queries (speculative decoding).
        schedule: ``None`` (default) or ``"split"``, the same: one program per (split of a
            sequence, kv head), token-balanced splits, then a merge. ``"persistent"`` was
            removed (slower than the split schedule on 15 of 16 rows on an H100 and an
            H200: ``docs/perf-notes.md`` step 48) and raises a ``ValueError`` naming
            ``schedule``.
        num_programs: ``None``. It was the persistent schedule's program count; kept for one
            release, any other value raises a ``ValueError`` naming ``num_programs``.
        variants: the plan-time options of :mod:`pagedattn.options`, as in
            :func:`paged_decode`: compile-time specializations of the plan's kernel (the
            per-call ones are per layer: pass them to :meth:`DecodePlan.run`):
<variant options>

    Returns:
        A :class:`DecodePlan`. Nothing is read from the device (no host sync).

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, rank, value or device;
            the message names it.
    """
    V.check_plan(block_tables, context_lens, num_q_heads=num_q_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                 q_dtype=q_dtype, kv_dtype=kv_dtype, kv_layout=kv_layout,
                 num_splits=num_splits)
    V.check_int("q_len", q_len, 1)
    options = O.plan_options(variants)
    V.check_schedule(schedule)
    V.check_num_programs_removed(num_programs)
    ragged = False
    if host_context_lens is not None:
        lens = V.check_host_context_lens(host_context_lens, block_tables.shape[0])
        ragged = bool(lens) and 2 * sum(lens) < max(lens) * len(lens)
    return DecodePlan(block_tables, context_lens, num_q_heads=num_q_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                      q_dtype=q_dtype, kv_dtype=q_dtype if kv_dtype is None else kv_dtype,
                      kv_layout=kv_layout, num_splits=num_splits, ragged=ragged, q_len=q_len,
                      options=options)


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
    schedule: str | None = None,
    num_programs: int | None = None,
    out: torch.Tensor | None = None,
    kv_layout: str = "NHD",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
    **variants,
) -> torch.Tensor | DecodeOutput:
    """One decode step of paged attention: ``softmax(q·Kᵀ·scale)·V`` per sequence and head.

    Grouped-query attention: query head ``h`` reads kv head ``h // (num_q_heads //
    num_kv_heads)``. Only the first ``context_lens[b]`` tokens of sequence ``b`` count; they
    live in pages ``block_tables[b, :ceil(context_lens[b] / page_size)]``. Entries past that
    are never read (they may hold -1 or garbage), and cache slots past the length are masked
    before the softmax *and* before ``P·V`` (NaN there cannot leak). ``impl="auto"`` is the
    one-shot form of :func:`plan_decode` + :meth:`DecodePlan.run`.

    Args:
        query: ``[batch, num_q_heads, head_dim]``, float32/float16/bfloat16. Any strides.
            ``impl="auto"`` also takes ``[batch, q_len, num_q_heads, head_dim]`` (multi-token
            queries, as in speculative decoding): token ``j`` sits at position
            ``context_lens[b] - q_len + j`` (the ``q_len`` new keys are already in the cache,
            counted by ``context_lens``) and attends causally; a token at a position below 0
            gets 0 (and LSE ``-inf``, or the sink). The tokens' rows share one tile, so the
            cache is read once for all of them.
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
        schedule, num_programs: as in :func:`plan_decode`: ``schedule`` ``None`` or
            ``"split"`` (``impl="auto"`` only; ``"persistent"`` was removed: a ``ValueError``
            naming it), ``num_programs`` ``None`` (kept for one release).
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
        variants: the attention variants, :mod:`pagedattn.options` (``impl="auto"``
            only), each off by default:
<variant options>

    Returns:
        ``out`` in the query's shape and dtype (a row that saw no key is all zeros), or
        ``DecodeOutput(out, lse)`` with ``return_lse=True`` (``lse`` is the query's shape
        without ``head_dim``).

    Raises:
        TypeError: a non-tensor argument, or a wrong dtype (mixed query/cache dtypes, non-integer
            ``block_tables``/``context_lens``, an fp8 query).
        ValueError: a wrong rank or shape, mixed devices (or a device other than CUDA or the
            CPU with ``TRITON_INTERPRET=1``), ``num_q_heads % num_kv_heads != 0``, ``head_dim``
            outside [16, 256], an unknown ``impl``/``kv_layout``, ``num_splits`` outside
            [1, 65536], a bad scale shape, ``scale``/``k_scale``/``v_scale`` (or ``scale *
            k_scale``) past float32's range / log2(e) (about 2.36e38: the kernels work in base
            2), fp8 scales <= 0, a variant outside the range its entry above states (a
            per-call one not ``[num_q_heads]`` float32 on the query's device: TypeError for
            a wrong dtype; an unknown keyword: TypeError), an ``out`` whose elements overlap
            or that overlaps the query (``out`` may be the query itself) or a cache, an
            option the impl cannot honour (every variant and 4-D queries are ``impl="auto"``
            only), or (when value checks run) tensor fp8 scales or per-call variants out of
            those ranges, a length outside ``[0, max_pages * page_size]`` (or past 2^30, the
            kernels' int32 bound), a used page id outside ``[0, num_pages)``, or data past
            the kernels' float32 range (``_validation.check_value_ranges``: ``head_dim ·
            max|q| · max|k|``, ``max|q| · |scale| · log2(e)``, the scores and ``max
            context_lens · max|v|`` within 2^127). The message names the argument.

    Sources: split-KV with a log-sum-exp merge as in Flash-Decoding (Dao et al., 2023); paging
    as in vLLM (Kwon et al., SOSP 2023); the plan/run split as in FlashInfer (Ye et al., 2025);
    soft-cap from Gemma 2 (Gemma Team, 2024); sliding window from Mistral 7B (Jiang et al.,
    2023); sinks from gpt-oss (OpenAI, 2025); ALiBi from Press et al. (ICLR 2022).
    """
    result, _ = _decode(query, key_cache, value_cache, block_tables, context_lens, scale=scale,
                        impl=impl, num_splits=num_splits, schedule=schedule,
                        num_programs=num_programs, out=out, kv_layout=kv_layout,
                        k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                        validate=validate, **variants)
    return result



def compiled_kernels(query, key_cache, value_cache, block_tables, context_lens, *,
                     impl: str = "auto", **kwargs) -> tuple[object, dict[str, object]]:
    """Run :func:`paged_decode` once; return its result and the compiled kernels that call
    launched, by name (Triton's ``CompiledKernel``: ``n_regs``, ``n_spills``, ``metadata``;
    ``None`` values under the interpreter), for the profiling tools. Takes the same arguments
    as :func:`paged_decode`."""
    return _decode(query, key_cache, value_cache, block_tables, context_lens, impl=impl,
                   **kwargs)


def check_decode(query, key_cache, value_cache, block_tables, context_lens, *, scale, impl,
                 num_splits, out, kv_layout, k_scale, v_scale, return_lse, validate,
                 variants: dict, where: str = "paged_decode", schedule=None,
                 num_programs=None) -> tuple[DecodeOptions, dict]:
    """Every metadata check of a decode call (``_validation.check_metadata``, the variants
    through :func:`pagedattn.options.split`, then the schedule); returns ``(plan-time
    options, per-call tensors that are on)``. Shared by :func:`paged_decode` and the custom
    ops' fake kernels (``serving/ops.py``)."""
    V.check_metadata(
        query, key_cache, value_cache, block_tables, context_lens, scale=scale, impl=impl,
        impls=tuple(IMPLS), num_splits=num_splits, out=out, kv_layout=kv_layout,
        k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, validate=validate)
    options, calls = O.split(variants, query.shape[-2], query.device, where)
    V.check_schedule(schedule, impl=impl)
    V.check_num_programs_removed(num_programs)
    return options, calls


def _decode(query, key_cache, value_cache, block_tables, context_lens, *, scale=None,
            impl="auto", num_splits=None, schedule=None, num_programs=None, out=None,
            kv_layout="NHD", k_scale=None, v_scale=None, return_lse=False, validate=None,
            **variants):
    # the fast path: a plain call of a static key that an earlier call passed check_metadata
    # with (everything check_metadata reads is the key or checked here per call)
    if type(impl) is str and impl == "auto":
        key = static_key(query, key_cache, block_tables, context_lens, kv_layout, num_splits,
                         O.fast_key(variants), schedule, num_programs)
        plan = TEMPLATES.get(key) if key is not None else None
        if plan is not None and plan.is_plain_call(query, key_cache, value_cache, scale,
                                                   k_scale, v_scale, out, return_lse,
                                                   validate) \
                and block_tables.device == plan.device and context_lens.device == plan.device \
                and (not plan.on_cpu or runnable(query)):
            if plan.on_cpu:  # validate is None here: the value checks run on the CPU
                plan.checks.check(query, key_cache, value_cache, block_tables, context_lens,
                                  scale=scale, k_scale=k_scale, v_scale=v_scale)
            return plan.launch(query, key_cache, value_cache, scale, k_scale, v_scale, out,
                               return_lse, tables=(block_tables, context_lens))
    options, calls = check_decode(
        query, key_cache, value_cache, block_tables, context_lens, scale=scale, impl=impl,
        num_splits=num_splits, out=out, kv_layout=kv_layout, k_scale=k_scale,
        v_scale=v_scale, return_lse=return_lse, validate=validate, variants=variants,
        schedule=schedule, num_programs=num_programs)
    num_splits = None if num_splits is None else int(num_splits)  # numpy ints pass the check
    spec = IMPLS[impl]
    _check_capabilities(spec, key_cache, kv_layout, k_scale, v_scale, return_lse, query,
                        variants)
    _, page_size, _, head_dim = V.cache_dims(key_cache, kv_layout)
    ValueChecks(page_size, options.window_left if spec.planned else -1,
                query.shape[1] if query.dim() == 4 else 1, kv_layout).check(
        query, key_cache, value_cache, block_tables, context_lens, validate, scale=scale,
        k_scale=k_scale, v_scale=v_scale, calls=calls)
    if spec.planned:
        return one_shot.decode(
            query, key_cache, value_cache, block_tables, context_lens, scale=scale,
            num_splits=num_splits, out=out,
            kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
            options=options, calls=calls,
            plan_variants={n: v for n, v in variants.items() if n not in O.CALL})
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    compiled: dict[str, object] = {}
    if query.shape[0] > 0 and query.shape[-2] > 0:
        key_cache, value_cache = nhd_views(key_cache, value_cache, kv_layout)
        sm_scale = head_dim**-0.5 if scale is None else float(scale)
        with on_device(query.device):
            compiled = spec.launcher()(query, key_cache, value_cache, block_tables,
                                       context_lens, out, scale=sm_scale,
                                       num_splits=num_splits) or {}
    return out, compiled


def append_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, slot_mapping: torch.Tensor, *, kv_layout: str = "NHD",
              k_scale: float | torch.Tensor | None = None,
              v_scale: float | torch.Tensor | None = None,
              validate: bool | None = None) -> None:
    """Write one step's new keys and values into their cache slots, in place (vLLM's
    ``reshape_and_cache``), on the tensors' device.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` float32/float16/bfloat16, any
            strides: the cache's dtype, or any of the three for an fp8 cache.
        key_cache, value_cache: as in :func:`paged_decode` (NHD or HND, float or fp8). Mutated.
        slot_mapping: ``[num_tokens]`` int32/int64: token ``t`` goes to page
            ``slot // page_size``, offset ``slot % page_size``; negative slots are skipped
            (padding rows).
        kv_layout: ``"NHD"`` or ``"HND"``.
        k_scale, v_scale: fp8 caches only: a float, 0-d tensor or ``[num_kv_heads]`` tensor;
            stored values are ``saturate(x / scale)``.
        validate: ``None`` checks slot values only for CPU tensors, ``True`` always (one host
            sync; refused under CUDA-graph capture), ``False`` never.

    Raises:
        TypeError, ValueError: a wrong type, dtype, rank, shape, device or slot (when value
            checks run), named in the message; checked in ``pagedattn._validation`` before
            any launch.
    """
    _append_kv_launcher()(key, value, key_cache, value_cache, slot_mapping,
                          kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale,
                          validate=validate)



O.with_variants(paged_decode, tuple(O.OPTIONS), indent=12)
O.with_variants(compiled_kernels, tuple(O.OPTIONS))
O.with_variants(plan_decode, O.PLAN, indent=12)


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> DecodeOutput:
    """Merge attention states computed over disjoint key sets into the state over their union.

    ``out = Σ_s exp(lse_s - L) · out_s`` with ``L = log Σ_s exp(lse_s)``: the log-sum-exp merge
    of split-KV decoding, exposed for cascade / shared-prefix serving (FlashInfer's
    ``merge_state`` / ``merge_states``, Ye et al., 2025): attend a shared prefix once for many
    requests (``return_lse=True``), each request's own suffix separately, then merge.

    Args:
        outs: ``[S, ..., num_heads, head_dim]`` float32/float16/bfloat16, the ``S`` states'
            normalized outputs (e.g. ``paged_decode`` results stacked on a new dim 0).
        lses: ``[S, ..., num_heads]`` float32/float16/bfloat16/float64, their natural-log
            LSEs: ``-inf`` for a state that saw no key, and so ``+inf``, FlashAttention-2's
            value for such a row (as vLLM's ``merge_attn_states`` reads it).

    Returns:
        ``DecodeOutput(out, lse)``: ``out`` ``[..., num_heads, head_dim]`` in ``outs``'
        dtype, ``lse`` ``[..., num_heads]`` natural log, float64 for float64 ``lses`` (which
        are merged in float64: ``[1e8, 1e8 + 1]`` or ``1e39`` are not float32 values),
        else float32. Computed with the maximum LSE factored out; ``-inf``-safe: where every
        state is empty, out is 0 and LSE ``-inf``.

    An attention sink (``sinks=``) is one more term of the whole denominator: apply it to
    exactly one of the merged parts (e.g. the shared prefix), never to several.

    Raises:
        TypeError, ValueError: non-tensors, a dtype outside those above, mismatched shapes
            (``lses.shape != outs.shape[:-1]``), ``S == 0`` or mixed devices; the message
            names the argument.
    """
    V.check_merge_states(outs, lses)
    wide = torch.float64 if lses.dtype == torch.float64 else torch.float32
    lse_w = lses.to(wide)
    lse_w = torch.where(lse_w == math.inf, -math.inf, lse_w)  # FA2's empty row: no key
    top = lse_w.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all-empty: 0
    w = torch.exp(lse_w - top)  # [S, ..., H], 0 for an empty state
    total = w.sum(dim=0)
    # an empty state adds nothing, whatever its out holds (0 x NaN would be NaN)
    weighted = torch.where((w != 0).unsqueeze(-1), w.unsqueeze(-1) * outs.to(wide), 0.0)
    merged = weighted.sum(dim=0)
    nonempty = total > 0
    merged = merged / torch.where(nonempty, total, torch.ones_like(total)).unsqueeze(-1)
    # only an all-empty merge is -inf: a NaN LSE stays NaN (it was reported as empty)
    lse = torch.where(total == 0, torch.full_like(total, -math.inf), torch.log(total) + top)
    return DecodeOutput(merged.to(outs.dtype), lse)
