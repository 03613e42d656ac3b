"""kvserve: an LLM inference serving engine.

``from kvserve import LLM, SamplingParams`` — LLM is imported lazily so that light modules (errors,
config, request) can be used without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.request import LoRARequest, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from kvserve.engine import LLM, Engine

__all__ = ["LLM", "Engine", "LoRARequest", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "Engine"):
        from kvserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
