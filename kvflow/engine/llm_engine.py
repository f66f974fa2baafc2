"""The synchronous engine behind the offline API: process inputs, step the engine core
in-process, turn its outputs into RequestOutputs."""

from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.engine.args import EngineArgs
from kvflow.engine.core import EngineCore
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.processor import InputProcessor, PromptType
from kvflow.errors import InvalidParameterError
from kvflow.logger import init_logger
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

logger = init_logger(__name__)


def load_tokenizer(config: EngineConfig):
    """The model's tokenizer, or None when it has none (token ids only)."""
    if config.model.tokenizer is None:
        return None
    from kvflow.engine.tokenizer import Tokenizer

    return Tokenizer.from_path(config.model.tokenizer).with_chat_template(
        config.model.chat_template)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.core = EngineCore(config)
        self.processor = InputProcessor(config, self.tokenizer, self.core.num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        logger.info("%s", config.model.generation_defaults_line())

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, pooling=None, lora_request=None) -> None:
        """Validate, tokenize and queue a request (raises a kvflow error if it can't run).
        ``pooling``: a PoolingParams to prefill and pool the prompt instead of generating."""
        if request_id in self.output_processor.requests:
            raise InvalidParameterError(f"request id {request_id!r} is already in use",
                                        param="request_id")
        processed = self.processor.process(request_id, prompt, params, arrival_time,
                                           priority, pooling=pooling,
                                           lora_request=lora_request)
        state = self.output_processor.add_request(processed, arrival_time)
        added = []
        try:
            for req in processed.core_requests:
                self.core.add_request(req)
                added.append(req.request_id)
        except Exception:
            self.core.abort_requests(added)
            self.output_processor.abort_request(state.request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for rid in ids:
            self.core.abort_requests(self.output_processor.abort_request(rid))

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of requests that progressed."""
        core_outputs = self.core.step()
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        for child_id, stop in stopped:
            self.core.finish_requests([child_id], stop_reason=stop)
        for failure in self.core.take_failures():
            # The request ends with finish_reason "error"; the others go on.
            ro, siblings = self.output_processor.fail_request(failure.request_id,
                                                             failure.message)
            self.core.abort_requests(siblings)
            if ro is not None:
                outputs.append(ro)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()
