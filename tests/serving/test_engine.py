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


def test_overlapped_engine_discards_the_token_in_flight_after_eos(model, dense):
    """Without kept logits the host launches step k + 1 before it reads step k: a request that
    meets EOS in a decode step has one more token in flight, dropped and counted, so the
    stats line can say why the steps outnumber the tokens."""
    eos = dense[1][0][3]
    res = generate_greedy(model, [PROMPTS[1]], MAX_NEW[1], page_size=4, eos_token_ids=[eos])
    want = dense[1][0]
    assert res.requests[0].output == want[:want.index(eos) + 1]
    s = res.stats
    assert (s.decode_tokens, s.discarded_tokens, s.decode_steps) == (want.index(eos), 1,
                                                                       want.index(eos) + 1)


def test_a_request_that_cannot_fit_raises_cache_full(model):
    """Refused when added (it was queued, then every step raised): the whole cache holds 8
    tokens, the request writes 21."""
    from pagedattn.serving.cache import CacheFullError

    engine = Engine(model, model.make_cache(2, page_size=4))
    with pytest.raises(CacheFullError, match="needs 6 pages of 4 tokens, more than the 2"):
        engine.add_request(list(range(20)), 2)
    assert engine.done


def test_a_request_that_fits_only_an_empty_cache_waits_for_the_callers_pages(model):
    """The caller's own sequence holds the pages: step() says the cache is full (the request
    waits, nothing is lost), and once the caller frees them the request runs."""
    from pagedattn.serving.cache import CacheFullError

    cache = model.make_cache(4, page_size=4)
    cache.add_sequence("mine")
    cache.append("mine", 12)
    engine = Engine(model, cache)
    engine.add_request(list(range(10)), 3)
    with pytest.raises(CacheFullError, match="request 0"):
        engine.step()
    cache.free("mine")
    (r,) = engine.run()
    assert len(r.output) == 3 and cache.num_free_pages == 4


def test_abort_and_a_raising_callback_leave_the_others_equal_to_dense(model, dense):
    """With the real model: request 1 is aborted between decode steps (a step in flight),
    request 3's callback raises at its first token (the prefill); the others still give the
    dense tokens and every page comes back."""
    cache = model.make_cache(64, page_size=4)
    engine = Engine(model, cache, max_batch_size=5)
    for p, n in zip(PROMPTS, MAX_NEW, strict=True):
        engine.add_request(p, n)

    def cb(r, tok):
        if r.rid == 3:
            raise RuntimeError("client went away")

    engine.on_token = cb
    with pytest.raises(RuntimeError, match="client went away"):
        engine.step()  # the prefill of all five
    engine.step()
    assert engine.abort(1)
    reqs = engine.run()
    assert [r.finish_reason for r in reqs] == ["length", "abort", "length", "abort", "length"]
    for i in (0, 2, 4):
        assert reqs[i].output == dense[i][0], i
    assert reqs[1].output == dense[1][0][:len(reqs[1].output)] and reqs[3].output == dense[3][0][:1]
    assert cache.num_free_pages == 64 and cache.seq_ids == []


def test_a_cache_for_another_model_is_refused_at_construction(model):
    from pagedattn.serving.cache import PagedKVCache

    other = PagedKVCache(CFG.num_layers, CFG.num_kv_heads * 2, CFG.head_dim, num_pages=4,
                         dtype=model.dtype, device=model.device)
    with pytest.raises(ValueError, match="^cache: num_kv_heads 4 does not match the model's 2"):
        Engine(model, other)


def test_engine_rejects_bad_requests(model):
    engine = Engine(model, model.make_cache(4, page_size=4))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1], 0)
    with pytest.raises(ValueError, match="max_batch_size"):
        Engine(model, model.make_cache(4), max_batch_size=0)


def test_a_batch_past_the_largest_bucket_names_max_batch_size(model):
    """300 sequences do not fit the largest decode bucket (256): the error names the
    argument given (it said "batch: expected 1..256 sequences")."""
    from pagedattn.serving.runner import DecodeRunner

    for make in (lambda: Engine(model, model.make_cache(4), max_batch_size=300),
                 lambda: DecodeRunner(model, model.make_cache(4), max_batch_size=300,
                                      max_pages=8)):
        with pytest.raises(ValueError, match=r"^max_batch_size: expected 1\.\.256 .*got 300"):
            make()


@pytest.mark.parametrize("prompt, exc", [([1, 97, 3], ValueError), ([1, -1], ValueError),
                                          ([1, 10 ** 20], ValueError), ("abc", TypeError),
                                          ([1.7, 2.2], TypeError), ([True], TypeError)])
def test_bad_prompt_tokens_are_refused_before_the_request_is_queued(model, prompt, exc):
    """A token outside the vocabulary failed inside the prefill, after the request had left
    the queue and its sequence held pages: the request was lost and its pages leaked. Float
    tokens were truncated."""
    engine = Engine(model, model.make_cache(8, page_size=4))
    with pytest.raises(exc, match="^prompt: expected"):
        engine.add_request(prompt, 3)
    assert engine.done and engine.cache.num_free_pages == 8


def test_a_prefill_that_fails_puts_its_requests_back(model, monkeypatch):
    """Whatever fails in a prefill (here the model), the requests wait again and their pages
    return, so a later run can still serve them."""
    engine = Engine(model, model.make_cache(8, page_size=4))
    engine.add_request([1, 2, 3], 2)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(model, "prefill", boom)
    with pytest.raises(RuntimeError, match="boom"):
        engine.run()
    assert len(engine.waiting) == 1 and engine.cache.num_free_pages == 8
    assert engine.cache.seq_ids == []
    monkeypatch.undo()
    (req,) = engine.run()
    assert len(req.output) == 2


def test_requests_share_a_cache_with_the_callers_own_int_sequences(model, dense):
    """Request ids are ints 0, 1, ...; a cache already holding the caller's sequence 1 made
    the engine's add_sequence(1) fail mid-prefill and lose both requests. The engine's
    sequences now have keys of their own."""
    cache = model.make_cache(16, page_size=4)
    cache.add_sequence(1)
    cache.append(1, 3)
    engine = Engine(model, cache, keep_logits=True)
    for p, n in zip(PROMPTS[:2], MAX_NEW[:2], strict=True):
        engine.add_request(p, n)
    reqs = engine.run()
    check_against_dense(reqs, dense[:2])
    assert cache.seq_ids == [1] and cache.seq_len(1) == 3


def test_a_request_that_fits_alone_is_admitted_without_headroom(model):
    """Admission keeps a page of headroom per request; a request alone in a cache that holds
    exactly its pages was refused ("needs 1 new page(s), only 1 free")."""
    engine = Engine(model, model.make_cache(1, page_size=16))
    engine.add_request([1, 2, 3, 4], 4)
    (req,) = engine.run()
    assert len(req.output) == 4


@pytest.mark.parametrize("kw", [dict(max_model_len=3.5), dict(max_batch_size=True),
                                dict(max_prefill_tokens=2.0)])
def test_engine_sizes_must_be_ints(model, kw):
    with pytest.raises(TypeError, match=f"^{next(iter(kw))}: expected an int"):
        Engine(model, model.make_cache(4), **kw)


# -- decode runner: buckets, padding, static buffers (the code the CUDA-graph path replays) --
def test_buckets():
    from pagedattn.serving.runner import BUCKETS, bucket_for, buckets_up_to

    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert [bucket_for(n) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert buckets_up_to(3) == (1, 2, 4) and buckets_up_to(256) == BUCKETS
    for bad in (0, 257):
        with pytest.raises(ValueError, match="batch"):
            bucket_for(bad)


def test_padded_metadata_rows_point_nowhere():
    cache = tiny_model().make_cache(8, page_size=4)
    for s, n in ((0, 5), (1, 2)):
        cache.add_sequence(s)
        cache.append(s, n)
    out = torch.full((cache.metadata_size(4, 3),), 99, dtype=cache.index_dtype)
    meta = cache.prepare_step([0, 1], [1, 1], max_pages=3, pad_to=4, out=out)
    assert meta.block_tables.data_ptr() == out[12:].data_ptr()  # views of the static buffer
    assert meta.slot_mapping.tolist()[2:] == [-1, -1]  # append_kv skips padding
    assert meta.context_lens.tolist() == [6, 3, 0, 0]
    assert meta.positions.tolist() == [5, 2, 0, 0]
    assert meta.block_tables.tolist() == [[0, 1, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="pad_to"):
        cache.build_metadata([0, 1], [[], []], max_pages=3, pad_to=1)


def test_runner_padded_steps_equal_unpadded_decode(model):
    """Three sequences run at bucket 4 in the static buffers (reused in place, step after
    step) give the logits of an unpadded ``model.decode`` on a twin cache."""
    from pagedattn.serving.runner import DecodeRunner

    caches = [model.make_cache(16, page_size=4) for _ in range(2)]
    prompts = PROMPTS[:3]
    for cache in caches:
        for s, p in enumerate(prompts):
            cache.add_sequence(s)
            ids = torch.tensor(p, device=model.device)
            model.prefill(ids, cache.prepare_step([s], [len(p)]), cache)
    if model.device.type == "cpu":
        with pytest.raises(ValueError, match="graphs"):
            DecodeRunner(model, caches[0], max_batch_size=4, max_pages=8, graphs=True)
    runner = DecodeRunner(model, caches[0], max_batch_size=4, max_pages=8)
    runner.warmup()  # padding rows only: nothing written
    assert torch.equal(caches[0].kv, caches[1].kv)
    tokens, ptr = [3, 1, 4], runner._meta[4].data_ptr()
    fed = tokens
    for _ in range(3):
        # the first step takes host tokens, the next ones the last step's on the device
        step = runner.step([0, 1, 2], fed)
        got = step.logits
        meta = caches[1].prepare_step([0, 1, 2], [1, 1, 1])
        want = model.decode(torch.tensor(tokens, device=model.device), meta, caches[1])
        assert got.shape == want.shape and rel_l2_error(got, want) <= 1e-5
        assert runner._meta[4].data_ptr() == ptr
        tokens = step.token_ids()
        assert tokens == got.argmax(-1).tolist()
        fed = None
    # the same slots written (padding rows wrote nothing), values equal up to GEMM rounding
    assert torch.equal(caches[0].kv != 0, caches[1].kv != 0)
    assert rel_l2_error(caches[0].kv, caches[1].kv) <= 1e-6


@pytest.mark.parametrize("impl", ["gqa_reuse_v3", "auto"])  # generate's CPU default; the GPU's
def test_a_padded_decode_bucket_warns_nothing(impl):
    """No numpy warning reaches a user of batched generation on the CPU: a decode step of three
    requests runs in a bucket of four, and the padding row (an empty sequence) divided 0 / 0 in
    the kernels' discarded ``where`` branch, which Triton's interpreter computes with numpy
    (``RuntimeWarning: invalid value encountered in divide`` from ``pagedattn generate "a" "b"
    "c"``). The divisor of an empty row is now 1."""
    import warnings

    from pagedattn.serving.bench_model import TINY_CFG

    cfg = LlamaConfig(**TINY_CFG)
    model = Llama(cfg, random_weights(cfg), dtype=torch.float32, impl=impl,
                  device="cuda" if torch.cuda.is_available() else "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = generate_greedy(model, [[5, 17, 3], [9, 1], [7]], 3, page_size=4)
    assert [len(r.output) for r in res.requests] == [3, 3, 3]
    assert res.stats.max_running == 3  # three sequences: the bucket of 4 has a padding row


def test_a_device_fed_step_needs_a_previous_step_of_its_bucket(model):
    from pagedattn.serving.runner import DecodeRunner

    cache = model.make_cache(16, page_size=4)
    for s, p in enumerate(PROMPTS[:3]):
        cache.add_sequence(s)
        ids = torch.tensor(p, device=model.device)
        model.prefill(ids, cache.prepare_step([s], [len(p)]), cache)
    runner = DecodeRunner(model, cache, max_batch_size=4, max_pages=8)
    with pytest.raises(ValueError, match="tokens: None"):
        runner.step([0, 1, 2], None)
    runner.step([0], [5])  # bucket 1
    with pytest.raises(ValueError, match="tokens: None"):
        runner.step([0, 1, 2], None)  # bucket 4
    assert [cache.seq_len(s) for s in range(3)] == [4, 11, 6]  # nothing reserved by a refusal


def _spy_on_steps(engine, monkeypatch):
    """Count the runner's steps by how their tokens came (host list, or None: device-fed)."""
    seen = {"host": 0, "device": 0}
    step = engine.runner.step

    def counted(seq_ids, tokens):
        seen["device" if tokens is None else "host"] += 1
        return step(seq_ids, tokens)

    monkeypatch.setattr(engine.runner, "step", counted)
    return seen


def test_overlapped_decode_equals_dense_with_eos_and_joins(model, dense, monkeypatch):
    """Without ``keep_logits`` the engine launches step k + 1 before reading step k: requests
    joining, finishing by length and by EOS (with one extra step in flight) still give the
    dense tokens, and every page comes back."""
    eos = dense[1][0][3]
    cache = model.make_cache(64, page_size=4)
    engine = Engine(model, cache, max_batch_size=3, eos_token_ids=[eos])
    seen = _spy_on_steps(engine, monkeypatch)
    for p, n in zip(PROMPTS, MAX_NEW, strict=True):
        engine.add_request(p, n)
    reqs = engine.run()
    for r, (want, _) in zip(reqs, dense, strict=True):
        n = next((i + 1 for i, t in enumerate(want) if t == eos), len(want))
        assert r.output == want[:n], f"request {r.rid}"
        assert r.logits == []
    assert reqs[1].finish_reason == "eos"
    assert seen["device"] >= 3 and seen["host"] >= 2  # both kinds of step ran
    assert engine.stats.decode_tokens == sum(len(r.output) - 1 for r in reqs)
    assert engine._inflight is None and cache.seq_ids == [] and cache.num_free_pages == 64


def test_overlapped_decode_under_preemption_equals_dense(model, monkeypatch):
    prompts, max_new = [[5, 17, 3, 8], [9, 1, 44, 2]], [11, 11]
    want = [dense_greedy(model, p, n)[0] for p, n in zip(prompts, max_new, strict=True)]
    cache = model.make_cache(6, page_size=4)
    engine = Engine(model, cache, max_batch_size=4)
    seen = _spy_on_steps(engine, monkeypatch)
    for p, n in zip(prompts, max_new, strict=True):
        engine.add_request(p, n)
    reqs = engine.run()
    assert [r.output for r in reqs] == want
    assert engine.stats.preemptions >= 1 and seen["device"] >= 1
    assert cache.num_free_pages == 6 and cache.seq_ids == []


def test_engine_rejects_requests_longer_than_max_model_len(model):
    engine = Engine(model, model.make_cache(8, page_size=4), max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(8)), 3)


# -- fp8 cache: scales calibrated from the prompt's K/V amax ---------------------------------
def test_fp8_scales_are_amax_over_the_format_max():
    from pagedattn.serving.cache import fp8_scales

    amax = torch.tensor([448.0, 0.0, 1.0, float("nan")])
    got = fp8_scales(amax, torch.float8_e4m3fn)
    assert torch.equal(got, torch.tensor([1.0, 1.0, 1.0 / 448, 1.0]))  # amax 0/NaN: 1.0
    assert fp8_scales(torch.tensor([57344.0]), torch.float8_e5m2).item() == 1.0
    with pytest.raises(ValueError, match="dtype"):
        fp8_scales(amax, torch.float16)


def test_fp8_prefill_calibrates_per_layer_and_kv_head(model):
    """After the first prefill each layer's largest stored |K| and |V| per kv head is the fp8
    maximum (scale = amax / 448); a second prefill keeps the scales; given scales are kept."""
    cache = model.make_cache(16, page_size=4, dtype=torch.float8_e4m3fn)
    assert cache.needs_calibration
    cache.add_sequence(0)
    ids = torch.tensor(PROMPTS[1], device=model.device)
    model.prefill(ids, cache.prepare_step([0], [len(ids)]), cache)
    assert not cache.needs_calibration
    for layer in range(CFG.num_layers):
        ks, vs = cache.scales(layer)
        assert ks.shape == (CFG.num_kv_heads,) and bool((ks != 1).all() & (vs != 1).all())
        for c in (cache.key_cache(layer), cache.value_cache(layer)):
            assert c.float().abs().amax(dim=(0, 1, 3)).tolist() == [448.0] * CFG.num_kv_heads
    before = cache._scales.clone()
    cache.add_sequence(1)
    ids = torch.tensor(PROMPTS[4], device=model.device)
    model.prefill(ids, cache.prepare_step([1], [len(ids)]), cache)
    assert torch.equal(cache._scales, before)
    fixed = model.make_cache(4, page_size=4, dtype=torch.float8_e4m3fn, k_scale=0.5,
                             v_scale=0.25)
    assert not fixed.needs_calibration
    assert fixed.scales(1)[0].tolist() == [0.5] * 2 and fixed.scales(0)[1].tolist() == [0.25] * 2
    assert model.make_cache(4).scales(0) == (None, None)


def test_fp8_engine_stays_close_to_the_fp32_cache(model, dense):
    """fp8 K/V (calibrated) change the decode logits by a few percent at most, up to the
    first token that differs from the fp32 cache's."""
    res = generate_greedy(model, PROMPTS[:3], MAX_NEW[:3], page_size=4, max_batch_size=3,
                          keep_logits=True, cache_dtype=torch.float8_e4m3fn)
    for r, (want, want_logits) in zip(res.requests, dense[:3], strict=True):
        assert rel_l2_error(r.logits[0], want_logits[0]) <= 1e-5  # prefill: unquantized K/V
        n = next((i + 1 for i, (a, b) in enumerate(zip(r.output, want, strict=True)) if a != b),
                 len(want))
        assert n >= 2
        assert rel_l2_error(torch.stack(r.logits[:n]), torch.stack(want_logits[:n])) <= 0.05


@pytest.mark.gpu
def test_graph_engine_equals_eager_engine_and_dense(model, dense):
    """On a GPU, CUDA-graph replays with overlapped steps (device-fed tokens, argmax inside
    the graph) give the eager engine's tokens and the dense ones, EOS and joins included."""
    eos = dense[1][0][3]
    outs = []
    for graphs in (False, True):
        res = generate_greedy(model, PROMPTS, MAX_NEW, page_size=4, max_batch_size=3,
                              eos_token_ids=[eos], graphs=graphs)
        outs.append([r.output for r in res.requests])
    assert outs[0] == outs[1]
    for got, (want, _) in zip(outs[1], dense, strict=True):
        n = next((i + 1 for i, t in enumerate(want) if t == eos), len(want))
        assert got == want[:n]


def test_chunked_prefill_equals_dense_greedy(model, dense):
    """Prompts longer than ``max_prefill_tokens`` prefill chunk by chunk over the paged cache
    (``Transformer.extend``: paged attention over the tokens already cached), a decode step
    of the running batch between two chunks; tokens and logits as full dense recompute."""
    res = generate_greedy(model, PROMPTS, MAX_NEW, page_size=4, max_batch_size=3,
                          keep_logits=True, max_prefill_tokens=4)
    check_against_dense(res.requests, dense)
    s = res.stats
    # the 11- and 17-token prompts take 3 and 5 chunks, the 6-token one 2
    assert s.extend_steps >= 3 + 5 + 2
    assert s.prefill_tokens == sum(len(p) for p in PROMPTS)


def test_a_cached_prefix_prefills_only_the_rest(model):
    """A request that starts with a cached prefix (``add_prefix``) forks its pages and
    prefills only its own tokens; its tokens and logits are those of the whole prompt."""
    prefix, suffixes = PROMPTS[4][:10], [PROMPTS[4][10:], [3, 1, 4], [42]]
    want = [dense_greedy(model, prefix + s, 5) for s in suffixes]
    cache = model.make_cache(40, page_size=4)
    engine = Engine(model, cache, max_batch_size=3, keep_logits=True, max_model_len=64)
    pid = engine.add_prefix(prefix)
    pages_held = cache.num_free_pages
    for s in suffixes:
        engine.add_request(prefix + s, 5, prefix=pid)
    check_against_dense(engine.run(), want)
    # the requests prefilled their own tokens only (the prefix's pass is add_prefix's)
    assert engine.stats.prefill_tokens == sum(len(s) for s in suffixes)
    assert cache.num_free_pages == pages_held  # the requests' pages returned, the prefix kept
    engine.drop_prefix(pid)
    assert cache.num_free_pages == 40 and cache.seq_ids == []
    with pytest.raises(KeyError, match="prefix"):
        engine.add_request(prefix + [1], 2, prefix=pid)
    pid = engine.add_prefix(prefix)
    with pytest.raises(ValueError, match="^prefix"):
        engine.add_request(prefix, 2, prefix=pid)  # no token past the prefix
    with pytest.raises(ValueError, match="^prefix"):
        engine.add_request([1] + prefix, 2, prefix=pid)
