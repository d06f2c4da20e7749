"""DeepSpeed training on a machine without GPUs (to try mpitailor, or in CI): a plain
DeepSpeed loop, HF Trainer or Accelerate, as real multi-process gloo worlds.

`enable_cpu_training()`, called first thing (before `deepspeed.initialize`,
`TrainingArguments` or `Accelerator`), undoes what stops them there:

- every loop: DeepSpeed compiles a CPU shared-memory all-reduce with g++ when it sets up its
  communication (~25 s, and a failure without a compiler); gloo training does not need it.
- HF Trainer and Accelerate: accelerate finds no distributed backend without a GPU and
  falls back to a world of one (a Trainer then fails with "Check batch related
  parameters"). Under a launcher (LOCAL_RANK set) it gets gloo.
- HF Trainer: HF refuses `bf16=True` without a GPU (`bf16=False` leaves that alone).

The accelerate and transformers parts apply only where those are installed (a plain loop
needs neither). On GPUs, leave it out.

End such a script with `end_cpu_training()`. ZeRO-3 keeps the gloo process groups alive
(every parameter holds one) past `destroy_process_group`, until the interpreter tears down;
a gloo thread that then drops its last tensor needs the GIL, which Python no longer hands
out, and the process aborts ("terminate called without an active exception", exit -6) after
the work is done: a Slurm job would be marked failed. Exiting at once avoids the teardown.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import NoReturn


def enable_cpu_training(bf16: bool = True) -> None:
    import deepspeed.comm.torch  # noqa: F401  (registers the module patched below)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    # DeepSpeed's ZeRO calls collectives torch 2.13 deprecates, warning twice a step on
    # every rank: dozens of lines that bury the run's own (nothing a user can change).
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|"
                                    r"reduce_scatter_tensor)` is deprecated")
    if importlib.util.find_spec("accelerate") is not None:
        _accelerate_on_gloo()
    if bf16 and importlib.util.find_spec("transformers") is not None:
        import transformers.training_args as ta
        ta.is_torch_bf16_gpu_available = lambda: True


def _accelerate_on_gloo() -> None:
    import accelerate.state
    from accelerate.utils import DistributedType

    orig = accelerate.state.PartialState.__init__
    if getattr(orig, "_mpitailor_cpu", False):
        return

    def init(self, cpu: bool = False, **kwargs):
        if "LOCAL_RANK" in os.environ and not kwargs.get("backend"):
            kwargs["backend"] = "gloo"
        orig(self, cpu, **kwargs)
        if self.distributed_type == DistributedType.NO and int(os.environ.get("WORLD_SIZE",
                                                                               "1")) > 1:
            self.distributed_type = DistributedType.MULTI_CPU
    init._mpitailor_cpu = True
    accelerate.state.PartialState.__init__ = init


def end_cpu_training(code: int = 0) -> NoReturn:
    """Wait for the asynchronous layer-wise saves still in flight (saying so, one line; one
    that failed makes the exit code 1), leave the process group, flush stdout/stderr and end
    the process with `code` now, without the interpreter's teardown (see above). Call it
    last, on every rank. (A bare `os._exit` skips the wait: call `ckpt.wait()` before it.)"""
    from mpitailor.training.distcomm import leave_process_group
    code = _wait_for_saves(code)
    leave_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for_saves(code: int) -> int:
    """Collective: every live LayerwiseCheckpointer's save in flight published (or its
    failure said, on every rank): the exit code, 1 where one failed."""
    if "mpitailor.training.checkpointer" not in sys.modules:
        return code  # no checkpointer was ever made
    import logging

    from mpitailor.display import shown
    from mpitailor.training.checkpointer import saves_in_flight
    from mpitailor.training.distcomm import training_comm
    from mpitailor.training.notice import make_visible
    from mpitailor.training.snapshot import PartialSaveFailed
    log = logging.getLogger(__name__)
    rank = training_comm().rank
    for ckpt, tag_dir in saves_in_flight():
        make_visible()
        if rank == 0:
            log.info("end_cpu_training: waiting for the asynchronous save of %s to be "
                     "published", shown(tag_dir))
        try:
            ckpt.wait()
        except PartialSaveFailed as e:
            log.error("end_cpu_training: %s; exiting with 1", e)
            code = code or 1
    return code
