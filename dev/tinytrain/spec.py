"""What a tiny training run does: a plain, JSON-serialisable record."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("fp32", "bf16")
GROUPINGS = ("one", "decay", "per_layer")


@dataclass(frozen=True)
class TrainSpec:
    """One tiny DeepSpeed ZeRO-3 run: model, optimizer layout, steps, saves, resume."""

    save_dir: str
    world_size: int = 2
    arch: str = "llama"       # any HF model type that builds tiny (tiny_config)
    layers: int = 4
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    seq_len: int = 16
    micro_batch: int = 2
    tie: bool = False
    dtype: str = "fp32"
    grouping: str = "one"
    sub_group_size: int = 1_000_000_000
    zero_stage: int = 3
    save_16bit: bool = False  # HF Trainer: also save gathered 16-bit model.safetensors
    policy: dict | None = None  # layer-wise saving: {"name": "parity", **options}
    stats: str | None = None    # HDF5 update-statistics log of the policy's saves
    frozen: tuple[str, ...] = ()
    seed: int = 1234
    lr: float = 1e-3
    steps: int = 10
    save_at: tuple[int, ...] = (5, 10)
    load_dir: str | None = None
    load_tag: str | None = None
    load_universal: bool = False  # resume from a Universal checkpoint (any world size)
    node_local_storage: bool = False  # DeepSpeed's use_node_local_storage: a save dir per node
    data_seed: int = 0
    task: str = "random"      # "random" tokens, or "copy": learnable, with a held-out set
    eval_batches: int = 0     # held-out batches scored after training (copy task)
    step_sleep: float = 0.0  # seconds after each step: a run slow enough to interrupt
    client_state: bool = False  # save ordinary objects (Namespace, numpy, dataclass) too
    layer_patterns: dict | None = None  # layer-wise saving: {regex: layer key}
    hf_trainer: str = "layerwise"  # HF runs with a policy: "layerwise" or plain "trainer"
    per_layer_groups: bool = True  # LayerwiseTrainer's default: one param group per layer
    then_resume: int = 0  # after training: recover the own saves, load them, train N steps
    async_save: bool = False  # layer-wise saving: partial saves written in the background
    max_host_bytes: int | str | None = None  # ... with host buffers of at most this many bytes
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        if self.load_tag is not None and self.load_dir is None:
            raise ValueError("load_tag needs load_dir")

    def changes(self) -> dict:
        """The fields that differ from the defaults (a stable cache key as fields are added)."""
        base = TrainSpec(save_dir=self.save_dir)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainSpec":
        raw = json.loads(text)
        raw["frozen"] = tuple(raw["frozen"])
        raw["save_at"] = tuple(raw["save_at"])
        if isinstance(raw.get("policy"), dict) and "always" in raw["policy"]:
            raw["policy"]["always"] = tuple(raw["policy"]["always"])
        return cls(**raw)

    def write(self, path: Path) -> None:
        path.write_text(self.to_json())
