"""Data parallelism applied to a built TransformerLM from outside (the model code knows nothing of it).

Under `torchrun --nproc_per_node=N` the environment holds RANK / WORLD_SIZE / LOCAL_RANK; `setup()`
joins the process group (NCCL on CUDA, gloo on CPU). `wrap()` applies either
- DDP: every rank holds all weights, gradients are averaged in backward (Li et al. 2020), or
- FSDP2: `torch.distributed.fsdp.fully_shard` per block and at the root: parameters, gradients and
  optimizer state are sharded as DTensors (ZeRO-3; Rajbhandari et al. 2020, Zhao et al. 2023).
Checkpoints go through `full_model_state` / `full_optimizer_state` (gathered on rank 0, on CPU) so a
checkpoint is the same file whichever strategy (or none) wrote it.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistInfo", "setup", "teardown", "wrap", "prepare_model", "PreparedModel", "unwrap", "no_grad_sync",
           "all_reduce_mean",
           "broadcast_flag", "full_model_state", "load_full_model_state", "full_optimizer_state",
           "load_full_optimizer_state", "gather_objects"]


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"   # none | ddp | fsdp

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device_kind: str, strategy: str) -> DistInfo:
    """Join the process group described by torchrun's environment (no-op for a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        if device_kind == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend)
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"train.dist_strategy={strategy!r} is not one of 'ddp', 'fsdp'")
    return DistInfo(rank=rank, world_size=world, local_rank=local, strategy=strategy)


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, info: DistInfo, device: torch.device) -> nn.Module:
    """The model to call in training: DDP-wrapped, FSDP2-sharded in place, or the model itself."""
    if not info.enabled:
        return model
    if info.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:      # one all-gather unit per block, then the rest at the root
        fully_shard(block)
    fully_shard(model)
    return model


@dataclass
class PreparedModel:
    model: nn.Module                      # what a step calls: DDP-wrapped, FSDP-sharded, or the model itself
    optimizer: torch.optim.Optimizer
    step_model: nn.Module                 # `model`, compiled when asked


def prepare_model(raw: nn.Module, info: DistInfo, device: torch.device, *,
                  build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                  activation_checkpointing: bool = False, compile: bool = False) -> PreparedModel:
    """Apply everything that acts on a built model from outside, in the one order that works:

    1. activation checkpointing: wraps each block's forward before DDP/FSDP see the blocks;
    2. wrap: DDP, or FSDP2 sharding the parameters in place into DTensors;
    3. the optimizer, over those (sharded) parameters, so its state is sharded too;
    4. torch.compile of the wrapped model, so the graphs include the wrappers' hooks.
    The raw model keeps its parameter names throughout (checkpoints and HF rules read them).
    Example: prepared = prepare_model(model, info, device, build_optimizer=lambda m: AdamW(m.parameters()))"""
    if activation_checkpointing:
        from archlab.training.recompute import checkpoint_blocks
        checkpoint_blocks(raw)
    model = wrap(raw, info, device)
    optimizer = build_optimizer(raw)
    return PreparedModel(model, optimizer, torch.compile(model) if compile else model)


def unwrap(model: nn.Module) -> nn.Module:
    """The TransformerLM under DDP / torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def no_grad_sync(model: nn.Module, info: DistInfo, sync: bool):
    """Context for a micro-batch of gradient accumulation: skip the gradient all-reduce unless `sync`."""
    if not info.enabled or sync:
        return contextlib.nullcontext()
    if info.strategy == "ddp":
        return model.no_sync()
    raw = unwrap(model)
    return _FSDPNoSync(raw)


class _FSDPNoSync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


def all_reduce_mean(values: list[float], info: DistInfo) -> list[float]:
    if not info.enabled:
        return values
    return [v / info.world_size for v in all_reduce_sum(values, info)]


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    return _all_reduce(values, info, dist.ReduceOp.SUM)


def all_reduce_max(values: list[float], info: DistInfo) -> list[float]:
    """Each value's maximum over the ranks (a minimum: the negated values'). Example: all_reduce_max([x], info)"""
    return _all_reduce(values, info, dist.ReduceOp.MAX)


def _all_reduce(values: list[float], info: DistInfo, op: Any) -> list[float]:
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return t.tolist()


def broadcast_flag(flag: bool, info: DistInfo) -> bool:
    """Rank 0's decision, on every rank (e.g. 'the time budget is spent')."""
    if not info.enabled:
        return flag
    obj = [flag]
    dist.broadcast_object_list(obj, src=0)
    return bool(obj[0])


def gather_objects(obj, info: DistInfo) -> list:
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def _is_fsdp(model: nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def full_model_state(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict on CPU; under FSDP every rank must call it (rank 0 gets the data)."""
    raw = unwrap(model)
    if not _is_fsdp(raw):
        return {k: v.detach().cpu() for k, v in raw.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(raw, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor], info: DistInfo) -> None:
    raw = unwrap(model)
    if not _is_fsdp(raw):
        raw.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(raw, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict:
    """Optimizer state keyed by parameter name (FQN), unsharded, on CPU: the same format for plain,
    DDP and FSDP runs (that of torch.distributed.checkpoint's full state dict), so a checkpoint
    resumes under any of them. Under FSDP every rank must call it."""
    raw = unwrap(model)
    if _is_fsdp(raw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(raw, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    names = {id(p): n for n, p in raw.named_parameters()}
    index_to_name, groups = {}, []
    sd = optimizer.state_dict()
    for group, live in zip(sd["param_groups"], optimizer.param_groups):
        for idx, param in zip(group["params"], live["params"]):
            index_to_name[idx] = names[id(param)]
        groups.append({**group, "params": [index_to_name[i] for i in group["params"]]})
    state = {index_to_name[i]: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                for k, v in s.items()} for i, s in sd["state"].items()}
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                              info: DistInfo) -> None:
    raw = unwrap(model)
    if _is_fsdp(raw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(raw, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    names = {id(p): n for n, p in raw.named_parameters()}
    live_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    # a parameter the optimizer held but never stepped (it got no gradient: a reward model's LM head, frozen since)
    # has no state to lose: the checkpoint's groups are read without it
    live = {n for group in live_names for n in group}
    saved = [{**g, "params": [n for n in g["params"] if n in live or n in state["state"]]}
             for g in state["param_groups"]]
    state = {**state, "param_groups": saved}
    if live_names != [g["params"] for g in saved]:
        raise ValueError("the optimizer's parameter groups differ from the checkpoint's "
                         "(was train.optimizer.no_decay or the model changed?)")
    name_to_index, i = {}, 0
    for group in live_names:
        for name in group:
            name_to_index[name] = i
            i += 1
    groups = [{**g, "params": [name_to_index[n] for n in g["params"]]} for g in state["param_groups"]]
    optimizer.load_state_dict({"state": {name_to_index[n]: s for n, s in state["state"].items()},
                               "param_groups": groups})
