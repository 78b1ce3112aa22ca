"""``pagedattn generate`` / ``bench-model`` argument checks (one line on stderr, exit status 2,
before any model loads; a bad GGUF file too), the chat-template choice of the tokenizer module,
the stats line and report wording, and the benchmark's CPU smoke run on a tiny random model.

Streaming text from generated token ids (the tokenizer module's ``TextStream``, ``generate``'s
output): a character split across byte-level tokens (an emoji, CJK) is printed once complete,
never as U+FFFD. ``pagedattn generate`` decoded each step's whole output and printed the new
suffix, so a half-decoded character printed "�" and the completed one was then never
printed."""

import json
import re
import warnings

import pytest
import torch

from pagedattn import cli
from pagedattn.serving import engine as engine_module
from pagedattn.serving import model as model_module
from pagedattn.serving import tokenizer as tokenizer_module
from pagedattn.serving.tokenizer import TextStream, encode

# "1 tokens" as a count, not the tail of a rate such as "1.1 tokens/s" (a measured time: the
# CLI test read 1 token in 0.95 s as 1.1 tokens/s and failed CI on it).
PLURAL_OF_ONE = re.compile(r"(?<![\d.])1 tokens\b")

NO_GPU = not torch.cuda.is_available()
PROMPT = "What is the capital of France?"


def run(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse exits from inside parse_args
        rc = e.code
    return rc, *capsys.readouterr()


@pytest.mark.parametrize("args, names", [
    (["--page-size", "0"], "--page-size"),
    (["--max-batch-size", "0"], "--max-batch-size"),
    (["--max-batch-size", "257"], "--max-batch-size"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "ten"], "--max-new-tokens"),
    (["--num-pages", "-1"], "--num-pages"),
    (["--num-pages", "99999999999999999999"], "--num-pages"),  # past 64 bits: a traceback
    (["--impl", "fastest"], "--impl"),
    (["--device", "tpu"], "--device"),
    (["--gguf", "/no/such/model.gguf"], "--gguf"),
    (["--cache-dtype", "fp8_e4m3", "--impl", "gqa_reuse_v3"], "--impl"),
    pytest.param(["--device", "cuda"], "--device", marks=pytest.mark.skipif(
        not NO_GPU, reason="needs a machine without a GPU")),
    pytest.param(["--graphs", "--device", "cpu"], "--graphs", marks=pytest.mark.skipif(
        not NO_GPU, reason="needs a machine without a GPU")),
])
def test_generate_rejects_bad_arguments_in_one_line(args, names, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(model_module.Transformer, "from_gguf", no_load)
    rc, out, err = run(["generate", PROMPT, *args], capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedattn generate: error:"), err
    assert names in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("batches", ["1,0", "a,b", "1,,2", "", "300", "1.5"])
def test_bench_model_rejects_bad_batches(batches, capsys):
    rc, _, err = run(["bench-model", "--batches", batches, "--tiny"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err == ("pagedattn bench-model: error: argument --batches: expected comma-separated "
                   f"integers in [1, 256], got {batches!r} (see --help)\n")


@pytest.mark.parametrize("command", ["generate", "bench-model"])
@pytest.mark.parametrize("content, says", [
    (None, "no file at"),
    (b"hello, not a model\n", "is not a GGUF file"),
    (b"GGUF\x03\x00\x00\x00junk", "cannot load a llama model from"),  # the magic, then junk
])
def test_a_missing_or_bad_gguf_is_one_line_naming_gguf(command, content, says, tmp_path, capsys):
    """generate and bench-model say the same thing, ``--gguf: ...``, and exit 2."""
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    argv = [command, *([PROMPT] if command == "generate" else ["--no-hf", "--trace-requests",
                                                                "0", "--yes"]), "--gguf", str(path)]
    rc, out, err = run(argv, capsys)
    # bench-model on the CPU first says how long it expects to take (--yes: past 15 minutes)
    err = "".join(line for line in err.splitlines(keepends=True)
                  if not line.startswith("bench-model on the CPU: expect about"))
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1, err
    assert err.startswith(f"pagedattn {command}: error: --gguf: ") and says in err, err


def _tiny():
    from pagedattn.serving.baselines import random_weights
    from pagedattn.serving.bench_model import TINY_CFG
    from pagedattn.serving.gguf_loader import LlamaConfig

    cfg = LlamaConfig(**TINY_CFG)
    return model_module.Transformer(cfg, random_weights(cfg), device="cpu")


def test_stats_line_of_a_request_ended_by_eos_at_its_first_token():
    """A request whose first token (from the prefill) is EOS: the stats line says it stopped
    at end-of-sequence after 1 token, that no decode step ran, and the batch held 1."""
    from pagedattn.serving.engine import generate_greedy
    from pagedattn.serving.generate import summary

    model, prompt = _tiny(), [5, 17, 3]
    first = generate_greedy(model, [prompt], 1).requests[0].output[0]
    res = generate_greedy(model, [prompt], 5, eos_token_ids=[first])
    assert res.requests[0].output == [first] and res.stats.decode_steps == 0
    line = summary(res, 0.5, graphs=False)
    assert line.startswith("1 token in 0.50 s = 2.0 tokens/s, stopped at end-of-sequence "
                           "after 1 token; prefill 3 prompt tokens in "), line
    assert "no decode step" in line and "max batch 1," in line
    assert not PLURAL_OF_ONE.search(line) and "0 steps" not in line
    res = generate_greedy(model, [prompt, [9, 1]], 3)
    line = summary(res, 1.0, graphs=False)
    assert "6 tokens in" in line and "0 stopped at end-of-sequence, 2 at --max-new-tokens" in line
    assert "decode 4 tokens in 2 steps" in line


@pytest.mark.skipif(not NO_GPU, reason="the CPU user's path")
def test_stats_line_counts_the_token_discarded_after_eos():
    """"decode 3 tokens in 4 steps" read as a miscount: the step in flight when a request met
    EOS had its token discarded (tests/serving/test_engine.py checks the engine's count). The line
    says so, and says nothing when no token was discarded."""
    from types import SimpleNamespace

    from pagedattn.serving.engine import EngineStats
    from pagedattn.serving.generate import summary

    req = SimpleNamespace(output=[1, 2, 3, 4], finish_reason="eos", max_new_tokens=12)
    stats = EngineStats(prefill_steps=1, decode_steps=4, prefill_tokens=7, decode_tokens=3,
                        prefill_s=0.1, decode_s=0.4, max_running=1, discarded_tokens=1)
    line = summary(SimpleNamespace(stats=stats, requests=[req]), 1.0, graphs=True)
    assert ("decode 3 tokens in 4 steps (+1 token discarded: launched before the end was "
            "read), 0.40 s = 7.5 tokens/s") in line, line
    stats.discarded_tokens = 0
    line = summary(SimpleNamespace(stats=stats, requests=[req]), 1.0, graphs=True)
    assert "decode 3 tokens in 4 steps, 0.40 s" in line and "discarded" not in line, line


def test_generate_raw_readme_question_says_why_the_answer_is_empty(capsys):
    """The README's question with --raw: SmolLM2-Instruct (and transformers' greedy run on the
    same file) ends its turn at once without the chat template. The output says so."""
    from pagedattn.serving.gguf_loader import find_gguf

    try:
        find_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"no SmolLM2 GGUF file: {e}")
    rc, out, err = run(["generate", PROMPT, "--max-new-tokens", "12", "--raw"], capsys)
    assert rc == 0 and out == "\n"
    assert ("pagedattn generate: empty answer: the first token was the end-of-sequence token "
            "'<|im_end|>'; with --raw") in err
    assert "1 token in" in err and "stopped at end-of-sequence after 1 token" in err
    assert "no decode step" in err and "max batch 1," in err
    assert not PLURAL_OF_ONE.search(err), err


def test_bench_model_report_words_for_none_and_unmeasured():
    """The page says "no divergence" for a None divergence, gives small tokens/s as they are
    (0.28, not 0) and says "not measured" with the reason where no decode step was timed."""
    from pagedattn.serving.bench_model import to_markdown

    per_prompt = [{"first_divergence": None, "logits_rel_l2": 0.02},
                  {"first_divergence": 3, "logits_rel_l2": 0.05}]
    res = {"model": "m", "dtype": "bfloat16", "gpu": None, "git_commit": "c", "src_dirty": "no",
           "torch": "t", "new_tokens": 2, "page_size": 16, "command": "pagedattn bench-model",
           "modes": ["eager"], "transformers": False,
           "fixed": {"1": {"eager": {"decode_tokens_per_s": 0.28, "decode_steps": 1}},
                     "2": {"eager": {"decode_tokens_per_s": 0.0, "decode_steps": 0}}},
           "graphs_vs_eager": {},
           "transformers_agreement": {"mode": "eager", "first_divergence": None,
                                      "logits_rel_l2": 1e-6},
           "fp8": {"cache_dtype": "fp8_e4m3", "mode": "eager", "per_prompt": per_prompt,
                   "batch1": {"decode_tokens_per_s": 0.0, "decode_steps": 0}}}
    md = to_markdown(res)
    assert "None" not in md and "| 0 |" not in md
    assert "| 1 | 0.28 | not run (--no-hf) |" in md
    assert "| 2 | not measured (no decode step timed) | not run (--no-hf) |" in md
    assert "eager vs transformers (prompt 0): no divergence in 2 tokens" in md
    assert "prompt 0: no divergence in 2 tokens" in md
    assert "prompt 1: first divergence at token index 3" in md
    assert "fp8_e4m3 decode tokens/s at batch 1: not measured (no decode step timed)" in md
    assert "Triton's interpreter" in md  # a CPU page says its tokens/s are not performance


class _Tok:
    """The two tokenizer calls ``encode`` makes, with or without a chat template."""

    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert messages == [{"role": "user", "content": PROMPT}] and add_generation_prompt
        return {"input_ids": [1, 7, 2, 8]}  # transformers 5 returns an encoding

    def __call__(self, text):
        return {"input_ids": [7]}


def test_encode_uses_the_chat_template_when_there_is_one():
    assert encode(_Tok("{{ messages }}"), PROMPT) == [1, 7, 2, 8]
    assert encode(_Tok("{{ messages }}"), PROMPT, chat=False) == [7]  # --raw
    assert encode(_Tok(None), PROMPT) == [7]


def test_bench_model_tiny_smoke(tmp_path, capsys):
    """Every section of the benchmark on a tiny random model (eager only on the CPU): the
    JSON names the commit, the paged model agrees with transformers on the same weights."""
    out = tmp_path / "serving-cpu"
    with warnings.catch_warnings(record=True) as seen:  # fp8 steps pad rows: log2(0), x / 0
        warnings.simplefilter("always")
        rc, stdout, _ = run(["bench-model", "--tiny", "--dtype", "float32", "--out", str(out)],
                            capsys)
    assert rc == 0 and "| batch |" in stdout
    assert not [w for w in seen if "divide by zero" in str(w.message)]
    assert "first divergence None" not in stdout and "no divergence in 4 tokens" in stdout
    res = json.loads(out.with_suffix(".json").read_text())
    assert set(res["fixed"]) == {"1", "2"} and res["modes"] == ["eager"] + (
        [] if NO_GPU else ["graphs"])
    assert res["fixed"]["1"]["eager"]["decode_tokens_per_s"] > 0
    assert res["fixed"]["2"]["transformers"]["tokens_per_s"] > 0
    trace = res["trace"]["eager"]
    assert 0 < trace["tpot_p50_ms"] <= trace["tpot_p99_ms"]
    assert len(res["git_commit"]) == 40 and res["src_dirty"] in ("yes", "no")
    agree = res["transformers_agreement"]
    assert agree["first_divergence"] is None and agree["logits_rel_l2"] <= 1e-4
    assert len(res["fp8"]["per_prompt"]) == 4
    assert all(r["logits_rel_l2"] <= 0.1 for r in res["fp8"]["per_prompt"])
    assert out.with_suffix(".md").read_text().startswith("# Serving benchmark")


def test_bench_model_default_results_name_follows_the_gpu():
    from pagedattn.serving.bench_model import device_slug

    assert device_slug("NVIDIA H200") == "h200"  # the published serving-h200 pages
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert device_slug(None) == "cpu"


def test_the_batch_options_stop_at_the_largest_decode_bucket():
    """``--max-batch-size`` and ``--batches`` take up to ``_cli_types.MAX_BATCH``: the
    runner's largest bucket (a larger batch has no CUDA graph to replay)."""
    from pagedattn._cli_types import MAX_BATCH
    from pagedattn.serving.runner import BUCKETS

    assert BUCKETS[-1] == MAX_BATCH


# -- streaming: whole characters only ------------------------------------------------------

TEXT = "Hi 😀 世界, ok 👍🏽!"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A fast tokenizer whose tokens are single bytes (byte-level BPE without merges): every
    multi-byte character is split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from pagedattn.serving.gguf_loader import find_gguf

    try:
        path = find_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"no SmolLM2 GGUF file: {e}")
    return tokenizer_module.load_tokenizer(path)


def _pieces(tokenizer, ids):
    stream = TextStream(tokenizer)
    return [stream.push(t) for t in ids], stream


@pytest.mark.parametrize("which", ["byte_tokenizer", "smollm2_tokenizer"])
def test_text_stream_holds_back_incomplete_utf8(which, request):
    tokenizer = request.getfixturevalue(which)
    ids = tokenizer(TEXT)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # characters split by tokens
    pieces, stream = _pieces(tokenizer, ids)
    assert "".join(pieces) == TEXT and stream.end() == ""
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # something was held back


def test_text_stream_end_flushes_a_cut_character(byte_tokenizer):
    ids = byte_tokenizer("ok 😀")["input_ids"][:-2]  # generation stopped inside the emoji
    pieces, stream = _pieces(byte_tokenizer, ids)
    assert "".join(pieces) == "ok " and stream.end() == "\ufffd"


def test_text_stream_skips_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    pieces, stream = _pieces(tok, [*tok("Hi")["input_ids"], tok.eos_token_id])
    assert "".join(pieces) + stream.end() == "Hi"


def test_generate_streams_an_emoji_whole(byte_tokenizer, tmp_path, monkeypatch, capsys):
    """The CLI's one-prompt stream, on the byte tokenizer (the engine replaced by the token ids
    of TEXT, one callback each)."""
    from pagedattn.serving.baselines import random_weights
    from pagedattn.serving.bench_model import TINY_CFG
    from pagedattn.serving.gguf_loader import LlamaConfig

    ids = byte_tokenizer(TEXT)["input_ids"]
    cfg = LlamaConfig(**TINY_CFG)
    tiny = model_module.Transformer(cfg, random_weights(cfg), device="cpu")

    def fake_generate(model, prompts, max_new_tokens, *, on_token, **kwargs):
        r = engine_module.Request(0, prompts[0], max_new_tokens)
        for t in ids:
            r.output.append(t)
            on_token(r, t)
        r.finish_reason = "length"
        return engine_module.GenerateResult([r], engine_module.EngineStats())

    from pagedattn.serving import generate as generate_module

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda path: byte_tokenizer)
    monkeypatch.setattr(generate_module, "model_config", lambda args, path: cfg)  # metadata
    monkeypatch.setattr(model_module.Transformer, "from_gguf", lambda *a, **k: tiny)
    monkeypatch.setattr(engine_module, "generate_greedy", fake_generate)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    rc = cli.main(["generate", "x", "--raw", "--device", "cpu", "--gguf", str(gguf),
                   "--max-new-tokens", str(len(ids))])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == TEXT + "\n"
