"""FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (``plan``/``run``) on pagedattn's kernel.

A drop-in for code written against ``flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper``
(flashinfer-ai/flashinfer, Apache-2.0; the signatures and semantics of ``python/flashinfer/
decode.py``, no code copied):

- ``plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
  *, pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, sm_scale,
  ...)`` turns FlashInfer's CSR page list into pagedattn's ``block_tables [batch, max_pages]``
  and ``context_lens [batch]`` on the device, once (sequence ``b`` holds pages
  ``indices[indptr[b]:indptr[b+1]]``, the last one ``last_page_len[b]`` tokens full), and
  builds one :func:`pagedattn.plan_decode`. Like FlashInfer's, ``plan`` reads ``indptr`` and
  ``last_page_len`` on the host (one sync); it is not for CUDA-graph capture.
- ``run(q, paged_kv_cache, *, return_lse, k_scale, v_scale, out, lse, sinks, ...)`` runs that
  plan: no host sync, a few attribute reads and the plan's own call. The cache is a tuple
  ``(k_cache, v_cache)`` or one tensor ``[pages, 2, page_size, heads, dim]`` (NHD) /
  ``[pages, 2, heads, page_size, dim]`` (HND).
- **The LSE is base 2**, FlashInfer's convention (flashinfer-ai/flashinfer#2113:
  ``log2(sum(exp2(...)))`` of the scores times ``log2(e)``): pagedattn's natural-log LSE
  times ``log2(e)``, one elementwise op, only with ``return_lse=True``.
- Scales as FlashInfer: ``q_scale`` and ``k_scale`` multiply ``sm_scale``, ``v_scale`` the
  output; for fp8 caches a tensor scale goes to the kernel's ``k_scale``/``v_scale``.
- ``pos_encoding_mode="ALIBI"`` uses FlashInfer's default slopes (``get_alibi_slopes``: the
  ALiBi paper's geometric series). FlashInfer's kernels bias by ``slope * (key_pos - j)``
  for the request's query token ``j`` (the one token of a decode at 0), ours by ``slope *
  (key_pos - query_pos)`` with the token at its own position ``len - q_len_per_req + j``:
  the outputs are equal, and the LSE is shifted back by ``slope * (len - q_len_per_req)`` to
  match. ``"ROPE_LLAMA"`` (RoPE inside the kernel) is refused: rotate q and k first.
- ``use_cuda_graph=True`` takes FlashInfer's fixed buffers: the batch is fixed, and the block
  table is ``[batch, len(paged_kv_indices_buffer)]`` int32 (any one sequence may hold every
  page; ``max_pages_per_seq=``, pagedattn's keyword, bounds it instead), rewritten in place
  by each ``plan``, so a graph captured around ``run`` replays correctly after a re-plan.
- Accepted and ignored (they change no value): the workspace buffer (the plan owns its
  workspace), ``use_tensor_cores``, ``backend``, ``non_blocking``, ``enable_pdl``,
  ``rope_scale``/``rope_theta`` (RoPE is refused). Refused with a ``ValueError`` naming
  them: ``jit_args``, ``fixed_split_size``, ``window_right`` other than 0, an ``o_data_type``
  other than the query's, ``kv_cache_sf`` (NVFP4), ``skip_softmax_threshold_scale_factor``.
"""

from __future__ import annotations

import math

import torch

from pagedattn import _validation as V
from pagedattn.api import plan_decode

LOG2E = math.log2(math.e)
#: plan()'s optional arguments in FlashInfer's (deprecated) positional order
_PLAN_POSITIONAL = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type",
                    "kv_data_type", "o_data_type", "data_type", "sm_scale", "rope_scale",
                    "rope_theta", "non_blocking", "block_tables", "seq_lens",
                    "fixed_split_size", "disable_split_kv", "q_len_per_req")
_BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen", "cute-dsl")
#: one entry per layer's combined cache (each keeps its cache alive)
_MAX_VIEWS = 512
#: pagedattn's argument names in the errors of a plan's run -> FlashInfer's
_FI_NAMES = {"query": "q", "key_cache": "paged_kv_cache", "value_cache": "paged_kv_cache",
             "block_tables": "indices", "context_lens": "last_page_len", "scale": "sm_scale"}


def get_alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """ALiBi's default slopes (Press et al., ICLR 2022), as FlashInfer's ``get_alibi_slopes``:
    ``2^(-8 i / n)`` for the largest power of two ``n <= num_heads``, then every other slope
    of ``2n`` heads. ``[num_heads]`` float32."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n, device=device))
    if n < num_heads:
        extra = torch.pow(2.0 ** (-4.0 / n),
                          torch.arange(1, 1 + 2 * (num_heads - n), 2, device=device))
        slopes = torch.cat([slopes, extra])
    return slopes.float()


def _dtype(name: str, d) -> torch.dtype:
    """A dtype or its name (``"float16"``, ``"bfloat16"``, ``"float8_e4m3fn"``, ...)."""
    if isinstance(d, str):
        d = getattr(torch, d, None)
    if not isinstance(d, torch.dtype):
        raise TypeError(f"{name}: expected a torch.dtype or its name, got {d!r}")
    return d


def _unpack(paged_kv_cache, kv_layout: str):
    if isinstance(paged_kv_cache, tuple):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache: expected (k_cache, v_cache), got a tuple of "
                             f"{len(paged_kv_cache)}")
        return paged_kv_cache
    if not isinstance(paged_kv_cache, torch.Tensor):
        raise TypeError(f"paged_kv_cache: expected a tensor or a (k_cache, v_cache) tuple, got "
                        f"{type(paged_kv_cache).__name__}")
    if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
        dims = "page_size, num_kv_heads" if kv_layout == "NHD" else "num_kv_heads, page_size"
        raise ValueError(f"paged_kv_cache: expected [num_pages, 2, {dims}, head_dim] "
                         f"({kv_layout}), got shape {tuple(paged_kv_cache.shape)}")
    return paged_kv_cache.unbind(1)


def _csr_lengths(indptr, num_indices: int, last_page_len, page_size: int, seq_lens,
                 block_tables) -> torch.Tensor:
    """Each sequence's length (host int64) from host copies of FlashInfer's CSR, checked:
    ``indptr`` starts at 0 or more and never decreases, ``indices`` holds its ``indptr[-1]``
    ids, ``last_page_len`` is in ``[0, page_size]`` (0: the last page holds no token), and
    ``seq_lens``, when given, fits the sequence's pages (or ``block_tables``' row). Raises
    ValueError naming the argument and the first bad sequence."""
    pages = indptr[1:] - indptr[:-1]
    if indptr.shape[0] and int(indptr[0]) < 0:
        raise ValueError(f"indptr: expected entries >= 0, got {int(indptr[0])} first")
    V.first_bad("indptr", pages, pages < 0, "non-decreasing entries (sequence's page count)")
    if indptr.shape[0] and int(indptr[-1]) > num_indices:
        raise ValueError(f"indices: expected indptr[-1] = {int(indptr[-1])} page ids or more, "
                         f"got {num_indices}")
    V.first_bad("last_page_len", last_page_len,
                (last_page_len < 0) | (last_page_len > page_size),
                f"tokens in [0, page_size={page_size}]")
    lens = torch.where(pages > 0, (pages - 1) * page_size + last_page_len, 0)
    if seq_lens is None:
        return lens
    if not isinstance(seq_lens, torch.Tensor):
        raise TypeError(f"seq_lens: expected a tensor, got {type(seq_lens).__name__}")
    if seq_lens.shape != lens.shape or seq_lens.dtype not in V.INDEX_DTYPES:
        raise ValueError(f"seq_lens: expected a [{lens.shape[0]}] int32/int64 tensor (the "
                         f"batch), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    given = seq_lens.to("cpu", torch.int64)
    capacity = (pages if block_tables is None else block_tables.shape[1]) * page_size
    V.first_bad("seq_lens", given, (given < 0) | (given > capacity),
                "lengths within each sequence's pages")
    return given


class BatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer's batch decode wrapper over pagedattn's production kernel (see the module
    docstring for what maps to what). Construct once, ``plan`` once per decode step, ``run``
    once per layer."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 backend: str = "auto", jit_args=None, *,
                 max_pages_per_seq: int | None = None) -> None:
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("float_workspace_buffer: expected a torch.Tensor, got "
                            f"{type(float_workspace_buffer).__name__}")
        if kv_layout not in V.KV_LAYOUTS:
            raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
        if jit_args is not None:
            raise ValueError("jit_args: custom FlashInfer kernels are not supported")
        if backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._use_tensor_cores = bool(use_tensor_cores)
        self._plan = None
        self._key = None
        self._alibi = self._lse_shift = None
        self._views: dict = {}  # id(cache) -> (cache, data_ptr, shape, k view, v view)
        if self._use_cuda_graph:
            named = (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                     ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                     ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer))
            for name, t in named:
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"{name}: should be a torch.Tensor in cudagraph mode")
            batch = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != batch + 1:
                raise ValueError("paged_kv_indptr_buffer: its size should be batch_size + 1")
            # fixed shapes: a captured graph reads these buffers; plan() rewrites them in place
            cap = len(paged_kv_indices_buffer) if max_pages_per_seq is None \
                else int(max_pages_per_seq)
            self._block_tables = torch.zeros(batch, max(cap, 1), dtype=torch.int32,
                                             device=self.device)
            self._context_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        else:
            self._block_tables = self._context_lens = None

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             *positional, **kwargs) -> None:
        """Plan a decode step (FlashInfer's signature; the options after ``page_size`` are
        keywords, or positional in FlashInfer's deprecated order).

        Args:
            indptr: ``[batch + 1]`` int32/int64, sequence ``b``'s pages are
                ``indices[indptr[b]:indptr[b + 1]]``.
            indices: ``[indptr[-1]]`` int32/int64 page ids.
            last_page_len: ``[batch]`` tokens in each sequence's last page, in
                ``[1, page_size]``; 0 means that the last page holds no token (the length is
                ``(pages - 1) * page_size``, FlashInfer's formula); a sequence of no pages
                has length 0 whatever its entry.
            num_qo_heads, num_kv_heads, head_dim, page_size: the shapes.
            pos_encoding_mode: ``"NONE"`` or ``"ALIBI"``.
            window_left: ``-1`` or the sliding window (keys ``>= pos - window_left``).
            logits_soft_cap: ``None``/0 (off) or the cap.
            q_data_type, kv_data_type, data_type: dtypes or their names (``q_data_type``
                defaults to float16, as FlashInfer's).
            sm_scale: default ``head_dim ** -0.5``.
            block_tables, seq_lens: optional ready-made ``[batch, max_pages]`` table and
                ``[batch]`` lengths (FlashInfer's trtllm-gen inputs); used as they are: the
                lengths given replace ``last_page_len``'s, each within its sequence's pages
                (or its ``block_tables`` row).
            disable_split_kv: one split per sequence (our ``num_splits=1``).
            q_len_per_req: query tokens per request (causal within the request).

        Raises:
            TypeError, ValueError: a bad or unsupported option, or CSR arrays that disagree
                (checked on the host copies: ``indptr`` decreasing, ``indices`` shorter than
                ``indptr[-1]``, ``last_page_len`` outside ``[0, page_size]``, ``seq_lens``
                past the pages), named.
        """
        if len(positional) > len(_PLAN_POSITIONAL):
            raise TypeError(f"plan() takes at most {len(_PLAN_POSITIONAL)} optional positional "
                            f"arguments after page_size, got {len(positional)}")
        for name, value in zip(_PLAN_POSITIONAL, positional, strict=False):
            if name in kwargs:
                raise TypeError(f"plan() got multiple values for argument {name!r}")
            kwargs[name] = value
        self._plan_impl(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                        page_size, **kwargs)

    begin_forward = plan

    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                   head_dim, page_size, *, pos_encoding_mode="NONE", window_left=-1,
                   window_right=0, logits_soft_cap=None, q_data_type="float16",
                   kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
                   rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None,
                   seq_lens=None, fixed_split_size=None, disable_split_kv=False,
                   q_len_per_req=1) -> None:
        if pos_encoding_mode not in ("NONE", "ALIBI"):
            raise ValueError(f"pos_encoding_mode: {pos_encoding_mode!r} is not supported "
                             "(only 'NONE' and 'ALIBI'); apply RoPE to q and k before the "
                             "call" if pos_encoding_mode == "ROPE_LLAMA" else
                             f"pos_encoding_mode: expected 'NONE' or 'ALIBI', got "
                             f"{pos_encoding_mode!r}")
        if window_right != 0:
            raise ValueError(f"window_right: only 0 is supported, got {window_right!r}")
        if fixed_split_size is not None:
            raise ValueError("fixed_split_size: not supported (for batch-invariant outputs "
                             "use pagedattn.plan_decode(batch_invariant=True))")
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_dtype = _dtype("q_data_type", q_data_type)
        kv_dtype = q_dtype if kv_data_type is None else _dtype("kv_data_type", kv_data_type)
        if o_data_type is not None and _dtype("o_data_type", o_data_type) != q_dtype:
            raise ValueError(f"o_data_type: only the query's dtype {q_dtype} is supported, got "
                             f"{o_data_type}")
        soft_cap = None if not logits_soft_cap else float(logits_soft_cap)
        if pos_encoding_mode == "ALIBI" and soft_cap is not None:
            raise ValueError("logits_soft_cap: not supported with ALIBI (FlashInfer caps after "
                             "the bias, pagedattn before it)")
        for name, t in (("indptr", indptr), ("indices", indices),
                        ("last_page_len", last_page_len)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"{name}: expected a 1-D tensor, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
            if t.dtype not in V.INDEX_DTYPES:
                raise TypeError(f"{name}: expected int32 or int64, got {t.dtype}")
        batch = last_page_len.shape[0]
        if indptr.shape[0] != batch + 1:
            raise ValueError(f"indptr: expected {batch + 1} entries (batch + 1), got "
                             f"{indptr.shape[0]}")
        q_len = int(q_len_per_req)
        if q_len < 1:
            raise ValueError(f"q_len_per_req must be >= 1, got {q_len_per_req}")
        if self._use_cuda_graph and batch != self._block_tables.shape[0]:
            raise ValueError(f"last_page_len: the batch size is fixed in cudagraph mode "
                             f"({self._block_tables.shape[0]}), got {batch}")

        # one host read of the small CSR arrays, as FlashInfer's own plan does; every check
        # of them runs on these copies (no further sync)
        indptr_host = indptr.to("cpu", torch.int64)
        last_host = last_page_len.to("cpu", torch.int64)
        lens_host = _csr_lengths(indptr_host, indices.shape[0], last_host, page_size, seq_lens,
                                 block_tables)
        pages_host = indptr_host[1:] - indptr_host[:-1]
        if q_len > 1 and batch and int(lens_host.min()) < q_len:
            raise ValueError(f"q_len_per_req={q_len} requires kv_len >= q_len_per_req for "
                             "every request (the new tokens must already be in the cache)")
        max_pages = max(int(pages_host.max()) if batch else 0, 1)

        dev = self.device
        if block_tables is not None:
            table = block_tables.to(dev)
            lens = (seq_lens.to(dev, torch.int32) if seq_lens is not None
                    else lens_host.to(dev, torch.int32))
        else:
            if self._use_cuda_graph:
                table = self._block_tables
                if max_pages > table.shape[1]:
                    raise ValueError(f"indices: a sequence holds {max_pages} pages, more than "
                                     f"paged_kv_indices_buffer's {table.shape[1]}")
            else:  # capacity rounded up to a power of two: a plan survives a few steps
                cap = 1 << (max_pages - 1).bit_length()
                old = self._block_tables
                table = (old if old is not None and old.shape == (batch, cap)
                         else torch.zeros(batch, cap, dtype=torch.int32, device=dev))
            # scatter the CSR list into the rows, O(pages): entry t is page t - indptr[row]
            # of sequence row (entries past a row's pages are never read)
            nnz = int(indptr_host[-1]) - int(indptr_host[0]) if batch else 0
            ptr = indptr.to(dev, torch.int64)
            t = torch.arange(nnz, device=dev) + int(indptr_host[0])
            row = torch.searchsorted(ptr[1:], t, right=True)
            table[row, t - ptr[row]] = indices.to(dev, torch.int32)[t]  # indices may be on the host
            if seq_lens is not None:  # the lengths given (checked against the pages)
                lens = seq_lens.to(dev)
            else:
                count = ptr[1:] - ptr[:-1]
                lens = torch.where(count > 0, (count - 1) * page_size
                                   + last_page_len.to(dev, torch.int64), 0)
            old = self._context_lens
            if old is None or old.shape != (batch,):  # (never in cudagraph mode: fixed batch)
                old = torch.empty(batch, dtype=torch.int32, device=dev)
            lens = self._context_lens = old.copy_(lens)
            self._block_tables = table

        self._q_len = q_len
        self._batch = batch
        self._window_left = int(window_left)
        self._scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
        self._num_qo_heads, self._head_dim = int(num_qo_heads), int(head_dim)
        self._fp8 = kv_dtype in V.FP8_DTYPES
        if pos_encoding_mode != "ALIBI":
            self._alibi = None
        elif self._alibi is None or self._alibi.shape[0] != num_qo_heads:
            # kept while the head count holds: a captured graph reads this tensor
            self._alibi = get_alibi_slopes(int(num_qo_heads), dev)
        self._lens_host = lens_host
        options = dict(num_q_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, page_size=page_size, q_dtype=q_dtype,
                       kv_dtype=kv_dtype, kv_layout=self._kv_layout,
                       num_splits=1 if disable_split_kv else None, q_len=q_len,
                       window_left=self._window_left, logits_soft_cap=soft_cap)
        ragged = batch > 0 and 2 * int(lens_host.sum()) < int(lens_host.max()) * batch
        # (in cudagraph mode the first plan's tile choice stays: raggedness is a refinement)
        key = (table.data_ptr(), table.shape, lens.data_ptr(),
               None if self._use_cuda_graph else ragged, tuple(sorted(options.items())))
        if self._use_cuda_graph and self._plan is not None and key != self._key:
            # a captured graph holds the old plan's workspace: keep one plan per wrapper
            raise ValueError("plan: in cudagraph mode every plan() must keep the shapes, "
                             "dtypes and options of the first; use another wrapper")
        if key != self._key:
            self._plan = plan_decode(table, lens, host_context_lens=lens_host, **options)
            self._key = key
        # the run's LSE shape and its ALiBi shift (FlashInfer's query sits at position 0)
        if self._alibi is None:
            self._lse_shift = None
        else:  # rewritten in place, as the tables, for a captured graph; the query's
            # tokens sit at positions len - q_len_per_req + j here and at j in FlashInfer's
            shift = (lens.float() - q_len).clamp_(min=0)[:, None] * self._alibi[None, :]
            old = self._lse_shift
            self._lse_shift = (old.copy_(shift) if old is not None and old.shape == shift.shape
                               else shift)
        self._q_shape = (batch, q_len, self._num_qo_heads, self._head_dim)

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None,
            v_scale=None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None,
            q_len_per_req=None, skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        """Decode attention of the planned batch for one layer (FlashInfer's ``run``).

        Args:
            q: ``[batch * q_len_per_req, num_qo_heads, head_dim]`` of ``q_data_type``.
            paged_kv_cache: ``(k_cache, v_cache)`` 4-D, or one 5-D ``[num_pages, 2, ...]``
                tensor, in the wrapper's layout and ``kv_data_type``.
            q_scale, k_scale: floats multiplying ``sm_scale`` (fp8 caches: ``k_scale`` may
                be a 0-d / ``[num_kv_heads]`` tensor, the kernel's dequantization scale).
            v_scale: float multiplying the output (fp8: also a tensor, as ``k_scale``).
            out: optional output of q's shape and dtype.
            lse: optional ``[batch * q_len_per_req, num_qo_heads]`` float32 for the LSE.
            return_lse: also return the LSE, **base 2** (FlashInfer's convention).
            sinks: optional ``[num_qo_heads]`` float32 sink logits.
            window_left: ``None`` or the planned value.

        Returns:
            ``out`` ``[batch * q_len_per_req, num_qo_heads, head_dim]``, or ``(out, lse)``.

        Raises:
            TypeError, ValueError: a tensor that does not match the plan, or an unsupported
                argument (named).
        """
        plan = self._plan
        if plan is None:
            raise ValueError("run: call plan() first")
        if args or kv_cache_sf is not None or skip_softmax_threshold_scale_factor is not None \
                or (window_left is not None and window_left != self._window_left) \
                or q_len_per_req is not None:
            self._refuse(args, kv_cache_sf, skip_softmax_threshold_scale_factor, window_left,
                         q_len_per_req, q)
        if type(paged_kv_cache) is tuple and len(paged_kv_cache) == 2:
            k_cache, v_cache = paged_kv_cache
        else:  # a layer's [pages, 2, ...] cache: its two views made once (checked per call)
            views = self._views.get(id(paged_kv_cache))
            if views is not None and views[0] is paged_kv_cache \
                    and views[1] == paged_kv_cache.data_ptr() \
                    and views[2] == paged_kv_cache.shape:
                k_cache, v_cache = views[3], views[4]
            else:
                k_cache, v_cache = _unpack(paged_kv_cache, self._kv_layout)
                if len(self._views) >= _MAX_VIEWS:
                    self._views.clear()
                self._views[id(paged_kv_cache)] = (paged_kv_cache, paged_kv_cache.data_ptr(),
                                                   paged_kv_cache.shape, k_cache, v_cache)
        scale, ks, vs, post = self._scale, None, None, None
        if q_scale is not None:
            scale *= float(q_scale)
        if k_scale is not None:
            if isinstance(k_scale, torch.Tensor) and self._fp8:
                ks = k_scale
            else:
                scale *= float(k_scale)
        if v_scale is not None:
            if self._fp8:
                vs = v_scale
            elif not (type(v_scale) is float and v_scale == 1.0):
                post = v_scale
        query, res_out = q, out
        if self._q_len > 1:
            if not isinstance(q, torch.Tensor) or q.dim() != 3 \
                    or q.shape[0] != self._batch * self._q_len:
                raise ValueError(f"q: expected [batch * q_len_per_req = {self._batch} * "
                                 f"{self._q_len}, num_qo_heads, head_dim], got "
                                 f"{tuple(q.shape) if isinstance(q, torch.Tensor) else q!r}; "
                                 "re-plan with the matching q_len_per_req")
            if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape):
                raise ValueError(f"out: expected q's shape {tuple(q.shape)}")
            query = q.view(self._q_shape)
            res_out = None if out is None else out.view(self._q_shape)
        try:  # sinks / alibi_slopes of None are the plain call: run's fast check
            result = plan.run(query, k_cache, v_cache, scale=scale, k_scale=ks, v_scale=vs,
                              out=res_out, return_lse=return_lse, sinks=sinks,
                              alibi_slopes=self._alibi)
        except (TypeError, ValueError) as e:
            fi = V.renamed(e, _FI_NAMES)
            if fi is e:
                raise
            raise fi from None
        o = result.out if return_lse else result
        if self._q_len > 1:
            o = o.view(q.shape)
        if post is not None:
            o *= post
        if not return_lse:
            return o
        lse_nat = result.lse
        if self._lse_shift is not None:  # FlashInfer's ALiBi puts the query at position 0
            lse_nat = lse_nat + (self._lse_shift if self._q_len == 1
                                 else self._lse_shift[:, None])
        lse_nat = lse_nat.view(q.shape[:-1])
        if lse is None:
            return o, lse_nat.mul_(LOG2E)  # a fresh tensor: converted in place
        if not isinstance(lse, torch.Tensor) or lse.shape != lse_nat.shape \
                or lse.dtype != torch.float32 or lse.device != lse_nat.device:
            raise ValueError(f"lse: expected a float32 tensor of shape "
                             f"{tuple(lse_nat.shape)} on {lse_nat.device}")
        torch.mul(lse_nat, LOG2E, out=lse)
        return o, lse

    def _refuse(self, args, kv_cache_sf, skip_softmax, window_left, q_len_per_req, q) -> None:
        if args:
            raise ValueError("run: extra positional arguments are for custom (jit_args) kernels, "
                             "which are not supported")
        if kv_cache_sf is not None:
            raise ValueError("kv_cache_sf: NVFP4 caches are not supported")
        if skip_softmax is not None:
            raise ValueError("skip_softmax_threshold_scale_factor: not supported")
        if window_left is not None and window_left != self._window_left:
            raise ValueError(f"window_left: must equal the planned {self._window_left}, got "
                             f"{window_left}")
        if q_len_per_req is not None and q_len_per_req != self._q_len:
            raise ValueError(f"q_len_per_req: planned {self._q_len}, got {q_len_per_req} "
                             "(pass it to plan())")

    def end_forward(self) -> None:
        """FlashInfer's no-op."""


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's CUDA-graph form: the wrapper with ``use_cuda_graph=True`` and its fixed
    buffers, in FlashInfer's positional order."""

    def __init__(self, workspace_buffer: torch.Tensor, indptr_buffer: torch.Tensor,
                 indices_buffer: torch.Tensor, last_page_len_buffer: torch.Tensor,
                 kv_layout: str = "NHD", use_tensor_cores: bool = False, *,
                 max_pages_per_seq: int | None = None) -> None:
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True,
                         use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer,
                         paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer,
                         max_pages_per_seq=max_pages_per_seq)
