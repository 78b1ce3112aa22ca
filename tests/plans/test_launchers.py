"""The launchers' one signature and their compile records: each returns ``{kernel name:
compiled}`` for what it launched (``None`` values under the interpreter), and only
``split_kv_v4`` reads ``num_splits``. Every impl with a launcher is covered (the study's stages
and any impl added beside them, from the impl table)."""

import inspect

import pytest
import torch
from _hardening import LAUNCHER_IMPLS, NAN, check

import pagedattn
from pagedattn.testing import make_paged_inputs

KERNELS = {
    "baseline": {"baseline"},
    "fused_v1": {"fused_v1"},
    "vectorized_v2": {"vectorized_v2"},
    "gqa_reuse_v3": {"gqa_reuse_v3"},
    "split_kv_v4": {"split_kv_v4", "split_kv_v4_merge"},
}


def test_launchers_share_one_signature():
    signatures = {name: inspect.signature(pagedattn.IMPLS[name].launcher())
                  for name in LAUNCHER_IMPLS}
    first = signatures[LAUNCHER_IMPLS[0]]
    assert list(first.parameters) == ["query", "key_cache", "value_cache", "block_tables",
                                      "context_lens", "out", "scale", "num_splits"]
    assert first.parameters["scale"].kind is inspect.Parameter.KEYWORD_ONLY
    assert first.parameters["num_splits"].default is None
    assert all(s == first for s in signatures.values())


@pytest.mark.parametrize("impl", LAUNCHER_IMPLS)
def test_launcher_returns_what_it_launched(impl, device):
    inputs = make_paged_inputs([5, 0, 19], num_q_heads=4, num_kv_heads=2, head_dim=32,
                               page_size=8, dtype=torch.float16, seed=3, device=device)
    out = torch.full_like(inputs.query, NAN)
    num_splits = 3 if impl == "split_kv_v4" else None
    launched = pagedattn.IMPLS[impl].launcher()(*inputs, out, scale=32**-0.5,
                                                num_splits=num_splits)
    if impl in KERNELS:  # a stage launches its own kernels
        assert set(launched) == KERNELS[impl]
    else:  # an impl beside them names whatever kernels it ran
        assert launched and all(isinstance(name, str) for name in launched)
    if device == "cuda":
        assert all(hasattr(k, "n_regs") for k in launched.values())
    check(out, inputs)
