"""No numpy warning reaches a user of batched generation on the CPU: a decode step of three
requests runs in a bucket of four, and the padding row (an empty sequence) divided 0 / 0 in the
kernels' discarded ``where`` branch, which Triton's interpreter computes with numpy
(``RuntimeWarning: invalid value encountered in divide`` from ``pagedattn generate "a" "b"
"c"``). The divisor of an empty row is now 1."""

import warnings

import pytest
import torch

from pagedattn.serving.baselines import random_weights
from pagedattn.serving.bench_model import TINY_CFG
from pagedattn.serving.engine import generate_greedy
from pagedattn.serving.gguf_loader import LlamaConfig
from pagedattn.serving.model import Llama

CFG = LlamaConfig(**TINY_CFG)


@pytest.mark.parametrize("impl", ["gqa_reuse_v3", "auto"])  # generate's CPU default; the GPU's
def test_a_padded_decode_bucket_warns_nothing(impl):
    model = Llama(CFG, random_weights(CFG), dtype=torch.float32, impl=impl)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = generate_greedy(model, [[5, 17, 3], [9, 1], [7]], 3, page_size=4)
    assert [len(r.output) for r in res.requests] == [3, 3, 3]
    assert res.stats.max_running == 3  # three sequences: the bucket of 4 has a padding row
