"""README.md's Python examples run as a CPU user runs them: the README tells them to write
``device="cpu"`` for every ``device="cuda"`` and set ``TRITON_INTERPRET=1`` (the suite runs
with it). The usage block and the variants block run in one namespace, as written otherwise,
and the last output (the cascade's merge) is checked against the float64 oracle."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagedattn.reference import paged_decode_reference
from pagedattn.testing import rel_l2_error

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    """The Usage and variants blocks (the compat section's blocks run in their own tests)."""
    text = README.read_text(encoding="utf-8").split("\n## Use it from code written for")[0]
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_readme_has_the_usage_and_variant_examples():
    blocks = python_blocks()
    assert len(blocks) == 2
    assert "pagedattn.paged_decode(" in blocks[0] and "merge_states" in blocks[1]
    assert 'device="cuda"' in blocks[0]  # the substitution below has something to do


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU user's path")
def test_readme_examples_run_on_the_cpu():
    code = "\n".join(python_blocks()).replace('device="cuda"', 'device="cpu"')
    assert "cuda" not in code
    ns: dict = {}
    torch.manual_seed(0)
    # the README's own examples, as a user pastes them
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102
    q, kc, vc, bt, cl = (ns[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                          "context_lens"))
    # the last `out, lse` are the cascade's merge: attention over every key (the README's
    # claim), against the oracle on the caches as the examples left them (after append_kv)
    merged, lse = ns["out"], ns["lse"]
    assert merged.shape == q.shape and lse.shape == q.shape[:-1]
    ref = paged_decode_reference(q, kc, vc, bt, cl)  # (out, lse), float64
    assert rel_l2_error(merged, ref.out) <= 1e-2
    finite = torch.isfinite(ref.lse)
    assert torch.allclose(lse[finite].double(), ref.lse[finite], atol=1e-3)
