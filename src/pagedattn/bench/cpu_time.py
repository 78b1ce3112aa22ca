"""How long our impls take in Triton's interpreter on the CPU, said before a job starts.

The interpreter runs every program of a grid one after the other in Python, each ``tl`` op a
numpy call, so a call's time grows with the work its programs loop over: about
``PER_HEAD_TOKEN[impl]`` seconds per (query head x KV token) plus ``PER_HEAD_SEQ[impl]`` per
(query head x sequence), the programs' fixed cost. The constants were fitted to the process
CPU times of one ``paged_decode`` call per impl on ``pagedattn run``'s CPU batch (Llama-3-8B
heads, 6 sequences, lengths scaled to 32 and to 64 tokens: 56 and 109 KV tokens) on the
2-core CI machine, session 13 (the whole default run: about 70 s of CPU time): an estimate,
and a busy machine is slower. :func:`say_estimate` is the line ``run`` and
``bench --dry-run`` print before their first kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedattn._cli_types import say_duration
from pagedattn.bench.shapes import BenchShape

#: seconds per (query head x KV token), per impl
PER_HEAD_TOKEN = {"baseline": 0.0096, "fused_v1": 0.0067, "vectorized_v2": 0.0075,
                  "gqa_reuse_v3": 0.00053, "split_kv_v4": 0.0055, "auto": 0.00016}
#: seconds per (query head x sequence), per impl
PER_HEAD_SEQ = {"baseline": 0.028, "fused_v1": 0.012, "vectorized_v2": 0.0,
                "gqa_reuse_v3": 0.0013, "split_kv_v4": 0.026, "auto": 0.0040}


def interpreter_seconds(shape: BenchShape, impls: Iterable[str]) -> float:
    """About how many seconds one call of each of ``impls`` (our impl names; a peer counts 0)
    takes on ``shape`` in the interpreter, summed, with the float64 oracle's check."""
    heads, seqs = shape.model.num_q_heads, len(shape.context_lens)
    return sum(PER_HEAD_TOKEN.get(i, 0.0) * heads * shape.num_tokens
               + PER_HEAD_SEQ.get(i, 0.0) * heads * seqs for i in impls)


def say_estimate(command: str, seconds: float, what: str) -> str:
    """The line a CPU job prints before it starts: how long, and why it is slow."""
    return (f"{command}: expect {say_duration(seconds)} in Triton's interpreter ({what}; "
            "estimated for an idle core, a busy machine is slower).")
