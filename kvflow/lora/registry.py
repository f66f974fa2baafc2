"""Which adapters are served, by name (the API's view), and the engine core's check of
the adapter a request names.

The API process keeps a ``LoRARegistry``: ``--lora-modules`` at start, then
/v1/load_lora_adapter and /v1/unload_lora_adapter. A request that names an adapter
carries its ``LoRARequest`` (name, id, path) to the engine core and the worker, so
unloading one only stops new requests: those in flight keep their LoRARequest and finish.
"""

from __future__ import annotations

import itertools
import threading

from kvflow.config import EngineConfig
from kvflow.errors import InvalidParameterError, ModelNotFoundError
from kvflow.lora.adapter import load_adapter
from kvflow.lora.request import LoRARequest


def check_lora_request(config: EngineConfig, lora: LoRARequest, salt: str | None
                       ) -> str:
    """Refuse a LoRARequest the engine cannot run (LoRA off, a bad adapter: read from
    its header, no weights) and return the prefix-cache salt that keeps its blocks
    apart from other adapters' and the base model's."""
    if config.lora is None:
        raise InvalidParameterError("this engine serves no LoRA adapters; start it with "
                                    "--enable-lora", param="lora_request")
    if not isinstance(lora, LoRARequest):
        raise InvalidParameterError("lora_request must be a LoRARequest",
                                    param="lora_request")
    load_adapter(lora.lora_path, lora.lora_name, lora.lora_int_id, config.model.arch,
                 config.lora, weights=False)
    return lora.cache_key if salt is None else f"{salt}\x00{lora.cache_key}"


class LoRARegistry:
    """name -> LoRARequest of the adapters the server offers (thread-safe: the load
    endpoint checks files in a worker thread)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.num_loaded = 0  # since start (for /metrics)
        self.num_unloaded = 0

    @property
    def enabled(self) -> bool:
        return self.config.lora is not None

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter (config and every tensor's shape) and register it; a bad one
        raises and changes nothing."""
        if self.config.lora is None:
            raise InvalidParameterError("this engine serves no LoRA adapters; start it "
                                        "with --enable-lora", param="lora_name")
        if not isinstance(name, str) or not name:
            raise InvalidParameterError("lora_name must be a non-empty string",
                                        param="lora_name")
        served = self.config.model.served_model_name
        if name == served:
            raise InvalidParameterError(f"lora_name {name!r} is the base model's name",
                                        param="lora_name")
        with self._lock:
            if name in self._by_name:
                raise InvalidParameterError(f"a LoRA adapter named {name!r} is already "
                                            "loaded; unload it first", param="lora_name")
        probe = LoRARequest(name, 1, path)
        load_adapter(probe.lora_path, name, 1, self.config.model.arch, self.config.lora,
                     weights=False)
        with self._lock:
            if name in self._by_name:
                raise InvalidParameterError(f"a LoRA adapter named {name!r} is already "
                                            "loaded; unload it first", param="lora_name")
            req = LoRARequest(name, next(self._ids), path)
            self._by_name[name] = req
            self.num_loaded += 1
        return req

    def unload(self, name: str) -> LoRARequest:
        with self._lock:
            req = self._by_name.pop(name, None)
            if req is None:
                raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded",
                                         param="lora_name")
            self.num_unloaded += 1
            return req
