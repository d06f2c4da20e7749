"""HF Trainer + DeepSpeed on a machine without GPUs (to try mpitailor, or in CI).

Two things stop them there, and `enable_cpu_training()` undoes just those: accelerate finds
no distributed backend without a GPU and falls back to a world of one (DeepSpeed then fails
with "Check batch related parameters"), and HF refuses `bf16=True` without a GPU. It also
skips the CPU shared-memory all-reduce that DeepSpeed compiles with g++ at start (~25 s),
which gloo training does not need. Call it before making `TrainingArguments`; on GPUs,
leave it out.

End such a script with `end_cpu_training()`. ZeRO-3 keeps the gloo process groups alive
(every parameter holds one) past `destroy_process_group`, until the interpreter tears down;
a gloo thread that then drops its last tensor needs the GIL, which Python no longer hands
out, and the process aborts ("terminate called without an active exception", exit -6) after
the work is done: a Slurm job would be marked failed. Exiting at once avoids the teardown.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn


def enable_cpu_training(bf16: bool = True) -> None:
    import accelerate.state
    import deepspeed.comm.torch  # noqa: F401  (registers the module patched below)
    import transformers.training_args as ta
    from accelerate.utils import DistributedType

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
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
    if bf16:
        ta.is_torch_bf16_gpu_available = lambda: True


def end_cpu_training(code: int = 0) -> NoReturn:
    """Leave the process group, flush stdout/stderr and end the process with `code` now,
    without the interpreter's teardown (see above). Call it last, on every rank."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
