"""An asynchronous save's snapshot overlapped with the next training step.

A partial save holds the fp32 master weights and both Adam moments of its layers. Only the
optimizer's step changes them (forward and backward touch the low-precision parameters and
the gradients), so the copy of the slices into host buffers need not stop training: it runs
in the background writer's thread while the next step's forward and backward run, and a
hook before the optimizer's step holds that step until the copy is done (CheckFreq's
pipelined snapshot, FAST'21).

The hook is a step pre-hook of the torch optimizer inside DeepSpeed's ZeRO optimizer
(`engine.optimizer.optimizer`): DeepSpeed's engine, the HF Trainer and Accelerate all reach
the weights through it. Where there is none (another optimizer wrapper), the snapshot is
copied while training waits, and the checkpointer says so once.
"""
from __future__ import annotations

import threading
import time

from mpitailor.training import dependencies

with dependencies(__name__):
    import torch


def inner_optimizer(engine) -> torch.optim.Optimizer | None:
    """The torch optimizer whose step changes the fp32 master weights and the moments (the
    one DeepSpeed's ZeRO optimizer wraps), or None when there is no such."""
    opt = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    return opt if isinstance(opt, torch.optim.Optimizer) else None


class StepGuard:
    """Holds the engine's next optimizer step while a snapshot is being copied.

    arm() before the copy starts (the training thread), release() once it is done or failed
    (the copying thread; a failure is raised at the next save or wait(), the step goes on:
    the copy no longer reads the state). `waited` sums the seconds steps were held."""

    def __init__(self, engine) -> None:
        self._done = threading.Event()
        self._done.set()
        self.waited = 0.0
        opt = inner_optimizer(engine)
        self._handle = opt.register_step_pre_hook(self._before_step) if opt is not None else None

    @property
    def installed(self) -> bool:
        return self._handle is not None

    def arm(self) -> None:
        self._done.clear()

    def release(self) -> None:
        self._done.set()

    def wait(self) -> float:
        """Wait for the copy (if one runs); the seconds waited."""
        if self._done.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._done.wait()
        return time.perf_counter() - t0

    def _before_step(self, *_) -> None:
        self.waited += self.wait()
