"""The DeepSeek-V2/V3-shaped model (``pagedattn.serving.deepseek``): tiny random-weight
transformers models saved as checkpoints, loaded by ``load_hf`` and generated greedily, a
batch of three prompts of different lengths through MLA decode (pagedattn's kernel, one plan
a step), token for token and logit for logit as transformers' own ``generate`` on each
prompt alone (fp32 on the CPU). Both model types, with and without ``q_lora_rank``, the
default rope and YaRN (its ``mscale`` folded into the softmax scale), V3's sigmoid router
with its correction bias and V2's softmax routers (``greedy``, ``group_limited_greedy``).
The loader's refusals name the field or the tensor."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedattn.serving.deepseek import DeepseekModel, hf_config, load_hf  # noqa: E402
from pagedattn.testing import rel_l2_error  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
              kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
              qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
              first_k_dense_replace=1, max_position_embeddings=256)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0}
MODELS = {
    "v3-yarn-q_lora": ("v3", dict(rope_scaling=YARN)),
    "v3-q_proj": ("v3", dict(q_lora_rank=None)),
    "v2-group-limited": ("v2", dict(topk_method="group_limited_greedy")),
    "v2-greedy-q_proj": ("v2", dict(q_lora_rank=None)),
}
PROMPTS = [[5, 17, 42], [3, 9, 27, 81, 100, 12, 7, 7, 1], list(range(20, 37))]


def _checkpoint(tmp_path, kind: str, over: dict):
    torch.manual_seed(0)
    if kind == "v3":
        model = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(norm_topk_prob=True, **{**COMMON, **over}))
    else:
        model = transformers.DeepseekV2ForCausalLM(
            transformers.DeepseekV2Config(**{**COMMON, **over}))
    model.eval()
    with torch.no_grad():  # larger weights: sharper attention, routing and next tokens
        for p in model.parameters():
            p.mul_(8)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_generates_as_transformers(tmp_path, name):
    ref_model = _checkpoint(tmp_path, *MODELS[name])
    ours = DeepseekModel.from_hf(tmp_path)
    tokens, logits = ours.generate(PROMPTS, 6, page_size=4, return_logits=True)
    for i, prompt in enumerate(PROMPTS):
        ref = ref_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, len(prompt):].tolist()
        assert tokens[i] == ref_tokens, (name, i)
        for step, scores in enumerate(ref.scores):  # each step's logits, this prompt's row
            assert rel_l2_error(logits[step][i], scores[0]) <= 1e-4, (name, i, step)


def test_loader_refusals(tmp_path):
    _checkpoint(tmp_path, "v3", {})
    cfg_path = tmp_path / "config.json"
    good = json.loads(cfg_path.read_text())
    assert hf_config(good).topk_method == "noaux_tc"
    for change, field in [({"model_type": "llama"}, "model_type"),
                          ({"n_group": 3}, "n_group"),
                          ({"topk_group": 5}, "topk_group"),
                          ({"num_key_value_heads": 2}, "num_key_value_heads"),
                          ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
                           "rope_scaling"),
                          ({"kv_lora_rank": 0}, "kv_lora_rank"),
                          ({"topk_method": "greedy"}, "topk_method"),
                          # constants out of range, groups of one expert (noaux_tc sums each
                          # group's top two), more experts than the kept groups hold, and
                          # switches that are not JSON booleans ("false" is not false)
                          ({"rope_theta": -1.0}, "rope_theta"),
                          ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
                          ({"rope_parameters": dict(YARN, factor=0.0)},
                           r"rope_parameters\.factor"),
                          ({"rope_parameters": dict(YARN, beta_fast=-1.0)},
                           r"rope_parameters\.beta_fast"),
                          ({"n_group": 4}, "n_group"),
                          ({"num_experts_per_tok": 3}, "num_experts_per_tok"),
                          ({"norm_topk_prob": "false"}, "norm_topk_prob"),
                          ({"tie_word_embeddings": "false"}, "tie_word_embeddings")]:
        with pytest.raises(ValueError, match=f"config.json: {field}:"):
            hf_config({**good, **change})
    cfg_path.write_text(json.dumps({**good, "kv_lora_rank": 16}))
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa\.weight: expected shape"):
        load_hf(tmp_path)
    cfg_path.write_text(json.dumps({**good, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match="tensors missing"):
        load_hf(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_hf(tmp_path / "nowhere")
