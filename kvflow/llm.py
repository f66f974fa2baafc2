"""The offline API, shaped like vLLM's: ``LLM(model, **engine_args).generate(prompts)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from kvflow import envs
from kvflow.engine.args import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.processor import PromptType
from kvflow.errors import InvalidParameterError
from kvflow.models.registry import DEFAULT_MODEL
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

ChatMessages = list[dict]


class LLM:
    """Generate text for batches of prompts with continuous batching.

    ``LLM("smollm2-135m")`` runs the embedded default model; any ``EngineArgs`` field
    (``dtype``, ``max_model_len``, ``kv_cache_memory``, ...) can be passed by name.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise InvalidParameterError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Release the model and stop any rank processes (tensor/pipeline parallel);
        they also stop when this process exits."""
        self.engine.core.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.processor.default_sampling_params()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt; returns RequestOutputs in input order.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``.
        ``sampling_params`` is one SamplingParams for all prompts or one per prompt.
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidParameterError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts",
                    param="sampling_params")
        if priority is not None and len(priority) != len(prompts):
            raise InvalidParameterError(f"got {len(priority)} priorities for {len(prompts)} "
                                        "prompts", param="priority")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p,
                                        priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or to
        several, then generate. ``tools`` (OpenAI's function tools) are rendered as the
        server renders them (the template's own tool prompt, or kvflow's default one);
        parse the output with kvflow.entrypoints.tool_parsers."""
        from kvflow.entrypoints.chat_utils import render_chat
        from kvflow.entrypoints.tools import messages_for_template, template_knows_tools

        tokenizer = self.get_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        templates = getattr(tokenizer, "chat_templates", None) or {}
        knows = template_knows_tools(templates.get("tool_use") if tools and "tool_use"
                                     in templates else templates.get("default"))
        kwargs = dict(chat_template_kwargs or {})
        if tools and knows:
            kwargs["tools"] = tools
        prompts = []
        for conv in conversations:
            conv = messages_for_template(list(conv), tools, knows)
            text, ids = render_chat(tokenizer, conv, add_generation_prompt, kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and not envs.no_progress_bar():
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                       postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if not out.finished:
                        continue
                    results[out.request_id] = out
                    if bar is not None:
                        in_tokens += len(out.prompt_token_ids)
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.postfix = (f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                       f"output: {out_tokens / elapsed:.2f} toks/s")
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
