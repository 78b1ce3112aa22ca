"""Peer implementations of paged decode, for the benchmark (each optional, each honest).

A peer factory takes ``(shape, batch, for_graph)`` and returns a zero-argument callable that
runs one decode and returns ``out`` ``[batch, num_q_heads, head_dim]``. Everything a serving
engine would do once per step outside the attention call (FlashInfer's ``plan``, building
index arrays and block masks) happens in the factory, outside the timing. A factory raises
:class:`PeerUnsupported` when the peer cannot run a shape (an fp8 cache, a missing package).

* ``naive``: gather every sequence's pages into a padded dense ``[batch, num_kv_heads, L,
  head_dim]`` (inside the timing) and call ``F.scaled_dot_product_attention`` with a length
  mask.
* ``flex-paged``: ``torch.compile(flex_attention)`` straight on the paged cache. The whole
  cache is one long key sequence and the batch is the query sequence; the block mask lets
  query ``b`` see a slot only if its page belongs to ``b`` and the slot is below ``b``'s
  length. Nothing is gathered; masked tiles still cost compute.
* ``flex-gathered``: the cache is gathered to a dense padded layout *outside* the timing and
  flex_attention runs on it with a length block mask: it times attention on a contiguous copy,
  not a paged read (label it so).
* ``flashinfer-tc``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` with
  ``use_tensor_cores=True`` on our NHD cache (``use_cuda_graph=True`` for graph timing), when
  ``import flashinfer`` works.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedattn.bench.shapes import BenchBatch, BenchShape

PeerFn = Callable[[], torch.Tensor]
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20


class PeerUnsupported(Exception):
    """The peer cannot run this shape (the message says why)."""


def _scale(shape: BenchShape) -> float:
    return shape.model.head_dim**-0.5


def _no_fp8(shape: BenchShape, peer: str) -> None:
    if shape.cache_dtype != shape.dtype:
        raise PeerUnsupported(f"{peer}: no fp8 KV cache")


def _gather_dense(b: BenchBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded dense K/V ``[batch, num_kv_heads, max_pages * page_size, head_dim]``."""
    pages = b.block_tables.clamp(min=0).long()  # padding entries read page 0, then masked
    k = b.key_cache[pages].flatten(1, 2).transpose(1, 2)
    v = b.value_cache[pages].flatten(1, 2).transpose(1, 2)
    return k, v


def naive(shape: BenchShape, b: BenchBatch, for_graph: bool = False) -> PeerFn:
    _no_fp8(shape, "naive")
    length = b.block_tables.shape[1] * shape.page_size
    mask = (torch.arange(length, device=b.query.device)[None, :]
            < b.context_lens[:, None])[:, None, None, :]  # [batch, 1, 1, L]
    query = b.query[:, :, None, :]  # [batch, num_q_heads, 1, head_dim]
    scale = _scale(shape)

    def run() -> torch.Tensor:
        k, v = _gather_dense(b)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out[:, :, 0, :]

    return run


@functools.lru_cache(maxsize=1)
def _flex_api():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return flex_attention, create_block_mask


_COMPILED_FLEX: list = []  # the last compiled flex_attention, reused by the graph-mode call


def _flex_callable(device: torch.device, fresh: bool):
    """``torch.compile(flex_attention)`` on CUDA, compiled afresh for each shape's eager call
    (so the recompile limit is never hit, which would fall back silently to the unfused eager
    path) and reused by the graph-mode call that follows; the eager flex_attention elsewhere
    (tests)."""
    flex_attention, _ = _flex_api()
    if device.type != "cuda":
        return flex_attention
    if fresh or not _COMPILED_FLEX:
        torch._dynamo.reset()
        _COMPILED_FLEX[:] = [torch.compile(flex_attention, dynamic=False)]
    return _COMPILED_FLEX[0]


def flex_paged(shape: BenchShape, b: BenchBatch, for_graph: bool = False) -> PeerFn:
    _no_fp8(shape, "flex-paged")
    _, create_block_mask = _flex_api()
    dev, ps = b.query.device, shape.page_size
    num_pages, _, num_kv_heads, head_dim = b.key_cache.shape
    tables = b.block_tables.long()
    used = (torch.arange(tables.shape[1], device=dev)[None, :]
            < ((b.context_lens.long() + ps - 1) // ps)[:, None])  # [batch, max_pages]
    owner = torch.full((num_pages,), -1, dtype=torch.long, device=dev)  # page -> sequence
    logical = torch.zeros(num_pages, dtype=torch.long, device=dev)  # page -> its index in it
    rows, cols = used.nonzero(as_tuple=True)
    owner[tables[rows, cols]] = rows
    logical[tables[rows, cols]] = cols
    lens = b.context_lens.long()

    def mask_mod(_b, _h, q_idx, kv_idx):
        page = kv_idx // ps
        return (owner[page] == q_idx) & (logical[page] * ps + kv_idx % ps < lens[q_idx])

    n = num_pages * ps
    block_mask = create_block_mask(mask_mod, 1, None, shape.batch, n, device=dev)
    query = b.query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, num_q_heads, batch, D]
    k = b.key_cache.view(n, num_kv_heads, head_dim).permute(1, 0, 2).unsqueeze(0)
    v = b.value_cache.view(n, num_kv_heads, head_dim).permute(1, 0, 2).unsqueeze(0)
    flex, scale = _flex_callable(dev, fresh=not for_graph), _scale(shape)

    def run() -> torch.Tensor:
        out = flex(query, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    return run


def flex_gathered(shape: BenchShape, b: BenchBatch, for_graph: bool = False) -> PeerFn:
    _no_fp8(shape, "flex-gathered")
    _, create_block_mask = _flex_api()
    k, v = (t.contiguous() for t in _gather_dense(b))  # outside the timing, by design
    lens = b.context_lens.long()

    def mask_mod(b_idx, _h, _q_idx, kv_idx):
        return kv_idx < lens[b_idx]

    block_mask = create_block_mask(mask_mod, shape.batch, None, 1, k.shape[2],
                                   device=b.query.device)
    query = b.query[:, :, None, :]
    flex, scale = _flex_callable(b.query.device, fresh=not for_graph), _scale(shape)

    def run() -> torch.Tensor:
        out = flex(query, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[:, :, 0, :]

    return run


@functools.lru_cache(maxsize=1)
def _flashinfer():
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - absent, or present but unusable (CUDA/ABI mismatch)
        return None
    return flashinfer


def flashinfer_page_table(b: BenchBatch, page_size: int):
    """FlashInfer's CSR page table of a batch: ``(indptr, indices, last_page_len)`` int32."""
    lens = b.context_lens.long()
    need = (lens + page_size - 1) // page_size
    indptr = torch.cat([need.new_zeros(1), need.cumsum(0)]).to(torch.int32)
    used = torch.arange(b.block_tables.shape[1], device=lens.device)[None, :] < need[:, None]
    indices = b.block_tables[used].to(torch.int32)  # row-major: each sequence's pages in order
    last_page_len = ((lens - 1).clamp(min=0) % page_size + 1).to(torch.int32)
    return indptr, indices, last_page_len


def flashinfer_tc(shape: BenchShape, b: BenchBatch, for_graph: bool = False) -> PeerFn:
    fi = _flashinfer()
    if fi is None:
        raise PeerUnsupported("flashinfer-tc: `import flashinfer` failed")
    if shape.dtype == torch.float32:
        raise PeerUnsupported("flashinfer-tc: no fp32")
    if b.query.device.type != "cuda":
        raise PeerUnsupported("flashinfer-tc: needs CUDA")
    m, ps, dev = shape.model, shape.page_size, b.query.device
    indptr, indices, last_page_len = flashinfer_page_table(b, ps)
    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    graph_buffers = {}
    if for_graph:
        graph_buffers = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr.clone(),
                             paged_kv_indices_buffer=indices.clone(),
                             paged_kv_last_page_len_buffer=last_page_len.clone())
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True,
                                                    **graph_buffers)
    wrapper.plan(indptr, indices, last_page_len, m.num_q_heads, m.num_kv_heads, m.head_dim, ps,
                 pos_encoding_mode="NONE", q_data_type=shape.dtype,
                 kv_data_type=shape.cache_dtype, sm_scale=_scale(shape))
    paged_kv = (b.key_cache, b.value_cache)
    scales = b.scales

    def run() -> torch.Tensor:
        return wrapper.run(b.query, paged_kv, **scales)

    run.keepalive = (workspace, graph_buffers, wrapper)  # type: ignore[attr-defined]
    return run


#: peer name -> factory(shape, batch, for_graph) -> callable
PEERS: dict[str, Callable[..., PeerFn]] = {
    "naive": naive,
    "flex-paged": flex_paged,
    "flex-gathered": flex_gathered,
    "flashinfer-tc": flashinfer_tc,
}
DEFAULT_PEERS = ("naive", "flex-paged", "flashinfer-tc")
