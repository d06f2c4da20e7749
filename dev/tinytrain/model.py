"""Tiny random-init models and their data, identical on every rank for a given seed."""
from __future__ import annotations

import torch

from dev.tinytrain.spec import TrainSpec


def tiny_config(spec: TrainSpec):
    """A tiny config of architecture `spec.arch` (any HF model type), sizes from the spec.
    Configs name their sizes differently; the common names are set where the config has
    them (or maps them: GPT-2's n_embd answers to hidden_size)."""
    import transformers

    config = transformers.AutoConfig.for_model(spec.arch)
    sizes = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                 num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                 intermediate_size=spec.intermediate, ffn_dim=spec.intermediate,
                 n_inner=spec.intermediate, max_position_embeddings=max(64, spec.seq_len),
                 n_positions=max(64, spec.seq_len), head_dim=spec.hidden // spec.heads,
                 rotary_dim=spec.hidden // spec.heads,
                 word_embed_proj_dim=spec.hidden, tie_word_embeddings=spec.tie)
    for key, value in sizes.items():
        if key == "tie_word_embeddings" or hasattr(config, key) or \
                key in getattr(config, "attribute_map", {}):
            try:
                setattr(config, key, value)
            except AttributeError:  # derived (a read-only property): follows the others
                pass
    for i, key in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):
        if (getattr(config, key, None) or 0) >= spec.vocab:  # a default for a big vocabulary
            setattr(config, key, i)
    return config


def build_model(spec: TrainSpec) -> torch.nn.Module:
    import transformers

    config = tiny_config(spec)
    cls = transformers.AutoModelForCausalLM
    torch.manual_seed(spec.seed)
    model = cls.from_config(config)
    for name, p in model.named_parameters():
        if name in spec.frozen:
            p.requires_grad_(False)
    missing = set(spec.frozen) - {n for n, _ in model.named_parameters()}
    if missing:
        raise ValueError(f"frozen names not in the model: {sorted(missing)}")
    return model


def batch(spec: TrainSpec, step: int, rank: int) -> torch.Tensor:
    """Token ids for one micro-batch: random but a pure function of (seed, step, rank)."""
    g = torch.Generator().manual_seed(spec.data_seed * 1_000_003 + step * 131 + rank)
    return torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq_len), generator=g)


EVAL_SEED = 10**9  # held-out batches come from a seed range training never uses


def task_batch(spec: TrainSpec, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of one micro-batch. "copy": half random tokens, a separator (0),
    the same tokens again; only the copy is scored, so the task is learnable."""
    if spec.task == "random":
        ids = batch(spec, step, rank)
        return ids, ids
    half = (spec.seq_len - 1) // 2
    g = torch.Generator().manual_seed(spec.data_seed * 1_000_003 + step * 131 + rank)
    x = torch.randint(1, spec.vocab, (spec.micro_batch, half), generator=g)
    ids = torch.cat([x, torch.zeros(spec.micro_batch, 1, dtype=x.dtype), x], dim=1)
    labels = ids.clone()
    labels[:, : half + 1] = -100
    return ids, labels


def held_out_loss(spec: TrainSpec, engine) -> float:
    """Mean loss over spec.eval_batches fixed batches (collective: every rank runs them)."""
    losses = []
    with torch.no_grad():
        for i in range(spec.eval_batches):
            ids, labels = task_batch(spec, EVAL_SEED + i, 0)
            losses.append(float(engine(input_ids=ids, labels=labels).loss.float()))
    return sum(losses) / max(1, len(losses))
