"""LoRA adapters over HTTP (vLLM's routes and bodies): each adapter is a model of its
own in /v1/models (``parent``: the base), picked by a request's ``model``; with
``--allow-runtime-lora-updating`` adapters load and unload while serving.

Both routes sit behind the API key like every route but /health. Loading checks the
whole adapter (files, type, rank, target modules, every tensor's shape) before it is
registered, so a bad one changes nothing; unloading only stops new requests: those in
flight carry their adapter to the end.
"""

# No "from __future__ import annotations": FastAPI must see the body types as objects.

import asyncio
from typing import Annotated

from fastapi import Body, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from kvflow.entrypoints.openai.protocol import ErrorResponse, ModelCard
from kvflow.lora.registry import LoRARegistry

_NAME = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: _NAME
    """The name requests pick the adapter by (``model``)."""
    lora_path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]
    """A PEFT adapter directory on the server (adapter_config.json and
    adapter_model.safetensors)."""


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: _NAME
    lora_int_id: int | None = None
    """Accepted for vLLM compatibility; the name alone picks the adapter."""


def lora_model_cards(loras: LoRARegistry, created: int, parent: str,
                     max_model_len: int) -> list[ModelCard]:
    out = []
    for name in loras.names():
        req = loras.get(name)
        if req is not None:
            out.append(ModelCard(id=name, created=created, root=req.lora_path,
                                 parent=parent, max_model_len=max_model_len))
    return out


def add_lora_routes(app: FastAPI, loras: LoRARegistry) -> None:
    errors = {s: {"model": ErrorResponse} for s in (400, 401, 404)}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def load_lora_adapter(body: Annotated[LoadLoRAAdapterRequest, Body()]):
        # reading the adapter's header and config is file I/O: off the event loop
        await asyncio.get_running_loop().run_in_executor(None, loras.load, body.lora_name,
                                                         body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses=errors)
    async def unload_lora_adapter(body: Annotated[UnloadLoRAAdapterRequest, Body()]):
        loras.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")
