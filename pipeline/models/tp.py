"""Tensor parallelism applied from outside the model (as gpt-fast's `apply_tp`): `wqkv` and
`w_gate_up` keep this rank's rows of each fused part, `wo` and `w_down` the matching input
columns, summed across ranks by an `all_reduce` hook; embeddings, norms and LM head stay whole.
Every rank must call the model with identical arguments in lockstep."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

from pipeline.errors import KVDivergenceError
from pipeline.models.config import ModelConfig
from pipeline.models.llama import LlamaModel
from pipeline.models.quant import GroupQuant, Int4Linear


def init_distributed(rank: int, world_size: int, init_method: str,
                     backend: str | None = None, timeout_s: float = 300.0) -> str:
    """NCCL when CUDA is available, gloo otherwise; returns the backend used."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def check_tp(config: ModelConfig, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {world_size}")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(f"tensor parallel size {world_size} does not divide "
                             f"{name}={value}")


def _rows(w: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    return torch.cat([part.chunk(world, dim=0)[rank] for part in w.split(sizes, dim=0)])


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device="meta", dtype=weight.dtype)
    # Copies, so the unsharded tensors can be freed.
    lin.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format),
                              requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return lin


def _column_parallel(linear: nn.Module, sizes: list[int], rank: int, world: int) -> nn.Module:
    bias = linear.bias
    bias = None if bias is None else _rows(bias, sizes, rank, world)
    if isinstance(linear, Int4Linear):
        starts = [sum(sizes[:i]) + rank * (size // world) for i, size in enumerate(sizes)]
        parts = [linear.weight.rows(slice(start, start + size // world))
                 for start, size in zip(starts, sizes)]
        return Int4Linear(GroupQuant.cat(parts), bias)
    return _linear(_rows(linear.weight, sizes, rank, world), bias)


def _row_parallel(linear: nn.Module, rank: int, world: int) -> nn.Module:
    if isinstance(linear, Int4Linear):
        width = linear.in_features // world
        return Int4Linear(linear.weight.columns(rank * width, (rank + 1) * width), None)
    return _linear(linear.weight.chunk(world, dim=1)[rank], None)


def _all_reduce_hook(group: dist.ProcessGroup | None):
    def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
        return output
    return hook


def apply_tp(model: LlamaModel, rank: int, world_size: int,
             group: dist.ProcessGroup | None = None) -> LlamaModel:
    cfg = model.config
    check_tp(cfg, world_size)
    if world_size == 1:
        return model
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor parallel rank {rank} not in 0..{world_size - 1}")
    d = cfg.head_dim
    qkv_sizes = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
    with torch.no_grad():
        for layer in model.layers:
            attn, mlp = layer.attn, layer.mlp
            attn.wqkv = _column_parallel(attn.wqkv, qkv_sizes, rank, world_size)
            attn.wo = _row_parallel(attn.wo, rank, world_size)
            attn.n_heads = cfg.num_heads // world_size
            attn.n_kv_heads = cfg.num_kv_heads // world_size
            inter = cfg.intermediate_size
            mlp.w_gate_up = _column_parallel(mlp.w_gate_up, [inter, inter], rank, world_size)
            mlp.w_down = _row_parallel(mlp.w_down, rank, world_size)
            mlp.intermediate = inter // world_size
            attn.register_forward_hook(_all_reduce_hook(group))
            mlp.register_forward_hook(_all_reduce_hook(group))
    model.tp_rank, model.tp_size = rank, world_size
    return model


def check_ranks_agree(digest: bytes, what: str, group: dist.ProcessGroup | None = None) -> None:
    """A collective: KVDivergenceError on every rank, naming the ranks, when their digests
    differ; diverged ranks then fail clearly instead of in a mismatched all_reduce."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.frombuffer(bytearray(digest[:16].ljust(16, b"\0")), dtype=torch.int64)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    values = [tuple(g.tolist()) for g in gathered]
    if len(set(values)) > 1:
        groups: dict[tuple, list[int]] = {}
        for rank, v in enumerate(values):
            groups.setdefault(v, []).append(rank)
        raise KVDivergenceError(f"tensor-parallel ranks disagree on {what}: ranks "
                                f"{' vs '.join(map(str, groups.values()))} hold different state")


def share_from_rank0(tokens: list[int], group: dist.ProcessGroup | None = None) -> list[int]:
    """A collective: rank 0's `tokens` on every rank (the other ranks' are placeholders)."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    values = torch.tensor(tokens, dtype=torch.int64, device=device)
    dist.broadcast(values, src=0, group=group)
    return values.tolist()
