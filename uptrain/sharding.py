"""``--sharding fsdp``: the model's parameters, gradients and optimizer state sharded across processes
with torch's FSDP2 (``fully_shard``), one unit per decoder layer plus the root (embeddings, final
norm, head), on CPU with gloo or CUDA with NCCL.

Every process loads the model (from the student or the checkpoint being resumed) and keeps only its
shard; a forward or backward gathers one layer at a time. Gradients are averaged across processes as
DDP's are, so one command follows the same trajectory on 1 or N processes. Checkpoints keep the model
as Hugging Face files (gathered on the main process) and the optimizer through
``torch.distributed.checkpoint`` (each process writes its own shard; loading re-shards, so a run may
resume on another number of processes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from mha2gqa.core.errors import Mha2GqaError

OPTIMIZER_DIR = "optimizer"
T = TypeVar("T")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the classes transformers keeps whole (``_no_split_modules``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise Mha2GqaError(
            f"--sharding fsdp: {type(base).__name__} names no decoder-layer class (_no_split_modules); "
            "train it without --sharding"
        )
    return layers


def fsdp_mesh(device: torch.device):
    """The processes as one FSDP mesh on ``device``'s type. Collective: every process calls it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise Mha2GqaError("--sharding fsdp: no process group; run under torchrun or accelerate launch")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def in_turns(load: Callable[[], T]) -> T:
    """``load()`` on one process at a time, in rank order (each waits for the one before), so that
    the host holds one whole model at a time next to the shards already cut, not one a process:
    ``load`` must leave only this process's shard (:func:`shard`). Collective."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return load()
    out = None
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            out = load()
        dist.barrier()
    return out


def shard(model: torch.nn.Module, mesh, device: torch.device, mixed_precision: str, offload: bool) -> torch.nn.Module:
    """Shard ``model`` in place across the processes of ``mesh`` (:func:`fsdp_mesh`): each decoder layer
    one FSDP unit, then the rest; only this process's shard is kept. bf16 ``mixed_precision``
    computes in bfloat16 and reduces gradients in float32. Not collective."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    options: dict[str, Any] = {"mesh": mesh, "mp_policy": policy}
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    elif device.type != "cpu":
        model.to(device)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole, on CPU, on the main process (empty elsewhere). Collective.
    Tied parameters (an output layer tied to the embedding) come back as one tensor under each name,
    as an unsharded model's state dict has them, so ``save_pretrained`` writes them once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for first, *tied in names.values():
        for name in tied:
            if first in state and name in state:
                state[name] = state[first]
    return state


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Each process's optimizer shard into ``folder/optimizer`` (torch.distributed.checkpoint). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(folder / OPTIMIZER_DIR))


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """The optimizer state saved by :func:`save_optimizer`, re-sharded for this run. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(folder / OPTIMIZER_DIR))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def zero_rows(param: torch.nn.Parameter, rows: torch.Tensor) -> None:
    """Zero the gradient of ``rows`` (of the whole tensor) in this process's shard of ``param``:
    FSDP2 cuts dimension 0 into ``ceil(N / processes)``-row pieces, piece ``r`` on process ``r``."""
    import torch.distributed as dist

    grad = param.grad
    if grad is None:
        return
    if not hasattr(grad, "to_local"):  # not sharded: the whole gradient is here
        grad[rows] = 0
        return
    local = grad.to_local()
    start = dist.get_rank() * -(-param.shape[0] // dist.get_world_size())
    local[rows[(rows >= start) & (rows < start + local.shape[0])] - start] = 0


def merge_lora(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A peft LoRA model's whole state dict merged into its base model's: ``W + scaling * B @ A`` for
    every adapted linear, adapter keys dropped, peft's prefixes removed."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix("base_model.model.")
        if ".base_layer." in key:
            prefix, leaf = key.split(".base_layer.")
            name = name.replace(".base_layer.", ".")
            a, b = state.get(f"{prefix}.lora_A.default.weight"), state.get(f"{prefix}.lora_B.default.weight")
            if leaf == "weight" and a is not None and b is not None:
                value = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
        out[name] = value
    return out
