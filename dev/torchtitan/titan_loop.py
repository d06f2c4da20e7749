"""A tiny torchtitan 0.3 training loop on CPU over gloo, saved by torchtitan's own
`CheckpointManager` or, layer by layer, by mpitailor's `DcpCheckpointer` behind it.

    torchrun --nproc_per_node 2 dev/torchtitan/titan_loop.py OUT --steps 6 --every 2 \
        [--layerwise] [--resume]

What is torchtitan's: the llama3 model (`Llama3Model`, its layers built as the debug model's
are, smaller), `OptimizersContainer` (AdamW), `LRSchedulersContainer` and `CheckpointManager`
with its `step-N/` dirs and entries (the model's own names at the top level, `optimizer`,
`lr_scheduler`, `dataloader`, `train_state`). What is not, and why (torchtitan's `Trainer`
does not run on a CPU-only torch; dev/torchtitan/README.md says where it stops):
- the attention is torchtitan's `ScaledDotProductAttention` (causal), not FlexAttention:
  torch's FlexAttention has no backward on CPU, and torchtitan 0.3's `get_attention_config`
  refuses "sdpa" by name for language models; with one document a sequence (positions
  0..L-1) the causal mask is the document mask FlexAttention would build;
- FSDP2 is `fully_shard` per layer, then the root, on a gloo mesh (parallelize_llama's
  dp_shard layout, without its CUDA-only options);
- the data are a fixed synthetic task, its position a `Stateful` (`dataloader`).

--layerwise: `LayerwiseCheckpointManager`, a `CheckpointManager` whose saves are
`DcpCheckpointer`'s (Parity: a full save, then odd and even layers in turn) with torchtitan's
other entries as `extra`, and whose load is `recover_for_resume` + `load_dcp`: the newest
copy of every layer, at this job's world size. --resume: load before training (torchtitan's
own `load()` for its saves). Rank 0 writes OUT/result.json: the losses and the last step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    Llama3Model,
    _build_llama3_layers,
    _output_linear_init,
)

DIM, VOCAB, LAYERS, HEADS, SEQ, BATCH = 16, 32, 2, 2, 16, 4


def build_model(fuse_qkv: bool = True) -> torch.nn.Module:
    """torchtitan's llama3, the debug model's recipe at a tiny size. fuse_qkv=False for
    torch's get_state_dict: the fused layout's state-dict hook names `wq`, `wk`, `wv`
    entries that are no modules, and get_state_dict's name check refuses them
    ("'FusedQKVLinear' object has no attribute 'wq'")."""
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=fuse_qkv, n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=2 * DIM,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000),
            attn_backend="flex"))
    for layer in config.layers:  # FlexAttention has no backward on CPU (see above)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = config.build()
    model.init_states()
    return model


class Batches(Stateful):
    """A fixed synthetic task (next token = token + 1 mod VOCAB), its position saved."""

    def __init__(self, rank: int) -> None:
        self.rank, self.step = rank, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.step += 1
        g = torch.Generator().manual_seed(1000 * self.step + self.rank)
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class LayerwiseCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager, its saves layer-wise (mpitailor's DcpCheckpointer:
    the model and optimizer by get_state_dict, the other entries torchtitan keeps as
    `extra`) and its load the newest copy of every layer (recover_for_resume)."""

    def __init__(self, config, *, model, optimizer, policy, **kw) -> None:
        super().__init__(config, **kw)
        from mpitailor.training import DcpCheckpointer
        # torchtitan's OptimizersContainer flattens by parameter name too
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)
        self.model, self.optimizer = model, optimizer
        self.layerwise = DcpCheckpointer(model, optimizer, self.folder, policy,
                                         options=self.options)

    def _trainer_entries(self) -> dict:
        return {k: v for k, v in self.states.items() if k not in ("model", "optimizer")}

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.layerwise.save(curr_step, extra=self._trainer_entries())
        return True

    def _load(self, step: int = -1) -> bool:
        from mpitailor.training import load_dcp, recover_for_resume
        path = recover_for_resume(self.folder)
        if path is None:
            return False
        load_dcp(self.model, self.optimizer, path, self.options, self._trainer_entries())
        return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--layerwise", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--full-every", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank, as a seed checkpoint
    model = build_model(fuse_qkv=not args.layerwise)
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=100)
    batches, train_state = Batches(rank), TrainState()
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=args.every,
                                      last_save_model_only=False, keep_latest_k=0)
    common = {"dataloader": batches, "model_parts": [model], "optimizers": optimizers,
                  "lr_schedulers": schedulers, "states": {"train_state": train_state},
                  "sd_adapter": None, "base_folder": args.out}
    if args.layerwise:
        from mpitailor.training import Parity
        (inner,) = optimizers.optimizers  # one model part, one AdamW
        ckpt = LayerwiseCheckpointManager(config, model=model, optimizer=inner,
                                          policy=Parity(full_every=args.full_every), **common)
    else:
        ckpt = CheckpointManager(config, **common)
    if args.resume:
        ckpt.load()
    losses = []
    while train_state.step < args.steps:
        train_state.step += 1
        inputs, labels = batches.next()
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        logits = model(inputs, positions, None)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses.append(float(loss.detach()))
        ckpt.save(train_state.step)
    if rank == 0:
        Path(args.out, "result.json").write_text(json.dumps(
            {"losses": losses, "step": train_state.step, "world_size": dist.get_world_size()}))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # interpreter teardown with gloo's threads alive can abort() now and then: exit at once
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
