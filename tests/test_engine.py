"""Continuous batching on a tiny random Llama: the paged engine (requests joining, finishing at
different steps, preempted, pages reused; prompts prefilled together in one varlen pass; decode
padded to batch-size buckets in static buffers, the code the CUDA-graph path replays) equals
greedy decoding by full dense recompute; and the fp8 cache calibrates its scales at prefill."""

import pytest
import torch

from pagedattn.serving.baselines import dense_logits, dense_model, random_weights
from pagedattn.serving.engine import Engine, generate_greedy
from pagedattn.serving.gguf_loader import LlamaConfig
from pagedattn.serving.model import Llama
from pagedattn.testing import rel_l2_error

CFG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_q_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_eps=1e-5,
                  max_position=256, tie_word_embeddings=True, bos_token_id=None,
                  eos_token_id=None)
PROMPTS = [[5, 17, 3], [9, 1, 44, 2, 8, 70, 33, 12, 6, 90, 4], [60, 61, 62, 63, 64, 65], [7],
           [11, 22, 33, 44, 55, 66, 77, 88, 10, 20, 30, 40, 50, 60, 70, 80, 91]]
MAX_NEW = [5, 8, 3, 7, 4]


def tiny_model(device="cpu", dtype=torch.float32, impl="auto") -> Llama:
    return Llama(CFG, random_weights(CFG), dtype=dtype, device=device, impl=impl)


@torch.no_grad()
def dense_greedy(model: Llama, prompt, n, eos=()):
    """Full recompute every step (no cache at all): tokens and fp32 logits."""
    toks, out, logits = list(prompt), [], []
    dense = dense_model(model)
    for _ in range(n):
        row = dense_logits(dense, torch.tensor([toks], device=model.device))[0, -1].float()
        tok = int(row.argmax())
        out.append(tok)
        logits.append(row.cpu())
        toks.append(tok)
        if tok in eos:
            break
    return out, logits


@pytest.fixture(scope="module")
def model(request):
    return tiny_model("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def dense(model):
    return [dense_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_NEW, strict=True)]


def check_against_dense(reqs, dense, eos=()):
    for r, (want, want_logits) in zip(reqs, dense, strict=True):
        n = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert r.output == want[:n], f"request {r.rid}"
        got = torch.stack(r.logits)
        assert rel_l2_error(got, torch.stack(want_logits[:n])) <= 1e-4


def test_continuous_batching_equals_dense_greedy(model, dense):
    res = generate_greedy(model, PROMPTS, MAX_NEW, page_size=4, max_batch_size=3,
                          keep_logits=True)
    check_against_dense(res.requests, dense)
    s = res.stats
    assert s.max_running == 3  # a full batch
    assert s.prefill_steps >= 2  # some requests joined a running batch later
    assert [r.finish_reason for r in res.requests] == ["length"] * len(PROMPTS)
    assert s.decode_tokens == sum(MAX_NEW) - len(PROMPTS)


def test_preemption_under_a_small_cache_still_equals_dense(model):
    """Two requests that each grow to 4 pages share a 6-page cache: one is preempted when the
    pool runs dry, re-prefilled from its prompt plus its tokens later, and still matches."""
    prompts, max_new = [[5, 17, 3, 8], [9, 1, 44, 2]], [11, 11]
    want = [dense_greedy(model, p, n) for p, n in zip(prompts, max_new, strict=True)]
    cache = model.make_cache(6, page_size=4)
    engine = Engine(model, cache, max_batch_size=4, keep_logits=True)
    for p, n in zip(prompts, max_new, strict=True):
        engine.add_request(p, n)
    reqs = engine.run()
    check_against_dense(reqs, want)
    assert engine.stats.preemptions >= 1 and reqs[1].preemptions >= 1
    assert cache.num_free_pages == 6 and cache.seq_ids == []  # every page came back


def test_eos_finishes_a_request_early(model, dense):
    eos = dense[1][0][3]  # the 4th token of prompt 1 becomes an EOS token
    res = generate_greedy(model, PROMPTS, MAX_NEW, page_size=4, max_batch_size=5,
                          eos_token_ids=[eos], keep_logits=True)
    check_against_dense(res.requests, dense, eos=(eos,))
    assert res.requests[1].finish_reason == "eos"
    assert res.requests[1].output[-1] == eos


def test_a_request_that_cannot_fit_raises_cache_full(model):
    from pagedattn.serving.cache import CacheFullError

    engine = Engine(model, model.make_cache(2, page_size=4))
    engine.add_request(list(range(20)), 2)
    with pytest.raises(CacheFullError, match="request 0"):
        engine.run()


def test_engine_rejects_bad_requests(model):
    engine = Engine(model, model.make_cache(4, page_size=4))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1], 0)
    with pytest.raises(ValueError, match="max_batch_size"):
        Engine(model, model.make_cache(4), max_batch_size=0)
