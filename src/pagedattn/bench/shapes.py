"""Model shapes, benchmark shapes (every row of the peers table), the packaged request traces,
and the builder of a shape's decode batch.

A :class:`BenchShape` is one decode batch: a model's head layout, a dtype, a cache dtype and
the KV length of every sequence. ``page_size`` is 16 throughout. Names follow the peers table,
so our rows line up with the peers' numbers. GB = 1e9 bytes; "KV bytes" are the K and V bytes of
the valid tokens; the minimal bytes of one call (:func:`minimal_bytes`, the one formula of the
bench package: GB/s, % of the read rate and the size-matched limit all count it) add the used
block-table entries and the query.

Context lengths are computed lazily (the trace shapes read a CSV): :func:`get_shape` builds a
shape on first use; importing this module does no I/O.

The trace shapes draw their lengths from the packaged traces of :mod:`pagedattn.traces`
(:func:`~pagedattn.traces.sample_context_lens`, the recipe of ``API.md``).

To add a benchmark shape, add one entry to ``_SPECS`` (a model of :data:`MODELS` and a
function giving the lengths); ``pagedattn bench --shapes NAME`` then runs it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from pagedattn.testing import make_paged_inputs
from pagedattn.traces import sample_context_lens

FP8_E4M3 = torch.float8_e4m3fn
#: fp8 caches store ``value / scale``; this spread fills the e4m3 grid (max 448) with N(0, 1) data.
FP8_K_SCALE, FP8_V_SCALE = 1.0 / 64.0, 1.0 / 32.0


@dataclass(frozen=True)
class ModelShape:
    """Attention layout of one model layer: ``num_q_heads`` query heads sharing
    ``num_kv_heads`` kv heads of ``head_dim`` each, in the model's serving dtype."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16


MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-3-8b", 32, 8, 128),
    ModelShape("qwen2.5-7b", 28, 4, 128),  # group 7
    ModelShape("smollm2-135m", 9, 3, 64),  # group 3, head_dim 64
    ModelShape("mha", 32, 32, 128),
    ModelShape("tp8-70b", 8, 1, 128),  # one GPU's shard of a 64/8 model
    ModelShape("hd256", 16, 8, 256),
    ModelShape("seed", 32, 8, 128, torch.float32),  # the study's workload
)}


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class MinimalBytes(NamedTuple):
    """The bytes one decode call must read, by tensor (:func:`minimal_bytes`)."""

    kv: int  # K and V of the valid tokens
    block_table: int  # the used block-table entries
    query: int

    @property
    def total(self) -> int:
        return self.kv + self.block_table + self.query


def minimal_bytes(context_lens, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  page_size: int, q_dtype: torch.dtype, cache_dtype: torch.dtype,
                  q_len: int = 1, table_dtype: torch.dtype = torch.int32) -> MinimalBytes:
    """The bytes a decode call over sequences of ``context_lens`` tokens must read, exactly:

    * K/V: ``sum(context_lens) * num_kv_heads * head_dim * 2 * cache element size`` (1 byte
      for an fp8 cache),
    * block table: ``sum(ceil(len / page_size)) * table element size`` (only the entries a
      sequence uses are read: 4 bytes int32, 8 int64),
    * query: ``batch * q_len * num_q_heads * head_dim * query element size``.

    Not counted: ``context_lens`` itself (4 or 8 bytes a sequence) and the output (written,
    not read). Raises ValueError for a negative length, ``page_size < 1`` or ``q_len < 1``.
    The one minimal-bytes formula: GB/s, % of the read rate and the size-matched limit's
    buffer (:func:`pagedattn.bench.timing.read_buffer`) all come from it."""
    lens = [int(n) for n in context_lens]
    if any(n < 0 for n in lens):
        raise ValueError(f"context_lens: expected lengths >= 0, got {min(lens)}")
    if page_size < 1 or q_len < 1:
        raise ValueError(f"page_size, q_len: expected >= 1, got {page_size}, {q_len}")
    kv = sum(lens) * num_kv_heads * head_dim * 2 * _element_size(cache_dtype)
    pages = sum(-(-n // page_size) for n in lens)
    query = len(lens) * q_len * num_q_heads * head_dim * _element_size(q_dtype)
    return MinimalBytes(kv, pages * _element_size(table_dtype), query)


@dataclass(frozen=True)
class BenchShape:
    """One benchmark decode batch. ``context_lens[b]`` is sequence ``b``'s KV length (tokens)."""

    name: str
    model: ModelShape
    context_lens: tuple[int, ...]
    dtype: torch.dtype  # query and output dtype
    cache_dtype: torch.dtype  # the dtype or float8_e4m3fn
    page_size: int = 16
    k_scale: float | None = None  # dequantization: cache value = stored * scale (fp8 only)
    v_scale: float | None = None

    @property
    def batch(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.context_lens)

    @property
    def pages_per_seq(self) -> list[int]:
        return [math.ceil(n / self.page_size) for n in self.context_lens]

    @property
    def byte_counts(self) -> MinimalBytes:
        """What one decode call of this batch must read (:func:`minimal_bytes`; one query
        token, the int32 block table :func:`build_batch` makes)."""
        m = self.model
        return minimal_bytes(self.context_lens, num_q_heads=m.num_q_heads,
                             num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                             page_size=self.page_size, q_dtype=self.dtype,
                             cache_dtype=self.cache_dtype)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the valid K and V tokens: ``2 * tokens * num_kv_heads * head_dim * elem``."""
        return self.byte_counts.kv

    @property
    def minimal_bytes(self) -> int:
        """Bytes one decode call must read: valid K/V + used block-table entries + query."""
        return self.byte_counts.total

    def describe(self) -> str:
        m = self.model
        lens = self.context_lens
        return (f"{self.name}: batch {self.batch}, heads {m.num_q_heads}/{m.num_kv_heads}, "
                f"head_dim {m.head_dim}, {str(self.dtype).removeprefix('torch.')} query, "
                f"{str(self.cache_dtype).removeprefix('torch.')} cache, context "
                f"{min(lens, default=0)}..{max(lens, default=0)} ({self.num_tokens:,} tokens), "
                f"KV {self.kv_bytes / 1e6:,.1f} MB")


def make_shape(name: str, model: ModelShape | str, context_lens, *, fp8: bool = False,
               dtype: torch.dtype | None = None, page_size: int = 16) -> BenchShape:
    """A :class:`BenchShape` for a model (or registry name) and explicit lengths. Raises
    ValueError for a negative length or ``page_size < 1``."""
    model = MODELS[model] if isinstance(model, str) else model
    dtype = model.dtype if dtype is None else dtype
    lens = tuple(int(n) for n in context_lens)
    if any(n < 0 for n in lens):
        raise ValueError(f"context_lens: expected lengths >= 0, got {min(lens)}")
    if page_size < 1:
        raise ValueError(f"page_size: expected >= 1, got {page_size}")
    return BenchShape(name, model, lens, dtype,
                      FP8_E4M3 if fp8 else dtype, page_size,
                      FP8_K_SCALE if fp8 else None, FP8_V_SCALE if fp8 else None)


def ragged_lognormal_lens(batch: int = 64, seed: int = 0) -> list[int]:
    """``exp(7 + N(0, 1))`` (float32 draws, truncated to int), clipped to [1, 16384]; rows 0
    and 1 set to 1 and 17 (a lone token, a page plus one). Seed 0 totals 127,851 tokens."""
    z = torch.randn(batch, generator=torch.Generator().manual_seed(seed))
    lens = torch.exp(7.0 + z).clamp(1, 16384).long().tolist()
    lens[:2] = [1, 17][:batch]
    return lens


class _Spec(NamedTuple):
    model: str
    lens: Callable[[], list[int]]
    fp8: bool = False


def _uniform(batch: int, context: int) -> Callable[[], list[int]]:
    return lambda: [context] * batch


_SPECS: dict[str, _Spec] = {
    "seed-fp32-b64-c2048": _Spec("seed", _uniform(64, 2048)),
    "llama8b-b1-c32k": _Spec("llama-3-8b", _uniform(1, 32768)),
    "llama8b-b8-c8k": _Spec("llama-3-8b", _uniform(8, 8192)),
    "llama8b-b64-c2k": _Spec("llama-3-8b", _uniform(64, 2048)),
    "llama8b-b64-c8k": _Spec("llama-3-8b", _uniform(64, 8192)),
    "llama8b-b256-c1k": _Spec("llama-3-8b", _uniform(256, 1024)),
    "qwen7b-b64-c4k": _Spec("qwen2.5-7b", _uniform(64, 4096)),
    "mha-b32-c4k": _Spec("mha", _uniform(32, 4096)),
    "tp8-70b-b128-c8k": _Spec("tp8-70b", _uniform(128, 8192)),
    "hd256-b32-c4k": _Spec("hd256", _uniform(32, 4096)),
    "hd64-smollm-b64-c2k": _Spec("smollm2-135m", _uniform(64, 2048)),
    "fp8-llama8b-b64-c8k": _Spec("llama-3-8b", _uniform(64, 8192), fp8=True),
    "fp8-llama8b-b1-c32k": _Spec("llama-3-8b", _uniform(1, 32768), fp8=True),
    "ragged-b64-llama8b": _Spec("llama-3-8b", ragged_lognormal_lens),
    "azure-conv-b64-llama8b": _Spec("llama-3-8b", lambda: sample_context_lens("azure", 64, 0)),
    # API.md's recipe (180,464 tokens, max 35,355): the batch the peers timed (their GB/s imply
    # 739 MB); peers/README.md's "190,524 tokens, max 62,572" is a different draw
    "mooncake-b16-llama8b": _Spec("llama-3-8b", lambda: sample_context_lens("mooncake", 16, 0)),
    # beyond the peers table: pure latency, the served model at batch 1, a larger real batch
    "llama8b-b1-c1k": _Spec("llama-3-8b", _uniform(1, 1024)),
    "smollm-b1-c2k": _Spec("smollm2-135m", _uniform(1, 2048)),
    "mooncake-b64-llama8b": _Spec("llama-3-8b", lambda: sample_context_lens("mooncake", 64, 0)),
}
#: the rows of the peers comparison table (the numbers to beat), in its order
PEER_SHAPES: tuple[str, ...] = tuple(_SPECS)[:16]
SHAPES: tuple[str, ...] = tuple(_SPECS)


@functools.cache
def get_shape(name: str) -> BenchShape:
    """The registered shape ``name`` (built on first use). Raises ValueError if unknown."""
    if name not in _SPECS:
        raise ValueError(f"shape: unknown {name!r}; known: {', '.join(SHAPES)}")
    spec = _SPECS[name]
    return make_shape(name, spec.model, spec.lens(), fp8=spec.fp8)


#: the words ``--shapes`` accepts besides names
SHAPE_PRESETS: dict[str, tuple[str, ...]] = {"all": SHAPES, "peers": PEER_SHAPES}


def select_shapes(selection: str | list[str]) -> list[BenchShape]:
    """``"all"``, ``"peers"``, a comma list of names (presets among them) or a list of names
    -> shapes, in order. Raises ValueError for an unknown name or an empty selection."""
    names = selection.split(",") if isinstance(selection, str) else list(selection)
    picked = []
    for n in (str(n).strip() for n in names):
        if n:
            picked += SHAPE_PRESETS.get(n, [n])
    if not picked:
        raise ValueError(f"shapes: expected shape names or {', '.join(SHAPE_PRESETS)}, got "
                         f"{selection!r}")
    return [get_shape(n) for n in picked]


def shrink_lengths(lens, max_context: int) -> list[int]:
    """Scale lengths by ``max_context / max(lens)`` (never up), rounding up: a non-empty
    sequence keeps at least 1 token, an empty one stays empty, ragged stays ragged. The one
    length shrinker of the bench package (the CPU interpreter runs only small batches)."""
    if max_context < 1:
        raise ValueError(f"max_context: expected >= 1, got {max_context}")
    lens = [int(n) for n in lens]
    if any(n < 0 for n in lens):
        raise ValueError(f"lens: expected lengths >= 0, got {min(lens)}")
    top = max(lens, default=0)
    if top <= max_context:
        return lens
    return [-(-n * max_context // top) for n in lens]


def shrink(shape: BenchShape, *, max_batch: int = 2, max_kv_heads: int = 1,
           max_context: int = 17) -> BenchShape:
    """An interpreter-sized copy of ``shape`` named ``<name>-small``: the same group size,
    head_dim, page_size and dtypes; at most ``max_batch`` sequences and ``max_kv_heads`` kv
    heads; lengths through :func:`shrink_lengths` (by default the longest is one page plus one
    token: a page boundary)."""
    m = shape.model
    kv = min(m.num_kv_heads, max_kv_heads)
    model = ModelShape(f"{m.name}-small", m.num_q_heads // m.num_kv_heads * kv, kv,
                       m.head_dim, m.dtype)
    lens = shrink_lengths(shape.context_lens[:max_batch] or (1,), max_context)
    return replace(shape, name=f"{shape.name}-small", model=model, context_lens=tuple(lens))


def resolve_shape(name: str, small: bool = False) -> BenchShape:
    """A registered shape, shrunk with ``small``. Raises ValueError if unknown."""
    shape = get_shape(name)
    return shrink(shape) if small else shape


class BenchBatch(NamedTuple):
    """Device tensors of one shape, in ``paged_decode``'s positional order, plus fp8 scales."""

    query: torch.Tensor  # [batch, num_q_heads, head_dim]
    key_cache: torch.Tensor  # NHD [num_pages, page_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_pages] int32
    context_lens: torch.Tensor  # [batch] int32
    k_scale: float | None
    v_scale: float | None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self[:5]

    @property
    def scales(self) -> dict[str, Any]:
        """``{"k_scale": .., "v_scale": ..}`` for fp8 caches, else ``{}``."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}


def build_batch(shape: BenchShape, device: str | torch.device = "cpu", seed: int = 0, *,
                poison: bool = True, extra_pages: int = 2) -> BenchBatch:
    """A shape's decode batch on ``device``, from :func:`pagedattn.testing.make_paged_inputs`
    (the tests' builder, so one poison rule holds everywhere): pages in shuffled order,
    ``extra_pages`` unused pages, and with ``poison`` NaN in every unused cache slot and -1 or
    out-of-range ids in block-table padding. fp8 caches hold ``N(0, 1) / scale`` so that
    ``stored * scale`` is standard normal."""
    m = shape.model
    fp8 = shape.cache_dtype != shape.dtype
    inputs = make_paged_inputs(
        list(shape.context_lens), num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, page_size=shape.page_size, dtype=shape.dtype,
        cache_dtype=torch.float32 if fp8 else shape.cache_dtype, extra_pages=extra_pages,
        poison=poison, seed=seed, device=device)
    k, v = inputs.key_cache, inputs.value_cache
    if fp8:
        k = (k / shape.k_scale).to(shape.cache_dtype)
        v = (v / shape.v_scale).to(shape.cache_dtype)
    return BenchBatch(inputs.query, k, v, inputs.block_tables, inputs.context_lens,
                      shape.k_scale, shape.v_scale)
