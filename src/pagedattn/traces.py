"""The two packaged request traces and the recipe that draws a decode batch from them.

Files live in ``pagedattn/data`` (attribution and licenses in ``data/TRACES.md``):

* ``azure``: Azure LLM inference trace 2023, conversation service (CC BY 4.0), 19,366 rows;
  columns ``ContextTokens``, ``GeneratedTokens`` (CRLF line endings).
* ``mooncake``: Mooncake (Kimi) FAST'25 conversation trace (Apache-2.0), 12,031 rows;
  columns ``input_length``, ``output_length``.

A request with ``context`` prompt tokens and ``generated`` output tokens has, at decode step
``i`` (``0 <= i < generated``), a KV length of ``context + i``. A leaf module (torch and the
standard library only): the benchmark shapes and the serving benchmark both draw from it.
"""

from __future__ import annotations

import csv
import functools
import io
from importlib import resources
from typing import NamedTuple

import torch


class TraceSpec(NamedTuple):
    file: str  # file name inside the ``pagedattn.data`` folder
    context_column: str  # prompt/context tokens per request
    generated_column: str  # generated (output) tokens per request


TRACES: dict[str, TraceSpec] = {
    "azure": TraceSpec("azure_llm_2023_conv.csv", "ContextTokens", "GeneratedTokens"),
    "mooncake": TraceSpec("mooncake_fast25_conversation.csv", "input_length", "output_length"),
}


@functools.cache
def load_trace(trace: str) -> tuple[tuple[int, int], ...]:
    """All rows of a packaged trace as ``(context_tokens, generated_tokens)`` pairs, in file
    order. Read once through ``importlib.resources`` and cached.

    Raises:
        ValueError: an unknown trace name.
    """
    if trace not in TRACES:
        raise ValueError(f"trace: expected one of {', '.join(map(repr, TRACES))}, got {trace!r}")
    spec = TRACES[trace]
    text = (resources.files("pagedattn") / "data" / spec.file).read_text(encoding="utf-8")
    reader = csv.DictReader(io.StringIO(text, newline=""))  # handles CRLF and a last row sans \n
    return tuple((int(r[spec.context_column]), int(r[spec.generated_column])) for r in reader)


def sample_context_lens(
    trace: str, batch: int, seed: int = 0, *, generator: torch.Generator | None = None
) -> list[int]:
    """KV lengths (tokens) of ``batch`` requests drawn from a trace, by ``API.md``'s recipe.

    ``g = torch.Generator().manual_seed(seed)``; row indices are
    ``torch.randint(0, num_rows, (batch,), generator=g)`` (with replacement); then, in row
    order, each context is ``context_tokens + int(torch.randint(0, max(generated_tokens, 1),
    (1,), generator=g))``: a uniform decode step of the request.

    Args:
        trace: ``"azure"`` or ``"mooncake"``.
        batch: number of requests.
        seed: the generator's seed (ignored when ``generator`` is given).
        generator: continue drawing from this CPU generator instead of a fresh one.

    Returns:
        ``batch`` ints. Seed 0: azure b64 totals 81,465 tokens (max 6,791); mooncake b16
        totals 180,464 (max 35,355). (the peers comparison table quotes 190,524 / 62,572 for
        mooncake b16: that is a draw continued after azure b64 on one generator, but its
        measured GB/s match the 180,464-token batch of this recipe.)
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch: expected an int >= 0, got {batch!r}")
    if generator is None and not 0 <= seed < 1 << 64:
        raise ValueError(f"seed: expected an int in [0, 2^64), got {seed!r}")
    rows = load_trace(trace)
    g = torch.Generator().manual_seed(seed) if generator is None else generator
    picks = torch.randint(0, len(rows), (batch,), generator=g).tolist()
    lens = []
    for i in picks:
        context, generated = rows[i]
        lens.append(context + int(torch.randint(0, max(generated, 1), (1,), generator=g)))
    return lens
