"""What every gpu_check worker shares: the tiny Llama, its data, the rank environment."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RunSpec:
    """One training run (one process, world size 1)."""

    name: str
    device: str = "cuda"            # "cuda" (NCCL) or "cpu" (gloo; development of the script)
    stage: int = 3
    dtype: str = "bf16"             # bf16 | fp16 | fp32
    steps: int = 12                 # train up to and including this step
    save_every: int = 2             # a layer-wise save every N steps (0: none)
    full_every: int = 3             # Parity(full_every=K): saves 0, K, 2K, ... are full
    crash_after: int | None = None  # stop dead after this step (and its save), no shutdown
    asynchronous: bool = True       # LayerwiseCheckpointer(asynchronous=...)
    save_dir: str | None = None
    load_dir: str | None = None     # engine.load_checkpoint(load_dir, tag=load_tag)
    load_tag: str | None = None
    seed: int = 1234
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    seq_len: int = 64
    micro_batch: int = 8
    lr: float = 2e-3
    extra: dict = field(default_factory=dict)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, path: str | Path) -> RunSpec:
        return cls(**json.loads(Path(path).read_text()))


def llama_config(spec: RunSpec):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden,
                       num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                       num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
                       max_position_embeddings=max(128, spec.seq_len),
                       tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)


def build_llama(spec: RunSpec):
    """A random-init LlamaForCausalLM from a config (no download), the same for a seed.
    Eager attention: its backward has no atomics, so runs can be compared bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(llama_config(spec), attn_implementation="eager")


def batch(spec: RunSpec, step: int):
    """Token ids of one micro-batch: half random tokens, a separator, the same tokens again
    (learnable); a pure function of (seed, step). Labels = ids (HF shifts them)."""
    import torch
    half = (spec.seq_len - 1) // 2
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + step * 131)
    x = torch.randint(3, spec.vocab, (spec.micro_batch, half), generator=g)
    pad = spec.seq_len - 2 * half
    return torch.cat([x, torch.zeros(spec.micro_batch, pad, dtype=x.dtype), x], dim=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "SLURM_")


def child_env(device: str, port: int | None = None) -> dict[str, str]:
    """A world of one for torch.distributed; the repo first on PYTHONPATH (the workers are
    `python -m bench.gpu.*`, mpitailor may be a snapshot beside them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    path = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()),
               PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2",
               # deterministic cuBLAS (bit-exact run-to-run comparisons)
               CUBLAS_WORKSPACE_CONFIG=":4096:8", NCCL_DEBUG=env.get("NCCL_DEBUG", "WARN"))
    if device == "cuda":
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one host: bootstrap over loopback
    if device == "cpu":
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME="lo")
    return env


def deterministic(seed: int) -> None:
    """Bit-exact runs, and the same rng states saved (python's and numpy's seeded too)."""
    import random

    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def skip_shm_build() -> None:
    """On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce at init (~25 s of g++) that
    gloo training does not need."""
    import deepspeed.comm.torch  # noqa: F401  (registers the module)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def digest(tensors) -> str:
    """sha256 over the bytes of tensors, in order (fp32 on the CPU)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def write_json(path: str | Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
