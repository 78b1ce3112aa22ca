"""Absorbed multi-head latent attention on the paged cache (MLA: DeepSeek-V2/V3/R1, Kimi K2):
:func:`mla_decode` and its plan form :func:`plan_mla_decode`.

MLA caches one latent vector per token (``latent_dim``, DeepSeek's ``kv_lora_rank`` = 512)
and a rope key (``rope_dim``, ``qk_rope_head_dim`` = 64) shared by every head. With the key
and value up-projections absorbed into the query and the output (DeepSeek-V2, Section 2.1.2),
decode attends over the latent itself::

    out_h = softmax(scale · (q_nope_h · ckvᵀ + q_pe_h · kpeᵀ)) · ckv

the latent is both key (with the rope part) and value. The kernel is MLA's own
(``kernels/mla.py``, launched by ``launch/mla.py``): 64 query rows (heads of a block) a
program on 64-token latent tiles, each tile read once for both dots, and balanced parts of
the batch's tiles, one program per SM, with a small merge of the sequences they cut
(FlashMLA's schedule). On Hopper, 16-bit and fp8 latents at 512 + 64 dims run the same
schedule in Gluon (``kernels/mla_gluon.py``: the score split between the warpgroups, no
spill), 1.1-1.8x the plain kernel's speed on an H100 (docs/perf-notes.md steps 50 and 52).
The earlier path, ``schedule="split"`` and its ``num_splits`` (the production decode kernel
with an ``MLA`` flag), was removed after an H100 measured the Gluon kernel ahead of it on
every row but one (docs/perf-notes.md step 52). A plan is CUDA-graph safe: it reads
``block_tables`` and ``context_lens`` on the device at every run.
"""

from __future__ import annotations

import torch

from pagedattn import _errors
from pagedattn import _validation as V
from pagedattn import _validation_mla as VM
from pagedattn import options as O
from pagedattn._env import on_device
from pagedattn.plan import DecodeOutput, PlanBase
from pagedattn.spec import LaunchSpec


def _mla_launcher_class():
    from pagedattn.launch.mla import MLALauncher

    return MLALauncher


class MLADecodePlan(PlanBase):
    """One decode step of absorbed MLA for every layer: built by :func:`plan_mla_decode`, run
    once per layer with :meth:`run`. It owns its workspace (the cut sequences' partials and
    their piece records), keeps references to ``block_tables`` and
    ``context_lens`` and reads them on the device at every run (update them in place between
    steps; a CUDA graph captured around :meth:`run` replays for any lengths within
    ``max_pages * page_size``). One plan serves one stream at a time."""

    def __init__(self, block_tables, context_lens, *, num_q_heads, latent_dim, rope_dim,
                 page_size, q_dtype, kv_dtype, q_len, options, num_programs, one_shot=False):
        batch, max_pages = block_tables.shape
        # the latent is the one kv head of every query head: head_dim its dims
        spec = LaunchSpec(
            batch=batch, max_pages=max_pages, num_q_heads=int(num_q_heads), num_kv_heads=1,
            head_dim=int(latent_dim), page_size=int(page_size), q_dtype=q_dtype,
            kv_dtype=kv_dtype, device=block_tables.device, q_len=int(q_len),
            options=options, rope_dim=int(rope_dim))
        super().__init__(spec, dict(block_tables=block_tables, context_lens=context_lens),
                         dict(block_tables=(batch, max_pages), context_lens=(batch,)))
        self.latent_dim = self.head_dim
        # the MLA kernel's parts a head block (None: one per SM)
        self.num_programs = None if num_programs is None else int(num_programs)
        self.q_shape = ((batch, self.num_q_heads, self.latent_dim) if self.q_len == 1
                        else (batch, self.q_len, self.num_q_heads, self.latent_dim))
        self._one_shot = one_shot
        #: the MLA kernel's tiles and parts (a ``launch.policy_mla.MLAKernelConfig``) instead
        #: of its policy's, read when the first run builds the launcher (tuning)
        self.kernel_config = None

    def policy_config(self):
        """The MLA kernel's tiles and parts as its policy picks them for this plan's shapes
        (a ``launch.policy_mla.MLAKernelConfig``): the base that :attr:`kernel_config`
        replaces for tuning (``pagedattn.bench.mla --ours``). Builds a launcher without a
        workspace; the plan's own is built at its first run."""
        with on_device(self.device):
            return _mla_launcher_class()(self.spec, num_parts=self.num_programs,
                                         workspace=False).config

    def _build_launcher(self, key):
        return _mla_launcher_class()(self.spec, num_parts=self.num_programs,
                                     config=self.kernel_config, workspace=not self._one_shot)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, *, scale, kv_scale=None, out=None,
            return_lse=False, validate=None, sinks=None):
        """One layer: ``out_h = softmax(scale·(q_nope_h·ckvᵀ + q_pe_h·kpeᵀ))·ckv`` for every
        query head over its sequence's tokens (causal for ``q_len > 1``).

        Args:
            q_nope: ``[batch, num_q_heads, latent_dim]`` (``[batch, q_len, num_q_heads,
                latent_dim]`` for a plan with ``q_len > 1``) of the plan's ``q_dtype``, the
                query absorbed into the latent space; any strides.
            q_pe: its rope part, ``[..., num_q_heads, rope_dim]``; any strides (a view of
                one ``[..., latent_dim + rope_dim]`` buffer works).
            ckv_cache: ``[num_pages, page_size, latent_dim]`` of the plan's ``kv_dtype``; any
                strides (a view of a combined ``[num_pages, page_size, latent_dim +
                rope_dim]`` cache works).
            kpe_cache: ``[num_pages, page_size, rope_dim]``, the same dtype and pages.
            scale: the softmax scale, a Python float (required: DeepSeek-V3's is
                ``1 / sqrt(128 + 64)``, of the heads before absorption).
            kv_scale: an fp8 cache's dequantization scale (``stored · kv_scale``, latent and
                rope alike): a float or a 0-d float tensor (graph-safe); ``None`` is 1.
            out: optional output of ``q_nope``'s shape and dtype (written in full).
            return_lse: also return the LSE, float32, natural log, ``q_nope``'s shape
                without its last dim (``-inf`` for a row that sees no key).
            validate: the value checks (lengths, used page ids, scales, the float32 bounds
                of the data): ``None`` runs them for CPU tensors only, ``True`` always (a
                host sync), ``False`` never.
            sinks: ``[num_q_heads]`` float32, one logit per head added to the softmax
                denominator only (as :func:`pagedattn.paged_decode`'s), or ``None``.

        Returns:
            ``out``, or ``DecodeOutput(out, lse)`` with ``return_lse=True``.

        Raises:
            TypeError, ValueError: an argument that does not fit the plan, named, before any
                launch and any write.
        """
        _errors.raise_pending(self.device)  # what an earlier launch found (no sync)
        self.check_tables()
        VM.check_mla_run(self, q_nope, q_pe, ckv_cache, kpe_cache, scale=scale,
                         kv_scale=kv_scale, out=out, return_lse=return_lse, validate=validate)
        calls = O.call_options({"sinks": sinks}, self.num_q_heads, self.device)
        if V.value_checks_due(validate, self.device):
            VM.check_mla_values(self, q_nope, q_pe, ckv_cache, kpe_cache, scale=scale,
                                kv_scale=kv_scale)
            if calls:
                O.check_values(calls)
        out, lse = self.outputs(q_nope, out, return_lse, self.q_shape[:-1])
        if self.batch > 0:
            with self.guard():
                self.last_compiled = self._engine().launch(
                    q_nope, q_pe, ckv_cache, kpe_cache, self.block_tables, self.context_lens,
                    out, lse, scale=float(scale), kv_scale=kv_scale, calls=calls)
        return DecodeOutput(out, lse) if return_lse else out


def plan_mla_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                    num_q_heads: int, latent_dim: int, rope_dim: int, page_size: int,
                    q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None, q_len: int = 1,
                    num_programs: int | None = None,
                    logits_soft_cap: float | None = None) -> MLADecodePlan:
    """Plan one decode step of absorbed MLA (see the module docstring) for every layer.

    Args:
        block_tables: ``[batch, max_pages]`` int32/int64 page ids, read at each run.
        context_lens: ``[batch]`` int32/int64 tokens per sequence (the new ones included),
            read at each run.
        num_q_heads: query heads (an int >= 1; DeepSeek-V3: 128, or 128 / TP).
        latent_dim: the latent's dims (``kv_lora_rank``), an int in [16, 512].
        rope_dim: the rope key's dims (``qk_rope_head_dim``), an int in [0, 256] (0: no rope part).
        page_size: tokens per page (an int >= 1: 1 as SGLang's, 64 as FlashMLA's, ...).
        q_dtype: float32, float16 or bfloat16.
        kv_dtype: the caches' dtype: ``q_dtype`` (default) or float8_e4m3fn/float8_e5m2
            (with ``kv_scale`` at each run).
        q_len: query tokens per sequence, 1 to 64 (speculative decoding: token ``j`` sits
            at position ``context_len - q_len + j`` and attends causally).
        num_programs: the programs of each head block (an int in [1, 65536]: the parts the
            batch's tiles are shared into; ``None``: one per SM).
        logits_soft_cap: as in :func:`pagedattn.paged_decode` (a constexpr of the plan).

    Returns:
        An :class:`MLADecodePlan`. Nothing is read from the device (no host sync).

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, rank, value or device;
            the message names it.
    """
    VM.check_mla_plan(block_tables, context_lens, num_q_heads=num_q_heads,
                      latent_dim=latent_dim, rope_dim=rope_dim, page_size=page_size,
                      q_dtype=q_dtype, kv_dtype=kv_dtype, q_len=q_len)
    options = O.plan_options({"logits_soft_cap": logits_soft_cap}, "plan_mla_decode")
    if num_programs is not None:
        V.check_int("num_programs", num_programs, 1, V.MAX_PROGRAMS)
    return MLADecodePlan(block_tables, context_lens, num_q_heads=num_q_heads,
                         latent_dim=latent_dim, rope_dim=rope_dim, page_size=page_size,
                         q_dtype=q_dtype, kv_dtype=q_dtype if kv_dtype is None else kv_dtype,
                         q_len=q_len, options=options, num_programs=num_programs)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
               kpe_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               *, scale: float, kv_scale=None, out: torch.Tensor | None = None,
               return_lse: bool = False, num_programs: int | None = None,
               logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
               validate: bool | None = None):
    """Absorbed multi-head latent attention over the paged latent cache, one call.

    ``out_h = softmax(scale · (q_nope_h · ckvᵀ + q_pe_h · kpeᵀ)) · ckv`` per query head over
    each sequence's ``context_lens[b]`` tokens (DeepSeek-V2's absorbed decode; the latent is
    key and value).

    Args:
        q_nope: ``[batch, num_q_heads, latent_dim]``, or ``[batch, q_len, num_q_heads,
            latent_dim]`` with ``q_len`` 1 to 64 (multi-token prediction: token ``j`` at
            position ``context_len - q_len + j``, causal), float32/float16/bfloat16, any
            strides.
        q_pe: ``[..., num_q_heads, rope_dim]``, the same leading shape and dtype.
        ckv_cache: ``[num_pages, page_size, latent_dim]``, ``latent_dim`` in [16, 512]:
            ``q_nope``'s dtype, or float8_e4m3fn/float8_e5m2 with ``kv_scale``; any strides
            (a view of a combined ``[num_pages, page_size, latent_dim + rope_dim]`` cache).
        kpe_cache: ``[num_pages, page_size, rope_dim]``, ``rope_dim`` in [0, 256], the
            dtype and pages of ``ckv_cache``.
        block_tables: ``[batch, max_pages]`` int32/int64 page ids; entries past
            ``ceil(context_lens[b] / page_size)`` are never read.
        context_lens: ``[batch]`` int32/int64 tokens per sequence (0: out 0, LSE ``-inf``).
        scale, kv_scale, out, return_lse, validate, sinks: as in :meth:`MLADecodePlan.run`.
        num_programs, logits_soft_cap: as in :func:`plan_mla_decode`.

    Returns:
        ``out`` (``q_nope``'s shape and dtype), or ``DecodeOutput(out, lse)``.

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, rank, shape, device or
            (CPU tensors or ``validate=True``) value, named in the message, before any launch
            and any write.

    Sources: DeepSeek-V2 (DeepSeek-AI, 2024), absorbed decode as in FlashMLA and FlashInfer's
    ``BatchMLAPagedAttentionWrapper``.
    """
    VM.check_mla_call(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, context_lens)
    if q_nope.dim() == 4 and q_nope.shape[1] == 1:  # one token: the 3-D plan on views
        if q_pe.dim() != 4:
            V.fail(ValueError, "q_pe", "a rank-4 tensor (q_nope's rank)",
                   f"shape {tuple(q_pe.shape)}")
        if out is not None:
            V.check_out(out, q_nope, ckv_cache, kpe_cache)
        res = mla_decode(q_nope[:, 0], q_pe[:, 0], ckv_cache, kpe_cache, block_tables,
                         context_lens, scale=scale, kv_scale=kv_scale,
                         out=None if out is None else out[:, 0], return_lse=return_lse,
                         num_programs=num_programs, logits_soft_cap=logits_soft_cap,
                         sinks=sinks, validate=validate)
        full = (res.out if return_lse else res).unsqueeze(1) if out is None else out
        return DecodeOutput(full, res.lse.unsqueeze(1)) if return_lse else full
    multi = q_nope.dim() == 4
    plan = plan_mla_decode(block_tables, context_lens, num_q_heads=q_nope.shape[-2],
                           latent_dim=q_nope.shape[-1], rope_dim=q_pe.shape[-1],
                           page_size=ckv_cache.shape[1], q_dtype=q_nope.dtype,
                           kv_dtype=ckv_cache.dtype, q_len=q_nope.shape[1] if multi else 1,
                           num_programs=num_programs, logits_soft_cap=logits_soft_cap)
    plan._one_shot = True  # no workspace kept: the launch allocates its own
    return plan.run(q_nope, q_pe, ckv_cache, kpe_cache, scale=scale, kv_scale=kv_scale,
                    out=out, return_lse=return_lse, validate=validate, sinks=sinks)
