"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, served only
with ``--allow-runtime-lora-updating`` (a client may then make the server read adapters from its own disk)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from kvserve.engine import Engine
from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.server import protocol as p


class LoadLoRAAdapterRequest(p.StrictTextModel):
    lora_name: str
    lora_path: str
    model: str | None = None  # the base model it is for: behind a gateway, only its replicas load it


class UnloadLoRAAdapterRequest(p.StrictTextModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name identifies the adapter
    model: str | None = None


def add_lora_routes(app: FastAPI, engine: Engine, model_names: tuple[str, ...]) -> None:
    """The routes over ``engine``'s adapters; an adapter may not take one of ``model_names`` (the base model's)."""
    loading = asyncio.Lock()  # one load at a time: two loads of one name must not both succeed

    def check_base_model(model: str | None) -> None:
        if model is not None and model.strip() not in model_names:
            error = ModelNotFound(f"the model '{model}' is not this server's base model ({', '.join(model_names)})")
            error.param = "model"  # type: ignore[attr-defined]
            raise error

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        check_base_model(body.model)
        name = body.lora_name.strip()
        if not name or not body.lora_path.strip():
            raise InvalidRequest("lora_name and lora_path must be non-empty", param="lora_name" if not name
                                 else "lora_path")
        if name in model_names:
            raise InvalidRequest(f"'{name}' is the base model's name; give the adapter another", param="lora_name")
        async with loading:
            if name in engine.loras:
                raise InvalidRequest(f"the LoRA adapter '{name}' has already been loaded; unload it first",
                                     param="lora_name")
            await asyncio.to_thread(engine.add_lora, name, body.lora_path)  # reads and converts its tensors
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        check_base_model(body.model)
        if not engine.remove_lora(body.lora_name):
            error = ModelNotFound(f"the LoRA adapter '{body.lora_name}' cannot be found")
            error.param = "lora_name"  # type: ignore[attr-defined]
            raise error
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
