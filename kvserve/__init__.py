"""kvserve: an LLM inference serving engine.

``from kvserve import LLM, SamplingParams`` — LLM is imported lazily so that light modules (errors,
config, request, sampling parameters) can be used without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.request import LoRARequest, RequestOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine import Engine
    from kvserve.offline import LLM

__all__ = ["LLM", "Engine", "LoRARequest", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvserve.offline import LLM

        return LLM
    if name == "Engine":
        from kvserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
