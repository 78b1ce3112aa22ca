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
  ``import flashinfer`` works: 0.2.5 and 0.7.4 alike (the row's ``peer_info`` names the
  version; to compare two versions, run ``bench`` once per version, or load one through
  ``--peer-file``).
* ``flashinfer-xqa``: FlashInfer >= 0.7's ``xqa_batch_decode_with_kv_cache`` (vLLM's Hopper
  default) with a zeroed 256 MB workspace; fp8 scales fold into ``bmm1_scale``/``bmm2_scale``.

Both FlashInfer peers need CUDA and the package; elsewhere they report ``unsupported``.

**Peer files** (``pagedattn bench --peer-file [NAME=]PATH[:FUNC]``): any Python file that
defines a runner factory runs as a peer in the same session::

    def make_runner(query, key_cache, value_cache, block_tables, context_lens, scale,
                    [k_scale=None, v_scale=None]):
        ...                   # plan, allocate, tune: outside the timing
        return run            # run() -> out [batch, num_q_heads, head_dim]; or (run, cfg)

``FUNC`` defaults to ``make_runner``; the tensors are ``paged_decode``'s (NHD caches, int32
tables and lengths) and ``scale`` is ``head_dim ** -0.5``. A factory may return
``(runner, cfg)`` (as ``best_floor_runner`` of the plain floor does); ``cfg`` is recorded in the
row. A factory without ``k_scale``/``v_scale`` parameters is ``unsupported`` on fp8 caches.
A factory that raises ``NotImplementedError`` gives an ``unsupported`` cell, any other
exception an ``error`` cell. The row is named ``NAME``, else the module's ``PEER_NAME``, else
``<file stem>`` (``<file stem>.<FUNC>`` when ``FUNC`` is not ``make_runner``). The runner is
built once per batch and reused for graph capture. The file's folder is on ``sys.path`` while
it loads, so it may import its neighbours.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedattn.bench.shapes import BenchBatch, BenchShape

PeerFn = Callable[[], torch.Tensor]
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20
XQA_WORKSPACE_BYTES = 256 * 2**20
DEFAULT_FACTORY = "make_runner"


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


def _need_flashinfer(peer: str, shape: BenchShape, b: BenchBatch):
    """The flashinfer module, or :class:`PeerUnsupported` saying why not."""
    if b.query.device.type != "cuda":
        raise PeerUnsupported(f"{peer}: needs CUDA")
    fi = _flashinfer()
    if fi is None:
        raise PeerUnsupported(f"{peer}: `import flashinfer` failed")
    if shape.dtype == torch.float32:
        raise PeerUnsupported(f"{peer}: no fp32")
    return fi


def flashinfer_tc(shape: BenchShape, b: BenchBatch, for_graph: bool = False) -> PeerFn:
    fi = _need_flashinfer("flashinfer-tc", shape, b)
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
    run.info = f"flashinfer {getattr(fi, '__version__', '?')}"  # type: ignore[attr-defined]
    return run


def flashinfer_xqa(shape: BenchShape, b: BenchBatch, for_graph: bool = False) -> PeerFn:
    fi = _need_flashinfer("flashinfer-xqa", shape, b)
    xqa = getattr(getattr(fi, "decode", None), "xqa_batch_decode_with_kv_cache", None)
    if xqa is None:
        raise PeerUnsupported(f"flashinfer-xqa: needs FlashInfer >= 0.7 (found "
                              f"{getattr(fi, '__version__', '?')})")
    workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=b.query.device)
    max_seq_len = max(shape.context_lens, default=0)  # host value, known when planning
    bmm1 = _scale(shape) * (b.k_scale if b.k_scale is not None else 1.0)
    bmm2 = b.v_scale if b.v_scale is not None else 1.0
    paged_kv = (b.key_cache, b.value_cache)

    def run() -> torch.Tensor:
        return xqa(b.query, paged_kv, workspace, b.block_tables, b.context_lens, max_seq_len,
                   bmm1_scale=bmm1, bmm2_scale=bmm2, kv_layout="NHD")

    run.keepalive = (workspace,)  # type: ignore[attr-defined]
    run.info = f"flashinfer {getattr(fi, '__version__', '?')} xqa"  # type: ignore[attr-defined]
    return run


#: peer name -> factory(shape, batch, for_graph) -> callable
PEERS: dict[str, Callable[..., PeerFn]] = {
    "naive": naive,
    "flex-paged": flex_paged,
    "flex-gathered": flex_gathered,
    "flashinfer-tc": flashinfer_tc,
    "flashinfer-xqa": flashinfer_xqa,
}
DEFAULT_PEERS = ("naive", "flex-paged", "flashinfer-tc", "flashinfer-xqa")


class PeerFile(NamedTuple):
    """A peer loaded from a file: its row name and its factory (the ``PEERS`` signature)."""

    name: str
    factory: Callable[..., PeerFn]


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"_pagedattn_peer_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"not a Python module: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _adapt(name: str, func: Callable) -> Callable[..., PeerFn]:
    """A ``PEERS``-style factory around a file's runner factory (see the module docstring)."""
    takes_scales = {"k_scale", "v_scale"} <= set(inspect.signature(func).parameters)
    built: list = [None, None]  # (batch, runner): one runner per batch, reused for graphs

    def factory(shape: BenchShape, b: BenchBatch, for_graph: bool = False) -> PeerFn:
        if built[0] is b:
            return built[1]
        fp8 = b.k_scale is not None
        if fp8 and not takes_scales:
            raise PeerUnsupported(f"{name}: fp8 cache, and {func.__name__} takes no "
                                  "k_scale/v_scale")
        made = func(*b.tensors, _scale(shape), **(b.scales if fp8 else {}))
        runner, cfg = made if isinstance(made, tuple) else (made, None)
        if not callable(runner):
            raise TypeError(f"{name}: {func.__name__} returned {type(runner).__name__}, "
                            "not a callable (or a (callable, cfg) tuple)")

        def run() -> torch.Tensor:
            return runner()

        run.info = "" if cfg is None else json.dumps(cfg, default=str)  # type: ignore[attr-defined]
        built[:] = [b, run]
        return run

    return factory


def load_peer_file(text: str) -> PeerFile:
    """``[NAME=]PATH[:FUNC]`` -> :class:`PeerFile`. Raises ValueError naming what is wrong."""
    name, sep, rest = text.partition("=")
    if not sep or "/" in name or name.endswith(".py"):
        name, rest = "", text
    path_text, func_name = rest, DEFAULT_FACTORY
    head, colon, tail = rest.rpartition(":")
    if colon and tail.isidentifier():
        path_text, func_name = head, tail
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ValueError(f"peer file: no such file {str(path)!r}")
    try:
        module = _load_module(path.resolve())
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's file: report it
        # (a file that calls sys.exit while loading would end the benchmark silently)
        raise ValueError(f"peer file {path}: import failed: {type(e).__name__}: {e}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v)
                 and v.__module__ == module.__name__ and not n.startswith("_")]
        raise ValueError(f"peer file {path}: no function {func_name!r}; it defines "
                         f"{', '.join(found) or 'no public function'} (use PATH:FUNC)")
    default = path.stem if func_name == DEFAULT_FACTORY else f"{path.stem}.{func_name}"
    name = name or str(getattr(module, "PEER_NAME", "") or default)
    return PeerFile(name, _adapt(name, func))


def peer_file(text: str) -> PeerFile:
    """argparse type of ``--peer-file``: :func:`load_peer_file`, errors as usage errors."""
    try:
        return load_peer_file(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
