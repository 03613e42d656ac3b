"""transformers' own GGUF loader, the independent reference the real-model tests compare with."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch


def hf_from_gguf(path: Path):
    """transformers' own GGUF loader on ``path`` in float32 (its dequantisation, its model code)."""
    transformers = pytest.importorskip("transformers")
    import gguf

    # transformers parses the file twice (config, then tensors); parsing a large vocabulary's metadata takes
    # longer than the dequantisation, so both passes share one reader.
    reader = gguf.GGUFReader(path)
    with mock.patch.object(gguf, "GGUFReader", lambda *_args, **_kwargs: reader):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval()
