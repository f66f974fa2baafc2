"""kvflow: a fast, readable LLM inference and serving engine (PyTorch + Triton)."""

from kvflow.errors import (InvalidParameterError, KvflowError, ModelLoadError,
                           ModelNotFoundError, PromptTooLongError)
from kvflow.lora.request import LoRARequest
from kvflow.outputs import CompletionOutput, Logprob, RequestOutput
from kvflow.sampling_params import OutputKind, SamplingParams
from kvflow.version import __version__


def __getattr__(name: str):
    # LLM pulls in torch; keep `import kvflow` light for the pure-Python parts.
    if name == "LLM":
        from kvflow.llm import LLM

        return LLM
    if name == "EngineArgs":
        from kvflow.engine.args import EngineArgs

        return EngineArgs
    raise AttributeError(name)


__all__ = ["LLM", "EngineArgs", "SamplingParams", "OutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "KvflowError", "InvalidParameterError",
           "PromptTooLongError", "ModelNotFoundError", "ModelLoadError", "LoRARequest",
           "__version__"]
