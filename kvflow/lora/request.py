"""The adapter a request runs with: plain data that rides on the request from the API
to the worker (no torch, so the scheduler can read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter to apply to one request (vLLM's LoRARequest)."""

    lora_name: str
    """The adapter's name (the ``model`` an API request picks it by)."""
    lora_int_id: int
    """A positive id, unique per adapter: the worker's slots and host cache key on it."""
    lora_path: str
    """A directory with adapter_config.json and adapter_model.safetensors."""

    def __post_init__(self) -> None:
        from kvflow.errors import InvalidParameterError

        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidParameterError("lora_name must be a non-empty string",
                                        param="lora_name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise InvalidParameterError(f"lora_int_id must be an integer >= 1, got "
                                        f"{self.lora_int_id!r}", param="lora_int_id")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidParameterError("lora_path must be a non-empty string",
                                        param="lora_path")

    @property
    def cache_key(self) -> str:
        """What the prefix cache mixes into a request's first block hash: blocks computed
        with one adapter are never reused by another (or by the base model)."""
        return f"lora:{self.lora_int_id}:{self.lora_name}"
