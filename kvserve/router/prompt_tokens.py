"""The token ids a policy routes on: the whole rendered prompt, as the replica will see it.

A kvserve replica hands the gateway its tokenizer, chat template and the template variables it defaults
(``GET /kvserve/tokenizer``; ``--default-chat-template-kwargs``), so a chat request is rendered (messages and
tools) and tokenized here as the replica will do it, and prefix pages line up with the replica's KV blocks. A model whose replicas do not tell their tokenizer is routed on the UTF-8
bytes of a plain rendering of the conversation: coarser, still a prefix of what the replica caches.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx

from kvserve.errors import KVServeError, ModelLoadError
from kvserve.infill import FimTokens
from kvserve.reasoning import template_message
from kvserve.router.replicas import Replica
from kvserve.server.responses_api import ResponsesRequest
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class PromptTokens:
    """Per model, the tokenizer of its kvserve replicas (or none), and the rendering of a request."""

    def __init__(self, client: httpx.AsyncClient | None = None, headers: dict[str, str] | None = None) -> None:
        self._client = client
        self._headers = headers or {}
        self._tokenizers: dict[str, Tokenizer | None] = {}
        self._template_defaults: dict[str, dict[str, Any]] = {}  # per model, what its replicas default

    async def learn(self, replicas: list[Replica]) -> None:
        """Fetch the tokenizer of each model from one of its kvserve replicas (once: a model whose replica could
        not tell it is routed on bytes). One tokenizer serves every name a replica serves its model under, a
        LoRA adapter's loaded since included."""
        for replica in replicas:
            if not replica.is_kvserve:
                continue
            missing = [model for model in replica.models if model not in self._tokenizers]
            if not missing:
                continue
            known = next((m for m in replica.models if self._tokenizers.get(m) is not None), None)
            description = ((self._tokenizers[known], self._template_defaults.get(known, {})) if known is not None
                           else await self._fetch(replica))
            for model in missing:
                self.add(model, *description)

    def knows(self, model: str) -> bool:
        """Whether ``model``'s tokenizer was asked for (found or not)."""
        return model in self._tokenizers

    def add(self, model: str, tokenizer: Tokenizer | None, template_defaults: dict[str, Any] | None = None) -> None:
        """The tokenizer of ``model`` and the template variables its replicas default, learnt some other way (a
        Ray Serve replica hands them over)."""
        self._tokenizers[model] = tokenizer
        self._template_defaults[model] = template_defaults or {}

    async def _fetch(self, replica: Replica) -> tuple[Tokenizer | None, dict[str, Any]]:
        assert self._client is not None, "PromptTokens without a client learns tokenizers only through add()"
        try:
            response = await self._client.get(f"{replica.url}/kvserve/tokenizer", headers=self._headers,
                                              timeout=60.0)
            description = response.json()
            return Tokenizer.from_description(description), template_defaults(description)
        except (httpx.TransportError, ValueError, KeyError, TypeError, ModelLoadError) as exc:
            logger.warning("no tokenizer from %s (routing on text bytes): %r", replica.url, exc)
            return None, {}

    def tokenizer(self, model: str | None) -> Tokenizer | None:
        """``model``'s tokenizer; for a request naming none, the one tokenizer known (of one model, served under
        one name or several)."""
        if model is not None:
            return self._tokenizers.get(model)
        known = {id(t): t for t in self._tokenizers.values()}
        return next(iter(known.values())) if len(known) == 1 else None

    def _defaults_of(self, model: str | None, tokenizer: Tokenizer | None) -> dict[str, Any]:
        """The template variables ``model``'s replicas default; for a request naming none, those of the model
        whose tokenizer it is keyed with."""
        if model is not None:
            return self._template_defaults.get(model, {})
        named = [m for m, t in self._tokenizers.items() if tokenizer is not None and t is tokenizer]
        return self._template_defaults.get(named[0], {}) if named else {}

    def of(self, path: str, payload: dict[str, Any]) -> tuple[int, ...]:
        """The routing key of a request body already parsed as a JSON object. Never raises: a request the
        router cannot render is routed on its bytes, and the replica judges it."""
        model = payload.get("model") if isinstance(payload.get("model"), str) else None
        tokenizer = self.tokenizer(model)
        defaults = self._defaults_of(model, tokenizer)
        try:
            if path.endswith("/chat/completions"):
                return self._chat(tokenizer, payload, defaults)
            if path.endswith("/responses"):  # its input items as the conversation the replica renders
                chat = ResponsesRequest.model_validate(payload).chat_request()
                return self._chat(tokenizer, chat.model_dump(exclude_none=True), defaults)
            if path.endswith("/completions") and isinstance(payload.get("suffix"), str):
                return self._infill(tokenizer, payload.get("prompt"), payload["suffix"])
            return self._completion(tokenizer, payload.get("input" if path.endswith("/embeddings") else "prompt"))
        except (KVServeError, TypeError, ValueError, AttributeError, ArithmeticError) as exc:
            logger.debug("routing on bytes: %r", exc)
            return tuple(json.dumps(payload.get("messages", payload.get("prompt")), sort_keys=True).encode())

    @staticmethod
    def _chat(tokenizer: Tokenizer | None, payload: dict[str, Any], defaults: dict[str, Any]) -> tuple[int, ...]:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return ()
        if tokenizer is None or tokenizer.chat_template is None:
            plain = "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages if isinstance(m, dict))
            return tuple(plain.encode())
        tools = payload.get("tools") if "tools" in tokenizer.chat_template else None
        continued = payload.get("continue_final_message") is True  # the replica renders it as the body says
        variables = {**defaults, **(payload.get("chat_template_kwargs") or {}), "documents": payload.get("documents")}
        messages = [template_message(m) if isinstance(m, dict) else m for m in messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=payload.get("add_generation_prompt", True)
                                             is not False, tools=tools, continue_final_message=continued,
                                             variables=variables)
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    @classmethod
    def _infill(cls, tokenizer: Tokenizer | None, prompt: Any, suffix: str) -> tuple[int, ...]:
        """A fill-in-the-middle request's gap as the replica lays it out (kvserve/infill.py), on its first prompt."""
        fim = FimTokens.of(tokenizer) if tokenizer is not None else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if fim is None or not isinstance(prompt, str):
            return cls._completion(tokenizer, prompt)  # the replica refuses it
        assert tokenizer is not None
        return tuple(fim.prompt(tokenizer, prompt, suffix))

    @staticmethod
    def _completion(tokenizer: Tokenizer | None, prompt: Any) -> tuple[int, ...]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: routed whole, on its first prompt
        if isinstance(prompt, list):
            ids = tuple(int(t) for t in prompt)
            if not all(0 <= t < 2**32 for t in ids):  # no vocabulary's ids; the replica refuses them
                raise ValueError("token ids out of range")
            return ids
        if not isinstance(prompt, str):
            return ()
        return tuple(tokenizer.encode(prompt)) if tokenizer is not None else tuple(prompt.encode())


def template_defaults(description: dict[str, Any]) -> dict[str, Any]:
    """The template variables a replica's tokenizer description says it defaults ({} for one that says none)."""
    defaults = description.get("default_chat_template_kwargs") or {}
    if not isinstance(defaults, dict):
        raise TypeError(f"default_chat_template_kwargs is not an object: {defaults!r}")
    return defaults
