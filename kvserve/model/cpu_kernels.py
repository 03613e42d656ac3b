"""The optional C++ CPU kernels (csrc/*.cpp): built once per machine, used when they load.

The build runs through ``torch.utils.cpp_extension`` with ``-march=native`` and is cached under
``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``); ``scripts/install.sh`` builds it ahead of
time. If the build fails (no compiler, an unusual CPU) the torch reference paths run instead, with one
warning: correct, only slower. ``KVSERVE_CPU_KERNELS=0`` turns the kernels off. A build killed part way
leaves torch's lock file behind, on which torch would wait for ever: the loader waits while a live build
holds it and removes it once it is older than any build takes (``STALE_BUILD_LOCK_S``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted(str(path) for path in (Path(__file__).with_name("csrc")).glob("*.cpp"))
_EXTENSION_NAME = "kvserve_cpu_kernels"
# How the kernels are compiled and linked (benchmarks/kernel_ab.py builds other revisions the same way).
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
# A build takes a minute or two: torch's build lock older than this was left by a build that was killed, and
# torch would wait on it for ever.
STALE_BUILD_LOCK_S = 600.0


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """What the loaded build offers on this machine."""

    gemv_bf16: bool  # AVX512-BF16 weight GEMV (the attention and element-wise kernels build everywhere)
    amx: bool = False  # AMX tile matmuls for the projections (CPU support and the OS's permission)
    avx512: bool = False  # AVX-512 F/BW: fp32-FMA projections on bf16 weights (linear_avx512.cpp)
    # AVX512-VNNI: int8 dot products on GGUF-quantised weights for few rows (quantized.cpp; the dequantising
    # many-row path builds everywhere)
    quantized_gemv: bool = False
    # Rows per group of the interleaved quantised layout whose int8 kernels this build has (AVX512-VNNI; 0: none)
    quantized_interleave_rows: int = 0
    avx2: bool = False  # AVX2 and FMA: the same fp32-FMA projections, 8 lanes wide (linear_avx2.cpp)


class _Loader:
    """Builds and loads the extension at most once per process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._kernels: CpuKernels | None = None

    def get(self) -> CpuKernels | None:
        with self._lock:
            if not self._done:
                self._done = True
                self._kernels = self._build()
            return self._kernels

    def built(self) -> CpuKernels | None:
        """The kernels if an earlier ``get`` loaded them: never starts a build."""
        with self._lock:
            return self._kernels

    @staticmethod
    def _build() -> CpuKernels | None:
        if os.environ.get("KVSERVE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
            return None
        try:
            from torch.utils.cpp_extension import load

            lock = _build_lock()
            if lock is not None:
                release_stale_build_lock(lock)
            load(
                name=_EXTENSION_NAME,
                sources=SOURCES,
                extra_cflags=list(COMPILE_FLAGS),
                extra_ldflags=list(LINK_FLAGS),
                is_python_module=False,
                verbose=False,
            )
            return CpuKernels(gemv_bf16=bool(torch.ops.kvserve.has_avx512_bf16()),
                              amx=bool(torch.ops.kvserve.has_amx()),
                              avx512=bool(torch.ops.kvserve.has_avx512()),
                              quantized_gemv=bool(torch.ops.kvserve.has_quantized_gemv()),
                              quantized_interleave_rows=int(torch.ops.kvserve.quant_interleaved_rows()),
                              avx2=bool(torch.ops.kvserve.has_avx2()))
        except Exception as exc:  # a missing compiler or ninja must not stop serving
            log.warning("kvserve CPU kernels unavailable, using the torch reference paths: %s", exc)
            return None


def _build_lock() -> Path | None:
    """The lock file torch's build of the kernels takes (None where torch does not say where it builds)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return None
    return Path(_get_build_directory(_EXTENSION_NAME, verbose=False)) / "lock"


def release_stale_build_lock(lock: Path, stale_after_s: float = STALE_BUILD_LOCK_S,
                             clock: Callable[[], float] = time.time,
                             sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait while another process's build holds ``lock``, until the lock is gone or older than
    ``stale_after_s``: then a build that was killed left it, and it is removed. Whether it was."""
    waiting = False
    while True:
        try:
            age = clock() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age >= stale_after_s:
            log.warning("removing %s: a build of the CPU kernels that did not finish left it %.0f s ago", lock, age)
            lock.unlink(missing_ok=True)
            return True
        if not waiting:
            log.warning("waiting for another process's build of the CPU kernels (%s; taken as left by a killed "
                        "build once %.0f s old)", lock, stale_after_s)
            waiting = True
        sleep(min(1.0, stale_after_s - age))


class KernelThreadScope:
    """Within it, the kernels' parallel regions run on all of torch's threads (on the kernels' own worker
    pool, csrc/worker_pool.cpp) and torch's own ops on the calling thread alone.

    For a model the kernels carry (backends/cpu_kernels.py's plan), what is left to torch in a step is
    small: the embedding gather, the KV write, a concatenation, sampling. Letting those wake OpenMP's team
    puts three busy threads (the caller, the pool's worker, OpenMP's) on two cores, which slows prefills;
    keeping torch's ops on the caller does not (benchmarks/decode_stack_ab.py --compare pool measures both).
    Torch's thread count is restored on leaving, so
    code between steps (a reference model in a test, a user's own torch work) keeps its threads.
    """

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()

    def __enter__(self) -> None:
        if self.threads > 1:
            torch.ops.kvserve.set_kernel_threads(self.threads)
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.threads > 1:
            torch.set_num_threads(self.threads)
            torch.ops.kvserve.set_kernel_threads(0)


# One per process on purpose: the ops register in torch's process-wide op registry, once.
_loader = _Loader()


def load_cpu_kernels() -> CpuKernels | None:
    """The kernels if they build and load here, else None."""
    return _loader.get()


def loaded_cpu_kernels() -> CpuKernels | None:
    """The kernels if this process has loaded them already (a backend that uses them has), else None."""
    return _loader.built()
