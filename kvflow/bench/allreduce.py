"""``kvflow bench allreduce``: time the engine's own all-reduce (GroupCoordinator over
torch.distributed: gloo on CPU, NCCL on GPU) at the message sizes a TP step sends, and
put the planner's figure for each size beside it.

One process per rank, as in the engine: rank 0 is this process, the others are
``python -m kvflow.bench.allreduce --rank R ...`` subprocesses. Each size is warmed up,
then timed over ``--iters`` all-reduces (a barrier before, a device sync after); the
result is the median per all-reduce seen by rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

DEFAULT_SIZES = "16KB,256KB,1MB,16MB"


def add_allreduce_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU "
                   "per rank)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"message sizes, comma separated (default {DEFAULT_SIZES})")
    p.add_argument("--dtype", default="bfloat16", help="element type of the messages "
                   "(default bfloat16, as a GPU step; float32 for CPU steps)")
    p.add_argument("--iters", type=int, default=50, help="timed all-reduces per size")
    p.add_argument("--gpu", default="h200", help="GPU preset whose link figures the "
                   "planner column uses (default h200)")
    p.add_argument("--save-result", default=None, help="write the result JSON here")


def _sizes(text: str) -> list[int]:
    from kvflow.engine.args import parse_bytes

    # Decimal units, as message sizes are usually quoted (16 KB = 16,000 bytes is close
    # enough either way; parse_bytes takes KiB too).
    return [parse_bytes(s.strip().upper().replace("KB", "KiB").replace("MB", "MiB"),
                        "sizes") for s in text.split(",") if s.strip()]


def _time_rank(rank: int, ns: argparse.Namespace, port: int) -> list[float] | None:
    import torch

    from kvflow.config import ParallelConfig
    from kvflow.distributed import destroy_parallel_state, init_parallel_state

    device = torch.device(f"cuda:{rank}" if ns.device.startswith("cuda") else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // ns.world_size))
    cfg = ParallelConfig(tensor_parallel_size=ns.world_size, timeout_s=120)
    state = init_parallel_state(cfg, rank, rank, port, device)
    dtype = getattr(torch, ns.dtype)
    medians = []
    try:
        for size in _sizes(ns.sizes):
            x = torch.ones(max(1, size // dtype.itemsize), dtype=dtype, device=device)
            for _ in range(5):
                state.tp.all_reduce(x)
            times = []
            for _ in range(ns.iters):
                state.tp.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                state.tp.all_reduce(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t)
            medians.append(statistics.median(times))
    finally:
        destroy_parallel_state(state)
    return medians if rank == 0 else None


def run_allreduce(ns: argparse.Namespace) -> int:
    from kvflow.bench.machine import save_result
    from kvflow.distributed.launch import free_port
    from kvflow.plan.gpus import get_gpu

    port = free_port()
    args = ["--world-size", str(ns.world_size), "--device", ns.device, "--sizes", ns.sizes,
            "--dtype", ns.dtype, "--iters", str(ns.iters)]
    procs = [subprocess.Popen([sys.executable, "-m", "kvflow.bench.allreduce", "--rank",
                               str(r), "--port", str(port), *args])
             for r in range(1, ns.world_size)]
    try:
        medians = _time_rank(0, ns, port)
    finally:
        for p in procs:
            p.wait(60)
    gpu = get_gpu(ns.gpu)
    n = ns.world_size
    rows = []
    for size, t in zip(_sizes(ns.sizes), medians):
        # The planner's model: a fixed latency plus each GPU's ring traffic, 2(N-1)/N of
        # the message, at the datasheet link bandwidth.
        planned = gpu.link_latency_s + size * 2 * (n - 1) / n / gpu.link_bytes_per_s
        rows.append({"bytes": size, "measured_us": t * 1e6,
                     "measured_bus_gbs": size * 2 * (n - 1) / n / t / 1e9,
                     f"planner_{ns.gpu}_us": planned * 1e6})
        print(f"{size:>10} B  {t * 1e6:10.1f} us  (planner for {ns.gpu}: "
              f"{planned * 1e6:.1f} us)")
    save_result(ns.save_result, {
        "benchmark": "allreduce", "world_size": n, "device": ns.device,
        "backend": "nccl" if ns.device.startswith("cuda") else "gloo", "dtype": ns.dtype,
        "iters": ns.iters, "loadavg": os.getloadavg(), "results": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="an all-reduce rank (started by kvflow bench "
        "allreduce)")
    add_allreduce_args(p)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    ns = p.parse_args(argv)
    _time_rank(ns.rank, ns, ns.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
