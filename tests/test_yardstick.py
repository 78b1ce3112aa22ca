"""The yardstick of the harness, on the CPU (issue 46, item 1): the minimal-bytes formula.
Nothing is timed."""

from __future__ import annotations

import math

import pytest
import torch

from pagedattn.bench import harness
from pagedattn.bench.shapes import FP8_E4M3, get_shape, minimal_bytes
from pagedattn.testing import make_paged_inputs

# --- minimal bytes: one formula, checked against the bytes of real tensors ------------------


def _bytes_of_tensors(lens, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
                      cache_dtype, q_len, table_dtype) -> int:
    """Independent count: build the batch and add up what a decode call must read of it,
    sequence by sequence: every valid token's K and V slots, the used block-table entries,
    the whole query."""
    inputs = make_paged_inputs(lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, page_size=page_size, dtype=dtype,
                               poison=False)
    k = inputs.key_cache.to(cache_dtype)
    table = inputs.block_tables.to(table_dtype)
    query = torch.empty(len(lens), q_len, num_q_heads, head_dim, dtype=dtype)
    total = query.numel() * query.element_size()
    for b, n in enumerate(lens):
        for t in range(n):  # token t of sequence b: its page, its slot
            page = int(table[b, t // page_size])
            total += 2 * k[page, t % page_size].numel() * k.element_size()  # K and V
        used = table[b, :math.ceil(n / page_size)]
        total += used.numel() * used.element_size()
    return total


CASES = {  # name: (lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, cache,
    #          q_len, table dtype)
    "gqa-bf16": ([1, 17, 40], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, 1, torch.int32),
    "fp8-cache": ([5, 33], 8, 2, 64, 16, torch.bfloat16, FP8_E4M3, 1, torch.int32),
    "int64-table": ([16, 0, 3], 9, 3, 64, 16, torch.float16, torch.float16, 1, torch.int64),
    "q_len-4": ([9, 30], 12, 4, 80, 8, torch.float32, torch.float32, 4, torch.int32),
    "page-1-fp8-int64-q3": ([3, 1], 4, 1, 32, 1, torch.bfloat16, FP8_E4M3, 3, torch.int64),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_minimal_bytes_are_exact(case):
    lens, qh, kvh, hd, ps, dtype, cache, q_len, table = CASES[case]
    got = minimal_bytes(lens, num_q_heads=qh, num_kv_heads=kvh, head_dim=hd, page_size=ps,
                        q_dtype=dtype, cache_dtype=cache, q_len=q_len, table_dtype=table)
    want = _bytes_of_tensors(lens, num_q_heads=qh, num_kv_heads=kvh, head_dim=hd,
                             page_size=ps, dtype=dtype, cache_dtype=cache, q_len=q_len,
                             table_dtype=table)
    assert got.total == want
    assert got.kv == 2 * sum(lens) * kvh * hd * (1 if cache == FP8_E4M3 else
                                                 torch.empty((), dtype=cache).element_size())


def test_every_byte_count_of_the_bench_is_the_one_formula():
    """The registry's rows, the harness's ``minimal_bytes`` column and the GB/s divide by
    the same number; an fp8 row by hand: 1-byte K/V, int32 table, bf16 query."""
    s = get_shape("fp8-llama8b-b64-c8k")
    assert s.minimal_bytes == 64 * 8192 * 8 * 128 * 2 + 64 * 512 * 4 + 64 * 32 * 128 * 2
    assert s.byte_counts.total == s.minimal_bytes and s.kv_bytes == s.byte_counts.kv
    ragged = get_shape("ragged-b64-llama8b")
    m = ragged.model
    assert ragged.minimal_bytes == minimal_bytes(
        ragged.context_lens, num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, page_size=16, q_dtype=torch.bfloat16,
        cache_dtype=torch.bfloat16).total
    assert harness.base_row(ragged, "auto", "ours")["minimal_bytes"] == ragged.minimal_bytes
    with pytest.raises(ValueError, match="context_lens"):
        minimal_bytes([3, -1], num_q_heads=1, num_kv_heads=1, head_dim=16, page_size=16,
                      q_dtype=torch.float16, cache_dtype=torch.float16)
