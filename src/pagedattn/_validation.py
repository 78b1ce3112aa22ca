"""Input validation for :func:`pagedattn.paged_decode` and the KV append.

Two kinds of checks:

* metadata checks (rank, shape, dtype, device, divisibility): free, always run, raise
  ``TypeError``/``ValueError`` naming the argument before any kernel launches;
* value checks (lengths in range, used page ids in range): they need the data, so they run
  when the tensors live on the CPU, or when ``validate=True`` (one device-to-host sync).
  With ``validate=None`` on CUDA they are skipped, keeping the hot path free of host syncs
  (CUDA-graph capture works); the kernels clamp lengths to the table's capacity and never
  read block-table entries past ``ceil(len / page_size)``, so they stay in bounds anyway.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from typing import Any

import torch

from pagedattn._env import TRUE_WORDS, is_interpreter

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = tuple(
    d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d
)
INDEX_DTYPES = (torch.int32, torch.int64)
KV_LAYOUTS = ("NHD", "HND")
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
#: most forced splits per sequence (a split holds at least one token; more only allocate)
MAX_SPLITS = 1 << 16
#: the most parts a head block of the MLA kernel takes (``num_programs`` of ``plan_mla_decode``)
MAX_PROGRAMS = 1 << 16
#: the production kernel's schedules (``schedule=``; ``None`` is the same): the split one
SCHEDULES = ("split",)
#: why ``schedule="persistent"`` is refused (issue 68): the message of the ValueError
PERSISTENT_REMOVED = (
    "schedule: 'persistent' was removed (the persistent schedule measured slower than the "
    "split schedule on 15 of 16 rows on an H100 and on an H200, and tied on the Mooncake "
    "trace: docs/perf-notes.md step 48); expected None or 'split', got 'persistent'")
#: the largest finite float32: a Python float past it is inf in the kernels
FLOAT32_MAX = 3.4028234663852886e38
#: the largest magnitude of a scalar that the kernels multiply by log2(e) (their softmax runs
#: in base 2): ``scale``, ``logits_soft_cap``, the fp8 scales and the sinks; past it the
#: product is inf in float32 (about 2.36e38)
KERNEL_SCALAR_MAX = FLOAT32_MAX / math.log2(math.e)
#: the smallest soft-cap whose ln(2) / cap is finite in float32
SOFTCAP_MIN = math.log(2) / FLOAT32_MAX
#: how an error message says "at most KERNEL_SCALAR_MAX in magnitude"
WITHIN = "within +-2.36e38 (float32's range / log2(e): the kernels work in base 2)"
#: the longest context the kernels hold: they compute token positions, split bounds and
#: window starts in int32, and the largest of those intermediates is about twice the
#: capacity (a split's start plus its length), so the capacity they clamp lengths to is at
#: most 2^30 tokens (a ``max_pages * page_size`` past it is cut to it, on the host)
MAX_CONTEXT_LEN = 1 << 30


#: ``PAGEDATTN_VALIDATE=1`` (read once, when pagedattn is imported; any of Triton's true words):
#: the debug switch. A call that leaves ``validate`` at ``None`` then runs the value checks
#: on every device, a GPU's too (one host sync a call; skipped while a CUDA graph is being
#: captured, which forbids the sync): bad metadata raises before the launch, naming the
#: argument, instead of being clamped and reported by the kernels (``pagedattn._errors``)
DEBUG_CHECKS = os.environ.get("PAGEDATTN_VALIDATE", "").strip().lower() in TRUE_WORDS


def value_checks_due(validate: bool | None, device: torch.device) -> bool:
    """Whether a call's value checks run: ``validate`` when given; for ``None``, on CPU
    tensors, and on a GPU under the debug switch (:data:`DEBUG_CHECKS`) outside a CUDA-graph
    capture."""
    if validate is not None:
        return bool(validate)
    if device.type == "cpu":
        return True
    return DEBUG_CHECKS and not (device.type == "cuda" and torch.cuda.is_available()
                                 and torch.cuda.is_current_stream_capturing())


def kernel_max_pages(max_pages: int, page_size: int) -> int:
    """The table width the kernels are given: ``max_pages``, or fewer so that
    ``max_pages * page_size <= MAX_CONTEXT_LEN`` (the entries past it could only serve
    lengths past the kernels' int32 range, which the value checks refuse)."""
    return min(max_pages, MAX_CONTEXT_LEN // page_size)


def fail(exc: type[Exception], name: str, expected: str, got: Any) -> None:
    """Raise ``exc`` in the one form every check uses: ``name: expected ..., got ...``."""
    raise exc(f"{name}: expected {expected}, got {got}")


def renamed(e: Exception, names: dict[str, str]) -> Exception:
    """``e`` (a TypeError or ValueError whose message starts with ``name: ``, as :func:`fail`
    writes it) with ``names[name]`` in its place, or ``e`` itself when it names nothing in
    ``names``: the drop-ins (``pagedattn.compat``) raise an error of the API underneath again
    under the name their caller passed (FlashAttention's ``page_table``, FlashInfer's
    ``indices``)."""
    name, sep, rest = str(e).partition(": ")
    if type(e) not in (TypeError, ValueError) or not sep or name not in names:
        return e
    return type(e)(f"{names[name]}: {rest}")


def type_name(x: Any) -> str:
    """``bool`` for a Python bool, ``numpy.bool`` for numpy's (the two print alike)."""
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def check_float32(name: str, x: Any, expected: str, limit: float = KERNEL_SCALAR_MAX) -> float:
    """A real number the kernels can hold: finite and at most ``limit`` in magnitude (a Python
    float past float32's range becomes inf there, and one past ``KERNEL_SCALAR_MAX`` once
    multiplied by log2(e)). Returns it as a float."""
    try:
        value = float(x)
    except OverflowError:  # an int past float64's range
        fail(ValueError, name, expected, f"an int of {len(str(abs(x)))} digits")
    if not (math.isfinite(value) and abs(value) <= limit):
        fail(ValueError, name, expected, x)
    return value


def check_tensor(name: str, t: Any, rank: int | tuple[int, ...], dtypes: tuple,
                 dtype_words: str) -> None:
    """A dense tensor of ``rank`` (or one of the ranks) and one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.layout != torch.strided:  # sparse or nested: the kernels take strides
        fail(TypeError, name, "a dense (strided) tensor", t.layout)
    ranks = (rank,) if isinstance(rank, int) else rank
    if t.dim() not in ranks:
        fail(ValueError, name, f"a rank-{' or rank-'.join(map(str, ranks))} tensor",
             f"shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        fail(TypeError, name, dtype_words, t.dtype)


def _kernels_built_for_gpu() -> bool:
    """True when a ``pagedattn.kernels`` module was imported without the interpreter (its
    ``@triton.jit`` functions are GPU ``JITFunction`` objects, not ``InterpretedFunction``)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("pagedattn.kernels.") and module is not None:
            for attr, obj in vars(module).items():
                if attr.endswith("_kernel") and type(obj).__name__ == "JITFunction":
                    return True
    return False


def check_device_runnable(name: str, t: torch.Tensor) -> None:
    """CPU tensors run only through Triton's interpreter, which Triton reads when its kernels
    are defined: ``TRITON_INTERPRET=1`` must be in the environment before ``triton`` is
    imported (this library never sets it). Raise a ``ValueError`` naming ``name`` when a CPU
    tensor comes without it, before any launch (Triton itself would fail with "0 active
    drivers"), and for a tensor on any other device (``meta``, ``mps``...). Reads no data and
    imports nothing; for a CUDA tensor it is one attribute test."""
    if t.device.type == "cuda":
        return
    if t.device.type != "cpu":
        fail(ValueError, name, "a CUDA tensor (or a CPU one under TRITON_INTERPRET=1)",
             f"a tensor on {t.device}")
    if not is_interpreter():  # read as Triton reads it: TRITON_INTERPRET=false is off
        fail(ValueError, name,
             "a CUDA tensor, or CPU tensors with TRITON_INTERPRET=1 set in the environment "
             "before triton is imported (Triton runs CPU tensors through its interpreter "
             "only; pagedattn does not set the variable)", "a CPU tensor without it")
    if _kernels_built_for_gpu():
        fail(ValueError, name,
             "a CUDA tensor: pagedattn's kernels were imported before TRITON_INTERPRET=1 "
             "was set, so they run on a GPU only; set it before triton is imported",
             "a CPU tensor")


def check_same_device(reference: str, device: torch.device, named: tuple) -> None:
    """Every ``(name, tensor)`` in ``named`` lives on ``device`` (that of ``reference``)."""
    for name, t in named:
        if t.device != device:
            fail(ValueError, name, f"a tensor on the {reference}'s device {device}", t.device)


def cache_dims(key_cache: torch.Tensor, kv_layout: str) -> tuple[int, int, int, int]:
    """``(num_pages, page_size, num_kv_heads, head_dim)`` of a cache in either layout."""
    num_pages, a, b, head_dim = key_cache.shape
    return (num_pages, a, b, head_dim) if kv_layout == "NHD" else (num_pages, b, a, head_dim)


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """``value_cache`` has the shape and dtype of ``key_cache``."""
    if value_cache.shape != key_cache.shape:
        fail(ValueError, "value_cache", f"the shape of key_cache {tuple(key_cache.shape)}",
             tuple(value_cache.shape))
    if value_cache.dtype != key_cache.dtype:
        fail(TypeError, "value_cache", f"the dtype of key_cache ({key_cache.dtype})",
             value_cache.dtype)


def check_scale_arg(name: str, s: Any, num_kv_heads: int, device: torch.device) -> None:
    """fp8 scales: a Python float, a 0-d tensor, or a ``[num_kv_heads]`` tensor."""
    if s is None:
        return
    if isinstance(s, bool):
        fail(TypeError, name, "a float, a 0-d tensor or a [num_kv_heads] tensor", "bool")
    if isinstance(s, numbers.Real):  # a dequantization scale: positive (0 divides by zero)
        if check_float32(name, s, f"a finite scale > 0 {WITHIN}") <= 0:
            fail(ValueError, name, "a finite scale > 0", s)
        return
    if not isinstance(s, torch.Tensor):
        fail(TypeError, name, "a float, a 0-d tensor or a [num_kv_heads] tensor", type(s).__name__)
    if not s.is_floating_point():
        fail(TypeError, name, "a floating-point tensor", s.dtype)
    if not (s.dim() == 0 or (s.dim() == 1 and s.shape[0] == num_kv_heads)):
        fail(
            ValueError, name, f"a float, a 0-d tensor or a [num_kv_heads={num_kv_heads}] tensor",
            f"shape {tuple(s.shape)}",
        )
    if s.device != device:
        fail(ValueError, name, f"a tensor on the inputs' device {device}", s.device)


def check_head_tensor(name: str, t: Any, num_q_heads: int, device: torch.device) -> None:
    """``sinks`` / ``alibi_slopes``: None or a float32 ``[num_q_heads]`` tensor on ``device``."""
    if t is None:
        return
    check_tensor(name, t, 1, (torch.float32,), "float32")
    if t.shape[0] != num_q_heads:
        fail(ValueError, name, f"shape ({num_q_heads},) (num_q_heads)", f"{tuple(t.shape)}")
    if t.device != device:
        fail(ValueError, name, f"a tensor on the query's device {device}", t.device)


def _check_run_options(k_scale, v_scale, num_kv_heads: int, device, return_lse,
                       validate, scale=None) -> None:
    """The cache scales, ``return_lse`` and ``validate`` of a decode call. The kernels fold
    ``scale · k_scale · log2(e)`` into one float32, so two float scales must multiply within
    ``KERNEL_SCALAR_MAX`` too."""
    check_scale_arg("k_scale", k_scale, num_kv_heads, device)
    check_scale_arg("v_scale", v_scale, num_kv_heads, device)
    if scale is not None and isinstance(k_scale, numbers.Real) \
            and abs(float(scale) * float(k_scale)) > KERNEL_SCALAR_MAX:
        fail(ValueError, "k_scale", f"scale * k_scale {WITHIN}",
             f"{k_scale!r} with scale {scale!r}")
    if not isinstance(return_lse, bool):
        fail(TypeError, "return_lse", "a Python bool", type_name(return_lse))
    if validate is not None and not isinstance(validate, bool):
        fail(TypeError, "validate", "None, True or False", type_name(validate))


def check_softmax_scale(scale: Any) -> None:
    """``scale``: None or a finite Python float."""
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            fail(TypeError, "scale", "a Python float or None", type_name(scale))
        check_float32("scale", scale, f"a finite float {WITHIN}")


def check_metadata(
    query, key_cache, value_cache, block_tables, context_lens, *, scale, impl, impls,
    num_splits, out, kv_layout, k_scale, v_scale, return_lse, validate,
) -> None:
    """Metadata checks: no data is read, so no host sync. Raises TypeError/ValueError.
    ``query`` is 3-D, or 4-D ``[batch, q_len, num_q_heads, head_dim]`` (multi-token). The
    variants are checked by ``pagedattn.options``."""
    if not isinstance(impl, str) or impl not in impls:
        fail(ValueError, "impl", f"one of {', '.join(repr(i) for i in impls)}", repr(impl))
    if kv_layout not in KV_LAYOUTS:
        fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    # [batch, num_q_heads, head_dim], or [batch, q_len, num_q_heads, head_dim] (multi-token)
    check_tensor("query", query, (3, 4), FLOAT_DTYPES, "float32, float16 or bfloat16")
    multi = query.dim() == 4
    if multi and query.shape[1] < 1:
        fail(ValueError, "query", "q_len >= 1 (dim 1 of a 4-D query)", query.shape[1])
    cache_dtypes = FLOAT_DTYPES + FP8_DTYPES
    words = "float32, float16, bfloat16, float8_e4m3fn or float8_e5m2"
    check_tensor("key_cache", key_cache, 4, cache_dtypes, words)
    check_tensor("value_cache", value_cache, 4, cache_dtypes, words)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, "int32 or int64")
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, "int32 or int64")

    check_cache_pair(key_cache, value_cache)
    if key_cache.dtype in FLOAT_DTYPES and key_cache.dtype != query.dtype:
        fail(TypeError, "key_cache", f"the query's dtype {query.dtype} (or an fp8 dtype)",
             key_cache.dtype)
    check_same_device("query", query.device, (
        ("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
        ("context_lens", context_lens)))

    batch, num_q_heads, head_dim = query.shape[0], query.shape[-2], query.shape[-1]
    num_pages, page_size, num_kv_heads, cache_head_dim = cache_dims(key_cache, kv_layout)
    if cache_head_dim != head_dim:
        fail(ValueError, "key_cache", f"head_dim {head_dim} (the query's) in the last dim",
             cache_head_dim)
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        fail(ValueError, "head_dim", f"a value in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]", head_dim)
    if not 1 <= page_size <= MAX_CONTEXT_LEN:
        fail(ValueError, "page_size", f"in [1, {MAX_CONTEXT_LEN}] (key_cache dim; the "
             "kernels hold token positions in int32)", page_size)
    if num_kv_heads < 1:
        fail(ValueError, "key_cache", f"num_kv_heads >= 1 (dim {1 if kv_layout == 'HND' else 2} "
             f"in layout {kv_layout})", num_kv_heads)
    if num_q_heads % num_kv_heads != 0:
        fail(ValueError, "num_q_heads",
             f"a multiple of num_kv_heads={num_kv_heads} (key_cache's dim "
             f"{1 if kv_layout == 'HND' else 2} in layout {kv_layout}: is kv_layout right?)",
             num_q_heads)
    if block_tables.shape[0] != batch:
        fail(ValueError, "block_tables", f"{batch} rows (the batch)", block_tables.shape[0])
    if context_lens.shape[0] != batch:
        fail(ValueError, "context_lens", f"{batch} entries (the batch)", context_lens.shape[0])

    check_softmax_scale(scale)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
            fail(TypeError, "num_splits", "an int or None", type_name(num_splits))
        if not 1 <= num_splits <= MAX_SPLITS:
            fail(ValueError, "num_splits", f"an int in [1, {MAX_SPLITS}] or None", num_splits)
    if out is not None:
        check_out(out, query, key_cache, value_cache)
    _check_run_options(k_scale, v_scale, num_kv_heads, query.device, return_lse, validate,
                       scale=scale)
    check_device_runnable("query", query)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` that a tensor's elements can touch."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two non-empty tensors of one storage can touch a common byte."""
    if not (a.numel() and b.numel()) or \
            a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1



def check_out(out, query, key_cache, value_cache) -> None:
    """``out``: a tensor of the query's shape, dtype and device sharing memory with neither the
    query (unless it is the query) nor the caches; one error type per mistake, for
    ``check_metadata`` and ``check_run`` alike."""
    if not isinstance(out, torch.Tensor):
        fail(TypeError, "out", "a torch.Tensor or None", type(out).__name__)
    if out.shape != query.shape:
        fail(ValueError, "out", f"shape {tuple(query.shape)}", tuple(out.shape))
    if out.dtype != query.dtype:
        fail(TypeError, "out", f"dtype {query.dtype} (the query's)", out.dtype)
    check_same_device("query", query.device, (("out", out),))
    check_out_aliasing(out, query, (("key_cache", key_cache), ("value_cache", value_cache)))

def check_out_aliasing(out: torch.Tensor, query: torch.Tensor, caches: tuple = ()) -> None:
    """``out`` is written by many programs at once: no two of its elements may share memory
    (a broadcast view with stride 0, or overlapping strides), and it may share none with the
    query unless it is the query itself (each program reads its query rows before writing
    the same rows), nor with the caches in ``caches`` (``(name, tensor)`` pairs: read while
    ``out`` is written). Metadata only. Raises ValueError naming ``out`` (TypeError for a
    sparse or nested ``out``: its strides, read here, would say nothing of its memory)."""
    if out.layout != torch.strided:
        fail(TypeError, "out", "a dense (strided) tensor", out.layout)
    dims = sorted((stride, size) for size, stride in zip(out.shape, out.stride(), strict=True)
                  if size > 1)
    reach = 1
    for stride, size in dims:
        if stride < reach:
            fail(ValueError, "out", "a tensor whose elements do not overlap (no stride-0 or "
                 "overlapping dims)", f"strides {tuple(out.stride())} for shape "
                 f"{tuple(out.shape)}")
        reach = stride * size
    same = out.data_ptr() == query.data_ptr() and out.stride() == query.stride()
    if not same and _overlaps(out, query):
        fail(ValueError, "out", "memory apart from the query's, or the query itself",
             "a view overlapping the query")
    for name, cache in caches:  # the kernels read the caches while out is written
        if _overlaps(out, cache):
            fail(ValueError, "out", f"memory apart from {name}'s", f"a view overlapping {name}")


def check_values(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_pages: int, page_size: int,
    window_left: int = -1, q_len: int = 1, *, added: int = 0,
    names: tuple[str, str] = ("block_tables", "context_lens"),
) -> None:
    """Value checks: lengths in ``[0, max_pages * page_size]`` (and at most
    ``MAX_CONTEXT_LEN``, the kernels' int32 bound) and used page ids in ``[0, num_pages)``.
    Reads the data (a host sync on CUDA). Raises ValueError naming the argument and the first
    offending batch row. With a sliding window the pages wholly before the earliest query
    token's window are never read, so they may hold anything (a server frees them: -1).
    ``added``: tokens a caller appends to every sequence before the kernels read it (the
    lengths are then ``context_lens + added``, checked before anything is written);
    ``names``: the caller's names of the table and the lengths (a drop-in's own)."""
    batch, max_pages = block_tables.shape
    if batch == 0:
        return
    table_name, lens_name = names
    capacity = kernel_max_pages(max_pages, page_size) * page_size
    lens = context_lens.long()
    bad = (lens < 0) | (lens + added > capacity)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        bound = (f"max_pages * page_size = {capacity}" if capacity == max_pages * page_size
                 else f"{capacity} (the kernels' int32 bound)")
        if added:
            bound = f"{bound} - {added} (the {added} tokens appended)"
        fail(ValueError, lens_name, f"lengths in [0, {bound}] (row {row})", int(lens[row]))
    lens = lens + added
    used_pages = (lens.clamp(0, capacity) + page_size - 1) // page_size  # [batch]
    cols = torch.arange(max_pages, device=block_tables.device)
    used = cols[None, :] < used_pages[:, None]
    if window_left >= 0:  # the first key any query token sees, and its page
        first_page = (lens.clamp(0, capacity) - q_len - window_left).clamp(min=0) // page_size
        used &= cols[None, :] >= first_page[:, None]
    ids = block_tables.long()
    bad_ids = used & ((ids < 0) | (ids >= num_pages))
    if bool(bad_ids.any()):
        row, col = (int(x) for x in bad_ids.nonzero()[0])
        fail(ValueError, table_name,
             f"used page ids in [0, num_pages={num_pages}) (row {row}, column {col})",
             int(ids[row, col]))


def first_bad(name: str, t: torch.Tensor, bad: torch.Tensor, expected: str) -> None:
    """Raise a ValueError naming ``name``, ``expected`` and the first entry where ``bad``."""
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0, 0])
        fail(ValueError, name, f"{expected} (entry {i})", t.reshape(-1)[i].item())


def check_scalar_values(named: tuple) -> None:
    """Value checks of fp8 scales given as tensors (a host sync on CUDA, so they run where
    the index checks run; ``named``: ``(name, tensor or other)`` pairs, non-tensors were
    checked as floats): finite and in ``(0, KERNEL_SCALAR_MAX]``. The variants' per-call
    tensors have their own (``pagedattn.options``). Raises ValueError naming the argument
    and the first bad entry."""
    for name, t in named:
        if isinstance(t, torch.Tensor):
            v = t.detach().double()
            first_bad(name, v, ~((v > 0) & (v <= KERNEL_SCALAR_MAX)),
                      f"finite scales > 0 {WITHIN}")


#: the largest magnitude any float32 intermediate of the kernels may reach on valid input:
#: half of float32's range, so the rounding of a sum of up to 256 (or a context's) terms
#: never pushes it to inf, and a difference of two scores (``s - m``) stays finite
VALUE_LIMIT = 2.0 ** 127


def _scale_per_head(s, num_kv_heads: int) -> torch.Tensor:
    """An fp8 scale (None, a float, a 0-d or ``[num_kv_heads]`` tensor) as float64
    ``[num_kv_heads]`` on the CPU."""
    if s is None:
        return torch.ones(num_kv_heads, dtype=torch.float64)
    if isinstance(s, torch.Tensor):
        return s.detach().double().cpu().expand(num_kv_heads) if s.dim() == 0 else \
            s.detach().double().cpu()
    return torch.full((num_kv_heads,), float(s), dtype=torch.float64)


def _used_rows(cache: torch.Tensor, block_tables, lens, first, page_size) -> torch.Tensor:
    """The rows ``[T, num_kv_heads, head_dim]`` (float64, CPU) of an NHD-shaped cache view
    that the kernels read: tokens ``[first_b, lens_b)`` of each sequence."""
    counts = (lens - first).clamp(min=0)
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, cache.shape[2], cache.shape[3], dtype=torch.float64)
    dev = block_tables.device
    b = torch.repeat_interleave(torch.arange(lens.shape[0], device=dev), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos = (torch.arange(total, device=dev) - torch.repeat_interleave(starts, counts)
           + torch.repeat_interleave(first, counts))
    pages = block_tables.long()[b, pos // page_size]
    return cache[pages, pos % page_size].double().cpu()


def check_value_ranges(query, key_cache, value_cache, block_tables, context_lens, *,
                       kv_layout: str = "NHD", scale=None, k_scale=None, v_scale=None,
                       window_left: int = -1, q_len: int = 1, appended=None) -> None:
    """Value checks of the data the kernels' float32 arithmetic must hold (run where the
    index checks run, after them: a host sync on CUDA, and one read of the keys and values
    in use). Per kv head ``h``, with ``D = head_dim``, ``qmax`` the query group's largest
    ``|q|``, ``kmax``/``vmax`` the largest ``|k|``/``|v|`` the sequences read (times the fp8
    scales), ``kraw`` that of the stored keys, ``c = |scale| · log2(e)``, ``n`` the longest
    length, every bound ``VALUE_LIMIT = 2^127``:

    * ``D · qmax · kraw`` (``query``): the float32 dot of a 16-bit or fp32 query and key, before
      any scale (bf16 q and k near 1e19 overflowed it; fp8 dots are bounded by their format);
    * ``qmax · c · k_scale`` (``scale``): the stages' pre-scaled query, and ``auto``'s fp8
      score factor;
    * ``D · qmax · kmax · c`` (``scale``): every score (a scale of -1e37 or 2e38 made scores
      inf: NaN in ``auto``, a wrong average in the stages);
    * ``n · vmax`` (``value_cache``): the float32 sum of up to ``n`` values weighted by
      probabilities <= 1 (bf16 V near 1e38 gave inf).

    ``appended``: ``(key, value)`` ``[batch, seqlen_new, num_kv_heads, head_dim]`` that a
    caller appends after ``context_lens`` before the kernels read the cache (checked before
    anything is written): they count as read, every one of them.

    Raises ValueError naming the argument, the kv head and the bound."""
    batch, max_pages = block_tables.shape
    if batch == 0 or query.numel() == 0:
        return
    k_nhd, v_nhd = (key_cache, value_cache) if kv_layout == "NHD" else (
        key_cache.transpose(1, 2), value_cache.transpose(1, 2))
    page_size, num_kv_heads, head_dim = k_nhd.shape[1:]
    capacity = kernel_max_pages(max_pages, page_size) * page_size
    stored = context_lens.long().clamp(0, capacity)  # the cache's tokens before the append
    lens = (stored + (appended[0].shape[1] if appended is not None else 0)).clamp(max=capacity)
    first = torch.zeros_like(lens)
    if window_left >= 0:
        first = (lens - q_len - min(window_left, capacity)).clamp(min=0)
    k = _used_rows(k_nhd, block_tables, stored, first, page_size).abs()
    v = _used_rows(v_nhd, block_tables, stored, first, page_size).abs()
    if appended is not None:
        k, v = (torch.cat((rows, new.detach().reshape(-1, num_kv_heads, head_dim).double()
                           .cpu().abs())) for rows, new in ((k, appended[0]), (v, appended[1])))
    kraw = k.amax(dim=(0, 2)) if k.numel() else torch.zeros(num_kv_heads, dtype=torch.float64)
    vraw = v.amax(dim=(0, 2)) if v.numel() else torch.zeros(num_kv_heads, dtype=torch.float64)
    ks, vs = _scale_per_head(k_scale, num_kv_heads), _scale_per_head(v_scale, num_kv_heads)
    # the queries of sequences that see a key (an empty one's query is never used)
    q = query.detach()[(lens > first).to(query.device)].double().cpu().abs()
    q = q.reshape(-1, num_kv_heads, q.shape[-2] // num_kv_heads, head_dim)
    if q.shape[0] == 0:
        return
    qmax = q.amax(dim=(0, 2, 3))  # [num_kv_heads]
    c = abs(head_dim ** -0.5 if scale is None else float(scale)) * math.log2(math.e)
    n = int(lens.max())
    fp8 = key_cache.dtype in FP8_DTYPES
    checks = (
        ("query", None if fp8 else head_dim * qmax * kraw, "head_dim * max|q| * max|k|"),
        ("scale", qmax * c * ks, "max|q| * |scale| * log2(e) * k_scale"),
        ("scale", head_dim * qmax * kraw * ks * c,
         "head_dim * max|q| * max|k| * k_scale * |scale| * log2(e)"),
        ("value_cache", n * vraw * vs, "max context_lens * max|v| * v_scale"),
    )
    for name, value, words in checks:
        if value is None:
            continue
        bad = ~(value <= VALUE_LIMIT)  # NaN too
        if bool(bad.any()):
            h = int(bad.nonzero()[0, 0])
            fail(ValueError, name, f"{words} <= 2^127 (float32's range, halved for "
                 f"rounding: the kernels compute in float32) (kv head {h})",
                 f"{float(value[h]):.4g}")


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """An integer (Python's or numpy's) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(TypeError, name, "an int", type_name(value))
    if value < low or (high is not None and value > high):
        fail(ValueError, name, f"an int >= {low}" if high is None
             else f"an int in [{low}, {high}]", value)


def check_plan(block_tables, context_lens, *, num_q_heads, num_kv_heads, head_dim, page_size,
               q_dtype, kv_dtype, kv_layout, num_splits, lens_name="context_lens") -> None:
    """:func:`pagedattn.plan_decode`'s checks (and :func:`pagedattn.plan_attention`'s, whose
    lengths are ``seq_lens``: ``lens_name``): metadata only (no host sync)."""
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, "int32 or int64")
    check_device_runnable("block_tables", block_tables)
    check_tensor(lens_name, context_lens, 1, INDEX_DTYPES, "int32 or int64")
    if context_lens.shape[0] != block_tables.shape[0]:
        fail(ValueError, lens_name, f"{block_tables.shape[0]} entries (block_tables rows)",
             context_lens.shape[0])
    if context_lens.device != block_tables.device:
        fail(ValueError, lens_name, f"a tensor on block_tables' device "
             f"{block_tables.device}", context_lens.device)
    check_int("num_kv_heads", num_kv_heads, 1)
    check_int("num_q_heads", num_q_heads, 1)
    if num_q_heads % num_kv_heads:
        fail(ValueError, "num_q_heads", f"a multiple of num_kv_heads={num_kv_heads}",
             num_q_heads)
    check_int("head_dim", head_dim, 1)
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        fail(ValueError, "head_dim", f"a value in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]", head_dim)
    check_int("page_size", page_size, 1, MAX_CONTEXT_LEN)
    if q_dtype not in FLOAT_DTYPES:
        fail(TypeError, "q_dtype", "torch.float32, torch.float16 or torch.bfloat16", q_dtype)
    if kv_dtype is not None and kv_dtype != q_dtype and kv_dtype not in FP8_DTYPES:
        fail(TypeError, "kv_dtype", f"None, q_dtype ({q_dtype}) or an fp8 dtype", kv_dtype)
    if kv_layout not in KV_LAYOUTS:
        fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    if num_splits is not None:
        check_int("num_splits", num_splits, 1, MAX_SPLITS)


def _check_plan_caches(plan, query, key_cache, value_cache) -> int:
    """The caches of a plan's run: the plan's dtype, layout, page size, kv heads and
    head_dim, and every tensor on the plan's device; returns ``num_kv_heads``."""
    words = f"{plan.kv_dtype} (the plan's kv_dtype)"
    check_tensor("key_cache", key_cache, 4, (plan.kv_dtype,), words)
    check_tensor("value_cache", value_cache, 4, (plan.kv_dtype,), words)
    check_cache_pair(key_cache, value_cache)
    _, page_size, num_kv_heads, head_dim = cache_dims(key_cache, plan.kv_layout)
    if (page_size, num_kv_heads, head_dim) != (plan.page_size, plan.num_kv_heads,
                                               plan.head_dim):
        fail(ValueError, "key_cache", f"page_size, num_kv_heads, head_dim = "
             f"{(plan.page_size, plan.num_kv_heads, plan.head_dim)} in layout "
             f"{plan.kv_layout}", tuple(key_cache.shape))
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.device != plan.device:
            fail(ValueError, name, f"a tensor on the plan's device {plan.device}", t.device)
    return num_kv_heads


def check_run(plan, query, key_cache, value_cache, *, scale, k_scale, v_scale, out,
              return_lse, validate) -> None:
    """:meth:`DecodePlan.run`'s checks: the tensors match the plan (metadata only)."""
    q_shape = tuple(plan.q_shape)
    check_tensor("query", query, len(q_shape), (plan.q_dtype,),
                 f"{plan.q_dtype} (the plan's q_dtype)")
    if tuple(query.shape) != q_shape:
        fail(ValueError, "query", f"shape {q_shape} (the plan's batch, "
             f"{'q_len, ' if len(q_shape) == 4 else ''}num_q_heads, head_dim)",
             tuple(query.shape))
    num_kv_heads = _check_plan_caches(plan, query, key_cache, value_cache)
    check_softmax_scale(scale)
    if out is not None:
        check_out(out, query, key_cache, value_cache)
    _check_run_options(k_scale, v_scale, num_kv_heads, query.device, return_lse, validate,
                       scale=scale)


def check_append_kv_args(key, value, key_cache, value_cache, slot_mapping, *, kv_layout,
                         k_scale, v_scale) -> None:
    """Metadata checks of :func:`pagedattn.launch.append_kv.append_kv` (no data read).
    Raises TypeError/ValueError naming the argument."""
    floats = "float32, float16 or bfloat16"
    caches = floats + ", float8_e4m3fn or float8_e5m2"
    table = (
        ("key", key, 3, FLOAT_DTYPES, floats),
        ("value", value, 3, FLOAT_DTYPES, floats),
        ("key_cache", key_cache, 4, FLOAT_DTYPES + FP8_DTYPES, caches),
        ("value_cache", value_cache, 4, FLOAT_DTYPES + FP8_DTYPES, caches),
        ("slot_mapping", slot_mapping, 1, INDEX_DTYPES, "int32 or int64"),
    )
    for name, t, rank, dtypes, words in table:
        check_tensor(name, t, rank, dtypes, words)
    if kv_layout not in KV_LAYOUTS:
        fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    if value.shape != key.shape:
        fail(ValueError, "value", f"the shape of key {tuple(key.shape)}", tuple(value.shape))
    check_cache_pair(key_cache, value_cache)
    check_same_device("key", key.device, (
        ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
        ("slot_mapping", slot_mapping)))
    num_tokens, num_kv_heads, head_dim = key.shape
    _, page_size, cache_heads, cache_dim = cache_dims(key_cache, kv_layout)
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        fail(ValueError, "key_cache",
             f"{kv_layout} dims (num_kv_heads={num_kv_heads}, head_dim={head_dim}) as in key",
             f"(num_kv_heads={cache_heads}, head_dim={cache_dim})")
    if page_size < 1:
        fail(ValueError, "page_size", "at least 1 (key_cache dim)", page_size)
    if slot_mapping.shape[0] != num_tokens:
        fail(ValueError, "slot_mapping", f"{num_tokens} entries (key's num_tokens)",
             slot_mapping.shape[0])
    fp8 = key_cache.dtype in FP8_DTYPES
    if not fp8 and key.dtype != key_cache.dtype:
        fail(TypeError, "key", f"the cache dtype {key_cache.dtype} (or an fp8 cache)", key.dtype)
    if value.dtype != key.dtype:
        fail(TypeError, "value", f"the key's dtype {key.dtype}", value.dtype)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and not fp8:
            fail(ValueError, name, f"None for a {key_cache.dtype} cache (scales are for fp8)",
                 "a scale")
        check_scale_arg(name, s, num_kv_heads, key.device)
    check_device_runnable("key", key)


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Slots must be < ``num_pages * page_size`` (negative = skip). Reads the data."""
    if slot_mapping.numel() == 0:
        return
    bad = slot_mapping.long() >= num_slots
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail(ValueError, "slot_mapping",
             f"slots < num_pages * page_size = {num_slots} or negative (entry {i})",
             int(slot_mapping[i]))


def check_schedule(schedule: Any, *, impl: str = "auto") -> None:
    """``schedule``: ``None`` or ``"split"`` (the same: the split schedule, the production
    kernel's only one). ``"persistent"`` is refused by name with the reason it was removed
    (:data:`PERSISTENT_REMOVED`). Only ``impl="auto"`` has schedules."""
    if schedule is None:
        return
    if not isinstance(schedule, str):
        fail(TypeError, "schedule", "None or 'split'", type_name(schedule))
    if schedule == "persistent":
        raise ValueError(PERSISTENT_REMOVED)
    if schedule not in SCHEDULES:
        fail(ValueError, "schedule", "None or 'split'", repr(schedule))
    if impl != "auto":
        fail(ValueError, "schedule", f"None for impl={impl!r} (only impl='auto' has "
             "schedules)", repr(schedule))


def check_num_programs_removed(num_programs: Any) -> None:
    """``num_programs`` of ``plan_decode`` / ``paged_decode`` (and the decode ops): ``None``.
    It was the persistent schedule's program count; the keyword is kept for one release so a
    caller that still passes it is told why, by name, before any launch."""
    if num_programs is not None:
        fail(ValueError, "num_programs", "None (it set the program count of the persistent "
             "schedule, which was removed: docs/perf-notes.md step 48)", repr(num_programs))


def check_host_context_lens(lens: Any, batch: int) -> list[int]:
    """``plan_decode``'s optional host copy of the lengths: a sequence of ``batch`` ints or a
    CPU integer tensor of shape ``[batch]``. Returns them as a list of ints."""
    if isinstance(lens, torch.Tensor):
        if lens.device.type != "cpu" or lens.dim() != 1 or lens.layout != torch.strided \
                or lens.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32,
                                      torch.int64):
            fail(ValueError, "host_context_lens", "a 1-D integer CPU tensor (a host copy)",
                 f"{lens.dtype} {tuple(lens.shape)} on {lens.device}")
        values = lens.tolist()
    else:
        try:
            values = list(lens)
        except TypeError:
            fail(TypeError, "host_context_lens", "a sequence of ints or a CPU tensor",
                 type(lens).__name__)
        bad = next((n for n in values if isinstance(n, bool)
                    or not isinstance(n, numbers.Integral)), None)
        if bad is not None:  # a float length would be truncated silently
            fail(TypeError, "host_context_lens", "a sequence of ints or a CPU tensor",
                 f"an entry {bad!r}")
        values = [int(n) for n in values]
    if len(values) != batch:
        fail(ValueError, "host_context_lens", f"{batch} entries (the batch)", len(values))
    return values


def check_merge_states(outs: Any, lses: Any) -> None:
    """:func:`pagedattn.merge_states`' checks: ``outs [S, ..., H, D]`` and ``lses [S, ..., H]``
    float tensors on one device, ``S >= 1``."""
    for name, t, dtypes, words in (
            ("outs", outs, FLOAT_DTYPES, "float32, float16 or bfloat16"),
            ("lses", lses, (*FLOAT_DTYPES, torch.float64), "float32, float16, bfloat16 or "
             "float64")):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.dtype not in dtypes:  # fp8 outs lost their scale
            fail(TypeError, name, words, t.dtype)
    if outs.dim() < 3:
        fail(ValueError, "outs", "a tensor [S, ..., num_heads, head_dim] of rank >= 3",
             f"shape {tuple(outs.shape)}")
    if lses.shape != outs.shape[:-1]:
        fail(ValueError, "lses", f"shape {tuple(outs.shape[:-1])} (outs without head_dim)",
             f"shape {tuple(lses.shape)}")
    if outs.shape[0] < 1:
        fail(ValueError, "outs", "at least one state (S >= 1 along dim 0)", outs.shape[0])
    check_same_device("outs", outs.device, (("lses", lses),))


# --- varlen queries (pagedattn.attention: paged prefill) ---------------------------------


def check_query_start_loc(query_start_loc: Any, block_tables: torch.Tensor) -> None:
    """``query_start_loc``: an int32 ``[batch + 1]`` tensor on ``block_tables``' device."""
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,), "int32")
    batch = block_tables.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        fail(ValueError, "query_start_loc", f"{batch + 1} entries (batch + 1)",
             query_start_loc.shape[0])
    if query_start_loc.device != block_tables.device:
        fail(ValueError, "query_start_loc", f"a tensor on block_tables' device "
             f"{block_tables.device}", query_start_loc.device)
    if query_start_loc.stride(0) != 1 and query_start_loc.shape[0] > 1:
        fail(ValueError, "query_start_loc", "a contiguous tensor (the kernels read it so)",
             f"stride {query_start_loc.stride(0)}")


def check_attention_call(query, key_cache, value_cache, block_tables, seq_lens,
                         query_start_loc, *, kv_layout) -> None:
    """:func:`pagedattn.paged_attention`'s own checks before it plans: the tensors' types,
    ranks and dtypes, the layout and the heads (the plan and its run check the rest)."""
    if kv_layout not in KV_LAYOUTS:
        fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    check_tensor("query", query, 3, FLOAT_DTYPES, "float32, float16 or bfloat16")
    words = "float32, float16, bfloat16, float8_e4m3fn or float8_e5m2"
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES + FP8_DTYPES, words)
    check_tensor("value_cache", value_cache, 4, FLOAT_DTYPES + FP8_DTYPES, words)
    check_cache_pair(key_cache, value_cache)
    if key_cache.dtype in FLOAT_DTYPES and key_cache.dtype != query.dtype:
        fail(TypeError, "key_cache", f"the query's dtype {query.dtype} (or an fp8 dtype)",
             key_cache.dtype)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, "int32 or int64")
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, "int32 or int64")
    _, _, num_kv_heads, head_dim = cache_dims(key_cache, kv_layout)
    if num_kv_heads < 1 or query.shape[1] % num_kv_heads:
        fail(ValueError, "query", f"num_q_heads a multiple of num_kv_heads={num_kv_heads} "
             f"(key_cache's dim {1 if kv_layout == 'HND' else 2} in layout {kv_layout})",
             query.shape[1])
    if query.shape[2] != head_dim:
        fail(ValueError, "key_cache", f"head_dim {query.shape[2]} (the query's) in the last "
             "dim", head_dim)


def check_attention_run(plan, query, key_cache, value_cache, *, scale, k_scale, v_scale, out,
                        return_lse, validate) -> None:
    """:meth:`pagedattn.attention.AttentionPlan.run`'s checks: the tensors match the plan
    (metadata only; any number of query rows)."""
    check_tensor("query", query, 3, (plan.q_dtype,), f"{plan.q_dtype} (the plan's q_dtype)")
    if tuple(query.shape[1:]) != (plan.num_q_heads, plan.head_dim):
        fail(ValueError, "query", f"shape [num_tokens, {plan.num_q_heads}, {plan.head_dim}] "
             "(the plan's num_q_heads, head_dim)", tuple(query.shape))
    num_kv_heads = _check_plan_caches(plan, query, key_cache, value_cache)
    check_device_runnable("query", query)
    check_softmax_scale(scale)
    if out is not None:
        check_out(out, query, key_cache, value_cache)
    _check_run_options(k_scale, v_scale, num_kv_heads, query.device, return_lse, validate,
                       scale=scale)
    if validate and query.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        fail(ValueError, "validate", "None or False under CUDA-graph capture (True needs a "
             "device-to-host sync)", True)


def check_attention_values(plan, num_tokens: int, num_pages: int) -> None:
    """The plan's metadata values against ``num_tokens`` query rows and a cache of
    ``num_pages`` pages (reads the data: a host sync on CUDA): ``query_start_loc`` from 0,
    non-decreasing, at most ``num_tokens``; each sequence's new tokens at most its
    ``seq_lens`` (and ``max_query_len``); lengths and the used page ids as
    :func:`check_values` checks them (the window counted from each sequence's first new
    token)."""
    qsl = plan.query_start_loc.long().cpu()
    if int(qsl[0]) != 0:
        fail(ValueError, "query_start_loc", "0 in entry 0", int(qsl[0]))
    q_lens = qsl[1:] - qsl[:-1]
    if bool((q_lens < 0).any()):
        b = int((q_lens < 0).nonzero()[0, 0])
        fail(ValueError, "query_start_loc", f"non-decreasing entries (entries {b} and "
             f"{b + 1})", (int(qsl[b]), int(qsl[b + 1])))
    if int(qsl[-1]) > num_tokens:
        fail(ValueError, "query_start_loc", f"a last entry of at most the query's "
             f"{num_tokens} rows", int(qsl[-1]))
    lens = plan.seq_lens.long().cpu()
    if bool((q_lens > lens).any()):
        b = int((q_lens > lens).nonzero()[0, 0])
        fail(ValueError, "seq_lens", f"at least each sequence's new tokens (sequence {b} has "
             f"{int(q_lens[b])})", int(lens[b]))
    nd = plan.num_decodes
    if nd and bool((q_lens[:nd] != 1).any()):
        b = int((q_lens[:nd] != 1).nonzero()[0, 0])
        fail(ValueError, "num_decodes", f"the first {nd} sequences bringing one new token "
             f"each (sequence {b} brings {int(q_lens[b])})", nd)
    if plan.max_query_len is not None and bool((q_lens > plan.max_query_len).any()):
        fail(ValueError, "max_query_len", "at least every sequence's new tokens",
             f"{plan.max_query_len} (a sequence has {int(q_lens.max())})")
    check_values(plan.block_tables, plan.seq_lens, num_pages, plan.page_size,
                 window_left=min(int(plan.options.window_left), MAX_CONTEXT_LEN),
                 q_len=q_lens.to(plan.seq_lens.device))
