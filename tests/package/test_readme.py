"""README.md's Python examples, and docs/compat.md's drop-in snippets, run as a CPU user runs
them: the README tells them to write ``device="cpu"`` for every ``device="cuda"`` and set
``TRITON_INTERPRET=1`` (the suite runs with it). The usage block and the variants block run in
one namespace, as written otherwise, and the last output (the cascade's merge) is checked
against the float64 oracle."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from pagedattn.reference import paged_attention_reference, paged_decode_reference
from pagedattn.testing import rel_l2_error

README = Path(__file__).resolve().parents[2] / "README.md"
COMPAT = Path(__file__).resolve().parents[2] / "docs" / "compat.md"


def python_blocks() -> list[str]:
    """The Usage, variants and prefill blocks (docs/compat.md's run in their own tests)."""
    text = README.read_text(encoding="utf-8")
    return [b for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
            if "mla_decode" not in b]  # MLA's block stands alone (its own test)


def test_readme_has_the_usage_and_variant_examples():
    blocks = python_blocks()
    assert len(blocks) == 3
    assert "pagedattn.paged_decode(" in blocks[0] and "merge_states" in blocks[1]
    assert "pagedattn.paged_attention(" in blocks[2]
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


def _block(word: str, doc: Path = README) -> str:
    """The one block of ``doc`` that uses ``word``, as a CPU user runs it."""
    every = re.findall(r"^```python\n(.*?)^```", doc.read_text(encoding="utf-8"), re.M | re.S)
    found = [b for b in every if word in b]
    assert len(found) == 1, word
    return found[0].replace('device="cuda"', 'device="cpu"')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU user's path")
def test_readme_mla_example_runs_on_the_cpu():
    from pagedattn.reference import mla_decode_reference

    ns: dict = {}
    torch.manual_seed(0)
    exec(compile(_block("plan_mla_decode"), str(README), "exec"), ns)  # noqa: S102
    args = [ns[k] for k in ("q_nope", "q_pe", "ckv", "kpe", "tables", "lens")]
    ref = mla_decode_reference(*args, scale=1 / math.sqrt(192))
    assert rel_l2_error(ns["out"], ref.out) <= 1e-2
    assert torch.allclose(ns["lse"].double(), ref.lse, atol=1e-3)  # natural log


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU user's path")
def test_compat_flash_attention_example_runs_on_the_cpu():
    ns: dict = {}
    torch.manual_seed(0)
    exec(compile(_block("flash_attn_with_kvcache", COMPAT), str(COMPAT), "exec"), ns)  # noqa: S102
    q, kc, vc, table, lens = (ns[k] for k in ("q", "k_cache", "v_cache", "page_table",
                                              "cache_seqlens"))
    ref = paged_decode_reference(q[:, 0], kc, vc, table, lens + 1)  # the new token included
    assert ns["out"].shape == q.shape and ns["lse"].shape == (4, 8, 1)
    assert rel_l2_error(ns["out"][:, 0], ref.out) <= 1e-2
    assert torch.allclose(ns["lse"][..., 0].double(), ref.lse, atol=1e-3)  # natural log


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU user's path")
def test_compat_flashinfer_example_runs_on_the_cpu():
    ns: dict = {}
    torch.manual_seed(0)
    exec(compile(_block("BatchDecodeWithPagedKVCacheWrapper", COMPAT), str(COMPAT), "exec"),
         ns)  # noqa: S102
    kv, indptr, indices, last = (ns[k] for k in ("kv_cache", "indptr", "indices",
                                                 "last_page_len"))
    table = torch.zeros(3, 7, dtype=torch.int32)
    for b in range(3):
        table[b, :int(indptr[b + 1] - indptr[b])] = indices[indptr[b]:indptr[b + 1]]
    lens = (indptr[1:] - indptr[:-1] - 1) * 16 + last
    ref = paged_decode_reference(ns["q"], kv[:, 0], kv[:, 1], table, lens)
    assert rel_l2_error(ns["out"], ref.out) <= 2e-3
    assert torch.allclose(ns["lse"].double() * math.log(2), ref.lse, atol=1e-3)  # base 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU user's path")
def test_readme_prefill_example_runs_on_the_cpu():
    ns: dict = {}
    torch.manual_seed(0)
    exec(compile(_block("paged_attention("), str(README), "exec"), ns)  # noqa: S102
    args = [ns[k] for k in ("q_new", "k_pages", "v_pages", "tables", "seq_lens",
                            "query_start_loc")]
    ref = paged_attention_reference(*args)
    for name in ("attn", "attn2"):
        assert rel_l2_error(ns[name], ref.out) <= 1e-2, name
