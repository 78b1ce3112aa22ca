"""Input factories and the tolerance contract, shared by the tests and the benchmark harness.

``make_paged_inputs`` builds a decode batch the way a serving engine leaves it: pages allocated
in shuffled order, block-table padding holding -1 and out-of-range garbage ids, and every cache
slot that no sequence uses (whole unused pages and the tails of last pages) poisoned with NaN,
so a kernel that reads past a length fails loudly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pagedattn.reference import paged_decode_reference

#: relative L2 error bound against the float64 oracle, keyed by the cache dtype (API.md).
TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}
FP8_TOLERANCE = 3e-2


def tolerance_for(cache_dtype: torch.dtype) -> float:
    return TOLERANCES.get(cache_dtype, FP8_TOLERANCE)


class PagedInputs(NamedTuple):
    query: torch.Tensor  # [batch, num_q_heads, head_dim]
    key_cache: torch.Tensor  # NHD [num_pages, page_size, num_kv_heads, head_dim] (or HND)
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_pages] int32
    context_lens: torch.Tensor  # [batch] int32


def make_paged_inputs(
    context_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    dtype: torch.dtype = torch.float16,
    cache_dtype: torch.dtype | None = None,
    kv_layout: str = "NHD",
    max_pages: int | None = None,
    extra_pages: int = 2,
    poison: bool = True,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> PagedInputs:
    """A random paged decode batch.

    Pages are a random permutation of ``[0, num_pages)``; ``extra_pages`` unused pages exist
    beyond those the sequences need. With ``poison``: unused pages and slots past each length
    hold NaN, and block-table entries past ``ceil(len / page_size)`` hold -1 or ids
    ``>= num_pages``. For fp8 ``cache_dtype`` the values are drawn so that the fp8 grid is
    well used (the caller passes scales to the kernel and the oracle).
    """
    g = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    need = [math.ceil(n / page_size) for n in context_lens]
    max_pages = max([*need, 1]) if max_pages is None else max_pages
    num_pages = sum(need) + extra_pages
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g, dtype=torch.float32)
    v = torch.randn(shape, generator=g, dtype=torch.float32)
    perm = torch.randperm(num_pages, generator=g)
    tables = torch.full((batch, max_pages), -1, dtype=torch.int32)
    used_slot = torch.zeros(num_pages, page_size, dtype=torch.bool)
    nxt = 0
    for b, (n, p) in enumerate(zip(context_lens, need, strict=True)):
        ids = perm[nxt:nxt + p]
        nxt += p
        tables[b, :p] = ids.to(torch.int32)
        if poison and max_pages > p:  # garbage past the used pages: -1 and out-of-range ids
            pad = torch.randint(num_pages, 2 * num_pages + 7, (max_pages - p,), generator=g)
            pad[::2] = -1
            tables[b, p:] = pad.to(torch.int32)
        for j, pid in enumerate(ids.tolist()):
            used_slot[pid, : min(page_size, n - j * page_size)] = True
    if poison:
        k[~used_slot] = float("nan")
        v[~used_slot] = float("nan")
    query = torch.randn(batch, num_q_heads, head_dim, generator=g, dtype=torch.float32)
    if kv_layout == "HND":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    return PagedInputs(
        query.to(dtype).to(device),
        k.to(cache_dtype).to(device),
        v.to(cache_dtype).to(device),
        tables.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def rel_l2_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (``‖out‖`` when the reference is all zero);
    ``inf`` when ``out`` holds any NaN or Inf."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    if not torch.isfinite(out64).all():
        return math.inf
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def check_against_reference(out: torch.Tensor, inputs: PagedInputs, **kwargs) -> float:
    """Relative L2 error of ``out`` against the oracle on ``inputs`` (kwargs go to the oracle)."""
    ref = paged_decode_reference(*inputs, **kwargs).out
    return rel_l2_error(out, ref)


class MLAInputs(NamedTuple):
    """An absorbed-MLA decode batch (``pagedattn.mla_decode``'s positional tensors)."""

    q_nope: torch.Tensor  # [batch, (q_len,) num_q_heads, latent_dim]
    q_pe: torch.Tensor  # [batch, (q_len,) num_q_heads, rope_dim]
    ckv_cache: torch.Tensor  # [num_pages, page_size, latent_dim]
    kpe_cache: torch.Tensor  # [num_pages, page_size, rope_dim]
    block_tables: torch.Tensor  # [batch, max_pages] int32
    context_lens: torch.Tensor  # [batch] int32


def make_mla_inputs(context_lens: list[int], *, num_q_heads: int = 16, latent_dim: int = 512,
                    rope_dim: int = 64, page_size: int = 64, q_len: int = 1,
                    dtype: torch.dtype = torch.bfloat16, cache_dtype: torch.dtype | None = None,
                    combined: bool = False, max_pages: int | None = None,
                    extra_pages: int = 2, poison: bool = True, seed: int = 0,
                    device: str | torch.device = "cpu") -> MLAInputs:
    """A random absorbed-MLA decode batch, made as :func:`make_paged_inputs` makes one: pages
    in shuffled order, with ``poison`` NaN in every cache slot no sequence uses and -1 or
    out-of-range ids in the block tables' padding. ``combined``: the latent and rope caches
    are views of one ``[num_pages, page_size, latent_dim + rope_dim]`` buffer, and ``q_nope``
    / ``q_pe`` of one query buffer (as FlashMLA and SGLang lay them out). An fp8
    ``cache_dtype`` stores the values as drawn (the caller's ``kv_scale`` dequantizes)."""
    one = make_paged_inputs(context_lens, num_q_heads=1, num_kv_heads=1,
                            head_dim=latent_dim + rope_dim, page_size=page_size,
                            dtype=torch.float32, max_pages=max_pages, extra_pages=extra_pages,
                            poison=poison, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    lead = (len(context_lens), num_q_heads) if q_len == 1 else \
        (len(context_lens), q_len, num_q_heads)
    q = torch.randn(*lead, latent_dim + rope_dim, generator=g).to(dtype).to(device)
    cache = one.key_cache[:, :, 0].to(cache_dtype or dtype).to(device)
    if not combined:
        q = q.clone()
        return MLAInputs(q[..., :latent_dim].contiguous(), q[..., latent_dim:].contiguous(),
                         cache[..., :latent_dim].contiguous(),
                         cache[..., latent_dim:].contiguous(), one.block_tables.to(device),
                         one.context_lens.to(device))
    return MLAInputs(q[..., :latent_dim], q[..., latent_dim:], cache[..., :latent_dim],
                     cache[..., latent_dim:], one.block_tables.to(device),
                     one.context_lens.to(device))
