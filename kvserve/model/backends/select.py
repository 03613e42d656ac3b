"""The one place a backend is chosen, and the only module that names the concrete ones."""

from __future__ import annotations

import logging

import torch

from kvserve.config import ArchConfig, BackendConfig
from kvserve.model.backends.base import Backend
from kvserve.model.backends.cpu_kernels import CpuKernelsBackend, plan_kernels
from kvserve.model.backends.torch_ref import TorchRefBackend
from kvserve.model.cpu_kernels import load_cpu_kernels

logger = logging.getLogger(__name__)


def select_backend(device: torch.device, dtype: torch.dtype, arch: ArchConfig, want_kernels: bool,
                   config: BackendConfig, int8_activations: bool = False) -> Backend:
    """The C++ kernels on a CPU where they build and load (unless ``want_kernels`` is False), the CUDA backend
    (Triton attention) on a GPU where Triton imports, else the torch reference. What each C++ kernel takes is
    decided by the backend's own plan, from the CPU, dtype and shape, and whether quantised weights' kernels
    may take int8 activations at every width."""
    kernels = load_cpu_kernels() if want_kernels and device.type == "cpu" else None
    if kernels is not None:
        # Its description names each part's kernel and why any part fell back (the plan's reasons).
        backend: Backend = CpuKernelsBackend(plan_kernels(kernels, dtype, arch, int8_activations),
                                               arch, device, config)
        logger.info("backend: %s", backend.description)
        return backend
    if device.type == "cuda":
        try:
            from kvserve.model.backends.cuda import CudaBackend  # Triton is needed only here
        except ImportError as error:
            logger.warning("backend: no Triton (%s): CUDA runs the torch reference attention", error)
        else:
            backend = CudaBackend(arch, device, config)
            logger.info("backend: %s", backend.description)
            return backend
    why = ("not wanted" if not want_kernels else f"none for {device.type}" if device.type != "cpu"
           else "they did not build or load here")
    backend = TorchRefBackend(arch, device, config)
    logger.info("backend: %s; no C++ kernels: %s", backend.description, why)
    return backend
