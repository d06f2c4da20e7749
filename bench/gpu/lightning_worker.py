"""Lightning `DeepSpeedStrategy` (ZeRO stage 3, bf16-mixed) on one GPU: train the tiny Llama
and save twice with `trainer.save_checkpoint` (or resume from `load_dir` with
`trainer.fit(ckpt_path=...)` and train on).

argv: spec.json result.json. spec.extra: {"save_at": [3, 6], "root": DIR}. Each save is a
directory `DIR/saveN/` in DeepSpeed's layout with the tag `checkpoint` (Lightning's):
`latest`, `checkpoint/` (model states + optimizer states), `zero_to_fp32.py`.
The LightningModule holds the Llama's `model` and `lm_head` as its own children, so that
the parameter names are the HF ones (`model.layers.N.*`, `model.embed_tokens`, `lm_head`).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from bench.gpu.common import RunSpec, batch, build_llama, deterministic, write_json


def main(spec_path: str, result_path: str) -> None:
    t_start = time.perf_counter()
    spec = RunSpec.read(spec_path)
    import torch
    import torch.nn.functional as F
    deterministic(spec.seed)
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import DeepSpeedStrategy
    except ImportError:  # the standalone package
        import pytorch_lightning as pl
        from pytorch_lightning.strategies import DeepSpeedStrategy
    from mpitailor.training import per_layer_param_groups

    class TinyLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            llama = build_llama(spec)
            self.model, self.lm_head = llama.model, llama.lm_head
            self.losses: list[dict] = []

        def training_step(self, batch_, batch_idx):
            ids = batch_[0]
            hidden = self.model(input_ids=ids).last_hidden_state
            logits = self.lm_head(hidden).float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   ids[:, 1:].reshape(-1))
            self.losses.append({"step": self.trainer.global_step + 1,
                                "loss": float(loss.detach())})
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(per_layer_param_groups(self, 0.01), lr=spec.lr)

    root = Path(spec.extra["root"])
    saved: list[dict] = []

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch_, batch_idx):
            if trainer.global_step in spec.extra.get("save_at", ()):
                path = root / f"save{trainer.global_step}"
                t0 = time.perf_counter()
                trainer.save_checkpoint(str(path))
                saved.append({"step": trainer.global_step, "path": str(path),
                              "seconds": time.perf_counter() - t0})

    # one batch per step: the dataset is `steps` micro-batches stacked along dim 0
    data = torch.cat([batch(spec, s) for s in range(1, spec.steps + 1)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data),
                                         batch_size=spec.micro_batch, shuffle=False)
    module = TinyLlama()
    trainer = pl.Trainer(accelerator="gpu" if spec.device == "cuda" else "cpu", devices=1,
                         strategy=DeepSpeedStrategy(stage=3),
                         precision="bf16-mixed", max_steps=spec.steps, max_epochs=-1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[SaveAt()])
    t_fit = time.perf_counter()
    trainer.fit(module, loader, ckpt_path=spec.load_dir)
    engine = trainer.strategy.deepspeed_engine
    import deepspeed
    result = {"name": spec.name, "lightning": pl.__version__, "torch": torch.__version__,
              "deepspeed": deepspeed.__version__,
              "gpu": torch.cuda.get_device_name(0) if spec.device == "cuda" else None,
              "steps": module.losses, "saves": saved, "global_step": trainer.global_step,
              "engine_global_steps": engine.global_steps,
              "zero_stage": engine.zero_optimization_stage(),
              "bf16": engine.bfloat16_enabled(),
              "param_names": [n for n, _ in module.named_parameters()][:6],
              "seconds": {"init": t_fit - t_start, "fit": time.perf_counter() - t_fit}}
    write_json(result_path, result)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
