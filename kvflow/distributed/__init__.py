"""Distributed inference: process groups and collectives over torch.distributed (gloo
on CPU, NCCL on GPU), typed step messages between ranks, and rank launch."""

from kvflow.distributed.parallel_state import (GroupCoordinator, ParallelState,
                                               destroy_parallel_state, init_parallel_state)

__all__ = ["GroupCoordinator", "ParallelState", "init_parallel_state",
           "destroy_parallel_state"]
