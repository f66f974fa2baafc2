"""What rank 0 tells the other ranks, as typed msgspec messages (DESIGN rule 8).

Rank 0 encodes each message with MessagePack and broadcasts the bytes over the gloo
control group; every other rank decodes them against the tagged union below, so a
SchedulerOutput arrives field-checked and nothing is ever pickled. The first broadcast
carries a fixed-size chunk with the length in front, so a small message (a decode step)
costs one collective; a larger one sends its remainder in a second.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from kvflow.config import EngineConfig
from kvflow.core.sched_output import SchedulerOutput

CHUNK_BYTES = 16 << 10  # covers a decode step of a few hundred requests
_HEADER = 8  # little-endian payload length


class Setup(msgspec.Struct, tag="setup", frozen=True):
    """Sent once, right after the rendezvous: the engine config every rank runs with
    (rank 0's), so ranks on other nodes cannot disagree with it on model, dtype, lengths
    or seed."""

    config: EngineConfig


class ExecuteStep(msgspec.Struct, tag="step", frozen=True):
    """Run this step (every rank runs every step, in order)."""

    sched: SchedulerOutput


class StopWorkers(msgspec.Struct, tag="stop", frozen=True):
    """Leave the loop, release the device and exit 0."""


ToRank = Setup | ExecuteStep | StopWorkers

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ToRank)


def encode(msg: ToRank) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> ToRank:
    return _decoder.decode(data)


def _chunks(msg: ToRank) -> list[torch.Tensor]:
    """The tensors rank 0 broadcasts for ``msg``: the first chunk, and the rest if any."""
    data = encode(msg)
    n = len(data)
    head = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
    head[:_HEADER] = torch.frombuffer(bytearray(n.to_bytes(_HEADER, "little")),
                                      dtype=torch.uint8)
    first = min(n, CHUNK_BYTES - _HEADER)
    if first:
        head[_HEADER:_HEADER + first] = torch.frombuffer(bytearray(data[:first]),
                                                         dtype=torch.uint8)
    if n > first:
        return [head, torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)]
    return [head]


def broadcast_message_async(group, msg: ToRank) -> list:
    """Rank 0 posts ``msg`` without waiting for the ranks to take it (pipeline
    parallelism: a later stage still busy with an earlier batch takes the next step's
    message when it gets there). Returns the works; each keeps its tensor alive."""
    return [dist.broadcast(t, src=group.ranks[0], group=group.cpu_group, async_op=True)
            for t in _chunks(msg)]


def broadcast_message(group, msg: ToRank | None) -> ToRank:
    """Rank 0 passes ``msg`` and gets it back; the others pass None and receive it.

    ``group`` is a GroupCoordinator whose cpu_group is gloo; it blocks until rank 0
    sends, and raises if a rank of the group is gone.
    """
    cpu = group.cpu_group
    src = group.ranks[0]
    if msg is not None:
        for t in _chunks(msg):
            dist.broadcast(t, src=src, group=cpu)
        return msg
    head = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
    dist.broadcast(head, src=src, group=cpu)
    raw = head.numpy().tobytes()
    n = int.from_bytes(raw[:_HEADER], "little")
    first = min(n, CHUNK_BYTES - _HEADER)
    data = raw[_HEADER:_HEADER + first]
    if n > first:
        rest = torch.empty(n - first, dtype=torch.uint8)
        dist.broadcast(rest, src=src, group=cpu)
        data += rest.numpy().tobytes()
    return decode(data)
