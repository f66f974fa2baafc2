"""AsyncEngine pieces that need no engine core: merging outputs a slow consumer missed."""

from __future__ import annotations

import asyncio

from kvflow.engine.async_client import _ABORTED, _RequestStream, merge_outputs
from kvflow.outputs import CompletionOutput, Logprob, RequestOutput
from kvflow.sampling_params import OutputKind


def _out(samples, finished=False, prompt_lp=None):
    return RequestOutput("r", None, [1, 2], samples, finished, prompt_logprobs=prompt_lp)


def test_merge_deltas_concatenates_per_sample():
    lp = {5: Logprob(-0.5, 1)}
    a = _out([CompletionOutput(0, "Hel", [5], -0.5, [lp]),
              CompletionOutput(1, "A", [9], None, None)], prompt_lp=[None, lp])
    b = _out([CompletionOutput(0, "lo", [6], -1.0, [{6: Logprob(-0.5, 1)}], "stop", "!")],
             finished=False)
    c = _out([CompletionOutput(1, "B", [8], None, None, "length")], finished=True)
    m = merge_outputs(merge_outputs(a, b, OutputKind.DELTA), c, OutputKind.DELTA)
    s0, s1 = m.outputs
    assert (s0.text, s0.token_ids, s0.finish_reason, s0.stop_reason) == ("Hello", [5, 6],
                                                                         "stop", "!")
    assert len(s0.logprobs) == 2 and s0.cumulative_logprob == -1.0
    assert (s1.text, s1.token_ids, s1.finish_reason) == ("AB", [9, 8], "length")
    assert m.finished and m.prompt_logprobs == [None, lp]


def test_merge_cumulative_keeps_the_latest():
    a = _out([CompletionOutput(0, "He", [5])])
    b = _out([CompletionOutput(0, "Hello", [5, 6])], finished=True)
    assert merge_outputs(a, b, OutputKind.CUMULATIVE) is b


def test_request_stream_hands_out_everything_in_order():
    async def run():
        stream = _RequestStream()
        waiter = asyncio.ensure_future(stream.get_all())
        await asyncio.sleep(0)
        assert not waiter.done()
        stream.put(1)
        stream.put(2)
        stream.put(_ABORTED)
        assert await waiter == [1, 2, _ABORTED]
        stream.put(3)
        assert await stream.get_all() == [3]
    asyncio.run(run())
