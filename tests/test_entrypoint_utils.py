"""The helpers the entry points share: the chat-template render (LLM.chat and the
server) with its limits, the base-URL normaliser, the fd limit and the stream-chunk
builder."""

from __future__ import annotations

import copy
import json
import resource
import time

import pytest

from kvflow.entrypoints.chat_utils import RESERVED_TEMPLATE_KWARGS, render_chat
from kvflow.entrypoints.utils import normalize_base_url, raise_fd_limit
from kvflow.errors import InvalidParameterError

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.engine.tokenizer import Tokenizer
    from kvflow.models.registry import embedded_model_path

    return Tokenizer.from_path(embedded_model_path("smollm2-135m"))


def with_template(tokenizer, template: str):
    tok = copy.copy(tokenizer)
    tok.chat_templates = {"default": template}
    return tok


def test_render_matches_the_template_and_encodes_without_specials(tokenizer):
    text, ids = render_chat(tokenizer, CHAT, True)
    assert text == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_llm_chat_uses_the_same_render(smollm2):
    from kvflow import SamplingParams

    out = smollm2.chat(CHAT, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    text, ids = render_chat(smollm2.get_tokenizer(), CHAT, True)
    assert out[0].prompt == text and out[0].prompt_token_ids == ids


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_template_kwargs_may_not_override_the_renderer(tokenizer, key):
    with pytest.raises(InvalidParameterError, match=key) as e:
        render_chat(tokenizer, CHAT, True, {key: 1})
    assert e.value.param == "chat_template_kwargs"


def test_a_template_that_loops_without_output_is_stopped(tokenizer):
    slow = with_template(tokenizer, "{% for i in range(100000) %}{% for j in range(100000) %}"
                                    "{% endfor %}{% endfor %}x")
    start = time.monotonic()
    with pytest.raises(InvalidParameterError, match="longer than 0.3 s") as e:
        render_chat(slow, CHAT, True, timeout_s=0.3)
    assert time.monotonic() - start < 10 and e.value.param == "messages"
    # The thread that rendered it is fine afterwards.
    assert render_chat(tokenizer, CHAT, True, timeout_s=5)[0]


def test_a_render_that_grows_too_large_is_stopped(tokenizer):
    big = with_template(tokenizer, "{% for i in range(100000) %}0123456789{% endfor %}")
    with pytest.raises(InvalidParameterError, match="more than 1000 characters"):
        render_chat(big, CHAT, True, max_chars=1000)
    assert len(render_chat(big, CHAT, True, max_chars=2_000_000)[0]) == 1_000_000


def test_no_tokenizer_no_chat():
    with pytest.raises(InvalidParameterError, match="tokenizer"):
        render_chat(None, CHAT)


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1",
                                 "http://h:8000/v1/", " http://h:8000 ", "h:8000",
                                 "h:8000/v1"])
def test_base_url_normaliser(url):
    assert normalize_base_url(url) == "http://h:8000"


def test_fd_limit_raised_to_the_hard_limit():
    raise_fd_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard


def test_chunk_builder_shapes_both_chunk_kinds():
    from kvflow.entrypoints.openai.protocol import ChatCompletionChunk, CompletionChunk
    from kvflow.entrypoints.openai.serving import ChunkBuilder

    chat = ChunkBuilder("id1", "chat.completion.chunk", "m")
    event = chat([{"index": 0, "delta": {"content": "x"}, "logprobs": None,
                   "finish_reason": None}])
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    ChatCompletionChunk.model_validate(json.loads(event[6:]))
    done = ChunkBuilder("id2", "text_completion", "m")([], {"prompt_tokens": 1})
    body = json.loads(done[6:])
    CompletionChunk.model_validate(body)
    assert body["usage"] == {"prompt_tokens": 1} and body["object"] == "text_completion"


def test_gather_or_cancel_reads_every_error():
    """Two prompts of one request failing together: the first error is raised and the
    other is read too, so asyncio logs no 'Task exception was never retrieved' (the
    schema fuzzer's server log caught that traceback)."""
    import asyncio
    import gc

    from kvflow.entrypoints.openai.serving import gather_or_cancel

    async def fail(msg: str) -> None:
        raise InvalidParameterError(msg)

    async def main() -> list:
        unretrieved: list = []
        # only this test's errors: another test's leaked task may be collected here
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: unretrieved.append(ctx.get("message"))
            if isinstance(ctx.get("exception"), InvalidParameterError) else None)
        with pytest.raises(InvalidParameterError, match="first"):
            await gather_or_cancel([fail("first"), fail("second")])
        gc.collect()
        await asyncio.sleep(0)
        return unretrieved

    assert asyncio.run(main()) == []
