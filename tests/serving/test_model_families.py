"""The model seam (pagedattn.serving.config) and its family table (pagedattn.serving.families):
for each family of ``FAMILIES``, a tiny random-weight transformers model (its ``CASES`` entry:
Mistral with a sliding window shorter than the sequence, Gemma 2 with soft-caps and alternating
windows), saved as safetensors, loaded by ``load_hf`` and generated through the Engine (paged
cache, the plan API's kernel), token for token and logit for logit as transformers' greedy
``generate``; each variant a family adds changes the logits when switched off. The table's
generated text (the CLI's help, the unsupported-``model_type`` error, ``docs/models.md``)
follows it.

Tolerance: everything runs in float32 on both sides; the only differences are summation
orders (the kernel's online softmax and split-KV merge, SDPA against eager matmuls), worth a
few ulps of the O(1..10) logits, so 1e-4 absolute and relative is loose by two orders of
magnitude yet far below the differences a dropped variant makes (asserted: above 1e-2)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from pagedattn.serving.config import hf_config, load_hf  # noqa: E402
from pagedattn.serving.engine import generate_greedy  # noqa: E402
from pagedattn.serving.families import FAMILIES, families_markdown, family_names  # noqa: E402
from pagedattn.serving.model import Transformer  # noqa: E402

PROMPT_LEN, NEW_TOKENS, WINDOW = 6, 8, 4  # 13 tokens in the cache: longer than the window
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64)
NO_VARIANT = [(-1, None)]  # a decode step's one plan: no window, no soft-cap


@dataclasses.dataclass(frozen=True)
class Case:
    """A family's test entry: its transformers config class and the keys it adds to
    ``SHAPE``; the ``(window_left, logits_soft_cap)`` of each plan a decode step makes; the
    ``ModelConfig`` changes and the weights (name endings, zeroed) that each switch one of
    its variants off."""

    config: type
    extra: dict = dataclasses.field(default_factory=dict)
    plans: list = dataclasses.field(default_factory=lambda: NO_VARIANT)
    off: list = dataclasses.field(default_factory=list)
    off_weights: tuple = ()


#: one entry per family of FAMILIES (test_every_family_has_a_case)
CASES = {
    "llama": Case(transformers.LlamaConfig),
    "mistral": Case(transformers.MistralConfig, {"sliding_window": WINDOW},
                    plans=[(WINDOW - 1, None)], off=[{"window_left": ()}]),
    "qwen2": Case(transformers.Qwen2Config, off_weights=("bq", "bk", "bv")),
    "qwen3": Case(transformers.Qwen3Config),
    "gemma": Case(transformers.GemmaConfig),
    "gemma2": Case(transformers.Gemma2Config, {
        "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 5.0},
        plans=[(WINDOW - 1, 5.0), (-1, 5.0)],
        off=[{"window_left": ()}, {"logits_soft_cap": ()}, {"final_logit_soft_cap": 0.0}]),
}


def build(family: str, tmp_path, extra: dict | None = None):
    """A random-weight transformers model of ``family`` (``extra``: more config keys), saved
    to ``tmp_path``. Every parameter is redrawn (biases and norms too: their init is 0 / 1),
    Q/K large enough that Gemma 2's scores pass its soft-cap of 5."""
    case = CASES[family]
    cfg = case.config(**SHAPE, **case.extra, **(extra or {}), attn_implementation="eager",
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                mean = 1.0 - FAMILIES[family].norm_offset  # Gemma scales by (1 + w)
                p.copy_(mean + 0.2 * torch.randn(p.shape, generator=g))
            else:
                std = 0.5 if "q_proj" in name or "k_proj" in name else 0.2
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path)
    return model


def hf_greedy(model, prompt):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def engine_greedy(model: Transformer, prompt):
    req = generate_greedy(model, [prompt], NEW_TOKENS, page_size=4, keep_logits=True).requests[0]
    return req.output, torch.stack(req.logits)


@pytest.fixture
def planned(monkeypatch):
    """The (window_left, logits_soft_cap) of every decode plan the model makes."""
    import pagedattn.serving.model as m
    calls, real = [], m.plan_decode

    def recording(*args, **kwargs):
        calls.append((kwargs["window_left"], kwargs["logits_soft_cap"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(m, "plan_decode", recording)
    return calls


def test_every_family_has_a_case():
    assert list(CASES) == list(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_generates_as_transformers(family, tmp_path, planned):
    case = CASES[family]
    hf = build(family, tmp_path)
    prompt = torch.randint(1, 128, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    prompt = prompt.tolist()
    want_tokens, want_logits = hf_greedy(hf, prompt)
    cfg, weights = load_hf(tmp_path)
    model = Transformer(cfg, weights, impl="auto")
    got_tokens, got_logits = engine_greedy(model, prompt)
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    # each decode step plans once per distinct variant pair of the layers
    assert planned == case.plans * (NEW_TOKENS - 1)
    # the prompt prefilled chunk by chunk over the paged cache (Transformer.extend, the
    # variants applied by the prefill kernel): the same tokens and logits
    chunked = generate_greedy(model, [prompt], NEW_TOKENS, page_size=4, keep_logits=True,
                              max_prefill_tokens=5)
    assert chunked.stats.extend_steps >= 2
    assert chunked.requests[0].output == want_tokens
    torch.testing.assert_close(torch.stack(chunked.requests[0].logits), want_logits,
                               rtol=1e-4, atol=1e-4)

    # the variants bite: each one switched off changes the logits
    if case.off_weights:
        off_weights = {k: (torch.zeros_like(v) if k.endswith(case.off_weights) else v)
                       for k, v in weights.items()}
        _, logits = engine_greedy(Transformer(cfg, off_weights), prompt)
        assert (logits - want_logits).abs().max() > 1e-2
    for change in case.off:
        _, logits = engine_greedy(Transformer(dataclasses.replace(cfg, **change), weights),
                                  prompt)
        assert (logits - want_logits).abs().max() > 1e-2, change
    if case.off:  # a backend that applies no variants is refused for such a model
        from pagedattn.serving.baselines import DenseAttention
        with pytest.raises(ValueError, match="applies no attention variants"):
            model.with_attention(DenseAttention())


#: Llama 3.x's RoPE scaling, its original context cut to 16 tokens so that most of the 8
#: frequencies of a 16-dim head fall in the scaled or the blended band
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _llama3(tmp_path):
    """A tiny Llama 3.x model, saved to ``tmp_path`` (transformers 5 names the RoPE object
    ``rope_parameters`` and puts the base in it; 4.x ``rope_scaling``)."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return build("llama", tmp_path, {"rope_parameters": dict(LLAMA3_ROPE,
                                                                 rope_theta=10000.0)})
    return build("llama", tmp_path, {"rope_scaling": LLAMA3_ROPE})


def _prompt():
    g = torch.Generator().manual_seed(2)
    return torch.randint(1, 128, (PROMPT_LEN,), generator=g).tolist()


def test_llama3_rope_scaling_generates_as_transformers(tmp_path):
    """Llama 3.x (``rope_type`` llama3): the frequencies are transformers' own bits, the
    model generates as transformers token for token, and the scaling bites (the default
    frequencies change the logits)."""
    hf = _llama3(tmp_path)
    cfg, weights = load_hf(tmp_path)
    unscaled = dataclasses.replace(cfg, rope_inv_freq=())
    assert torch.equal(cfg.inv_freq(), hf.model.rotary_emb.inv_freq.float())
    assert not torch.equal(cfg.inv_freq(), unscaled.inv_freq())
    want_tokens, want_logits = hf_greedy(hf, _prompt())
    got_tokens, got_logits = engine_greedy(Transformer(cfg, weights), _prompt())
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    _, logits = engine_greedy(Transformer(unscaled, weights), _prompt())
    assert (logits - want_logits).abs().max() > 1e-2


def write_gguf(path, cfg, weights, *, metadata: dict | None = None,
               tensors: dict | None = None) -> None:
    """``cfg`` and ``weights`` (``load_hf``'s) as a llama.cpp GGUF file at ``path``, the Q/K
    rows permuted as llama.cpp's converter does. ``metadata``: more keys (a str written as a
    string, a number as float32); ``tensors``: more tensors (name -> numpy array), first."""
    import gguf

    from pagedattn.serving import gguf_loader

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_q_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in (metadata or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    for name, t in (tensors or {}).items():
        w.add_tensor(name, t)
    gguf_names = {ours: suffix for suffix, ours in gguf_loader._LAYER_NAMES.items()}
    for name, t in weights.items():
        t = t.numpy()
        if name.startswith("layers."):
            _, i, ours = name.split(".", 2)
            if ours in ("wq", "wk"):  # llama.cpp's permute, undone by the loader
                heads = cfg.num_q_heads if ours == "wq" else cfg.num_kv_heads
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2)
                t = t.reshape(-1, cfg.hidden_size)
            w.add_tensor(f"blk.{i}.{gguf_names[ours]}", t.copy())
        else:
            w.add_tensor({"embed": "token_embd.weight", "final_norm": "output_norm.weight"}[name],
                         t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_llama3_gguf_rope_freqs(tmp_path):
    """The same model as a llama.cpp GGUF (Q/K rows permuted as llama.cpp's converter does,
    the scaling as ``rope_freqs.weight``, per-frequency divisors): ``load_gguf`` applies
    them, and the model generates as transformers."""
    pytest.importorskip("gguf")
    from pagedattn.serving import gguf_loader

    hf = _llama3(tmp_path / "hf")
    cfg, weights = load_hf(tmp_path / "hf")
    divisors = dataclasses.replace(cfg, rope_inv_freq=()).inv_freq() / cfg.inv_freq()
    path = tmp_path / "llama3.gguf"
    write_gguf(path, cfg, weights, tensors={"rope_freqs.weight": divisors.numpy()})
    gcfg, gweights = gguf_loader.load_gguf(path)
    torch.testing.assert_close(gcfg.inv_freq(), cfg.inv_freq(), rtol=1e-6, atol=0)
    want_tokens, want_logits = hf_greedy(hf, _prompt())
    got_tokens, got_logits = engine_greedy(Transformer(gcfg, gweights), _prompt())
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    # the lab's transformers baseline of a GGUF (bench-model) takes the same frequencies
    from pagedattn.serving.baselines import hf_from_weights
    base_tokens, base_logits = hf_greedy(
        hf_from_weights(gcfg, gweights, torch.float32, "cpu"), _prompt())
    assert base_tokens == want_tokens
    torch.testing.assert_close(base_logits, want_logits, rtol=1e-4, atol=1e-4)


def test_hf_config_variants_per_layer():
    """HF's sliding_window w (keys with q - k < w) is the kernel's window_left w - 1; Gemma 2
    slides on even layers; a Qwen window is off unless use_sliding_window, and then on the
    layers from max_window_layers on (transformers' default 28)."""
    base = dict(SHAPE, num_hidden_layers=4)
    g = hf_config(dict(base, model_type="gemma2", sliding_window=4, query_pre_attn_scalar=16,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       hidden_activation="gelu_pytorch_tanh"))
    assert g.window_left == (3, -1, 3, -1) and g.logits_soft_cap == (50.0,) * 4
    assert g.attn_scale == 16 ** -0.5 and g.final_logit_soft_cap == 30.0
    assert g.activation == "gelu_tanh" and g.post_norms and g.embed_scale == 8.0
    assert hf_config(dict(base, model_type="mistral", sliding_window=5)).window_left == (4,) * 4
    assert hf_config(dict(base, model_type="qwen2", sliding_window=5)).window_left == ()
    for mt in ("qwen2", "qwen3"):
        qwen = dict(base, model_type=mt, sliding_window=5, use_sliding_window=True)
        assert hf_config(dict(qwen, max_window_layers=2)).window_left == (-1, -1, 4, 4)
        assert hf_config(dict(qwen, max_window_layers=0)).window_left == (4,) * 4
        assert hf_config(qwen).window_left == ()  # layers 28 on: none of the 4
    q3 = hf_config(dict(base, model_type="qwen3"))
    assert q3.qk_norm and not q3.qkv_bias


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_window_from_max_window_layers(family, tmp_path):
    """A Qwen config.json with ``use_sliding_window`` and no ``layer_types`` (Qwen's released
    configs have none): transformers slides the layers from ``max_window_layers`` on (here
    layer 1 of 2), and so does the loader, token for token and logit for logit; the window
    bites (dropped, the logits change)."""
    hf = build(family, tmp_path, {"use_sliding_window": True, "sliding_window": WINDOW,
                                  "max_window_layers": 1})
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, weights = load_hf(tmp_path)
    assert cfg.window_left == (-1, WINDOW - 1)
    want_tokens, want_logits = hf_greedy(hf, _prompt())
    got_tokens, got_logits = engine_greedy(Transformer(cfg, weights), _prompt())
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    _, logits = engine_greedy(Transformer(dataclasses.replace(cfg, window_left=()), weights),
                              _prompt())
    assert (logits - want_logits).abs().max() > 1e-2


def test_gemma_legacy_gelu_config(tmp_path):
    """Gemma 1's released config.json says ``"hidden_act": "gelu"``, which transformers reads
    as the tanh approximation: the loader does too (it refused the file), and the model
    generates as transformers' token for token; without the key, tanh-GELU as well."""
    assert transformers.GemmaConfig(hidden_act="gelu").hidden_act == "gelu_pytorch_tanh"
    hf = build("gemma", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, hidden_act="gelu")))
    cfg, weights = load_hf(tmp_path)
    assert cfg.activation == "gelu_tanh"
    want_tokens, want_logits = hf_greedy(hf, _prompt())
    got_tokens, got_logits = engine_greedy(Transformer(cfg, weights), _prompt())
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    del raw["hidden_act"]
    assert hf_config(raw).activation == "gelu_tanh"
    with pytest.raises(ValueError, match="^config.json: hidden_act: activation 'gelu' is not"):
        hf_config(dict(raw, model_type="llama", hidden_act="gelu"))  # Gemma's reading only


def test_load_hf_refuses_other_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(SHAPE, model_type="phi3")))
    listed = re.escape(f"(expected one of {', '.join(FAMILIES)})")
    with pytest.raises(ValueError, match=f"model_type 'phi3' is not supported {listed}"):
        load_hf(tmp_path)
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        hf_config(dict(SHAPE, model_type="llama", rope_scaling={"rope_type": "yarn"}))
    with pytest.raises(ValueError, match="attention_bias"):
        hf_config(dict(SHAPE, model_type="llama", attention_bias=True))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path / "nowhere")


def test_generate_cli_serves_a_hugging_face_directory(tmp_path, capsys):
    """``pagedattn generate --model DIR``: the Gemma 2 model with a word-level tokenizer
    prints transformers' greedy continuation; a directory without config.json is one line,
    exit 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from pagedattn import cli

    words = {f"w{i}": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(
        tmp_path)
    hf = build("gemma2", tmp_path)
    prompt = [5, 17, 3, 99, 42, 7]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    argv = ["generate", " ".join(f"w{t}" for t in prompt), "--raw", "--device", "cpu",
            "--max-new-tokens", str(NEW_TOKENS), "--model", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert len(out.split()) > 1 and out.split() == [f"w{t}" for t in want
                                                    if t != hf.config.eos_token_id], out
    try:
        rc = cli.main(argv[:-1] + [str(tmp_path / "nowhere")])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--model: no config.json" in err, err


def test_docs_models_md_is_the_generated_table():
    """docs/models.md is families_markdown()'s text: regenerate it with
    ``PYTHONPATH=src python -m pagedattn.serving.families > docs/models.md``."""
    path = Path(__file__).resolve().parents[2] / "docs" / "models.md"
    assert path.read_text(encoding="utf-8") == families_markdown(), (
        "docs/models.md is stale: run PYTHONPATH=src python -m pagedattn.serving.families "
        "> docs/models.md")
    for mt, spec in FAMILIES.items():
        assert f"| `{mt}` | {spec.name} |" in families_markdown()


def test_generate_help_names_every_family():
    from pagedattn import cli
    from pagedattn._cli_types import OneLineParser

    parser = OneLineParser(prog="pagedattn generate")
    cli._command("generate").add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert f"of a {family_names()} model" in text, text
    assert all(spec.name in family_names() for spec in FAMILIES.values())
