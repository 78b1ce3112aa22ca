"""A per-model paged KV cache: page pool, per-sequence block tables, refcounted sharing.

Storage is one tensor ``kv`` of shape ``[num_layers, 2, num_pages, page_size, num_kv_heads,
head_dim]``; ``key_cache(layer)`` and ``value_cache(layer)`` are contiguous NHD views of it in
the layout the decode kernel reads. All layers share one page table per sequence (as in vLLM):
page ``p`` of a sequence holds its tokens ``[p * page_size, (p + 1) * page_size)`` in every
layer.

Bookkeeping lives on the host (Python lists: free pages, refcounts, block tables, lengths), so
scheduling needs no device round trip. A step's device tensors (``slot_mapping``,
``block_tables``, ``context_lens``, ``positions``) are built in one host buffer (pinned when the
cache is on CUDA) and moved with one ``non_blocking`` copy.

Sharing: :meth:`PagedKVCache.fork` gives the child the parent's pages, refcounted. Full pages
are never written again, so they stay shared; the partial last page is copied on write: the
first sequence that appends into a page whose refcount is above one gets a private copy (one
device copy across all layers), and the other keeps the original.

fp8 scales: an fp8 cache keeps one K and one V scale per (layer, kv head), fp32 on the device
(:meth:`PagedKVCache.scales`). Given ``k_scale``/``v_scale`` fill them; without them the cache
calibrates itself from the first prefill it sees: each layer's scale is the prompt K/V amax
per kv head over the fp8 format's largest finite value (:func:`fp8_scales`), and later tokens
that exceed it saturate (``append_kv`` clamps), as vLLM's dynamically computed KV scales. The
scale tensors are updated in place, so a captured CUDA graph reads the calibrated values.

Errors leave the cache as it was: an append that would need more pages than are free raises
:class:`CacheFullError` before touching anything, for every sequence of the batch.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from pagedattn._validation import FP8_DTYPES, check_scalar_values, check_scale_arg


class CacheFullError(RuntimeError):
    """Not enough free pages for an append; nothing was changed.

    Attributes: ``seq_id`` (the first sequence that does not fit), ``pages_needed`` (new pages
    the whole request needs), ``pages_free``. ``message`` replaces the default text (the
    engine's refusal of a request that could never fit says so).
    """

    def __init__(self, seq_id: Hashable, num_tokens: int, pages_needed: int, pages_free: int,
                 *, message: str | None = None):
        self.seq_id, self.pages_needed, self.pages_free = seq_id, pages_needed, pages_free
        super().__init__(message or (
            f"KV cache full: appending {num_tokens} token(s) to sequence {seq_id!r} needs "
            f"{pages_needed} new page(s) for the request, only {pages_free} free; free or "
            "preempt a sequence, or build the cache with more pages"))


class StepMetadata(NamedTuple):
    """Device tensors for one step; all int32 (int64 when the cache has ≥ 2^31 slots)."""

    slot_mapping: torch.Tensor  # [num_new_tokens] slot = page_id * page_size + offset
    positions: torch.Tensor  # [num_new_tokens] token positions (RoPE), 0-based
    context_lens: torch.Tensor  # [batch] lengths after this step's tokens
    block_tables: torch.Tensor  # [batch, max_pages] page ids, padded with 0
    query_start: list[int]  # host: [batch + 1] offsets of each sequence's new tokens


def fp8_scales(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-kv-head fp8 scales ``amax / finfo(dtype).max`` (448 for e4m3fn, 57344 for e5m2),
    fp32, so that the largest value maps to the largest finite fp8 value; a head whose amax is
    0 (or not finite) gets scale 1.0. Raises ValueError for a non-fp8 ``dtype``."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype: expected an fp8 dtype, got {dtype}")
    amax = amax.float()
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, amax / torch.finfo(dtype).max, torch.ones_like(amax))


def _as_scale_tensor(name: str, s, num_kv_heads: int, device: torch.device):
    if s is None:
        return None
    if isinstance(s, torch.Tensor):
        s = s.detach().to(device)
        check_scale_arg(name, s, num_kv_heads, device)
        # the values too (once, at construction): a stored 0, negative, NaN or inf scale
        # would reach every decode step unchecked (the hot path reads no data)
        check_scalar_values(((name, s),))
        return s.to(dtype=torch.float32)
    check_scale_arg(name, s, num_kv_heads, device)
    return torch.tensor(float(s), dtype=torch.float32, device=device)


class PagedKVCache:
    """Paged KV cache for ``num_layers`` attention layers.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        num_pages: pages in the pool (shared by all sequences and layers).
        page_size: tokens per page.
        dtype: cache dtype: float32/float16/bfloat16, or float8_e4m3fn/float8_e5m2 with
            ``k_scale``/``v_scale`` (float, 0-d or ``[num_kv_heads]``; stored = x / scale,
            read back as stored * scale). Default scale 1.0 for fp8.
        device: where the pages live.

    Raises:
        ValueError: non-positive sizes, scales with a non-fp8 dtype or of a bad shape, or
            scales (float or tensor entries) that are not finite and > 0 (within about
            2.36e38).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_pages: int,
                 page_size: int = 16, dtype: torch.dtype = torch.float16,
                 device: str | torch.device = "cpu", k_scale=None, v_scale=None):
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("num_pages", num_pages),
                        ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES):
            raise TypeError(f"dtype: expected float32, float16, bfloat16 or an fp8 dtype, got "
                            f"{dtype}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        if dtype not in FP8_DTYPES and (k_scale is not None or v_scale is not None):
            raise ValueError(f"k_scale: scales are for fp8 caches, got dtype {dtype}")
        self.k_scale = _as_scale_tensor("k_scale", k_scale, num_kv_heads, self.device)
        self.v_scale = _as_scale_tensor("v_scale", v_scale, num_kv_heads, self.device)
        # [num_layers, 2 (K, V), num_kv_heads] fp32; given scales or 1.0 until calibrated
        self._scales = torch.ones(num_layers, 2, num_kv_heads, device=self.device)
        for i, s in enumerate((self.k_scale, self.v_scale)):
            if s is not None:
                self._scales[:, i] = s
        self.needs_calibration = dtype in FP8_DTYPES and k_scale is None and v_scale is None
        self.kv = torch.zeros(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim,
                              dtype=dtype, device=self.device)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() -> low id
        self._refcount = [0] * num_pages
        self._pages: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self.index_dtype = torch.int64 if num_pages * page_size >= 2**31 else torch.int32

    # -- views ---------------------------------------------------------------------------
    def key_cache(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, num_kv_heads, head_dim]`` view (NHD) of one layer."""
        return self.kv[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, v_scale)`` ``[num_kv_heads]`` fp32 views for ``layer`` (fp8), else
        ``(None, None)``."""
        if self.dtype not in FP8_DTYPES:
            return None, None
        return self._scales[layer, 0], self._scales[layer, 1]

    def calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``layer``'s scales from the amax of ``key``/``value`` ``[num_tokens,
        num_kv_heads, head_dim]`` per kv head (:func:`fp8_scales`), in place, on the device.
        The caller clears :attr:`needs_calibration` once every layer is done."""
        amax = torch.stack([key.detach().abs().amax(dim=(0, 2)),
                            value.detach().abs().amax(dim=(0, 2))])
        self._scales[layer].copy_(fp8_scales(amax, self.dtype))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._lens)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's page ids."""
        return list(self._pages[self._known(seq_id)])

    def refcount(self, page_id: int) -> int:
        return self._refcount[page_id]

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._lens:
            raise KeyError(f"seq_id: unknown sequence {seq_id!r}")
        return seq_id

    # -- sequence lifetime ---------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable) -> None:
        """Register an empty sequence. Raises ValueError if the id is taken."""
        if seq_id in self._lens:
            raise ValueError(f"seq_id: sequence {seq_id!r} already exists")
        self._pages[seq_id], self._lens[seq_id] = [], 0

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; pages whose refcount falls to 0 return to the pool."""
        for page in self._pages.pop(self._known(seq_id)):
            self._decref(page)
        del self._lens[seq_id]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """New sequence ``child_id`` sharing all of ``parent_id``'s tokens (no copy now; the
        partial last page is copied on the first write by either)."""
        pages = self._pages[self._known(parent_id)]
        self.add_sequence(child_id)
        for page in pages:
            self._refcount[page] += 1
        self._pages[child_id] = list(pages)
        self._lens[child_id] = self._lens[parent_id]

    def _decref(self, page: int) -> None:
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._free.append(page)

    # -- appending -----------------------------------------------------------------------
    def pages_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """New pages an append of ``num_tokens`` takes (a copy-on-write page counts)."""
        n = self._lens[self._known(seq_id)]
        if num_tokens <= 0:
            return 0
        cow = self._shared_tail(seq_id) is not None
        return cow + -(-(n + num_tokens) // self.page_size) - len(self._pages[seq_id])

    def _shared_tail(self, seq_id: Hashable) -> int | None:
        """The partial last page of ``seq_id`` if another sequence shares it (an append
        copies it first), else None."""
        pages, n = self._pages[seq_id], self._lens[seq_id]
        return pages[-1] if n % self.page_size and self._refcount[pages[-1]] > 1 else None

    def reserve(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> list[list[int]]:
        """Append ``num_tokens[i]`` slots to each ``seq_ids[i]``, all or nothing.

        Returns each sequence's new slots (host ints, ``page_id * page_size + offset``).
        Raises CacheFullError (nothing changed) when the batch needs more pages than are free;
        KeyError for an unknown sequence; ValueError for a repeated id or negative count;
        TypeError for a count that is not an int. Every check runs before any change.
        """
        self._check_counts(seq_ids, num_tokens)
        total = 0
        copies_of: dict[int, int] = {}  # shared tail page -> copies counted so far
        for sid, n in zip(seq_ids, num_tokens, strict=True):
            need = self.pages_needed(sid, int(n))
            tail = self._shared_tail(sid) if n else None
            if tail is not None:
                # a page held by r sequences is copied by the first r - 1 of them to append;
                # the last one then holds it alone and writes in place
                copies_of[tail] = copies_of.get(tail, 0) + 1
                if copies_of[tail] >= self._refcount[tail]:
                    need -= 1
            total += need
            if total > len(self._free):
                raise CacheFullError(sid, n, total, len(self._free))
        num_tokens = [int(n) for n in num_tokens]
        copies: list[tuple[int, int]] = []
        slots = [self._grow(sid, n, copies) for sid, n in zip(seq_ids, num_tokens, strict=True)]
        if copies:  # copy-on-write: one device copy for every layer, K and V
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv[:, :, dst] = self.kv[:, :, src]
        return slots

    def _check_counts(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> None:
        if len(seq_ids) != len(num_tokens):
            raise ValueError(f"num_tokens: expected {len(seq_ids)} counts, got {len(num_tokens)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: a sequence appears twice in one step")
        for sid, n in zip(seq_ids, num_tokens, strict=True):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral):
                raise TypeError(f"num_tokens: expected ints, got {n!r} for {sid!r}")
            if n < 0:
                raise ValueError(f"num_tokens: expected counts >= 0, got {n} for {sid!r}")
            self._known(sid)

    def append(self, seq_id: Hashable, num_tokens: int = 1) -> list[int]:
        """Reserve ``num_tokens`` new slots for one sequence (see :meth:`reserve`)."""
        return self.reserve([seq_id], [num_tokens])[0]

    def _grow(self, seq_id: Hashable, num_tokens: int, copies: list) -> list[int]:
        pages, n, ps = self._pages[seq_id], self._lens[seq_id], self.page_size
        if num_tokens and n % ps and self._refcount[pages[-1]] > 1:
            new = self._free.pop()
            self._refcount[new] = 1
            copies.append((pages[-1], new))
            self._decref(pages[-1])
            pages[-1] = new
        while len(pages) * ps < n + num_tokens:
            new = self._free.pop()
            self._refcount[new] = 1
            pages.append(new)
        self._lens[seq_id] = n + num_tokens
        return [pages[t // ps] * ps + t % ps for t in range(n, n + num_tokens)]

    # -- step tensors --------------------------------------------------------------------
    def build_metadata(self, seq_ids: Sequence[Hashable], new_slots: Sequence[Sequence[int]], *,
                       max_pages: int | None = None, pad_to: int | None = None,
                       out: torch.Tensor | None = None,
                       staging: torch.Tensor | None = None) -> StepMetadata:
        """Device tensors for a step whose new tokens were reserved as ``new_slots`` (the
        last ``len(new_slots[i])`` tokens of each sequence). One host buffer, one copy.

        ``max_pages`` fixes the block-table width (CUDA graphs); default: the widest sequence.
        ``pad_to`` appends padding rows up to that batch size (a decode bucket): one token each
        with slot -1 (``append_kv`` skips it), position 0, context length 0 and a block-table
        row of page 0 (a valid page that is never read). ``out`` (int, on the cache's device,
        ``metadata_size`` elements) receives the values in place and the result views it, so a
        captured graph sees them. ``staging`` (a host tensor of the same size and dtype as
        ``out``, pinned on a GPU) is written in place and copied from, instead of a fresh
        (pinned) host buffer per step; the caller must not rewrite it before that copy ran
        (:class:`~pagedattn.serving.runner.DecodeRunner` waits on an event). Raises ValueError
        when a sequence has more pages than ``max_pages``, ``pad_to`` is below the batch size,
        or ``out`` or ``staging`` has the wrong size.
        """
        tables = [self._pages[self._known(s)] for s in seq_ids]
        width = max([len(t) for t in tables] + [1]) if max_pages is None else max_pages
        for sid, t in zip(seq_ids, tables, strict=True):
            if len(t) > width:
                raise ValueError(f"max_pages: sequence {sid!r} has {len(t)} pages > {width}")
        lens = [self._lens[s] for s in seq_ids]
        slots = [s for group in new_slots for s in group]
        positions = [p for n, g in zip(lens, new_slots, strict=True) for p in range(n - len(g), n)]
        groups = [len(g) for g in new_slots]
        pad = 0 if pad_to is None else pad_to - len(seq_ids)
        if pad < 0:
            raise ValueError(f"pad_to: expected >= the batch size {len(seq_ids)}, got {pad_to}")
        slots, positions, lens = slots + [-1] * pad, positions + [0] * pad, lens + [0] * pad
        groups += [1] * pad
        head = slots + positions + lens
        size = len(head) + len(lens) * width
        if staging is None:
            arr = np.zeros(size, dtype=np.int64 if self.index_dtype == torch.int64 else np.int32)
        elif staging.numel() != size or staging.dtype != self.index_dtype:
            raise ValueError(f"staging: expected {size} {self.index_dtype} elements, got "
                             f"{staging.numel()} {staging.dtype}")
        else:
            arr = staging.numpy()
            arr[len(head):] = 0
        arr[:len(head)] = head
        rows = arr[len(head):].reshape(len(lens), width)
        for i, t in enumerate(tables):  # one numpy row write per sequence (wide tables: fast)
            rows[i, :len(t)] = t
        host = torch.from_numpy(arr) if staging is None else staging
        if self.device.type == "cuda" and staging is None:
            host = host.pin_memory()
        if out is None:
            buf = host.to(self.device, non_blocking=True)
            if buf.data_ptr() == host.data_ptr() and staging is not None:
                buf = buf.clone()  # a CPU cache: the step's tensors must outlive the staging
        elif out.numel() != host.numel():
            raise ValueError(f"out: expected {host.numel()} elements, got {out.numel()}")
        else:
            buf = out.copy_(host, non_blocking=True)
        nt, b = len(slots), len(lens)
        starts = [0]
        for n in groups:
            starts.append(starts[-1] + n)
        return StepMetadata(buf[:nt], buf[nt:2 * nt], buf[2 * nt:2 * nt + b],
                            buf[2 * nt + b:].view(b, width), starts)

    def _check_step(self, seq_ids, num_tokens, max_pages, pad_to, out, staging) -> None:
        """What :meth:`build_metadata` would refuse after :meth:`reserve`, computed first."""
        self._check_counts(seq_ids, num_tokens)
        ps = self.page_size
        pages = [max(len(self._pages[s]), -(-(self._lens[s] + int(k)) // ps))
                 for s, k in zip(seq_ids, num_tokens, strict=True)]
        width = max(pages + [1]) if max_pages is None else max_pages
        for sid, n in zip(seq_ids, pages, strict=True):
            if n > width:
                raise ValueError(f"max_pages: sequence {sid!r} would have {n} pages > {width}")
        pad = 0 if pad_to is None else pad_to - len(seq_ids)
        if pad < 0:
            raise ValueError(f"pad_to: expected >= the batch size {len(seq_ids)}, got {pad_to}")
        tokens, batch = sum(int(k) for k in num_tokens) + pad, len(seq_ids) + pad
        size = 2 * tokens + batch + batch * width
        if staging is not None and (staging.numel() != size or staging.dtype != self.index_dtype):
            raise ValueError(f"staging: expected {size} {self.index_dtype} elements, got "
                             f"{staging.numel()} {staging.dtype}")
        if out is not None and out.numel() != size:
            raise ValueError(f"out: expected {size} elements, got {out.numel()}")

    @staticmethod
    def metadata_size(batch: int, max_pages: int) -> int:
        """Elements of a decode step's metadata buffer (one token per sequence)."""
        return batch * (3 + max_pages)

    def prepare_step(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int], *,
                     max_pages: int | None = None, pad_to: int | None = None,
                     out: torch.Tensor | None = None,
                     staging: torch.Tensor | None = None) -> StepMetadata:
        """:meth:`reserve` then :meth:`build_metadata`: the usual call once per step. The
        metadata arguments are checked against the step's sizes before anything is reserved,
        so an error leaves the cache as it was."""
        self._check_step(seq_ids, num_tokens, max_pages, pad_to, out, staging)
        slots = self.reserve(seq_ids, num_tokens)
        return self.build_metadata(seq_ids, slots, max_pages=max_pages, pad_to=pad_to, out=out,
                                   staging=staging)

    def slot_mapping(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> torch.Tensor:
        """Reserve and return ``[sum(num_tokens)]`` device slots for a step's new tokens."""
        slots = self.reserve(seq_ids, num_tokens)
        flat = [s for g in slots for s in g]
        return torch.tensor(flat, dtype=self.index_dtype).to(self.device, non_blocking=True)
