"""Triton's interpreter for the CUDA backend's kernels on CPU tensors: the interpreter is chosen as a kernel is
decorated (at import) and consulted again as it runs. A test module calls ``load_cuda_backend()`` before
importing the backend's modules and uses the ``triton_interpreter`` fixture; the rest of the session runs
without the interpreter."""

from __future__ import annotations

import importlib
import os

import pytest

CUDA_BACKEND_MODULES = ("triton_attention", "triton_ops", "decode_graphs", "cuda")


def load_cuda_backend() -> None:
    """Imports the CUDA backend's modules under the interpreter (skips without Triton, unless
    KVSERVE_REQUIRE_TRITON is set, as in CI, where a missing Triton fails)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if os.environ.get("KVSERVE_REQUIRE_TRITON"):
            importlib.import_module("triton")
        else:
            pytest.importorskip("triton")
        for name in CUDA_BACKEND_MODULES:
            importlib.import_module(f"kvserve.model.backends.{name}")
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
