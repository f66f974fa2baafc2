"""A rank other than rank 0: joins the process groups, loads its shard of the model,
then runs every step rank 0 broadcasts until told to stop.

Started by the executor (or by ``kvflow serve --node-rank R`` on another node) as::

    python -m kvflow.worker.rank_proc --rank R --local-rank L --port P --config JSON

It exits 0 on StopWorkers, non-zero when a collective fails (another rank died or timed
out), and at once when its parent process is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

from kvflow.logger import init_logger

logger = init_logger("kvflow.worker.rank_proc")  # __name__ is __main__ under -m


def run_torchrun_rank(config, tr) -> int:
    """A torchrun rank other than 0 (``kvflow.distributed.torchrun.TorchrunRank``): serve
    rank 0's steps until it stops; the exit code (0 on a clean stop) tells torchrun how
    it went."""
    try:
        return run_rank(config, tr.rank, tr.local_rank, tr.master_port)
    except Exception as e:
        logger.error("rank %d stopped: %s: %s", tr.rank, type(e).__name__, e)
        return 1


def run_rank(config, rank: int, local_rank: int, port: int) -> int:
    from kvflow.distributed import destroy_parallel_state, init_parallel_state
    from kvflow.distributed.messages import ExecuteStep, Setup, broadcast_message
    from kvflow.cpu.threads import set_rank_threads
    from kvflow.worker.executor import rank_config
    from kvflow.worker.model_runner import ModelRunner

    set_rank_threads(config)
    state = init_parallel_state(config.parallel, rank, local_rank, port,
                                torch.device(rank_config(config, rank, local_rank).device.device))
    try:
        setup = broadcast_message(state.control, None)
        if not isinstance(setup, Setup):
            raise RuntimeError(f"expected the engine config first, got {type(setup).__name__}")
        if setup.config.parallel.world_size != config.parallel.world_size:
            raise RuntimeError("this node's --tensor/--pipeline-parallel-size disagree with "
                               "node 0's")
        runner = ModelRunner(rank_config(setup.config, rank, local_rank), state)
        runner.initialize()
        prev = None
        while True:
            msg = broadcast_message(state.control, None)
            if not isinstance(msg, ExecuteStep):
                return 0  # StopWorkers
            handle = runner.execute_model_async(msg.sched)
            # Collect the previous step only now, as rank 0 does with overlapped steps:
            # the GPU already has this one queued.
            if prev is not None:
                prev.result()
            prev = handle
    finally:
        destroy_parallel_state(state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description="kvflow rank process (started by the "
        "engine, not by hand)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    ns = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group: the engine decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvflow.distributed.launch import decode_config, watch_parent

    watch_parent(os.getppid())
    try:
        return run_rank(decode_config(ns.config), ns.rank, ns.local_rank, ns.port)
    except Exception as e:
        logger.error("rank %d stopped: %s: %s", ns.rank, type(e).__name__, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
