"""The engine never loses a request, leaks a page or wedges: requests that could never fit are
refused when added, ``abort`` ends a queued or running one, an ``on_token`` callback that raises
aborts only its own request, ``run`` hands each request back once, and a cache that does not
fit the model is refused at construction. Ends with 1,000 random scenarios mixing all of it.

The engine runs a fake model here (no layers, no kernels: fast on the CPU). It writes each fed
token into the paged cache at its slot and predicts the next token from what it reads back
through the step's block tables and lengths, so a page mix-up, a lost or a doubled token
changes the output, which must equal :func:`expected` exactly.
"""

import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from pagedattn.serving.cache import CacheFullError, PagedKVCache
from pagedattn.serving.engine import Engine
from pagedattn.serving.gguf_loader import LlamaConfig

VOCAB = 11


class TokenSumModel:
    """Next token = ``sum((token + 1) * (position + 1)) % vocab`` over the sequence, computed
    from the cache: each fed token is stored (as ``token + 1``) in layer 0's K at its slot, and
    each row sums its pages (``block_tables``) up to ``context_lens``."""

    def __init__(self, vocab_size: int = VOCAB, max_position: int = 64):
        self.cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=1, intermediate_size=1,
                               num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=1,
                               rope_theta=1.0, rms_eps=1e-5, max_position=max_position,
                               tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.steps = 0

    def make_cache(self, num_pages: int, *, page_size: int = 4) -> PagedKVCache:
        return PagedKVCache(1, 1, 1, num_pages=num_pages, page_size=page_size,
                            dtype=torch.float32)

    def _logits(self, token_ids, meta, cache):
        self.steps += 1
        k = cache.key_cache(0).view(-1)  # [num_pages * page_size]: one value per slot
        slots = meta.slot_mapping.long()
        keep = slots >= 0  # padding rows write nothing
        k[slots[keep]] = token_ids[keep].float() + 1
        rows = k.view(cache.num_pages, cache.page_size)[meta.block_tables.long()].flatten(1)
        pos = torch.arange(rows.shape[1])
        seen = pos[None, :] < meta.context_lens[:, None].long()
        score = (rows * (pos + 1) * seen).sum(1).long() % self.cfg.vocab_size
        return F.one_hot(score, self.cfg.vocab_size).float()

    # a prefill's rows are its prompts, an extend's its chunks: the last token's logits
    prefill = decode = extend = _logits


def expected(prompt, max_new, eos=()):
    """The tokens the fake model gives ``prompt``, up to ``max_new`` or the first EOS."""
    seq, out = list(prompt), []
    while len(out) < max_new:
        tok = sum((t + 1) * (i + 1) for i, t in enumerate(seq)) % VOCAB
        out.append(tok)
        seq.append(tok)
        if tok in eos:
            break
    return out


def pages_for(n, page_size):
    return -(-n // page_size)


class Boom(Exception):
    pass


def make(num_pages=8, page_size=4, **kw):
    model = TokenSumModel()
    return Engine(model, model.make_cache(num_pages, page_size=page_size), **kw)


# -- 1. a request that could never fit is refused when added ---------------------------------
@pytest.mark.parametrize("prompt_len, max_new", [(20, 1), (5, 30), (16, 2)])
def test_a_request_larger_than_the_cache_is_refused_at_add_request(prompt_len, max_new):
    """It was queued, then every step raised ``ValueError: max_pages`` (once its sequence
    outgrew the block table), it was never returned and its pages never freed, and the
    requests behind it waited forever."""
    engine = make(num_pages=4, page_size=4)  # 16 tokens in all
    need = pages_for(prompt_len + max_new - 1, 4)
    with pytest.raises(CacheFullError, match=rf"^request: prompt \({prompt_len}\) \+ "
                       rf"max_new_tokens \({max_new}\) needs {need} pages of 4 tokens, "
                       r"more than the 4 pages of the whole cache") as e:
        engine.add_request([1] * prompt_len, max_new)
    assert (e.value.pages_needed, e.value.pages_free) == (need, 4)
    assert engine.done and engine.cache.num_free_pages == 4
    rid = engine.add_request([2, 3], 5)  # the engine still serves what fits
    (r,) = engine.run()
    assert r.rid == rid and r.output == expected([2, 3], 5)


def test_a_request_that_fills_the_whole_cache_exactly_is_served():
    """The last token is never fed back, so prompt + max_new_tokens - 1 tokens must fit."""
    engine = make(num_pages=4, page_size=4)
    engine.add_request([1] * 10, 7)  # 16 tokens written: the 4 pages
    engine.add_request([4, 5, 6], 3)
    a, b = engine.run()
    assert a.output == expected([1] * 10, 7) and b.output == expected([4, 5, 6], 3)
    assert engine.cache.num_free_pages == 4


def test_the_block_table_width_bounds_a_request_too():
    """``max_model_len`` sets the decode steps' block-table width; max_model_len itself is
    checked first (ValueError), so the pool is what refuses here."""
    engine = make(num_pages=2, page_size=4, max_model_len=40)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 30, 11)
    with pytest.raises(CacheFullError, match="the 2 pages of the whole cache"):
        engine.add_request([1] * 8, 2)


# -- 2. abort ----------------------------------------------------------------------------------
def test_abort_a_queued_and_a_running_request():
    engine = make(num_pages=16, max_batch_size=2)
    ids = [engine.add_request([1, 2, 3], 6), engine.add_request([4, 5], 6),
           engine.add_request([6], 6)]
    engine.step()  # prefill: 0 and 1 run, 2 waits
    engine.step()  # a decode step (left in flight: its tokens are read by the next step)
    assert engine.abort(ids[1]) and engine.abort(ids[2])
    assert engine.cache.seq_ids == [engine.running[0].key]  # request 1's pages came back
    got = engine.run()
    assert [(r.rid, r.finish_reason) for r in got] == [(0, "length"), (1, "abort"),
                                                       (2, "abort")]
    assert got[0].output == expected([1, 2, 3], 6)
    assert got[1].output == expected([4, 5], 6)[:len(got[1].output)]
    assert 1 <= len(got[1].output) <= 2 and got[2].output == []
    assert engine.stats.discarded_tokens == 1  # request 1's token in flight
    assert engine.cache.num_free_pages == 16 and engine.run() == []


def test_abort_of_an_ended_request_is_a_no_op_and_of_an_unknown_id_an_error():
    engine = make()
    rid = engine.add_request([1, 2], 2)
    (r,) = engine.run()
    assert not engine.abort(rid) and r.finish_reason == "length"
    assert engine.run() == []  # not handed back a second time
    rid = engine.add_request([1, 2], 2)
    assert engine.abort(rid) and not engine.abort(rid)
    with pytest.raises(KeyError, match="request_id: no request 2 was added"):
        engine.abort(2)
    with pytest.raises(KeyError, match="request_id"):
        engine.abort(-1)
    with pytest.raises(TypeError, match="request_id: expected an int"):
        engine.abort("0")
    assert [r.finish_reason for r in engine.run()] == ["abort"]


def test_a_callback_may_abort_its_own_request_as_a_stop_string():
    engine = make(max_batch_size=4)
    want = expected([3, 1], 8)
    engine.add_request([3, 1], 8)
    engine.add_request([2], 8)

    def stop_at_third(r, tok):
        if r.rid == 0 and len(r.output) == 3:
            assert engine.abort(r.rid)

    a, b = engine.run(stop_at_third)
    assert (a.finish_reason, a.output) == ("abort", want[:3])
    assert (b.finish_reason, b.output) == ("length", expected([2], 8))
    assert engine.cache.num_free_pages == 8 and engine.cache.seq_ids == []


def test_a_callback_aborting_a_request_admitted_in_the_same_step():
    """Found by the random scenarios: a step admits request 1 (out of the queue), then reads
    the decode step in flight, whose callback aborts request 1. It was prefilled anyway and
    stayed running with no token (the next decode step raised IndexError)."""
    engine = make(num_pages=8, max_batch_size=2)
    engine.add_request([1, 2], 6)
    engine.step()  # prefill request 0
    engine.step()  # its decode step, left in flight
    engine.add_request([3], 6)
    engine.on_token = lambda r, tok: engine.abort(1)
    engine.step()  # admits 1, reads 0's token in flight: 1 is aborted before its prefill
    assert engine.running == [] or engine.running[0].rid == 0
    a, b = engine.run(engine.on_token)
    assert a.output == expected([1, 2], 6) and (b.finish_reason, b.output) == ("abort", [])
    assert engine.cache.num_free_pages == 8 and engine.cache.seq_ids == []


# -- 3. a callback that raises ----------------------------------------------------------------
@pytest.mark.parametrize("at", [1, 3])  # the prefill's token, a decode step's token
@pytest.mark.parametrize("keep_logits", [False, True])  # overlapped decode, or not
def test_a_raising_callback_aborts_its_request_and_the_engine_goes_on(at, keep_logits):
    """The exception propagates from run() once the step is done for the others; that
    request is aborted with its pages freed; the next run() finishes the rest. It left the
    engine broken (every later step raised IndexError) and leaked the pages."""
    engine = make(num_pages=12, max_batch_size=3, keep_logits=keep_logits)
    prompts = [[1, 2], [3, 4, 5], [6]]
    for p in prompts:
        engine.add_request(p, 5)

    def cb(r, tok):
        if r.rid == 1 and len(r.output) == at:
            raise Boom(f"callback of {r.rid}")

    with pytest.raises(Boom, match="callback of 1"):
        engine.run(cb)
    assert all(r.rid != 1 for r in engine.running + list(engine.waiting))
    got = engine.run(cb)
    assert [r.finish_reason for r in got] == ["length", "abort", "length"]
    for r, p in zip(got, prompts, strict=True):
        assert r.output == expected(p, 5)[:len(r.output)]
    assert len(got[1].output) == at
    assert engine.cache.num_free_pages == 12 and engine.cache.seq_ids == []


def test_callbacks_that_raise_for_several_requests_of_one_step():
    engine = make(num_pages=12, max_batch_size=3)
    for p in ([1], [2], [3]):
        engine.add_request(p, 4)

    def cb(r, tok):
        if r.rid != 1:
            raise Boom(f"callback of {r.rid}")

    engine.on_token = cb
    with pytest.raises(Boom, match="callback of 0") as e:
        engine.step()  # the prefill
    assert "1 more request" in "".join(e.value.__notes__)
    got = engine.run()
    assert [r.finish_reason for r in got] == ["abort", "length", "abort"]
    assert engine.cache.num_free_pages == 12


# -- 4. run() hands each request back once ----------------------------------------------------
def test_run_returns_each_request_once_and_forgets_it():
    engine = make(keep_logits=True)
    engine.add_request([1, 2], 3)
    (a,) = engine.run()
    engine.add_request([3], 2)
    (b,) = engine.run()
    assert (a.rid, b.rid) == (0, 1) and len(a.logits) == 3
    assert engine.run() == [] and engine.finished == {}


def test_take_finished_after_single_steps():
    engine = make()
    engine.add_request([1, 2], 1)  # ends at its prefill's token
    engine.step()
    (r,) = engine.take_finished()
    assert r.finish_reason == "length" and engine.take_finished() == []


# -- 5. the cache must fit the model ----------------------------------------------------------
@pytest.mark.parametrize("kw, says", [
    (dict(num_layers=2), "cache: num_layers 2 does not match the model's 1"),
    (dict(num_kv_heads=2), "cache: num_kv_heads 2 does not match the model's 1"),
    (dict(head_dim=8), "cache: head_dim 8 does not match the model's 1"),
    (dict(dtype=torch.float16), "cache: dtype torch.float16 does not fit the model"),
])
def test_a_cache_that_does_not_fit_the_model_is_refused_at_construction(kw, says):
    shape = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32) | kw
    cache = PagedKVCache(shape.pop("num_layers"), shape.pop("num_kv_heads"),
                         shape.pop("head_dim"), num_pages=4, page_size=4, **shape)
    with pytest.raises(ValueError, match=f"^{says}"):
        Engine(TokenSumModel(), cache)


def test_an_fp8_cache_fits_a_model_of_any_dtype():
    cache = PagedKVCache(1, 1, 1, num_pages=4, page_size=4, dtype=torch.float8_e4m3fn)
    assert Engine(TokenSumModel(), cache).cache is cache


# -- 8. random scenarios ----------------------------------------------------------------------
def _scenario(seed: int) -> Counter:
    """One random scenario; returns what happened in it (steps, refusals, aborts, callback
    errors, preemptions, finishes). Asserts: every added request is
    handed back exactly once, finished (its exact tokens) or aborted (a prefix of them); a
    refused one could never fit; no page leaks; the engine always comes to rest."""
    rng = random.Random(seed)
    page_size, num_pages = rng.randint(1, 4), rng.randint(1, 12)
    seen: Counter = Counter()
    eos = set(rng.sample(range(VOCAB), rng.randint(0, 2)))
    engine = make(num_pages=num_pages, page_size=page_size,
                  max_batch_size=rng.randint(1, 4), keep_logits=rng.random() < 0.3,
                  max_prefill_tokens=rng.randint(1, 16), eos_token_ids=sorted(eos))
    raise_p, abort_p = rng.choice([0.0, 0.05, 0.2]), rng.choice([0.0, 0.05, 0.2])
    prompts: dict[int, tuple[list[int], int]] = {}
    handed: dict[int, object] = {}

    def add():
        p = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        n = rng.randint(1, 10)
        never = pages_for(len(p) + n - 1, page_size) > num_pages
        try:
            rid = engine.add_request(p, n)
        except CacheFullError:
            assert never, (seed, len(p), n)
            seen["refused"] += 1
            return
        assert not never, (seed, len(p), n)
        prompts[rid] = (p, n)

    def collect(reqs):
        for r in reqs:
            assert r.rid not in handed, (seed, r.rid)
            handed[r.rid] = r

    def on_token(r, tok):
        x = rng.random()
        if x < raise_p:
            seen["raised"] += 1
            raise Boom(r.rid)
        if x < raise_p + abort_p:  # abort any known id from inside the callback
            engine.abort(rng.choice(list(prompts)))

    engine.on_token = on_token
    for _ in range(rng.randint(1, 8)):
        add()
    for _ in range(rng.randint(0, 40)):  # interleave steps, adds, aborts and runs
        action = rng.random()
        try:
            if action < 0.55:
                engine.step()
            elif action < 0.7:
                add()
            elif action < 0.85 and prompts:
                engine.abort(rng.choice(list(prompts)))
            else:
                collect(engine.run(on_token))
        except Boom:
            pass
        collect(engine.take_finished())
    for _ in range(1000):  # then to rest: a raising callback costs one run() call
        try:
            collect(engine.run(on_token))
            break
        except Boom:
            collect(engine.take_finished())
    else:
        raise AssertionError(f"seed {seed}: the engine never came to rest")
    assert set(handed) == set(prompts), seed
    for rid, (p, n) in prompts.items():
        r = handed[rid]
        want = expected(p, n, eos)
        if r.finish_reason == "abort":
            assert r.output == want[:len(r.output)], (seed, rid)
        else:
            assert r.output == want, (seed, rid)
            assert r.finish_reason == ("eos" if want[-1] in eos else "length"), (seed, rid)
    cache = engine.cache
    assert engine.done and engine._inflight is None, seed
    assert cache.num_free_pages == num_pages and cache.seq_ids == [], seed
    seen.update(r.finish_reason for r in handed.values())
    seen.update(steps=engine.model.steps, preempted=engine.stats.preemptions,
                discarded=engine.stats.discarded_tokens, extended=engine.stats.extend_steps)
    return seen


def test_one_thousand_random_scenarios():
    """Oversized requests, aborts (from the caller and from callbacks), raising callbacks,
    pools of 1 to 8 pages of 1 to 4 tokens, batches of 1 to 4, overlapped or not, prompts
    prefilled whole or chunk by chunk."""
    seen = sum((_scenario(seed) for seed in range(1000)), Counter())
    # every kind of event happened, many times (prompts longer than max_prefill_tokens
    # prefill chunk by chunk, "extended": a half-prefilled prompt is preempted too)
    kinds = ("refused", "raised", "abort", "eos", "length", "discarded", "extended")
    assert all(seen[k] >= 50 for k in kinds) and seen["steps"] >= 10_000, seen
    assert seen["preempted"] >= 30, seen
