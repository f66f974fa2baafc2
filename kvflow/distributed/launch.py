"""Starting, watching and stopping the rank processes of one node.

Each rank other than rank 0 is a plain subprocess, ``python -m kvflow.worker.rank_proc``,
given its rank and the engine config as JSON on the command line: nothing is pickled,
not even at start-up (multiprocessing's spawn would pickle its arguments). A rank exits
when its parent does (it polls its parent pid), so a killed engine leaves no orphans.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec

from kvflow.config import EngineConfig
from kvflow.logger import init_logger
from kvflow.utils import describe_exit

logger = init_logger(__name__)

PARENT_POLL_S = 0.5


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the rendezvous store binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def encode_config(config: EngineConfig) -> str:
    return msgspec.json.encode(config).decode()


def decode_config(text: str) -> EngineConfig:
    return msgspec.json.decode(text.encode(), type=EngineConfig)


class RankProcess:
    """One spawned rank."""

    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.proc = proc

    def describe_exit(self) -> str | None:
        """None while running, else how it ended."""
        code = self.proc.poll()
        if code is None:
            return None
        return describe_exit(f"rank {self.rank} (pid {self.proc.pid})", code)


def spawn_ranks(config: EngineConfig, ranks: list[tuple[int, int]], port: int
                ) -> list[RankProcess]:
    """Start one process per (global rank, local rank) pair."""
    cfg = encode_config(config)
    env = dict(os.environ)
    procs = []
    for rank, local_rank in ranks:
        cmd = [sys.executable, "-m", "kvflow.worker.rank_proc", "--rank", str(rank),
               "--local-rank", str(local_rank), "--port", str(port), "--config", cfg]
        procs.append(RankProcess(rank, local_rank,
                                 subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)))
    logger.info("started ranks %s (pids %s)", [p.rank for p in procs],
                [p.proc.pid for p in procs])
    return procs


def first_failure(procs: list[RankProcess]) -> str | None:
    """How the first rank that ended ended, or None while all run."""
    for p in procs:
        why = p.describe_exit()
        if why is not None:
            return why
    return None


def stop_ranks(procs: list[RankProcess], grace_s: float = 15.0) -> None:
    """Wait up to ``grace_s`` for the ranks to exit, then kill the rest (by pid)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("rank %d (pid %d) did not exit; killing it", p.rank, p.proc.pid)
            p.proc.kill()
            p.proc.wait()


def watch_parent(parent_pid: int) -> None:
    """Exit this process at once when its parent is gone (no orphan ranks)."""

    def loop() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=loop, name="kvflow-parent-watch", daemon=True).start()


def run_node(config: EngineConfig) -> int:
    """Run this node's ranks (a node other than node 0) until they exit.

    Returns 0 when they stop cleanly (rank 0 sent StopWorkers), 1 when one fails; then
    the others are killed, since the engine cannot go on without it.
    """
    pc = config.parallel
    first = pc.node_rank * pc.ranks_per_node
    procs = spawn_ranks(config, [(first + i, i) for i in range(pc.ranks_per_node)],
                        pc.master_port)

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    logger.info("node %d of %d: ranks %d-%d wait for rank 0 at %s:%d", pc.node_rank,
                pc.nnodes, first, first + pc.ranks_per_node - 1, pc.master_addr,
                pc.master_port)
    try:
        while True:
            codes = [p.proc.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                logger.error("%s; stopping this node's other ranks", first_failure(
                    [p for p in procs if p.proc.poll() not in (None, 0)]))
                return 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(PARENT_POLL_S)
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
