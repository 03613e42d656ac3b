"""A chat request's tools: validated, rendered into the prompt, and turned into the reply's grammar.

``tool_choice`` follows OpenAI: ``none`` (the default without tools) never calls, ``auto`` (the default
with tools) lets the model choose between text and calls, ``required`` always calls one or more offered
tools, ``{"type": "function", "function": {"name": ...}}`` calls that one. ``parallel_tool_calls: false``
allows one call per reply. The tools go into the prompt through the model's own chat template; a model
whose template has no place for them (SmolLM2) gets them in the system message, in the same hermes words
Qwen2.5's template uses, and its earlier calls and tool results written the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidRequest
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server import protocol as p
from kvserve.structured.grammar import MAX_NESTING, check_json_schema, json_schema_of, nesting_depth
from kvserve.structured.tool_calls import ToolCallFormat, ToolChoice, ToolSpec
from kvserve.tokenizer import message_text

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools of one chat request and how they may be called."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    parallel: bool
    # Under tool_choice auto with a response format: the JSON Schema (an object) of a reply that makes no call.
    # The format as the request gave it, under any tool_choice but none: compiled on its own first, so that its
    # errors name its field (under required or a named function it constrains nothing: the reply is calls).
    answer: dict[str, Any] | None = None
    answer_format: StructuredOutputsParams | None = None

    @property
    def calls_possible(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    def format_for(self, fmt: ToolCallFormat) -> ToolCallFormat:
        """``fmt`` as this request's replies are written: for its tools, answering in the response format where one
        is given; InvalidRequest where the format's calls could not be told from such an answer."""
        fmt = fmt.for_tools(self.tools)
        if self.answer is None:
            return fmt
        if not fmt.can_answer:
            raise InvalidRequest("this model's tool calls are JSON objects, which cannot be told from a JSON "
                                 "response; send tool_choice 'none' or 'required', or leave out the response format",
                                 param=self.answer_format.param if self.answer_format is not None else None)
        return fmt.with_answer(self.answer)

    def constraint(self, fmt: ToolCallFormat) -> StructuredOutputsParams:
        return StructuredOutputsParams(grammar=fmt.grammar(self.tools, self.choice, self.parallel), param="tools")


def tool_request(body: p.ChatCompletionRequest, response_format: StructuredOutputsParams | None) -> ToolRequest:
    """The request's tools and tool_choice, checked; InvalidRequest naming the field otherwise.
    ``response_format``: the request's own constraint of its output (response_format, guided_*, ...): under
    tool_choice auto a reply that makes no call must match it, which must then be a JSON object's schema; under
    required or a named function the reply is calls, whatever it says."""
    tools: list[ToolSpec] = []
    for i, tool in enumerate(body.tools or []):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise InvalidRequest(f"{where}.type must be 'function', got {tool.type!r}", param=f"{where}.type")
        name = tool.function.name
        if not _NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                                 param=f"{where}.function.name")
        if any(t.name == name for t in tools):
            raise InvalidRequest(f"{where}.function.name {name!r} is offered twice", param=f"{where}.function.name")
        parameters = tool.function.parameters
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        else:
            check_json_schema(parameters, f"{where}.function.parameters")
        tools.append(ToolSpec(name, parameters, tool.function.description))
    choice = _tool_choice(body.tool_choice, tools)
    if choice.mode == "none" or response_format is None:
        return ToolRequest(tuple(tools), choice, body.parallel_tool_calls)
    schema = json_schema_of(response_format) if response_format.json is not None or response_format.json_object \
        else None
    if schema is None or schema.get("type") != "object":
        raise InvalidRequest(f"{response_format.param}: with tools, a response format must be a JSON object (json_object, "
                             'or a json_schema whose root has "type": "object"); send tool_choice \'none\' to '
                             "constrain the reply otherwise", param=response_format.param)
    if choice.mode != "auto":  # required, or a named function: the reply is calls; the format is only checked
        return ToolRequest(tuple(tools), choice, body.parallel_tool_calls, answer_format=response_format)
    return ToolRequest(tuple(tools), choice, body.parallel_tool_calls, schema, response_format)


def _tool_choice(value: str | dict[str, Any] | None, tools: list[ToolSpec]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if not tools and value != "none":
        raise InvalidRequest("tool_choice is only allowed when tools are specified", param="tool_choice")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or a function, got {value!r}",
                                 param="tool_choice")
        return ToolChoice(value)  # type: ignore[arg-type]
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if value.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest('tool_choice must be {"type": "function", "function": {"name": ...}}', param="tool_choice")
    if all(t.name != name for t in tools):
        raise InvalidRequest(f"tool_choice names the function {name!r}, which is not among the tools offered",
                             param="tool_choice")
    return ToolChoice("function", name)


def template_messages(messages: list[dict[str, Any]], request: ToolRequest, fmt: ToolCallFormat,
                      template_has_tools: bool) -> list[dict[str, Any]]:
    """The messages as the chat template takes them. Earlier calls' arguments (JSON text in OpenAI's API)
    become objects, as templates expect, and call ids take the format's form (Mistral's nine letters and
    digits); without template support, tools and calls become plain text."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_call_for_template(call, fmt) for call in calls]
        if isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = fmt.template_call_id(message["tool_call_id"])
        out.append(message)
    if template_has_tools:
        return out
    return _without_tool_support(out, request, fmt)


def template_tools(request: ToolRequest) -> list[dict[str, Any]] | None:
    if not request.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description
                                                                   else {}), "parameters": t.parameters}}
            for t in request.tools]


def _call_for_template(call: Any, fmt: ToolCallFormat) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    if isinstance(call.get("id"), str):
        call = {**call, "id": fmt.template_call_id(call["id"])}
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            parsed = None  # left as text: the template writes what it was given
        if parsed is not None and nesting_depth(parsed) <= MAX_NESTING:  # a template walks it recursively
            function["arguments"] = parsed
    return {**call, "function": function}


def _without_tool_support(messages: list[dict[str, Any]], request: ToolRequest,
                          fmt: ToolCallFormat) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            text = f"<tool_response>\n{message_text(message)}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_responses": True})
        elif role == "assistant" and message.get("tool_calls"):
            calls = fmt.render_calls([(c["function"].get("name"), c["function"].get("arguments"))
                                      for c in message["tool_calls"]
                                      if isinstance(c, dict) and isinstance(c.get("function"), dict)])
            text = "\n".join(([message_text(message)] if message.get("content") else []) + [calls])
            out.append({"role": "assistant", "content": text})
        else:
            out.append(message)
    for message in out:
        message.pop("tool_responses", None)
    if request.tools and request.choice.mode != "none":
        prompt = fmt.system_prompt(request.tools)
        if out and out[0].get("role") == "system":
            content = out[0].get("content") or ""
            joined = ([*content, {"type": "text", "text": prompt}] if isinstance(content, list)
                      else f"{content}\n\n{prompt}")
            out[0] = {**out[0], "content": joined}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
