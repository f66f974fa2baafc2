"""The IPC messages between the API process and the engine-core process: typed msgspec
structs, one codec, no pickle; the core process reports a start-up failure and exits 1."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile
import time

import msgspec
import pytest
import zmq

from kvflow.core.sched_output import EngineCoreOutput, EngineCoreRequest
from kvflow.engine import messages as m
from kvflow.sampling_params import OutputKind, SamplingParams

STATS = m.CoreStats(num_running=1, num_waiting=2, num_blocks=10, num_used_blocks=3,
                    kv_cache_usage=0.3, num_preemptions=0, num_steps=5)


def _request(rid: str = "r") -> EngineCoreRequest:
    params = SamplingParams(max_tokens=5, stop=["\n"], logprobs=2, seed=3,
                            output_kind=OutputKind.DELTA, stop_token_ids=[7])
    return EngineCoreRequest(rid, [1, 2, 3], params, [2], time.monotonic(), priority=1,
                             fork_of=None)


@pytest.mark.parametrize("msg,decode_side", [
    (m.AddRequest("r", [_request("0_r"), _request("1_r")]), "core"),
    (m.Abort(["a", "b"]), "core"),
    (m.FinishStopped(["a"], ["STOP"]), "core"),
    (m.Shutdown(), "core"),
    (m.Ready(num_blocks=10, block_size=16, max_model_len=512, kv_cache_bytes=1 << 20,
             device="cpu", dtype="float32", startup_s=1.5, pid=123), "api"),
    (m.Outputs([EngineCoreOutput("r", [5, 6], [([5, 9], [-0.1, -2.5], 1)], None, "length",
                                 None, 0)], STATS, 0.01), "api"),
    (m.Stats(STATS), "api"),
    (m.RequestError("r", "QueueFullError", "busy", None), "api"),
    (m.EngineError("RuntimeError: boom"), "api"),
])
def test_round_trip(msg, decode_side):
    codec = m.core_codec() if decode_side == "core" else m.api_codec()
    data = codec.encode(msg)
    assert b"\x80\x04" not in data[:2]  # not a pickle stream
    back = codec.decode(data)
    assert type(back) is type(msg)
    assert back == msg or msgspec.to_builtins(back) == msgspec.to_builtins(msg)


def test_sampling_params_survive_the_trip():
    req = m.core_codec().decode(m.core_codec().encode(m.AddRequest("r", [_request()])))
    params = req.requests[0].sampling_params
    assert params.stop_strings == ["\n"] and params.all_stop_token_ids == {7}
    assert params.output_kind is OutputKind.DELTA and params.seed == 3


def test_decoder_rejects_unknown_and_malformed_messages():
    api, core = m.api_codec(), m.core_codec()
    with pytest.raises(msgspec.ValidationError):  # a core-bound message on the API side
        api.decode(core.encode(m.Abort(["x"])))
    with pytest.raises(msgspec.ValidationError):
        core.decode(msgspec.msgpack.encode({"type": "abort", "request_ids": "not a list"}))
    with pytest.raises(msgspec.DecodeError):
        core.decode(b"\xc1garbage")


def test_no_pickle_in_the_ipc_path():
    root = pathlib.Path(m.__file__).parent
    forbidden = ("import pickle", "pickle.", "cloudpickle", "send_pyobj", "recv_pyobj",
                 "multiprocessing")
    for name in ("messages.py", "core_proc.py", "async_client.py"):
        text = (root / name).read_text()
        for word in forbidden:
            assert word not in text, (name, word)


def test_core_process_reports_start_failure_and_exits_1():
    with tempfile.TemporaryDirectory() as d:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{d}/out")
        push = ctx.socket(zmq.PUSH)
        push.bind(f"ipc://{d}/in")
        proc = subprocess.run(
            [sys.executable, "-m", "kvflow.engine.core_proc", "--input", f"ipc://{d}/in",
             "--output", f"ipc://{d}/out", "--engine-args",
             '{"model": "/no/such/model-dir"}'], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert pull.poll(5000)
        msg = m.api_codec().decode(pull.recv())
        assert isinstance(msg, m.EngineError)
        assert "ModelNotFoundError" in msg.message and "/no/such/model-dir" in msg.message
        ctx.destroy(linger=0)
