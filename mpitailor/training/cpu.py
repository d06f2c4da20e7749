"""HF Trainer + DeepSpeed on a machine without GPUs (to try mpitailor, or in CI).

Two things stop them there, and `enable_cpu_training()` undoes just those: accelerate finds
no distributed backend without a GPU and falls back to a world of one (DeepSpeed then fails
with "Check batch related parameters"), and HF refuses `bf16=True` without a GPU. It also
skips the CPU shared-memory all-reduce that DeepSpeed compiles with g++ at start (~25 s),
which gloo training does not need. Call it before making `TrainingArguments`; on GPUs,
leave it out.
"""
from __future__ import annotations

import os
import sys


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
