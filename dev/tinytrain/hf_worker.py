"""One rank of a tiny HF Trainer + DeepSpeed ZeRO-3 run (the `checkpoint-N/` layout).

argv: spec.json result.json. Saves at spec.save_at into spec.save_dir/checkpoint-N;
with spec.load_dir set, resumes with `trainer.train(resume_from_checkpoint=load_dir)`
("last": `resume_from_checkpoint=True`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dev.tinytrain.model import batch, build_model
from dev.tinytrain.spec import TrainSpec
from dev.tinytrain.worker import SMALL_BUCKETS, shutdown
from mpitailor.training import enable_cpu_training


class TokenData(torch.utils.data.Dataset):
    def __init__(self, spec: TrainSpec, n: int) -> None:
        self.rows = [batch(spec, i, 0)[0] for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(spec_path: str, result_path: str) -> None:
    spec = TrainSpec.from_json(Path(spec_path).read_text())
    enable_cpu_training(bf16=spec.dtype == "bf16")
    import transformers

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto",
          "zero_optimization": {"stage": spec.zero_stage, "sub_group_size": spec.sub_group_size,
                                **SMALL_BUCKETS, "stage3_gather_16bit_weights_on_model_save": spec.save_16bit},
          "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True,
          "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9}
    save_every = spec.save_at[0]
    args = transformers.TrainingArguments(
        output_dir=spec.save_dir, max_steps=spec.steps, save_steps=save_every,
        save_strategy="steps", per_device_train_batch_size=spec.micro_batch,
        learning_rate=spec.lr, weight_decay=0.01, warmup_steps=2, logging_steps=1,
        bf16=spec.dtype == "bf16", deepspeed=ds, report_to=[], seed=spec.seed,
        dataloader_num_workers=0, save_only_model=False, use_cpu=False,
        save_total_limit=(spec.policy or {}).get("keep_last"))
    model = build_model(spec)
    data = TokenData(spec, spec.steps * spec.micro_batch * spec.world_size * 2)
    if spec.policy is not None and spec.hf_trainer == "layerwise":
        from mpitailor.training.hf import LayerwiseTrainer
        from mpitailor.training.policies import make_policy
        options = dict(spec.policy)
        options.pop("keep_last", None)  # LayerwiseTrainer takes it as save_total_limit
        trainer = LayerwiseTrainer(policy=make_policy(options.pop("name"), **options),
                                   stats=spec.stats, layer_patterns=spec.layer_patterns,
                                   per_layer_groups=spec.per_layer_groups,
                                   asynchronous=spec.async_save, model=model,
                                   args=args, train_dataset=data)
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=True if spec.load_dir == "last" else spec.load_dir)
    if trainer.args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        Path(result_path).write_text(json.dumps(
            {"losses": losses, "global_steps": trainer.state.global_step,
             "world_size": trainer.args.world_size,
             "param_groups": len(getattr(trainer.optimizer, "param_groups", ())),
             "save_timings": getattr(getattr(trainer, "_layerwise", None), "timings", None)}))
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
