"""Where the ranks meet and which addresses they listen on (DESIGN rule 8: nothing binds
every interface).

- One machine: the rendezvous store and every gloo socket listen on loopback only.
- Several machines: node 0's store listens on ``--master-addr`` (an address of node 0),
  and each rank's gloo sockets on the address its node uses to reach node 0.
- Under ``torchrun`` the store is torchrun's own (its agent hosts it; every rank is a
  client), and gloo follows the same rule as above.

torch.distributed's TCPStore listens on every interface when it creates its own socket,
so rank 0 binds the socket itself and hands the store its descriptor; gloo's sockets
follow the device a process group is created with, so kvflow registers a gloo backend
whose device is bound to the chosen address (``gloo_backend``). NCCL's own bootstrap
sockets are NCCL's business (``NCCL_SOCKET_IFNAME``).
"""

from __future__ import annotations

import re
import socket
from datetime import timedelta

import torch.distributed as dist

from kvflow import envs
from kvflow.config import ParallelConfig
from kvflow.errors import DistributedError

LOOPBACK = "127.0.0.1"
_BACKLOG = 1024


def store_host(config: ParallelConfig) -> str:
    """The address the ranks connect to for the rendezvous."""
    return LOOPBACK if config.nnodes == 1 else config.master_addr


def listen_host(config: ParallelConfig) -> str:
    """The address this node's sockets listen on."""
    if config.nnodes == 1:
        return LOOPBACK
    if config.node_rank == 0:
        return config.master_addr
    return route_to(config.master_addr)


def route_to(addr: str) -> str:
    """This machine's address on the route to ``addr`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except OSError as e:
        raise DistributedError(f"no route to the master address {addr}: {e}") from None


def listen_socket(config: ParallelConfig, port: int | None = None) -> socket.socket:
    """Rank 0's listening socket for the store, bound before any rank starts (so the
    port is known and taken): ``port``, else ``--master-port``, else one the kernel
    picks."""
    host = listen_host(config)
    port = config.master_port if port is None else port
    try:
        return socket.create_server((host, port or 0), backlog=_BACKLOG)
    except OSError as e:
        raise DistributedError(f"the rendezvous store cannot listen on {host}:{port or 0} "
                               f"({e}); --master-addr must be an address of node 0 and "
                               f"--master-port free") from None


def make_store(config: ParallelConfig, rank: int, port: int, timeout: timedelta,
               listen: socket.socket | None = None) -> dist.Store:
    """The rendezvous store: hosted by rank 0 on its own socket, or torchrun's."""
    if config.launcher == "torchrun" and envs.torchrun_agent_store():
        # torchrun's agent already hosts a store at MASTER_ADDR:MASTER_PORT.
        store = dist.TCPStore(config.master_addr, port, config.world_size, False,
                              timeout=timeout)
        return dist.PrefixStore(f"/kvflow/attempt_{envs.torchrun_restart_count()}", store)
    if rank != 0:
        return dist.TCPStore(store_host(config), port, config.world_size, False,
                             timeout=timeout)
    sock = listen if listen is not None else listen_socket(config, port)
    port = sock.getsockname()[1]
    return dist.TCPStore(store_host(config), port, config.world_size, True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())


def gloo_backend(host: str) -> str:
    """The name of a gloo backend whose sockets listen on ``host`` only, registered with
    torch.distributed on first use (one name per address, so the name says it all)."""
    name = "kvflow_gloo_" + re.sub(r"[^0-9a-z]", "_", host.lower())
    if name not in dist.Backend.backend_list:

        def create(store, rank: int, size: int, timeout: timedelta):
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            return dist.ProcessGroupGloo(store, rank, size, opts)

        dist.Backend.register_backend(name, create, devices=["cpu"])
    return name
