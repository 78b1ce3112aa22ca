"""Streaming text from generated token ids: a character split across byte-level tokens (an emoji,
CJK) is printed once complete, never as U+FFFD. ``pagedattn generate`` decoded each step's whole
output and printed the new suffix, so a half-decoded character printed "�" and the completed
one was then never printed."""

import pytest

from pagedattn import cli
from pagedattn.serving import engine as engine_module
from pagedattn.serving import model as model_module
from pagedattn.serving import tokenizer as tokenizer_module
from pagedattn.serving.tokenizer import TextStream

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
