"""What a correct merge is, stated independently of mpitailor: the test oracle.

`check_merge` compares every parameter slice of every output rank (fp32 master, exp_avg,
exp_avg_sq; padding excluded) with the same slice of the source the test says that layer
must come from, plus frozen fragments, counters and per-sub-group Adam steps; for ZeRO
stages 1/2 also every 16-bit weight and buffer of the one model-states file.

It shares no code with what it checks: nothing here imports `mpitailor`. Files are read
with `torch.load(weights_only=True, mmap=True)` and an explicit allow-list of DeepSpeed's
own classes, by DeepSpeed's own key names; the partition arithmetic is written out again
below from `deepspeed/utils/zero_to_fp32.py`, and layers are told apart by a small regex
that covers the fixtures' Llama and Qwen2 parameter names.
"""
from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

import torch
from safetensors import safe_open

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
PARTIAL_MANIFEST = "mpitailor_partial.json"  # a partial save (mpitailor's own format)
STAGE12_MODEL = "mp_rank_00_model_states.pt"


# ---------------------------------------------------------------------------------------------
# Reading files

@cache
def _allowed() -> list:
    """The only globals DeepSpeed's optimizer files pickle (fragment_address: stage 1/2)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _load(path: Path):
    with torch.serialization.safe_globals(_allowed()):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def layer_key(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `layers.3`; else embed / norm / lm_head / other
    (enough for the fixtures' LlamaForCausalLM and Qwen2ForCausalLM names)."""
    if m := re.match(r"model\.layers\.(\d+)\.", name):
        return f"layers.{int(m.group(1))}"
    if name.startswith("lm_head."):
        return "lm_head"
    if name.startswith("model.embed_tokens."):
        return "embed"
    if name.startswith("model.norm."):
        return "norm"
    return "other"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: equality of these is bitwise equality (-0.0 != 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


class Ckpt:
    """One checkpoint on disk: a DeepSpeed tag dir (ZeRO 1/2/3), a save dir or HF
    `checkpoint-N/` whose `latest` names one, or a partial save of mpitailor's checkpointer
    (`mpitailor_partial.json`, per rank `rank_{r}_model_states.pt`, `rank_{r}_optim_meta.pt`
    and `rank_{r}_layers.safetensors` holding records `{kind}/{name}`)."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        if not any(path.glob("*optim_states.pt")) and not (path / PARTIAL_MANIFEST).exists():
            path = path / (path / "latest").read_text().strip()
        self.tag_dir = path
        self.partial = (path / PARTIAL_MANIFEST).exists()
        self._models: dict[int, dict] = {}
        self._optims: dict[int, dict] = {}
        self._pieces: dict[int, dict] = {}
        if self.partial:
            manifest = json.loads((path / PARTIAL_MANIFEST).read_text())
            self.world_size = int(manifest["world_size"])
            self.held_layers = frozenset(manifest["layers"])
            names = [f"rank_{r}_layers.safetensors" for r in range(self.world_size)]
            assert all((path / n).is_file() for n in names), path
        else:
            optims = {int(m.group(2)): p for p in path.iterdir()
                      if (m := re.fullmatch(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states"
                                            r"\.pt", p.name))}
            assert sorted(optims) == list(range(len(optims))) and optims, (path, sorted(optims))
            self.world_size = len(optims)
            self._optim_paths = optims
        osd = self.optim(0)["optimizer_state_dict"]
        self.stage = int(osd["zero_stage"])
        self.flat = self.stage in (1, 2)
        if not self.partial:
            models = sorted(p.name for p in path.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
            if self.flat:
                assert not models and (path / STAGE12_MODEL).is_file(), path
            else:
                assert len(models) == self.world_size, (path, models)
        model = self.model(0)
        assert int(model["dp_world_size"]) == self.world_size, path
        counts = osd["partition_count"]
        assert {int(c) for c in (counts if isinstance(counts, (list, tuple)) else [counts])} \
            == {self.world_size}, (path, counts)
        self.param_shapes = [{n: tuple(int(d) for d in s) for n, s in g.items()}
                             for g in model["param_shapes"]]
        self.global_steps = int(model["global_steps"])

    @property
    def tag(self) -> str:
        return self.tag_dir.name

    def model(self, r: int) -> dict:
        if r not in self._models:
            name = f"rank_{r}_model_states.pt" if self.partial else \
                STAGE12_MODEL if self.flat else f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            self._models[r] = _load(self.tag_dir / name)
        return self._models[r]

    def optim(self, r: int) -> dict:
        if r not in self._optims:
            path = self.tag_dir / f"rank_{r}_optim_meta.pt" if self.partial \
                else self._optim_paths[r]
            self._optims[r] = _load(path)
        return self._optims[r]

    def inner(self, r: int) -> dict:
        """The torch Adam state dict (`state[g]` = step, exp_avg, exp_avg_sq)."""
        osd = self.optim(r)["optimizer_state_dict"]
        return osd["base_optimizer_state" if self.flat else "optimizer_state_dict"]

    def step(self, r: int, g: int) -> float:
        return float(self.inner(r)["state"][g]["step"])

    def pieces(self, r: int) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
        """name -> (first element of the parameter, {kind: the elements rank r holds}) for
        every parameter of which rank r holds real elements (padding left out). A partial
        save holds only some layers: the others are absent."""
        if r not in self._pieces:
            where = (_stage12_slices if self.flat else _stage3_slices)(self.param_shapes,
                                                                       self.world_size, r)
            self._pieces[r] = self._read_partial(r, where) if self.partial \
                else self._read_full(r, where)
        return self._pieces[r]

    def _read_full(self, r: int, where) -> dict:
        osd = self.optim(r)["optimizer_state_dict"]
        fp32 = osd["single_partition_of_fp32_groups" if self.flat else "fp32_flat_groups"]
        state = self.inner(r)["state"]
        assert len(fp32) == len(self.param_shapes), self.tag_dir
        buffers = {g: {"fp32": fp32[g], **{k: state[g][k] for k in KINDS[1:]}}
                   for g in range(len(self.param_shapes))}
        for g, size in enumerate(where.sizes):
            # stage 3: every buffer is the concatenation of this rank's slices. Stage 1/2:
            # the moments keep the whole partition, the fp32 master drops its padding.
            assert buffers[g]["exp_avg"].numel() == buffers[g]["exp_avg_sq"].numel() == size
            assert buffers[g]["fp32"].numel() == (where.lean[g] if self.flat else size), \
                (self.tag_dir, r, g)
            assert all(t.dtype == torch.float32 for t in buffers[g].values())
        if self.flat and "param_slice_mappings" in osd:  # DeepSpeed's own record agrees
            mine = [{} for _ in self.param_shapes]
            for name, (g, at, _, n, _) in where.items():
                mine[g][name] = (n, at)
            theirs = [{name: (int(a.numel), int(a.start)) for name, a in group.items()}
                      for group in osd["param_slice_mappings"]]
            assert mine == theirs, (self.tag_dir, r, "param_slice_mappings")
        return {name: (first, {k: buffers[g][k][at: at + n] for k in KINDS})
                for name, (g, at, first, n, _) in where.items()}

    def _read_partial(self, r: int, where) -> dict:
        out = {}
        with safe_open(self.tag_dir / f"rank_{r}_layers.safetensors", "pt") as f:
            records = set(f.keys())
            for name, (_, _, first, n, stored) in where.items():
                if f"fp32/{name}" not in records:
                    assert layer_key(name) not in self.held_layers, (self.tag_dir, name)
                    continue
                tensors = {}
                for k in KINDS:
                    t = f.get_tensor(f"{k}/{name}")
                    # stage 3: the slice with its padding; stage 1/2: what the rank holds
                    assert t.dtype == torch.float32 and t.numel() == stored, (name, k)
                    tensors[k] = t[:n]
                out[name] = (first, tensors)
        return out

    def full_fp32(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's fp32 master weights, put together from all ranks."""
        out = {}
        for shapes in self.param_shapes:
            for name, shape in shapes.items():
                flat = torch.full((math.prod(shape),), float("nan"))
                covered = 0
                for r in range(self.world_size):
                    if name in self.pieces(r):
                        first, t = self.pieces(r)[name]
                        flat[first: first + t["fp32"].numel()] = t["fp32"]
                        covered += t["fp32"].numel()
                assert covered == flat.numel(), (self.tag_dir, name, covered)
                out[name] = flat.view(shape)
        return out


class _Where(dict):
    """name -> (sub-group, offset in the rank's buffer, first element of the parameter,
    real elements, elements stored for it in a partial save); plus per sub-group the
    buffer size (`sizes`) and, stage 1/2, the fp32 partition without padding (`lean`)."""
    sizes: list[int]
    lean: list[int]


def _stage3_slices(param_shapes, world: int, r: int) -> _Where:
    """ZeRO-3 (zero_to_fp32.zero3_partitioned_param_info): every parameter is cut on its
    own into `world` slices of ceil(n / world) elements; rank r holds elements
    [r*pn, (r+1)*pn) of the zero-padded parameter; its buffer concatenates its slices."""
    where = _Where()
    where.sizes = []
    for g, shapes in enumerate(param_shapes):
        off = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            pn = math.ceil(n / world)
            real = max(0, min(pn, n - r * pn))
            if real:
                where[name] = (g, off, r * pn, real, pn)
            off += pn
        where.sizes.append(off)
    return where


def _stage12_slices(param_shapes, world: int, r: int) -> _Where:
    """ZeRO-1/2 (zero_to_fp32._zero2_merge_trainable_params): a group's parameters are
    concatenated into one flat buffer of N elements, padded to a multiple of 2*world and cut
    into `world` equal partitions; rank r holds [r*P, (r+1)*P). A parameter can straddle
    ranks."""
    where = _Where()
    where.sizes, where.lean = [], []
    for g, shapes in enumerate(param_shapes):
        total = sum(math.prod(s) for s in shapes.values())
        p = 2 * world * math.ceil(total / (2 * world)) // world
        start, end = r * p, (r + 1) * p
        off = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            lo, hi = max(off, start), min(off + n, end)
            if lo < hi:
                where[name] = (g, lo - start, lo - off, hi - lo, hi - lo)
            off += n
        where.sizes.append(p)
        where.lean.append(max(0, min(p, total - start)))
    return where


# ---------------------------------------------------------------------------------------------
# The checks

def check_merge(out: Path, expected: dict[str, Path], base: Path) -> None:
    """expected: layer key -> source checkpoint; base: source of counters and config."""
    merged = Ckpt(out)
    sources = {p: Ckpt(p) for p in set(expected.values()) | {base}}
    b = sources[base]
    assert not merged.partial, out
    assert merged.world_size == b.world_size, (merged.world_size, b.world_size)
    assert merged.global_steps == b.global_steps, ("global_steps", merged.global_steps,
                                                   b.global_steps)
    assert merged.stage == b.stage, ("zero_stage", merged.stage, b.stage)
    assert merged.param_shapes == b.param_shapes, "param_shapes"
    assert merged.tag == b.tag, ("tag", merged.tag, b.tag)

    def source_of(name: str) -> Ckpt:
        key = layer_key(name)
        assert key in expected, f"{name}: layer {key} has no expected source"
        return sources[expected[key]]

    if merged.flat:
        _check_weights16(merged, source_of)
    for r in range(merged.world_size):
        _check_rank(merged, r, source_of, b)


def _check_weights16(merged: Ckpt, source_of) -> None:
    """Stage 1/2: the one model-states file holds the whole model. Its 16-bit weights must be
    the merged fp32 master weights cast down (checked against the sources below), frozen
    parameters and buffers those of their layer's source."""
    module = merged.model(0)["module"]
    fp32 = merged.full_fp32()
    aliases = dict(merged.model(0).get("shared_params") or {})
    for name, t in module.items():
        target = aliases.get(name, name)
        if target in fp32:
            assert _same_bits(t, fp32[target].to(t.dtype)), name
            continue
        src = source_of(target).model(0)
        want = src["module"][name]
        if want.numel() != t.numel():  # a partial save's placeholder: frozen, kept whole
            want = src["frozen_param_fragments"][target].to(t.dtype).view(t.shape)
        assert _same_bits(t, want), name


def _check_rank(merged: Ckpt, r: int, source_of, base: Ckpt) -> None:
    got = merged.pieces(r)
    for shapes in merged.param_shapes:
        for name in shapes:
            src = source_of(name)
            want = src.pieces(r)
            assert name in want or name not in got, \
                f"{name}: output rank {r} holds part of it, {src.tag_dir} rank {r} does not"
            assert name in got or name not in want, \
                f"{name}: {src.tag_dir} rank {r} holds part of it, output rank {r} does not"
            if name not in got:
                continue
            assert got[name][0] == want[name][0], (name, r)
            for k in KINDS:
                assert _same_bits(got[name][1][k], want[name][1][k]), (name, k, r)

    m = merged.model(r)
    for name, frag in (m.get("frozen_param_fragments") or {}).items():
        want = source_of(name).model(r)["frozen_param_fragments"][name]
        assert _same_bits(frag, want), name
    bm = base.model(r)
    for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler",
                "dp_world_size", "param_shapes", "shared_params", "ds_config"):
        assert m[key] == bm[key], key
    # Each sub-group's Adam step: exact when one source owns it, else the newest's.
    for g, shapes in enumerate(merged.param_shapes):
        steps = {source_of(name).step(r, g) for name in shapes}
        assert merged.step(r, g) == max(steps), (g, r, merged.step(r, g), steps)


def parity(new: Path, old: Path, n_layers: int = 4) -> dict[str, Path]:
    layers = {f"layers.{i}": new if i % 2 == 0 else old for i in range(n_layers)}
    return {**layers, "embed": new, "norm": new, "lm_head": new, "other": new}


def filter_first_last(new: Path, old: Path, n_layers: int = 4) -> dict[str, Path]:
    layers = {f"layers.{i}": new if i in (0, n_layers - 1) else old for i in range(n_layers)}
    return {**layers, "embed": new, "norm": old, "lm_head": new, "other": new}


def assert_same(a, b, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        # Bitwise (padding is garbage and may be NaN): compare the raw bytes.
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif hasattr(a, "raw_bytes") and hasattr(a, "storage"):
        # A tensor as mpitailor's reader gives it (a reference to bytes in the file, known
        # here by its methods only): dtype, shape and the bytes of its elements.
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert bytes(a.raw_bytes()) == bytes(b.raw_bytes()), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or repr(a) == repr(b), where
