"""Layer keys for the parameter names of real HF models of each supported family."""
from __future__ import annotations

import pytest
import transformers

from mpitailor.layers import LayerClassifier, classify, layer_index, sort_keys

SMALL = dict(vocab_size=64, num_hidden_layers=3, num_attention_heads=2, hidden_size=16,
             intermediate_size=32)


def tiny(family: str):
    t = transformers
    if family == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_layer=3, n_head=2, n_embd=16))
    if family == "gpt_neox":
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**SMALL))
    cfg, cls = {"llama": (t.LlamaConfig, t.LlamaForCausalLM),
                "mistral": (t.MistralConfig, t.MistralForCausalLM),
                "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM)}[family]
    return cls(cfg(**SMALL, num_key_value_heads=1, tie_word_embeddings=False))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2", "gpt_neox"])
def test_every_parameter_of_a_real_model_gets_its_layer(family):
    model = tiny(family)
    keys = {}
    for name, _ in model.named_parameters():
        keys.setdefault(classify(name), []).append(name)
    assert "other" not in keys, keys.get("other")
    expect = {"embed", "norm", "layers.0", "layers.1", "layers.2"}
    if family != "gpt2":  # GPT-2 always ties lm_head to wte: no separate parameter
        expect.add("lm_head")
    assert set(keys) == expect
    # Every block holds the same number of parameters: nothing leaked to the wrong layer.
    assert len({len(keys[f"layers.{i}"]) for i in range(3)}) == 1


def test_wrappers_and_overrides():
    assert classify("module.model.layers.12.mlp.up_proj.weight") == "layers.12"
    assert classify("model.rotary_emb.inv_freq") == "other"
    custom = LayerClassifier({r"vision\.(\d+)\..*": "layers.{i}", r"proj\..*": "lm_head"})
    assert custom("vision.3.w") == "layers.3" and custom("proj.weight") == "lm_head"
    assert custom("model.layers.1.x") == "layers.1"


def test_model_order():
    assert sort_keys(["lm_head", "layers.10", "norm", "layers.2", "embed", "other"]) == \
        ["embed", "layers.2", "layers.10", "norm", "lm_head", "other"]
    assert layer_index("layers.7") == 7 and layer_index("embed") is None
