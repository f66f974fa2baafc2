"""Process groups and collectives over torch.distributed, as objects passed to layers.

A ``GroupCoordinator`` is one set of ranks (the tensor-parallel ranks of a stage, the
stages of a pipeline, or the whole world) with two torch.distributed groups: the device
group (NCCL on GPU, gloo on CPU) for tensors inside the model, and a gloo group on the
CPU for control data (step messages, block counts). ``ParallelState`` bundles the groups
of one rank; the model runner builds it once and hands it to the layers, so nothing is
kept in module globals (DESIGN rule 9) and a one-rank engine never touches
torch.distributed at all.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvflow.config import ParallelConfig
from kvflow.distributed.rendezvous import gloo_backend, listen_host, make_store, store_host
from kvflow.errors import DistributedError

# Ranks idle between steps wait on the control group for the next step, which may come
# hours later; death is still noticed at once because gloo fails a wait whose peer closed
# its connection. Collectives inside a step use ParallelConfig.timeout_s.
CONTROL_TIMEOUT = timedelta(days=30)


class GroupCoordinator:
    """Collectives over one group of ranks; with one rank every operation is free."""

    def __init__(self, ranks: list[int], rank: int, device_group, cpu_group,
                 device: torch.device) -> None:
        self.ranks = ranks
        self.rank = rank  # global rank
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(rank)
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.device = device

    @classmethod
    def single(cls, device: torch.device) -> "GroupCoordinator":
        """The group of a one-rank engine: no torch.distributed needed."""
        return cls([0], 0, None, None, device)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    # --- tensors on the device -------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (capturable in a CUDA graph on NCCL)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of ``x`` over the group, in place (load-time statistics,
        e.g. a quantization scale over a row split between the ranks)."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        x = x.contiguous()
        if self.device.type == "cuda":
            out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.device_group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of group rank ``src`` copied into ``x`` of every rank, in place."""
        if self.world_size == 1:
            return x
        dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def broadcast_async(self, x: torch.Tensor, src: int = 0):
        """Post a broadcast into ``x``; the returned work's ``wait()`` ends it (pipeline
        stages collect the sampled ids only when the step is collected)."""
        return dist.broadcast(x, src=self.ranks[src], group=self.device_group, async_op=True)

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Point-to-point send to group rank ``dst`` (pipeline stages)."""
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.device_group, tag=tag)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src=self.ranks[src], group=self.device_group)
        return out

    def recv_async(self, out: torch.Tensor, src: int, tag: int = 0):
        """Post a receive into ``out`` from group rank ``src``; ``wait()`` ends it."""
        return dist.irecv(out, src=self.ranks[src], group=self.device_group, tag=tag)

    # --- control data on the CPU -------------------------------------------------
    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the group (KV blocks every rank can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


@dataclass
class ParallelState:
    """The groups one rank belongs to, and where it sits in them."""

    config: ParallelConfig
    rank: int  # global rank
    local_rank: int  # rank on this node (its GPU index)
    world: GroupCoordinator
    tp: GroupCoordinator  # the tensor-parallel ranks of this rank's pipeline stage
    pp: GroupCoordinator  # this rank's position in every stage (same TP rank)
    control: GroupCoordinator  # the whole world on gloo, with the long control timeout

    @classmethod
    def single(cls, device: torch.device) -> "ParallelState":
        g = GroupCoordinator.single(device)
        return cls(ParallelConfig(), 0, 0, g, g, g, g)

    @property
    def is_driver(self) -> bool:
        """Rank 0: beside the scheduler, samples, returns outputs."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world.world_size > 1


def init_parallel_state(config: ParallelConfig, rank: int, local_rank: int, port: int,
                        device: torch.device, listen: socket.socket | None = None
                        ) -> ParallelState:
    """Join the rendezvous at ``port`` as ``rank`` and build every group.

    Every rank calls this with the same config; torch.distributed requires that all of
    them create the same groups in the same order. Rank 0 hosts the store, on
    ``listen`` when it bound the socket already. Sockets listen on loopback on one
    machine, never on every interface (see rendezvous.py).
    """
    world_size = config.world_size
    timeout = timedelta(seconds=config.timeout_s)
    if dist.is_initialized():
        raise DistributedError("torch.distributed is already initialized in this process; "
                               "one multi-rank engine per process")
    if device.type == "cuda":
        # NCCL communicators, barriers and CUDA graph capture use the current device.
        torch.cuda.set_device(device)
    gloo = gloo_backend(listen_host(config))
    try:
        store = make_store(config, rank, port, timeout, listen)
        backend = "nccl" if device.type == "cuda" else gloo
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    except (RuntimeError, ValueError) as e:  # DistStoreError and friends
        raise DistributedError(f"rank {rank} could not join the rendezvous at "
                               f"{store_host(config)}:{port} within {config.timeout_s:g} s: "
                               f"{e}") from None
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size

    def make(groups: list[list[int]], long: bool = False) -> GroupCoordinator:
        mine = None
        for ranks in groups:  # every rank creates every group, in the same order
            dev = dist.new_group(ranks, timeout=timeout)
            cpu = dist.new_group(ranks, backend=gloo,
                                 timeout=CONTROL_TIMEOUT if long else timeout)
            if rank in ranks:
                mine = GroupCoordinator(ranks, rank, dev, cpu, device)
        return mine

    world = make([list(range(world_size))])
    tp_group = make([list(range(s * tp, (s + 1) * tp)) for s in range(pp)])
    pp_group = make([list(range(t, world_size, tp)) for t in range(tp)])
    control = make([list(range(world_size))], long=True)
    return ParallelState(config, rank, local_rank, world, tp_group, pp_group, control)


def destroy_parallel_state(state: ParallelState) -> None:
    if state.is_distributed and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone; nothing left to release cleanly
            pass
