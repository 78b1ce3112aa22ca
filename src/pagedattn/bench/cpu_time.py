"""How long our impls take in Triton's interpreter on the CPU, and how much memory a run's
batch takes, said (and refused past the limits, ``pagedattn run``) before a job starts.

The interpreter runs every program of a grid one after the other in Python, each ``tl`` op a
numpy call, so a call's time grows with the work its programs loop over: about
``PER_HEAD_TOKEN[impl]`` seconds per (query head x KV token) plus ``PER_HEAD_SEQ[impl]`` per
(query head x sequence), the programs' fixed cost. The constants were fitted to the process
CPU times of one ``paged_decode`` call per impl on ``pagedattn run``'s CPU batch (Llama-3-8B
heads, 6 sequences, lengths scaled to 32 and to 64 tokens: 56 and 109 KV tokens) on the
2-core CI machine (the whole default run: about 70 s of CPU time): an estimate,
and a busy machine is slower. :func:`say_estimate` is the line ``run`` and
``bench --dry-run`` print before their first kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedattn._cli_types import say_duration
from pagedattn.bench.shapes import BenchShape, ModelShape

#: seconds per (query head x KV token), per impl
PER_HEAD_TOKEN = {"baseline": 0.0096, "fused_v1": 0.0067, "vectorized_v2": 0.0075,
                  "gqa_reuse_v3": 0.00053, "split_kv_v4": 0.0055, "auto": 0.00016}
#: seconds per (query head x sequence), per impl
PER_HEAD_SEQ = {"baseline": 0.028, "fused_v1": 0.012, "vectorized_v2": 0.0,
                "gqa_reuse_v3": 0.0013, "split_kv_v4": 0.026, "auto": 0.0040}


#: host bytes per element of one cache's allocated pages (``pages · page_size · num_kv_heads
#: · head_dim``) that a run's batch takes at its peak (the float32 draw of K and V, their
#: copies in the cache dtype, the float64 oracle): 12.2-13.5 measured (``build_batch`` and
#: ``paged_decode_reference`` of llama-3-8b batches of 51 k-160 k tokens, peak RSS), rounded up
HOST_BYTES_PER_ELEMENT = 14


def seconds_for(heads: int, tokens: int, seqs: int, impls: Iterable[str]) -> float:
    """About how many seconds one call of each of ``impls`` (our impl names; a peer counts 0)
    takes in the interpreter on ``seqs`` sequences of ``tokens`` KV tokens in all, with
    ``heads`` query heads, summed, with the float64 oracle's check."""
    return sum(PER_HEAD_TOKEN.get(i, 0.0) * heads * tokens + PER_HEAD_SEQ.get(i, 0.0) * heads
               * seqs for i in impls)


def interpreter_seconds(shape: BenchShape, impls: Iterable[str]) -> float:
    """:func:`seconds_for` of ``shape``'s batch."""
    return seconds_for(shape.model.num_q_heads, shape.num_tokens, len(shape.context_lens),
                       impls)


def batch_bytes(model: ModelShape, dtype: torch.dtype, pages: int, page_size: int) -> \
        tuple[int, int]:
    """About the memory a run's batch of ``pages`` pages of ``dtype`` takes at its peak:
    ``(host bytes, device bytes)``. The batch is drawn on the host
    (:data:`HOST_BYTES_PER_ELEMENT`); a GPU holds the K and V caches and a copy of each."""
    elements = pages * page_size * model.num_kv_heads * model.head_dim
    return HOST_BYTES_PER_ELEMENT * elements, 4 * elements * dtype.itemsize


def say_estimate(command: str, seconds: float, what: str) -> str:
    """The line a CPU job prints before it starts: how long, and why it is slow."""
    return (f"{command}: expect {say_duration(seconds)} in Triton's interpreter ({what}; "
            "estimated for an idle core, a busy machine is slower).")
