"""``POST /v1/embeddings``: each input prefilled as a one-token request that returns the model's final-norm
hidden state at its last token (last-token pooling), L2-normalised. Its KV stays in the prefix cache like any
prompt's, so a generation on the same prompt afterwards finds it cached."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import uuid
from dataclasses import replace
from typing import Any

from kvserve.async_engine import AsyncEngine
from kvserve.sampling_params import SamplingParams
from kvserve.server import protocol as p

EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, return_hidden_state=True)


async def embed(engine: AsyncEngine, prompts: list[tuple[list[int], str | None]],
                params: SamplingParams = EMBEDDING_PARAMS) -> list[list[float]]:
    """Each prepared prompt's vector, the prompts run side by side (``params``: ``embedding_params``')."""
    request_id = f"embd-{uuid.uuid4().hex}"

    async def one(i: int, ids: list[int], text: str | None) -> list[float]:
        hidden = None
        async for output in engine.generate(ids, params, f"{request_id}-{i}", text):
            hidden = output.outputs[0].hidden_state or hidden
        assert hidden is not None, "a finished embedding request without its hidden state"
        norm = math.sqrt(sum(x * x for x in hidden)) or 1.0
        return [x / norm for x in hidden]

    tasks = [asyncio.ensure_future(one(i, ids, text)) for i, (ids, text) in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:  # the first input to fail (a full queue) cancels the others rather than leaving them
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def embedding_response(vectors: list[list[float]], prompts: list[tuple[list[int], str | None]],
                       model: str, encoding_format: str = "float") -> dict[str, Any]:
    tokens = sum(len(ids) for ids, _ in prompts)
    encoded: list[Any] = vectors if encoding_format == "float" else [
        base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii") for v in vectors]
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(encoded)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def prepare_inputs(engine: AsyncEngine, body: p.EmbeddingRequest) -> list[tuple[list[int], str | None]]:
    params = embedding_params(body)
    return [engine.prepare(x, params) for x in body.inputs()]


def embedding_params(body: p.EmbeddingRequest) -> SamplingParams:
    return replace(EMBEDDING_PARAMS, truncate_prompt_tokens=body.truncate_prompt_tokens, cache_salt=body.cache_salt,
                   priority=body.priority)
