"""Layer keys for the parameter names of real HF models of each supported family."""
from __future__ import annotations

import pytest
import transformers

from mpitailor.planning.layers import LayerClassifier, classify, layer_index, sort_keys
from dev.tinytrain.model import build_model
from dev.tinytrain.spec import TrainSpec

# Decoder-only architectures, built tiny from their HF configs (random init, no download).
ARCHS = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
         "phi", "phi3", "gpt2", "gpt_neo", "gptj", "gpt_neox", "gpt_bigcode", "opt", "falcon",
         "bloom", "stablelm", "olmo", "olmo2", "mpt", "codegen", "starcoder2", "mamba"]
NO_FINAL_NORM_WEIGHTS = {"olmo"}  # its final LayerNorm has no parameters


@pytest.mark.parametrize("arch", ARCHS)
def test_every_parameter_of_a_real_model_gets_its_layer(arch):
    transformers.logging.set_verbosity_error()
    model = build_model(TrainSpec(save_dir="unused", arch=arch, layers=3))
    keys = {}
    for name, _ in model.named_parameters():
        keys.setdefault(classify(name), []).append(name)
    assert "other" not in keys, keys.get("other")
    expect = {"embed", "norm", "lm_head", "layers.0", "layers.1", "layers.2"}
    if arch in NO_FINAL_NORM_WEIGHTS:
        expect.discard("norm")
    assert set(keys) == expect, sorted(keys)
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
