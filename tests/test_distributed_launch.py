"""Where the ranks listen (loopback on one machine, never every interface) and the
torchrun environment variables as an alternative to the multi-node flags."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from kvflow import LLM
from kvflow.config import ParallelConfig
from kvflow.distributed.launch import free_port
from kvflow.distributed.rendezvous import listen_host, listen_socket, route_to
from kvflow.distributed.torchrun import torchrun_rank
from kvflow.engine.args import EngineArgs
from kvflow.errors import DistributedError, InvalidParameterError


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    found = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6",
                                                              socket.AF_INET6)):
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] != "0A" or int(parts[9]) not in inodes:  # 0A: LISTEN
                    continue
                addr, port = parts[1].split(":")
                raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1]
                               for i in range(0, len(addr), 8))
                found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux /proc")
def test_ranks_listen_on_loopback_only():
    before = listening(os.getpid())
    with LLM("tiny-llama", load_format="dummy", device="cpu", max_model_len=128,
             num_gpu_blocks_override=16, skip_tokenizer_init=True,
             tensor_parallel_size=2, distributed_timeout=120) as llm:
        rank1 = llm.engine.core.executor.procs[0].proc.pid
        mine = listening(os.getpid()) - before
        theirs = listening(rank1)
        assert mine and theirs  # the store and gloo on rank 0, gloo on rank 1
        assert all(is_loopback(a) for a, _ in mine | theirs), mine | theirs


def test_listen_addresses():
    assert listen_host(ParallelConfig(tensor_parallel_size=2)) == "127.0.0.1"
    # Even when a master address is given: one node needs nothing but loopback.
    assert listen_host(ParallelConfig(tensor_parallel_size=2, master_addr="10.1.2.3")) \
        == "127.0.0.1"
    two = dict(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=1234)
    assert listen_host(ParallelConfig(**two)) == "127.0.0.1"  # node 0: the master address
    assert listen_host(ParallelConfig(node_rank=1, **two)) == route_to("127.0.0.1") \
        == "127.0.0.1"


def test_store_refuses_an_address_of_another_machine():
    cfg = ParallelConfig(tensor_parallel_size=2, nnodes=2, master_addr="192.0.2.1",
                         master_port=29999)  # TEST-NET-1: never this machine's
    with pytest.raises(DistributedError, match="must be an address of node 0"):
        listen_socket(cfg)


def test_torchrun_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert torchrun_rank() is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun_rank() is None  # alone: nothing to join
    env = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               GROUP_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    tr = torchrun_rank()
    assert (tr.rank, tr.local_rank, tr.nnodes, tr.node_rank, tr.master_addr,
            tr.master_port) == (3, 1, 2, 1, "10.0.0.1", 29500)
    args = dict(model="tiny-llama", load_format="dummy", device="cpu",
                skip_tokenizer_init=True, tensor_parallel_size=2, pipeline_parallel_size=2)
    pc = EngineArgs(**args).create_engine_config().parallel
    assert (pc.nnodes, pc.node_rank, pc.master_addr, pc.master_port, pc.launcher) == \
        (2, 1, "10.0.0.1", 29500, "torchrun")
    with pytest.raises(InvalidParameterError, match="WORLD_SIZE=4"):
        EngineArgs(**dict(args, pipeline_parallel_size=1)).create_engine_config()
    with pytest.raises(InvalidParameterError, match="disagrees with torchrun"):
        EngineArgs(**args, master_port=1234).create_engine_config()
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(InvalidParameterError, match="LOCAL_RANK"):
        torchrun_rank()


# Eager on every side: a single process would otherwise run the C++ CPU step (int8
# activations on the GGUF linears), which pipeline ranks do not; the comparison is of the
# launcher, not of the two GEMVs' rounding (near ties part them within 8 tokens).
# greedy: `kvflow generate` samples at the model's recommended settings otherwise
GENERATE = ["-m", "kvflow.cli", "generate", "smollm2-135m", "--device", "cpu",
            "--max-model-len", "256", "--max-tokens", "8", "--temperature", "0",
            "--enforce-eager", "--prompt", "Hello"]


def answer(out: str) -> str:
    return out.split(">>> Hello", 1)[1].split("\n1 prompts")[0].strip()


@pytest.fixture(scope="module")
def reference_answer():
    out = subprocess.run([sys.executable, *GENERATE], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return answer(out)


# In CI: the only end-to-end run of ranks that torchrun starts (two nodes is the slow one).
def test_torchrun_one_node(reference_answer):
    """``torchrun --nproc-per-node 2 -m kvflow.cli generate ... -pp 2``: torchrun starts
    both ranks (kvflow starts none), RANK 0 answers, both exit 0."""
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
         str(port), *GENERATE, "-pp", "2"],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert answer(done.stdout) == reference_answer


@pytest.mark.slow
def test_torchrun_two_nodes(reference_answer):
    """Two torchrun invocations as two nodes on 127.0.0.1 (GROUP_RANK 0 and 1)."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
           str(port), *GENERATE, "-pp", "2"]
    node1 = subprocess.Popen([*cmd[:3], "--node-rank", "1", *cmd[3:]],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        node0 = subprocess.run([*cmd[:3], "--node-rank", "0", *cmd[3:]],
                               capture_output=True, text=True, timeout=180)
        out1, _ = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, out1[-3000:]
    assert answer(node0.stdout) == reference_answer
