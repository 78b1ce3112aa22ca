"""FlashInfer's ``BatchMLAPagedAttentionWrapper`` (``plan``/``run``) on pagedattn's MLA kernel.

A drop-in for code written against ``flashinfer.mla.BatchMLAPagedAttentionWrapper``
(flashinfer-ai/flashinfer, Apache-2.0; the signatures and semantics of ``flashinfer/mla.py``,
no code copied), running :func:`pagedattn.plan_mla_decode`:

- ``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
  head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False,
  *, lse_mode=None)`` turns FlashInfer's CSR page list (request ``b`` holds pages
  ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and ``kv_len_arr[b]`` tokens) into
  ``block_tables``/``context_lens`` on the device and builds one MLA plan. Like FlashInfer's,
  it reads the index arrays on the host (one sync): plan outside a CUDA graph, run inside.
- Every request must bring the same number of query tokens (``qo_indptr`` in equal steps
  ``q_len``, 1 to 64): rows ``b·q_len .. b·q_len + q_len - 1`` of ``q_nope`` are request
  ``b``'s. ``causal=True`` with ``q_len > 1`` is the kernel's multi-token causal mask (token
  ``j`` at position ``kv_len - q_len + j``, FlashInfer's bottom-right alignment);
  ``causal=False`` gives every token all the request's keys (its tokens run as more heads of
  one query). Ragged query lengths are refused with a ``ValueError`` naming ``qo_indptr``.
- ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, ...,
  return_lse_base_on_e=False, *, ckv_scale=None, kpe_scale=None)``. **The LSE is base 2**
  (FlashInfer's default) unless ``return_lse_base_on_e`` or ``lse_mode="base_e"``; ``lse``
  is ``[total_q, num_heads]`` float32.
- fp8 caches (e4m3/e5m2) with per-tensor ``ckv_scale`` / ``kpe_scale`` (``stored · scale``),
  both or neither (FlashInfer's ``run`` takes the two together; one without the other is a
  ``ValueError`` naming the missing one, never a guess): the kernel takes one scale for the
  whole key, so a ``kpe_scale`` other than ``ckv_scale`` is folded into ``q_pe`` (``q_pe ·
  kpe_scale / ckv_scale``, computed in float32 and rounded to the query's dtype).
- ``use_cuda_graph=True`` takes FlashInfer's buffers: the batch is fixed and the block table
  is ``[batch, len(kv_indices)]`` int32, rewritten in place by each ``plan`` (a graph captured
  around ``run`` replays the new step).
- Accepted and ignored: the workspace buffer (the plan owns its workspace), ``backend``
  ``"auto"``/``"fa2"``/``"fa3"``. Refused, a ``ValueError`` naming them: ``backend="cutlass"``
  and its ``kv_len``/``page_table``, ``use_profiler``/``profiler_buffer``, ``ckv_scale_arr``
  (per-group fp8 scales: DeepSeek's FP8 format).
"""

from __future__ import annotations

import math
import numbers

import torch

from pagedattn import _validation as V
from pagedattn.mla import MLADecodePlan, plan_mla_decode

LOG2E = math.log2(math.e)
_BACKENDS = ("auto", "fa2", "fa3")
#: pagedattn's argument names in the errors of the plan and its run -> FlashInfer's
_FI_NAMES = {"block_tables": "kv_indices", "context_lens": "kv_len_arr", "scale": "sm_scale",
             "kv_scale": "ckv_scale", "num_q_heads": "num_heads", "latent_dim": "head_dim_ckv",
             "rope_dim": "head_dim_kpe", "q_dtype": "q_data_type",
             "kv_dtype": "kv_data_type", "q_len": "qo_indptr"}


def _index(name: str, t, rank: int = 1) -> torch.Tensor:
    V.check_tensor(name, t, rank, V.INDEX_DTYPES, "int32 or int64")
    return t


def _scale(name: str, s) -> float | None:
    if s is None:
        return None
    if isinstance(s, torch.Tensor) and s.numel() == 1:
        s = float(s)  # FlashInfer takes a float here; a one-element tensor is read once
    if isinstance(s, bool) or not isinstance(s, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(s).__name__}")
    if not (math.isfinite(float(s)) and float(s) > 0):
        raise ValueError(f"{name}: expected a finite scale > 0, got {s}")
    return float(s)


class BatchMLAPagedAttentionWrapper:
    """FlashInfer's MLA wrapper over pagedattn's MLA kernel (see the module docstring).
    Construct once, ``plan`` once per step, ``run`` once per layer."""

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None,
                 kv_len_arr: torch.Tensor | None = None, backend: str = "auto") -> None:
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("float_workspace_buffer: expected a torch.Tensor, got "
                            f"{type(float_workspace_buffer).__name__}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {_BACKENDS} (pagedattn's kernel "
                             f"serves them all; cutlass's run-time page table is not "
                             f"supported), got {backend!r}")
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = bool(use_cuda_graph)
        self._plan: MLADecodePlan | None = None
        self._key: tuple | None = None
        self._block_tables: torch.Tensor | None = None
        self._context_lens: torch.Tensor | None = None
        if self._use_cuda_graph:
            for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                            ("kv_indices", kv_indices), ("kv_len_arr", kv_len_arr)):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"{name}: expected a buffer (torch.Tensor) with "
                                     "use_cuda_graph=True")
            assert kv_len_arr is not None and kv_indices is not None  # checked above
            batch = kv_len_arr.shape[0]
            # fixed shapes, rewritten in place by plan(): any one request may hold every page
            self._block_tables = torch.zeros(batch, max(kv_indices.shape[0], 1),
                                             dtype=torch.int32, device=self.device)
            self._context_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype,
             kv_data_type: torch.dtype, use_profiler: bool = False, *,
             lse_mode: str | None = None) -> None:
        """Plan a step (FlashInfer's signature). Raises TypeError/ValueError naming
        FlashInfer's argument, before any launch."""
        if use_profiler:
            raise ValueError("use_profiler: FlashInfer's intra-kernel profiler is not "
                             "supported")
        if lse_mode not in (None, "base2", "base_e"):
            raise ValueError(f"lse_mode: expected None, 'base2' or 'base_e', got {lse_mode!r}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal: expected a Python bool, got {V.type_name(causal)}")
        V.check_softmax_scale(sm_scale)
        if sm_scale is None:
            raise TypeError("sm_scale: expected a float (1 / sqrt(qk_nope + qk_rope head "
                            "dims) for DeepSeek-V3), got None")
        qo = _index("qo_indptr", qo_indptr).to("cpu", torch.int64)
        kv = _index("kv_indptr", kv_indptr).to("cpu", torch.int64)
        lens = _index("kv_len_arr", kv_len_arr).to("cpu", torch.int64)
        _index("kv_indices", kv_indices)
        V.check_int("page_size", page_size, 1, V.MAX_CONTEXT_LEN)
        batch = lens.shape[0]
        for name, t in (("qo_indptr", qo), ("kv_indptr", kv)):
            if t.shape[0] != batch + 1:
                raise ValueError(f"{name}: expected {batch + 1} entries (kv_len_arr's batch "
                                 f"+ 1), got {t.shape[0]}")
        q_lens = qo[1:] - qo[:-1]
        q_len = int(q_lens[0]) if batch else 1
        if batch and (int(qo[0]) != 0 or bool((q_lens != q_len).any()) or q_len < 1):
            raise ValueError("qo_indptr: expected 0, q_len, 2·q_len, ... (every request the "
                             "same number >= 1 of query tokens: ragged query lengths are not "
                             f"supported), got {qo.tolist()[:8]}")
        pages = kv[1:] - kv[:-1]
        if batch:
            V.first_bad("kv_indptr", pages, pages < 0, "non-decreasing entries")
            if int(kv[0]) < 0 or int(kv[-1]) > kv_indices.shape[0]:
                raise ValueError(f"kv_indptr: expected entries in [0, len(kv_indices) = "
                                 f"{kv_indices.shape[0]}], got {int(kv[0])}..{int(kv[-1])}")
        V.first_bad("kv_len_arr", lens, (lens < 0) | (lens > pages * page_size),
                    "lengths within each request's pages")
        width = int(pages.max()) if batch else 0
        if self._block_tables is not None and self._context_lens is not None:  # graph mode
            bt, cl = self._block_tables, self._context_lens
            if batch != bt.shape[0] or width > bt.shape[1]:
                raise ValueError(f"kv_len_arr: expected at most {bt.shape[1]} pages for each "
                                 f"of {bt.shape[0]} requests (the use_cuda_graph buffers), "
                                 f"got {batch} requests of up to {width} pages")
        else:
            bt = torch.zeros(batch, max(width, 1), dtype=torch.int32, device=self.device)
            cl = torch.zeros(batch, dtype=torch.int32, device=self.device)
        if batch:  # request b's pages, row b (on the device; entries past them: 0, unread)
            cols = torch.arange(bt.shape[1], device=self.device)
            start = kv[:-1].to(self.device)
            used = cols[None, :] < pages.to(self.device)[:, None]
            idx = (start[:, None] + cols[None, :]).clamp(max=max(kv_indices.shape[0] - 1, 0))
            rows = kv_indices.to(self.device)[idx] if kv_indices.numel() else \
                torch.zeros_like(idx)
            bt.copy_(torch.where(used, rows, 0).to(torch.int32))
            cl.copy_(lens.to(self.device, torch.int32))
        fold = q_len > 1 and not causal  # non-causal tokens: more heads of one token
        key = (batch, bt.shape[1], num_heads, head_dim_ckv, head_dim_kpe, page_size,
               q_data_type, kv_data_type, q_len, causal)
        if self._plan is None or key != self._key or not self._use_cuda_graph:
            try:
                self._plan = plan_mla_decode(
                    bt, cl, num_q_heads=num_heads * q_len if fold else num_heads,
                    latent_dim=head_dim_ckv, rope_dim=head_dim_kpe, page_size=page_size,
                    q_dtype=q_data_type, kv_dtype=kv_data_type, q_len=1 if fold else q_len)
            except (TypeError, ValueError) as e:
                raise V.renamed(e, _FI_NAMES) from None
            self._key = key
        self._q_len, self._fold, self._heads = q_len, fold, num_heads
        self._sm_scale = float(sm_scale)
        self._base_e = lse_mode == "base_e"

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False, *,
            ckv_scale=None, kpe_scale=None, ckv_scale_arr=None):
        """One layer (FlashInfer's signature): ``q_nope [total_q, num_heads, head_dim_ckv]``,
        ``q_pe [total_q, num_heads, head_dim_kpe]``, ``ckv_cache [num_pages, page_size,
        head_dim_ckv]``, ``kpe_cache [num_pages, page_size, head_dim_kpe]``. Returns ``out``
        (``q_nope``'s shape and dtype), or ``(out, lse)`` with ``return_lse``. Raises
        TypeError/ValueError naming FlashInfer's argument, before any launch (``kpe_scale``
        given without ``ckv_scale`` or the other way round: the missing one)."""
        for name, value in (("profiler_buffer", profiler_buffer), ("kv_len", kv_len),
                            ("page_table", page_table), ("ckv_scale_arr", ckv_scale_arr)):
            if value is not None:
                raise ValueError(f"{name}: not supported (cutlass's run-time page table, the "
                                 "profiler and per-group fp8 scales are not); pass None")
        if self._plan is None:
            raise ValueError("plan: call plan() before run()")
        plan = self._plan
        batch, q_len, heads = plan.batch, self._q_len, self._heads
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
            V.check_tensor(name, t, 3, V.FLOAT_DTYPES, "float32, float16 or bfloat16")
            if t.shape[:2] != (batch * q_len, heads):
                raise ValueError(f"{name}: expected [{batch * q_len}, {heads}, dims] (the "
                                 f"plan's requests x query tokens, num_heads), got "
                                 f"{tuple(t.shape)}")
        ckv_s, kpe_s = _scale("ckv_scale", ckv_scale), _scale("kpe_scale", kpe_scale)
        if (ckv_s is None) != (kpe_s is None):  # FlashInfer takes both or neither
            given, missing = ("ckv_scale", "kpe_scale") if kpe_s is None else (
                "kpe_scale", "ckv_scale")
            raise ValueError(f"{missing}: expected a scale with {given} (an fp8 cache's two "
                             "scales come together), got None")
        if ckv_s is not None and kpe_s is not None and kpe_s != ckv_s:  # one key scale
            q_pe = (q_pe.float() * (kpe_s / ckv_s)).to(q_pe.dtype)
        if out is not None:
            V.check_out(out, q_nope, ckv_cache, kpe_cache)
        lead = (batch, heads * q_len) if self._fold else (batch, heads) if q_len == 1 else \
            (batch, q_len, heads)
        run_out = None if out is None else out.view(*lead, out.shape[-1])
        try:
            res = plan.run(q_nope.reshape(*lead, q_nope.shape[-1]),
                           q_pe.reshape(*lead, q_pe.shape[-1]), ckv_cache, kpe_cache,
                           scale=self._sm_scale, kv_scale=ckv_s, out=run_out,
                           return_lse=return_lse or lse is not None)
        except (TypeError, ValueError) as e:
            raise V.renamed(e, _FI_NAMES) from None
        if not (return_lse or lse is not None):
            return res.view(q_nope.shape) if out is None else out
        o, lse_nat = res
        base = lse_nat.reshape(batch * q_len, heads)
        if not (return_lse_base_on_e or self._base_e):
            base = base * LOG2E  # FlashInfer's base-2 LSE
        if lse is not None:
            lse.copy_(base)
            base = lse
        o = o.view(q_nope.shape) if out is None else out
        return (o, base) if return_lse else o
