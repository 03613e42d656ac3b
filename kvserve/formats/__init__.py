"""Readers of model files, torch-free, one per format.

- ``gguf``: a GGUF file's header (metadata and tensor directory) and the ``ArchConfig`` it describes.
- ``hf_config``: a Hugging Face ``config.json`` and the ``ArchConfig`` it describes.
- ``gguf_vocab``: a GGUF vocabulary rebuilt as a ``tokenizers`` backend.

They read any architecture the files describe; what the engine can run is checked by
``kvserve.model.loader``, which also turns tensor bytes into torch tensors.
"""
