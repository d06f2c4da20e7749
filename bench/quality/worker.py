"""One DeepSpeed ZeRO-3 process of the study. Started by tinytrain's `launch`, not by hand.

argv: job.json result.json. Rank 0 writes the result.

"train":  trains `steps` steps from scratch and carries every saver of the job at once:
          saving does not change training (the identity control checks that a resume
          replays the run loss for loss), so one run stands for the pre-failure part of
          every policy. Records each save's step, bytes (du of its tag dir), seconds.
"resume": loads each checkpoint in turn into the same engine and trains it to `until`.
Both score the held-out batches every `eval_every` steps (and at `extra_evals`, and right
after a load).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from bench.quality import corpus as text
from bench.quality.spec import POLICIES, Job, SaveLog, Saver
from dev.tinytrain.model import build_model
from dev.tinytrain.spec import TrainSpec
from dev.tinytrain.worker import shutdown, skip_shm_build
from mpitailor.training import LayerwiseCheckpointer, make_policy, per_layer_param_groups

VOCAB = 256  # bytes


def ds_config(job: Job) -> dict:
    m = job.model
    return {
        "train_micro_batch_size_per_gpu": m.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": m.lr, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": m.total_steps, "warmup_num_steps": m.warmup,
            "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_engine(job: Job):
    import deepspeed

    torch.set_num_threads(job.threads)
    skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    m = job.model
    model = build_model(TrainSpec(save_dir="", world_size=job.world_size, layers=m.layers,
                                  hidden=m.hidden, intermediate=m.intermediate, heads=m.heads,
                                  kv_heads=m.heads, vocab=VOCAB, seq_len=m.seq_len,
                                  micro_batch=m.micro_batch, seed=job.seed))
    groups = per_layer_param_groups(model, weight_decay=0.1)  # exact Adam steps on recovery
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups,
                                      config=ds_config(job))
    return engine


class Trainer:
    """The training loop and the held-out score of one engine."""

    def __init__(self, job: Job, engine) -> None:
        self.job, self.engine, self.m = job, engine, job.model
        self.corpus = text.load()
        self.held_out = text.held_out_batches(self.corpus, self.m.eval_batches,
                                              self.m.eval_batch, self.m.seq_len)
        self.extra = set(job.extra_evals)

    def held_out_loss(self) -> float:
        """Collective: mean loss over the fixed held-out batches."""
        self.engine.eval()
        with torch.no_grad():
            losses = [float(self.engine(input_ids=ids, labels=ids).loss) for ids in self.held_out]
        self.engine.train()
        return sum(losses) / len(losses)

    def run(self, until: int, after_step=None) -> tuple[dict[int, float], dict[int, float]]:
        """Train from the engine's step to `until`. Returns ({step: train loss},
        {step: held-out loss})."""
        losses, evals = {}, {}
        rank = self.engine.global_rank
        for step in range(self.engine.global_steps + 1, until + 1):
            ids = text.train_batch(self.corpus, self.job.seed * 1000 + rank, step,
                                   self.m.micro_batch, self.m.seq_len)
            loss = self.engine(input_ids=ids, labels=ids).loss
            self.engine.backward(loss)
            self.engine.step()
            losses[step] = float(loss.detach())
            if self.engine.global_steps != step:
                raise RuntimeError(f"engine at step {self.engine.global_steps}, loop at {step}")
            if after_step is not None:
                after_step(step)
            if step % self.m.eval_every == 0 or step in self.extra:
                evals[step] = self.held_out_loss()
        return losses, evals


class Savers:
    """Every saver of a train job, each into its own dir at its own interval."""

    def __init__(self, engine, savers: tuple[Saver, ...]) -> None:
        self.engine, self.savers = engine, savers
        self.logs = {s.name: SaveLog() for s in savers}
        self.ckpts = {}
        for s in savers:
            if s.policy != "full":
                options = dict(POLICIES[s.policy])
                options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
                self.ckpts[s.name] = LayerwiseCheckpointer(engine, s.dir,
                                                           make_policy(options.pop("name"),
                                                                       **options),
                                                           asynchronous=s.asynchronous)

    def __call__(self, step: int) -> None:
        for s in self.savers:
            if self.due(s, step):
                self.save(s, step)

    def due(self, s: Saver, step: int) -> bool:
        """Full saves: every `every` steps. Layer-wise: when the budget allows (spec.Saver).
        A replay: at the steps it was given."""
        if s.at:
            return step in s.at
        if s.policy == "full":
            return step % s.every == 0
        log = self.logs[s.name]
        partial = [b for b, layers in zip(log.bytes, log.layers) if layers]
        if not log.steps:
            expected = s.full_bytes
        else:
            expected = sum(partial) / len(partial) if partial else s.first_estimate
        return sum(log.bytes) + expected <= s.bytes_per_step * step

    def save(self, s: Saver, step: int) -> None:
        tag = f"global_step{step}"
        start = time.perf_counter()
        if s.policy == "full":
            self.engine.save_checkpoint(s.dir, tag=tag)
            layers = []
        else:
            decision = self.ckpts[s.name].save(tag=tag)
            layers = [] if decision.full else sorted(decision.layers)
        seconds = time.perf_counter() - start
        log = self.logs[s.name]
        log.steps.append(step)
        log.seconds.append(seconds)
        # an asynchronous save is published later (its bytes are the synchronous one's)
        log.bytes.append(0 if s.asynchronous else
                         agreed_du(Path(s.dir) / tag, self.engine.global_rank))
        log.layers.append(layers)

    def finish(self) -> None:
        """Collective: wait for the asynchronous saves in flight; their held seconds."""
        for name, ckpt in self.ckpts.items():
            ckpt.wait()
            self.logs[name].held = sum(t.get("step_held", 0.0) for t in ckpt.timings)


def agreed_du(path: Path, rank: int) -> int:
    """Collective: bytes under `path` as rank 0 sees them, on every rank (the pacing of the
    saves must agree)."""
    import torch.distributed as dist
    box = [sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if rank == 0 else 0]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def train_job(job: Job, engine) -> dict:
    trainer = Trainer(job, engine)
    savers = Savers(engine, job.savers)
    start = time.perf_counter()
    losses, evals = trainer.run(job.steps, after_step=savers)
    savers.finish()
    return {"losses": losses, "evals": evals, "seconds": time.perf_counter() - start,
            "saves": {k: dataclasses.asdict(v) for k, v in savers.logs.items()}}


def resume_job(job: Job, engine) -> dict:
    trainer = Trainer(job, engine)
    out = {}
    for r in job.resumes:
        start = time.perf_counter()
        path, _ = engine.load_checkpoint(r.load_dir, tag=r.tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed loaded nothing from {r.load_dir}/{r.tag}")
        base = engine.global_steps
        loaded_eval = trainer.held_out_loss()
        losses, evals = trainer.run(r.until)
        out[r.name] = {"base_step": base, "loaded_eval": loaded_eval, "losses": losses,
                       "evals": evals, "seconds": time.perf_counter() - start}
    return out


def main(job_path: str, result_path: str) -> None:
    job = Job.read(Path(job_path))
    engine = build_engine(job)
    result = train_job(job, engine) if job.mode == "train" else resume_job(job, engine)
    if engine.global_rank == 0:
        Path(result_path).write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
