"""Checkpoints at the loader's edges (issue 49): an FP8 checkpoint in each of transformers'
formats loads dequantized (the weights of its float twin, bit for bit, and transformers'
first-token logits), any other quantization is refused naming ``quantization_config`` or the
tensor, and a malformed ``config.json`` or tensor is one ValueError naming the field or the
tensor, at load."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_model_families import build, write_gguf  # noqa: E402  (a tiny random model)

from pagedattn.serving.config import load_hf  # noqa: E402
from pagedattn.serving.engine import generate_greedy  # noqa: E402
from pagedattn.serving.model import Transformer  # noqa: E402

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = (24, 40)  # divides neither 64 nor 128: short last blocks
#: format -> its quantization_config and the name of its scale tensors
FORMATS = {
    "per-tensor": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "type": "float", "num_bits": 8, "strategy": "tensor"}}}},
                   "weight_scale"),
    "per-channel": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
                    "weight_scale"),
    "block": ({"quant_method": "fp8", "activation_scheme": "dynamic",
               "weight_block_size": list(BLOCK)}, "weight_scale_inv"),
}


def _quantize(w: torch.Tensor, fmt: str):
    """``(codes, scale, codes x scale)`` of a float32 weight in ``fmt``; the product block by
    block, from the definition."""
    rows, cols = w.shape
    bm, bn = {"per-tensor": (rows, cols), "per-channel": (1, cols), "block": BLOCK}[fmt]
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            scale[i, j] = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].abs().amax() / E4M3_MAX
    codes = torch.empty(rows, cols, dtype=FP8)
    value = torch.empty(rows, cols)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = (slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))
            codes[part] = (w[part] / scale[i, j]).to(FP8)
            value[part] = codes[part].float() * scale[i, j]
    return codes, scale.reshape(1) if fmt == "per-tensor" else scale, value


def _write(path, config: dict, tensors: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                                str(path / "model.safetensors"))


def _checkpoints(tmp_path, fmt):
    """The tiny Llama as an FP8 checkpoint of ``fmt`` and as its float twin (the
    dequantized weights, no quantization_config)."""
    build("llama", tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    tensors = safetensors_torch.load_file(str(tmp_path / "src" / "model.safetensors"))
    quant_config, scale_name = FORMATS[fmt]
    fp8, twin = {}, {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            codes, scale, value = _quantize(t.float(), fmt)
            fp8[name], fp8[name[:-len("weight")] + scale_name] = codes, scale
            fp8[name[:-len("weight")] + "input_scale"] = torch.tensor(0.01)  # unused
            twin[name] = value
        else:
            fp8[name] = twin[name] = t
    fp8["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)  # a KV-cache scale: unused
    _write(tmp_path / "fp8", {**config, "quantization_config": quant_config}, fp8)
    _write(tmp_path / "float", config, twin)
    return tmp_path / "fp8", tmp_path / "float"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_loads_dequantized(tmp_path, fmt):
    """Each of transformers' FP8 formats: the weights of the float twin bit for bit, and
    the first token's logits of transformers' model of that twin (it was rel. L2 1.38 off,
    the codes cast to float and the scales dropped)."""
    fp8_dir, float_dir = _checkpoints(tmp_path, fmt)
    cfg, weights = load_hf(fp8_dir)
    _, want = load_hf(float_dir)
    assert weights.keys() == want.keys()
    for key, t in want.items():
        assert torch.equal(weights[key], t), key
    prompt = [5, 17, 99, 3, 64, 12]
    hf = transformers.AutoModelForCausalLM.from_pretrained(float_dir).float().eval()
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([prompt])).logits[0, -1]
    req = generate_greedy(Transformer.from_hf(fp8_dir), [prompt], 1, page_size=4,
                          keep_logits=True).requests[0]
    ours = req.logits[0]
    assert (ours - hf_logits).norm() / hf_logits.norm() < 1e-4
    assert int(ours.argmax()) == int(hf_logits.argmax())


def _src(tmp_path):
    build("llama", tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    return config, safetensors_torch.load_file(str(tmp_path / "src" / "model.safetensors"))


def test_other_quantizations_are_refused(tmp_path):
    """Never loaded silently: another quant_method or integer weights name
    quantization_config; int8 weights without one, float8 codes without their scale or a
    scale grid that does not fit name the tensor."""
    config, tensors = _src(tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    codes, scale, _ = _quantize(tensors[name].float(), "block")
    cases = [
        ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}, {},
         "^config.json: quantization_config: quant_method 'bitsandbytes'"),
        ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
            "g": {"weights": {"type": "int", "num_bits": 4}}}}}, {},
         "^config.json: quantization_config: config_groups.g.weights"),
        ({}, {name: tensors[name].to(torch.int8)}, f"^{name}: a torch.int8 tensor in a "
         "checkpoint without quantization_config"),
        ({"quantization_config": FORMATS["block"][0]}, {name: codes},
         f"^{name}: torch.float8_e4m3fn codes without"),
        ({"quantization_config": FORMATS["block"][0]},
         {name: codes, name + "_scale_inv": scale[:-1]}, f"^{name}_scale_inv: expected "),
        ({}, {name: codes}, f"^{name}: a torch.float8_e4m3fn tensor in a checkpoint without"),
    ]
    for i, (extra, changed, match) in enumerate(cases):
        _write(tmp_path / f"q{i}", {**config, **extra}, {**tensors, **changed})
        with pytest.raises(ValueError, match=match):
            load_hf(tmp_path / f"q{i}")


MALFORMED = [  # (config.json change, the start of the error)
    ("[]", "^config.json: expected a JSON object, got a list"),
    ({"rope_scaling": "linear"}, "^config.json: rope_scaling: expected an object"),
    ({"rope_scaling": {"rope_type": "llama3"}},
     r"^config.json: rope_scaling.factor: missing \(Llama 3's RoPE scaling\)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": "8k"}},
     "^config.json: rope_scaling.original_max_position_embeddings: expected a finite number"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "^config.json: rope_scaling.high_freq_factor: expected a number > low_freq_factor=4.0"),
    ({"num_hidden_layers": None}, "^config.json: num_hidden_layers: missing"),
    ({"num_hidden_layers": -1}, "^config.json: num_hidden_layers: expected an int >= 1"),
    ({"num_attention_heads": 0}, "^config.json: num_attention_heads: expected an int >= 1"),
    ({"num_key_value_heads": 3}, "^config.json: num_key_value_heads: expected a divisor"),
    ({"hidden_size": "64"}, "^config.json: hidden_size: expected an int >= 1, got '64'"),
    ({"rms_norm_eps": -1e-5}, "^config.json: rms_norm_eps: expected a finite number > 0"),
    ({"rope_theta": 0}, "^config.json: rope_theta: expected a finite number > 0"),
    ({"tie_word_embeddings": "false"},
     r"^config.json: tie_word_embeddings: expected a JSON boolean \(true or false\), got "
     "'false'"),
    ({"attention_bias": "false"}, "^config.json: attention_bias: expected a JSON boolean"),
    ({"layer_types": ["full_attention"]}, "^config.json: layer_types: expected a list of"),
    ({"intermediate_size": 96},
     r"^model.layers.0.mlp.gate_proj.weight: expected shape \(96, 64\) from config.json"),
    ({"vocab_size": 100}, r"^model.embed_tokens.weight: expected shape \(100, 64\)"),
    ({"head_dim": 8}, r"^model.layers.0.self_attn.q_proj.weight: expected shape \(32, 64\)"),
    ("{not json", "^config.json: not JSON"),
]


def test_malformed_checkpoints_are_one_error_at_load(tmp_path):
    """Each malformed config.json field or contradicting tensor: one ValueError naming it,
    at load (they were AttributeError, KeyError or ZeroDivisionError, a model of -1 layers,
    or a failure at the first forward)."""
    config, tensors = _src(tmp_path)
    for i, (change, match) in enumerate(MALFORMED):
        d = tmp_path / f"m{i}"
        if isinstance(change, str):
            _write(d, {}, tensors)
            (d / "config.json").write_text(change)
        else:
            _write(d, {k: v for k, v in {**config, **change}.items() if v is not None}, tensors)
        with pytest.raises(ValueError, match=match):
            load_hf(d)


def _gguf(tmp_path):
    """The tiny Llama's config and weights (``load_hf``'s), for a GGUF file of them."""
    build("llama", tmp_path / "hf")
    return load_hf(tmp_path / "hf")


@pytest.mark.parametrize("metadata, match", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
     r"^gguf: llama.rope.scaling.factor: RoPE scaling 'linear' by 4.0 is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
     r"^gguf: llama.rope.scaling.factor: RoPE scaling 'yarn' by 4.0"),
    ({"llama.rope.scale_linear": 2.0},  # the older key; no type is llama.cpp's "linear"
     r"^gguf: llama.rope.scale_linear: RoPE scaling 'linear' by 2.0"),
    ({"llama.rope.scaling.type": "ntk"}, r"^gguf: llama.rope.scaling.type: expected one of"),
    ({"llama.rope.scaling.attn_factor": 0.5},
     r"^gguf: llama.rope.scaling.attn_factor: RoPE's attention factor 0.5"),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0}, None),
])
def test_gguf_rope_scaling_is_refused(tmp_path, metadata, match):
    """A GGUF whose metadata scales RoPE (linear, YaRN: llama.cpp's keys) is refused naming
    the key, as config.json's rope_scaling is (it loaded with unscaled RoPE); a factor that
    scales nothing in llama.cpp (type none, factor 1) loads with the default frequencies."""
    pytest.importorskip("gguf")
    from pagedattn.serving.gguf_loader import load_gguf

    cfg, weights = _gguf(tmp_path)
    write_gguf(tmp_path / "m.gguf", cfg, weights, metadata=metadata)
    if match is None:
        gcfg, _ = load_gguf(tmp_path / "m.gguf")
        assert gcfg.rope_inv_freq == () and gcfg.rope_theta == cfg.rope_theta
    else:
        with pytest.raises(ValueError, match=match):
            load_gguf(tmp_path / "m.gguf")


def test_gguf_malformed_constants_and_rope_freqs_are_named(tmp_path):
    """A RoPE base or norm epsilon <= 0 names its key; a ``rope_freqs.weight`` entry that is
    not a finite factor > 0 names the entry (index and value), a wrong size the shape."""
    pytest.importorskip("gguf")
    import dataclasses

    from pagedattn.serving.gguf_loader import load_gguf

    cfg, weights = _gguf(tmp_path)
    half = cfg.head_dim // 2
    cases = [
        (dict(cfg=dataclasses.replace(cfg, rope_theta=-1.0)),
         r"^gguf: llama.rope.freq_base: expected a finite number > 0, got -1.0"),
        (dict(cfg=dataclasses.replace(cfg, rms_eps=-1e-5)),
         r"^gguf: llama.attention.layer_norm_rms_epsilon: expected a finite number > 0"),
        (dict(freqs=[1.0] * 3 + [0.0] + [1.0] * (half - 4)),
         r"^gguf: rope_freqs.weight\[3\]: expected a finite factor > 0, got 0.0$"),
        (dict(freqs=[1.0] * 5 + [float("nan")] + [1.0] * (half - 6)),
         r"^gguf: rope_freqs.weight\[5\]: expected a finite factor > 0, got nan$"),
        (dict(freqs=[1.0] * (half - 1)),
         rf"^gguf: rope_freqs.weight: expected {half} factors \(head_dim // 2\), got shape "
         rf"\({half - 1},\)"),
    ]
    for i, (change, match) in enumerate(cases):
        path = tmp_path / f"m{i}.gguf"
        freqs = change.get("freqs")
        write_gguf(path, change.get("cfg", cfg), weights, tensors=None if freqs is None else {
            "rope_freqs.weight": np.array(freqs, dtype=np.float32)})
        with pytest.raises(ValueError, match=match):
            load_gguf(path)


def test_gguf_without_a_required_field_is_named(tmp_path):
    """A llama GGUF file without its block count: a ValueError naming the field."""
    gguf = pytest.importorskip("gguf")
    from pagedattn.serving.gguf_loader import load_gguf

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_feed_forward_length(128)
    w.add_vocab_size(8)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="^gguf: llama.block_count: missing"):
        load_gguf(path)
