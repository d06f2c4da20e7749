"""Produce real Megatron-Core ``torch_dist`` checkpoints on CPU (gloo), for mpitailor fixtures.

Runs with a SEPARATE venv that has megatron-core (never mpitailor's own .venv):

    python3.11 -m venv /work/mcore-venv
    /work/mcore-venv/bin/pip install torch==2.13.0              # CPU wheel
    /work/mcore-venv/bin/pip install --only-binary :all: triton psutil
      # megatron.core imports triton; its checkpoint writer needs psutil
    /work/mcore-venv/bin/pip install --ignore-requires-python "numpy<2.4" megatron-core==0.19.2
      # megatron-core >= 0.17 declares Requires-Python >=3.12 but ships a cp311 wheel
      # that imports and runs on 3.11 (see dev/megatron/FORMAT.md)

    /work/mcore-venv/bin/python dev/megatron/make_fixture.py OUT_ROOT [--tp 1 --pp 1 --dp 2]
        [--sharding dp_reshardable,fully_reshardable] [--steps 2]
        [--seed 0] [--tag NAME] [--hidden 64] [--layers 4] [--vocab 128]
        [--bucket-size N] [--untie]
        [--singleton-local-shards] [--no-lm-extras]
    /work/mcore-venv/bin/python dev/megatron/make_fixture.py describe CKPT_DIR

It spawns ``tp*pp*dp`` processes (torch.multiprocessing, gloo backend, CPU only), builds
a tiny GPTModel (4 layers, hidden 64, 4 heads, vocab 128, seq 16, local/torch-native layer
spec: no transformer-engine, no apex), wraps it in Megatron's DistributedDataParallel,
builds Megatron's DistributedOptimizer (Adam, fp32), runs ``--steps`` training steps and then,
for each requested optimizer sharding type, writes

    OUT_ROOT/<tag>_<sharding>/          # a megatron.core.dist_checkpointing.save() dir
        .metadata  __<rank>_0.distcp  metadata.json     (0.19 writes no common.pt)

from ``{"model": model.sharded_state_dict(metadata=m), "optimizer":
opt.sharded_state_dict(model_sd, metadata=m)}`` with Megatron-LM's metadata ``m``
(distrib_optim_sharding_type, singleton_local_shards=False, chained_optim_avoid_prefix=True),
``content_metadata`` as Megatron-LM passes it, and (unless --no-lm-extras) mimicked
Megatron-LM extras: args (argparse.Namespace), checkpoint_version, iteration, rng_state.
Beside each dir, ``<tag>_<sharding>.truth.pt`` (plain torch.save, written by rank 0) holds
every rank's ground truth: per param (local module name, local TP/PP shard) the model
param, the fp32 main param, exp_avg and exp_avg_sq in param shape, its place in the DDP flat
buffer (gbuf, bucket, start, end), and the bucket list (offset, numel, numel_unpadded, params
in buffer order), so a reader can be checked against it. The sharding types
``dp_reshardable`` (Megatron-LM's default) and ``fully_reshardable`` work;
``fully_sharded_model_space`` fails in 0.19.2 itself (see FORMAT.md).

CPU patches (fixture script only; they don't change what is written): see ``_cpu_patches``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")

HEADS, LAYERS, VOCAB, SEQ, MBS = 4, 4, 128, 16, 2
HIDDEN = 64  # --hidden overrides (60 gives params whose numel is not a multiple of 64)


def _cpu_patches():
    """Patches needed to run Megatron-Core 0.19.2 on a CPU-only torch (what each works around
    is in dev/megatron/FORMAT.md section 1). None changes what is written."""
    # 1. RNG tracker (tensor_parallel/random.py: CudaRNGStatesTracker.add/fork,
    #    model_parallel_cuda_manual_seed) calls torch.cuda.get_rng_state/manual_seed and
    #    megatron's _get_cuda_rng_state/_set_cuda_rng_state. Back the "CUDA" RNG with a
    #    separate CPU torch.Generator. Only affects dropout streams (dropout is 0 here).
    import megatron.core.tensor_parallel.random as mrandom
    import torch

    gen = torch.Generator()
    torch.cuda.get_rng_state = lambda device="cuda": gen.get_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": gen.set_state(state)
    torch.cuda.manual_seed = lambda seed: gen.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: gen.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = lambda *a, **k: gen.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: gen.set_state(state)

    # 2. "cuda" devices -> cpu. DDP's _ParamAndGradBuffer allocates param/grad buffers on
    #    torch.cuda.current_device() (param_and_grad_buffer.py), the optimizer makes
    #    device='cuda' scalars (optimizer.py), exchange code calls .cuda().
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self

    class _Stream:  # start_grad_sync (param_and_grad_buffer.py) waits on the current stream
        def wait_event(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def synchronize(self):
            pass

    torch.cuda.current_stream = lambda *a, **k: _Stream()

    def _remap(dev):
        if isinstance(dev, int):
            return cpu
        if isinstance(dev, str) and dev.startswith("cuda"):
            return cpu
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return cpu
        return dev

    def _wrap(fn):
        def inner(*a, **k):
            if "device" in k:
                k["device"] = _remap(k["device"])
            return fn(*a, **k)

        inner.__wrapped__ = fn
        return inner

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "empty_like",
                 "zeros_like", "ones_like", "randn", "rand"):
        setattr(torch, name, _wrap(getattr(torch, name)))

    # 3. DistributedOptimizer._build_model_and_main_param_groups (distrib_optimizer.py)
    #    dispatches on model_param.type() == 'torch.cuda.FloatTensor' and raises TypeError
    #    for 'torch.FloatTensor'. Report CPU tensors under their CUDA type name.
    orig_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **k):
        if dtype is None:
            t = orig_type(self)
            if t.startswith("torch.") and not t.startswith("torch.cuda."):
                t = "torch.cuda." + t[len("torch."):]
            return t
        return orig_type(self, dtype, non_blocking, **k)

    torch.Tensor.type = _type
    return torch


def _sizes(args):
    global HIDDEN, LAYERS, VOCAB
    HIDDEN, LAYERS, VOCAB = args.hidden, args.layers, args.vocab


def _build(args):
    """The model, DDP and DistributedOptimizer a worker trains (after init; also used by
    load_check.py to load a checkpoint into the same objects)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=not args.untie,  # Megatron-LM's default: tied
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        # DDP drops bucket_size (one bucket per buffer) unless overlap_grad_reduce is on
        # (distributed_data_parallel.py __init__); Megatron-LM runs with it on at scale.
        overlap_grad_reduce=args.bucket_size is not None,
        bucket_size=args.bucket_size,
    )
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
        [ddp],
    )
    return cfg, model, ddp, opt


def _worker(rank: int, world: int, args):
    _sizes(args)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    torch = _cpu_patches()
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp
    )
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)

    cfg, model, ddp, opt = _build(args)
    config_fwd = model.config
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config_fwd.finalize_model_grads_func = finalize_model_grads
    config_fwd.no_sync_func = ddp.no_sync
    config_fwd.grad_scale_func = None

    dp_rank = parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(1000 + dp_rank)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)

    def batch():
        toks = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()

    def forward_step(data_iterator, model_):
        tokens, labels = next(data_iterator)
        out = model_(tokens, pos, mask, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    fwd_bwd = get_forward_backward_func()
    for step in range(args.steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        data = iter([batch()])
        losses = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        ok, gnorm, _ = opt.step()
        if rank == 0:
            print(f"step {step}: ok={ok} grad_norm={gnorm} losses={losses}", flush=True)

    # ---- save, once per requested optimizer sharding type ------------------------------
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for sharding in args.sharding.split(","):
        out_dir = os.path.join(args.out_root, f"{args.tag}_{sharding}")
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
        dist.barrier()
        # Megatron-LM megatron/training/checkpointing.py _build_sharded_state_dict_metadata()
        metadata = {
            "distrib_optim_sharding_type": sharding,
            "singleton_local_shards": args.singleton_local_shards,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": dp_cp_group,
        }
        model_sd = model.sharded_state_dict(metadata=metadata)
        sd = {"model": model_sd}
        sd["optimizer"] = opt.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
        if args.lm_extras:
            # What Megatron-LM's generate_state_dict() adds beside model/optimizer (mimicked,
            # megatron.training is not part of the megatron-core wheel).
            from megatron.core.dist_checkpointing.mapping import ShardedObject

            sd["checkpoint_version"] = 3.0
            sd["iteration"] = args.steps
            sd["args"] = argparse.Namespace(
                num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                padded_vocab_size=VOCAB, seq_length=SEQ, tensor_model_parallel_size=args.tp,
                pipeline_model_parallel_size=args.pp, data_parallel_size=args.dp,
                use_distributed_optimizer=True, ckpt_format="torch_dist",
            )
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            sd["rng_state"] = ShardedObject(
                "rng_state",
                [{"random_rng_state": None, "torch_rng_state": torch.get_rng_state()}],
                (args.pp, args.tp),
                (pp_rank, tp_rank),
                replica_id=dp_rank,
            )
        # Megatron-LM save_checkpoint passes the metadata (minus process groups) as
        # content_metadata; it lands in the common state under "content_metadata".
        content = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
        dist_checkpointing.save(sd, out_dir, content_metadata=content)
        dist.barrier()
        if rank == 0:
            print(f"saved {out_dir}", flush=True)
        _write_truth(out_dir + ".truth.pt", model, ddp, opt, sharding, args)
    dist.barrier()
    dist.destroy_process_group()


def _write_truth(path, model, ddp, opt, sharding, args):
    """Ground truth for a reader: full (global-shape) params and Adam state, per param name,
    plus the DDP flat-buffer layout. Gathered with plain all_gather on the model-parallel
    group (tp and pp), written by global rank 0."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank = dist.get_rank()
    local = {}
    name_of = {p: n for n, p in model.named_parameters()}
    for buf_idx, buf in enumerate(ddp.buffers):
        for p, (start, end, bucket_id) in buf.param_index_map.items():
            local[name_of[p]] = {
                "model_param": p.detach().clone(),
                "buffer": (buf_idx, bucket_id, start, end),
                "shape": tuple(p.shape),
            }
    # full Adam state, in model space, from get_parameter_state_dp_zero
    # (the same gather Megatron's fully_reshardable save uses), on every rank
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    assert len(getattr(opt, "chained_optimizers", [opt])) == 1
    dpz = inner.get_parameter_state_dp_zero(use_gloo_comm=True, return_on_all_ranks=True)
    for gbuf_idx, buf in enumerate(ddp.buffers):
        ((_dtype, world),) = dpz[gbuf_idx].items()
        # dp_zero world tensors drop each bucket's end padding (get_parameter_state_dp_zero):
        # shift param_index_map's buffer offsets by the padding of the buckets before it.
        shift, acc = [], 0
        for b in buf.buckets:
            shift.append(b.offset - acc)
            acc += b.numel_unpadded
        for p, (start, end, bucket_id) in buf.param_index_map.items():
            start, end = start - shift[bucket_id], end - shift[bucket_id]
            n = name_of[p]
            for k, v in world.items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and k != "numel_unpadded":
                    # "param" here is the optimizer's fp32 main param
                    local[n]["main_" + k if k == "param" else k] = \
                        v[start:end].reshape(p.shape).clone()
    payload = {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "params": local,
        "per_bucket_numel": getattr(inner, "per_bucket_numel", None),
        "per_bucket_numel_unpadded": getattr(inner, "per_bucket_numel_unpadded", None),
        "buckets": [
            [
                {"offset": b.offset, "numel": b.grad_data.numel(),
                 "numel_unpadded": b.numel_unpadded,
                 "params": [name_of[p] for p in b.params_list]}
                for b in buf.buckets
            ]
            for buf in ddp.buffers
        ],
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload)
    if rank == 0:
        torch.save({"sharding": sharding, "tp": args.tp, "pp": args.pp, "dp": args.dp,
                    "steps": args.steps, "seed": args.seed, "per_rank": gathered}, path)


def describe(ckpt_dir):
    """Print what a torch_dist dir holds: files, each DCP key with its global shape, dtype and
    chunks, extra attributes on the pickled Metadata, and each bytes item (ShardedObject)
    unpickled with torch.load (trusted local fixtures only)."""
    import io
    import pickle
    import pprint

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    print("files:", sorted(os.listdir(ckpt_dir)))
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        md = pickle.load(f)
    extra = [k for k in vars(md) if k not in md.__dataclass_fields__]
    print("Metadata extra attributes:", extra)
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, BytesStorageMetadata):
            continue
        ch = sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
        print(f"T {k} {tuple(v.size)} {v.properties.dtype} chunks={len(ch)} {ch}")
    for idx, si in md.storage_data.items():
        if not isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata):
            continue
        with open(os.path.join(ckpt_dir, si.relative_path), "rb") as f:
            f.seek(si.offset)
            raw = f.read(si.length)
        obj = torch.load(io.BytesIO(raw), weights_only=False)
        text = pprint.pformat(obj, width=100, compact=True)
        print(f"B {idx.fqn} ({si.relative_path} @{si.offset}+{si.length}):",
              text if len(text) < 400 else text[:400] + " ...")


def main(argv=None):
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "describe":
        return describe(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_root")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-size", type=int, default=None)
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--tag", default=None)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--untie", action="store_true",
                   help="separate output_layer.weight (Megatron-LM --untie-embeddings-...)")
    p.add_argument("--singleton-local-shards", action="store_true",
                   help="metadata singleton_local_shards=True (per-layer keys, no stacking)")
    p.add_argument("--no-lm-extras", dest="lm_extras", action="store_false",
                   help="save only model+optimizer (no Megatron-LM args/iteration/rng_state)")
    p.add_argument(
        "--sharding", default="dp_reshardable,fully_reshardable"
    )
    args = p.parse_args(argv)
    args.tag = args.tag or f"tp{args.tp}pp{args.pp}dp{args.dp}"
    world = args.tp * args.pp * args.dp
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
