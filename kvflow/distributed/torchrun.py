"""Running under ``torchrun``: one process per rank, started by torchrun, each told its
place by environment variables (read in kvflow/envs.py) instead of kvflow's flags.

``RANK`` and ``WORLD_SIZE`` say that torchrun started this process; ``LOCAL_RANK`` picks
its GPU, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` give the number of nodes and this
node's index, ``MASTER_ADDR``/``MASTER_PORT`` the rendezvous. RANK 0 runs the engine
(scheduler, rank 0 of the model, the HTTP server); every other rank runs the rank loop
of kvflow/worker/rank_proc.py in its own process (``run_torchrun_rank`` there). kvflow starts no processes of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow import envs
from kvflow.errors import InvalidParameterError


@dataclass(frozen=True)
class TorchrunRank:
    """This process's place, as torchrun describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size


def torchrun_rank() -> TorchrunRank | None:
    """This process's rank under torchrun; None when not started by torchrun (RANK or
    WORLD_SIZE unset) or alone (WORLD_SIZE 1)."""
    env = envs.torchrun()
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None

    def num(name: str, default: int | None = None) -> int:
        if name not in env:
            if default is None:
                raise InvalidParameterError(f"torchrun: {name} is not set (RANK and "
                                            f"WORLD_SIZE are)", param=name)
            return default
        try:
            return int(env[name])
        except ValueError:
            raise InvalidParameterError(f"torchrun: {name}={env[name]!r} is not an integer",
                                        param=name) from None

    world = num("WORLD_SIZE")
    if world <= 1:
        return None
    rank = num("RANK")
    local_world = num("LOCAL_WORLD_SIZE", world)
    local = num("LOCAL_RANK", rank % local_world)
    if not (0 <= rank < world and 0 < local_world <= world and world % local_world == 0
            and 0 <= local < local_world):
        raise InvalidParameterError(
            f"torchrun: inconsistent RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}, "
            f"LOCAL_WORLD_SIZE={local_world}", param="RANK")
    port = num("MASTER_PORT")
    return TorchrunRank(rank=rank, world_size=world, local_rank=local,
                        local_world_size=local_world,
                        node_rank=num("GROUP_RANK", rank // local_world),
                        master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=port)
