"""Offline batch generation, shaped like vLLM's ``LLM``: prompts in, finished outputs back, the engine stepped
in the caller's thread until the batch is done."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvserve.config_args import engine_config_from_keywords
from kvserve.engine import Engine
from kvserve.errors import InvalidRequest
from kvserve.input_processor import PromptType
from kvserve.reasoning import template_message
from kvserve.request import LoRARequest, RequestOutput
from kvserve.sampling_params import SamplingParams, expand_n
from kvserve.tokenizer import Tokenizer, chat_reply_phase


class LLM:
    """Offline batch generation, shaped like vLLM's ``LLM``."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """``options`` are the keywords of kvserve/config.py's settings (``max_num_seqs``, ``kv_host_gb``,
        ``scheduling_policy``, ``speculative_config`` as a dict or a SpeculativeConfig, ...; the README's
        flags table lists them); an unknown one is a ConfigError. No progress bar unless asked for."""
        options.setdefault("show_progress", False)
        config = engine_config_from_keywords({"model": model, **options})
        self.engine = Engine(config)
        self._batch_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def close(self) -> None:
        self.engine.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``priority``: one per prompt (vLLM's ``LLM.generate`` argument), under the priority scheduling policy;
        the same as each prompt's ``SamplingParams.priority``. ``lora_request``: the LoRA adapter every prompt
        runs with, or one (or None) per prompt, loaded the first time its name is seen."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequest("need one SamplingParams per prompt, or a single one", "sampling_params")
        if priority is not None:
            if len(priority) != len(prompts):
                raise InvalidRequest("need one priority per prompt", "priority")
            params_list = [replace(params, priority=p) for params, p in zip(params_list, priority, strict=True)]
        if lora_request is not None:
            loras = [lora_request] * len(prompts) if isinstance(lora_request, LoRARequest) else list(lora_request)
            if len(loras) != len(prompts):
                raise InvalidRequest("need one LoRARequest (or None) per prompt, or a single one", "lora_request")
            params_list = [params if lora is None else replace(params, lora_name=self._adapter(lora))
                           for params, lora in zip(params_list, loras, strict=True)]

        batch = next(self._batch_ids)
        groups: list[list[str]] = []
        added: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                ids = []
                for j, child in enumerate(expand_n(params)):
                    request = self.engine.add_request(prompt, child, request_id=f"llm{batch}-{i}-{j}")
                    ids.append(request.request_id)
                    added.append(request.request_id)
                groups.append(ids)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise

        final: dict[str, RequestOutput] = {}
        while len(final) < len(added) or self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    final[output.request_id] = output
        # An offline batch is done when its KV is where the tiers keep it, as after a synchronous write.
        self.engine.wait_for_tier_writes()
        return [self._merge([final[rid] for rid in ids]) for ids in groups]

    def _adapter(self, lora: LoRARequest) -> str:
        """The name ``lora`` runs under, its adapter loaded from its path if that name is not loaded yet."""
        if lora.lora_name not in self.engine.loras:
            if not lora.lora_path:
                raise InvalidRequest(f"LoRA adapter '{lora.lora_name}' is not loaded and its request has no lora_path",
                                     "lora_request")
            self.engine.add_lora(lora.lora_name, lora.lora_path)
        return lora.lora_name

    @staticmethod
    def _merge(outputs: list[RequestOutput]) -> RequestOutput:
        first = outputs[0]
        if len(outputs) == 1:
            return first
        completions = []
        for i, output in enumerate(outputs):
            completion = output.outputs[0]
            completion.index = i
            completions.append(completion)
        return replace(first, outputs=completions)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """``tools`` (OpenAI's function definitions) are rendered by the chat template, as vLLM's ``chat`` does;
        the reply is text (the server reads tool calls out of it and can enforce them). With
        ``continue_final_message`` (and ``add_generation_prompt=False``) the final message is continued."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer, markers = self.engine.tokenizer, self.engine.reasoning_markers
        prompts: list[PromptType] = []
        phases: list[str] = []
        for conversation in conversations:
            conversation = [template_message(m) for m in conversation]
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tools=tools, continue_final_message=continue_final_message)
            # The template already holds any BOS token: don't add special tokens twice.
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
            if markers is not None:
                phases.append(chat_reply_phase(tokenizer, text, conversation, markers,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, tools=tools).value)
        if phases:  # each reply's phase from its generation prompt
            given = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
            if len(given) == len(prompts):  # else generate's error names the mismatch
                sampling_params = [replace(p or SamplingParams(), reasoning_phase=phase)
                                   for p, phase in zip(given, phases, strict=True)]
        return self.generate(prompts, sampling_params, lora_request=lora_request)
