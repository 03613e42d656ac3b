"""The HumanEval harness: the sandbox's verdicts and limits, and a whole run against a real HTTP endpoint whose
completions are known to be right, wrong or endless."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvserve.evals.humaneval import STOP_SEQUENCES, EvalConfig, evaluate, load_problems
from kvserve.evals.sandbox import SandboxLimits, run_program
from tests.conftest import free_port

RIGHT = ("    for i, a in enumerate(numbers):\n        for b in numbers[i + 1:]:\n"
         "            if abs(a - b) < threshold:\n                return True\n    return False\n")
WRONG = "    return False\n"
ENDLESS = "    while True:\n        pass\n"


@pytest.fixture(scope="module")
def first_problem():
    return load_problems()[0]


def test_the_164_problems_load() -> None:
    problems = load_problems()
    assert len(problems) == 164
    assert problems[0].task_id == "HumanEval/0" and problems[0].entry_point == "has_close_elements"


def test_right_passes_wrong_fails_and_an_endless_loop_is_killed(first_problem) -> None:
    assert run_program(first_problem.program(RIGHT)).passed
    wrong = run_program(first_problem.program(WRONG))
    assert not wrong.passed and "AssertionError" in wrong.result
    t0 = time.monotonic()
    endless = run_program(first_problem.program(ENDLESS), SandboxLimits(timeout_s=1.0))
    assert (endless.passed, endless.result) == (False, "timed out")
    assert time.monotonic() - t0 < 10


def test_a_chat_reply_runs_as_a_whole_function_or_as_a_body(first_problem) -> None:
    whole = ("Here it is:\n```python\nfrom typing import List\n\n\ndef has_close_elements(numbers: List[float], "
             f"threshold: float) -> bool:\n{RIGHT}```\nIt compares every pair.")
    assert run_program(first_problem.program_from_reply(whole)).passed
    assert run_program(first_problem.program_from_reply(f"```python\n{RIGHT}```")).passed  # a body only
    assert not run_program(first_problem.program_from_reply(f"```python\n{WRONG}```")).passed


def test_the_sandbox_refuses_network_and_deletion_and_limits_memory(tmp_path) -> None:
    keep = tmp_path / "keep.txt"
    keep.write_text("x")
    assert "refused" in run_program("import socket\nsocket.socket()\n").result
    assert not run_program(f"import os\nos.remove({str(keep)!r})\n").passed
    assert keep.exists()
    assert "MemoryError" in run_program("x = bytearray(4 * 1024**3)\n", SandboxLimits(memory_bytes=1024**3)).result
    assert run_program("print('ok')\n").passed


def test_a_sleeping_child_dies_with_its_program() -> None:
    """The whole process group goes when time runs out: nothing the program started is left running."""
    duration = f"61.{os.getpid() % 1000}"  # picks the child out among the machine's processes
    program = f"import os, time\nos.posix_spawn('/bin/sleep', ['sleep', '{duration}'], {{}})\ntime.sleep(60)\n"
    assert run_program(program, SandboxLimits(timeout_s=2.0)).result == "timed out"
    time.sleep(0.2)
    alive = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid) == f"sleep\0{duration}\0"]
    assert alive == []


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class CannedEndpoint:
    """An OpenAI completions endpoint answering each known prompt with a canned completion."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.requests: list[dict] = []
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete(http: Request) -> JSONResponse:
            body = await http.json()
            self.requests.append(body)
            text = self.answers[body["prompt"]]
            return JSONResponse({"id": "c", "object": "text_completion", "model": "canned", "choices": [
                {"index": 0, "text": text, "finish_reason": "stop",
                 "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.1],
                              "top_logprobs": [{"a": -0.5, "z": -1.5}, {"b": -0.1}]}}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}})

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def canned() -> Iterator[CannedEndpoint]:
    problems = load_problems()[:3]
    endpoint = CannedEndpoint({problems[0].prompt: RIGHT, problems[1].prompt: WRONG, problems[2].prompt: ENDLESS})
    yield endpoint
    endpoint.stop()


def test_a_run_scores_each_completion_and_records_its_confidence(canned) -> None:
    config = EvalConfig(canned.url, model="canned", limit=3, concurrency=2, sandbox=SandboxLimits(timeout_s=1.0))
    result = evaluate(config)
    assert (result.num_problems, result.num_passed) == (3, 1)
    assert result.pass_at_1 == pytest.approx(1 / 3)
    right, wrong, endless = result.completions
    assert right.passed and right.result == "passed"
    assert not wrong.passed and "AssertionError" in wrong.result
    assert endless.result == "timed out"
    assert right.mean_logprob == pytest.approx(-0.3) and right.min_logprob == pytest.approx(-0.5)
    assert right.completion_tokens == 2 and right.model == "canned"
    sent = canned.requests[0]
    assert (sent["temperature"], sent["stop"], sent["model"]) == (0.0, list(STOP_SEQUENCES), "canned")
