"""``pagedattn generate`` / ``bench-model`` argument checks (one line on stderr, exit status 2,
before any model loads), the chat-template choice of the tokenizer module, and the benchmark's
CPU smoke run on a tiny random model."""

import json

import pytest
import torch

from pagedattn import cli
from pagedattn.serving import model as model_module
from pagedattn.serving.tokenizer import encode

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


def test_bench_model_rejects_bad_batches(capsys):
    rc, _, err = run(["bench-model", "--batches", "1,0", "--tiny"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "--batches" in err


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
    rc, stdout, _ = run(["bench-model", "--tiny", "--dtype", "float32", "--out", str(out)],
                        capsys)
    assert rc == 0 and "| batch |" in stdout
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
