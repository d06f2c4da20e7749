"""Load a (merged) Megatron-Core ``torch_dist`` checkpoint with Megatron's own
``dist_checkpointing.load`` and check every parameter and its Adam state against the truth file
of the source a recipe names for its layer. The oracle is the real library and the
``.truth.pt`` files make_fixture.py wrote: never mpitailor's reader.

    /work/mcore-venv/bin/python dev/megatron/load_check.py CKPT SOURCES.json
        [--tp 1 --pp 1 --dp 2 --hidden 32 --layers 2 --vocab 64]
        [--sharding fully_reshardable] [--port 29533]

SOURCES.json maps each layer key (``layers.0``, ..., ``embed``, ``norm``, ``lm_head``) to the
``.truth.pt`` of the checkpoint it must come from. It spawns ``tp*pp*dp`` gloo processes
built as make_fixture.py builds them (other init seed: a load that missed a tensor shows),
loads the model and the DistributedOptimizer, writes the loaded state as a truth file
(make_fixture's ``_write_truth``) and compares it, per rank and parameter, bit for bit:
``model_param``, the fp32 ``main_param``, ``exp_avg`` and ``exp_avg_sq``. Prints one line per
mismatch and ``OK n tensors`` at the end; exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixture as mf  # noqa: E402

FIELDS = ("model_param", "main_param", "exp_avg", "exp_avg_sq")


def _load_worker(rank: int, world: int, args):
    mf._sizes(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch = mf._cpu_patches()
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    # CPU only: torch's Adam (no apex/TE FusedAdam) keeps a tensor `step` per param, which
    # load_parameter_state_from_fully_reshardable leaves out of what it passes here (it
    # restores the step from the param groups): a KeyError in 0.19.2. Skip the missing key.
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_states(self, model_param, tensors):
        return set_states(self, model_param, {"step": None, **tensors})
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_states

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    torch.manual_seed(12345)
    model_parallel_cuda_manual_seed(12345)
    _cfg, model, ddp, opt = mf._build(args)
    metadata = {"distrib_optim_sharding_type": args.sharding, "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    # A fresh Adam has no state yet; state_dict() (called by sharded_state_dict) needs one
    # step, as after Megatron-LM's first iteration: its dummy state, then overwritten by load.
    for inner in getattr(opt, "chained_optimizers", [opt]):
        inner._init_optimizer_states_with_dummy_values()
    model_sd = model.sharded_state_dict(metadata=metadata)
    sd = {"model": model_sd,
          "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    state = dist_checkpointing.load(sd, args.ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    mf._write_truth(args.out, model, ddp, opt, args.sharding, args)
    dist.barrier()
    dist.destroy_process_group()


def layer_of(name: str, pp_rank: int, layers: int, pp: int, tied: bool) -> str:
    """A local parameter name's layer key, the layer number made global (PP stage offset)."""
    if m := re.match(r"decoder\.layers\.(\d+)\.", name):
        return f"layers.{int(m.group(1)) + pp_rank * (layers // pp)}"
    if name.startswith("embedding."):
        return "embed"
    if name.startswith("decoder.final_layernorm."):
        return "norm"
    if name.startswith("output_layer."):
        return "embed" if tied else "lm_head"  # tied: saved as the word embedding
    raise ValueError(f"no layer key for {name}")


def compare(loaded: dict, sources: dict, args) -> int:
    import torch

    truths = {k: torch.load(p, weights_only=False) for k, p in sources.items()}
    bad = n = 0
    for entry in loaded["per_rank"]:
        where = (entry["tp_rank"], entry["pp_rank"], entry["dp_rank"])
        for name, got in entry["params"].items():
            key = layer_of(name, entry["pp_rank"], args.layers, args.pp, not args.untie)
            want = next(e for e in truths[key]["per_rank"]
                        if (e["tp_rank"], e["pp_rank"], e["dp_rank"]) == where)["params"][name]
            for f in FIELDS:
                n += 1
                if not torch.equal(got[f], want[f]):
                    bad += 1
                    print(f"MISMATCH rank(tp,pp,dp)={where} {name} {f} (wanted {key} from "
                          f"{sources[key]})")
    print(f"{'OK' if not bad else 'FAILED'} {n - bad} of {n} tensors equal")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt")
    p.add_argument("sources")
    for name, default in (("tp", 1), ("pp", 1), ("dp", 2), ("hidden", 32), ("layers", 2),
                          ("vocab", 64), ("port", 29533)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--sharding", default="fully_reshardable")
    p.add_argument("--untie", action="store_true")
    args = p.parse_args(argv)
    args.bucket_size, args.steps, args.seed = None, 0, 0
    with open(args.sources) as f:
        sources = json.load(f)
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        args.out = os.path.join(tmp, "loaded.truth.pt")
        mp.spawn(_load_worker, args=(args.tp * args.pp * args.dp, args),
                 nprocs=args.tp * args.pp * args.dp, join=True)
        loaded = torch.load(args.out, weights_only=False)
    return compare(loaded, sources, args)


if __name__ == "__main__":
    sys.exit(main())
