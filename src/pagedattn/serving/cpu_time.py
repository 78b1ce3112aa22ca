"""How long serving runs take in Triton's interpreter on the CPU, said before they start
(``pagedattn generate``, ``pagedattn bench-model``): every decode step of the engine costs
:data:`STEP_S` at its bucket, scaled by the model's layers x query heads."""

from __future__ import annotations

#: CPU seconds of one eager decode step of SmolLM2-135M (30 layers, 9/3 heads, head_dim 64,
#: bf16 cache) in Triton's interpreter at a bucket of ``b`` sequences: ``STEP_S[0] +
#: STEP_S[1] * b``, twice that with an fp8 cache (:data:`FP8_STEP_FACTOR`); fitted to the
#: docs/usage.md's smoke run (177 s of CPU time, 16 steps, the 2-core CI machine): an
#: estimate, and a busy machine takes longer (``generate``'s fp32 steps of ``gqa_reuse_v3``
#: took 2.5 s at b 1 and 9.3 s at b 4 on that machine, busy)
STEP_S = (0.6, 2.7)
FP8_STEP_FACTOR = 2.0
#: the model :data:`STEP_S` was fitted to: layers x query heads (the interpreter's work per
#: step grows with both)
SMOLLM2_LAYER_HEADS = 30 * 9


def engine_steps(requests: list[int], max_batch: int, *, warm: bool = True) -> list[int]:
    """The bucket of every decode step the engine takes for requests making ``requests[i]``
    tokens each, at most ``max_batch`` running (the first token of each comes from its
    prefill): with ``warm``, the warm-up's buckets and its 2-token run first (bench-model's),
    then the run itself, with requests admitted in order as slots free up."""
    from pagedattn.serving.runner import BUCKETS, bucket_for

    top = bucket_for(min(max_batch, BUCKETS[-1]))
    steps = [b for b in BUCKETS if b <= top] if warm else []
    for tokens in ([2] * len(requests) if warm else [], list(requests)):
        left = [n - 1 for n in tokens if n > 1]  # decode steps each still needs, in order
        while left:
            running, rest = left[:max_batch], left[max_batch:]
            k = min(running)  # steps until the first of them finishes
            steps += [bucket_for(len(running))] * k
            left = [n - k for n in running if n > k] + rest
    return steps


def decode_seconds(steps: list[int], *, fp8: bool = False, layer_heads: int =
                   SMOLLM2_LAYER_HEADS) -> float:
    """About how long the decode ``steps`` (their buckets, :func:`engine_steps`) take in the
    interpreter, for a model of ``layer_heads`` layers x query heads."""
    scale = (FP8_STEP_FACTOR if fp8 else 1.0) * layer_heads / SMOLLM2_LAYER_HEADS
    return scale * sum(STEP_S[0] + STEP_S[1] * b for b in steps)
