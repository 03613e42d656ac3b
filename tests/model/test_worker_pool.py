"""The kernels' worker threads (csrc/worker_pool.cpp): the same results as on OpenMP's team, from several
calling threads at once, and in a forked child, which inherits none of its parent's threads."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from kvserve.model.cpu_kernels import KernelThreadScope, load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels did not build on this machine")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the pool only runs regions of two or more threads
    yield
    torch.set_num_threads(before)
    torch.ops.kvserve.use_worker_pool(True)


def make_inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "cache": torch.randn(2, 128, 16, 3, 64, generator=g).to(torch.bfloat16),
        "table": torch.randperm(128, generator=g)[:5 * 21].view(5, 21).to(torch.int32),
        "q": torch.randn(5, 3, 3, 64, generator=g).to(torch.bfloat16),
        "x": torch.randn(300, 576, generator=g).to(torch.bfloat16),
    }
    if kernels is not None and kernels.amx:
        inputs["packed"] = torch.ops.kvserve.amx_pack(torch.randn(1536, 576, generator=g).to(torch.bfloat16))
    return inputs


def run_kernels(inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Kernels that open parallel regions: claimed items (decode attention, projections) and ranges (norms).
    Only the kernels themselves: no torch op that would start OpenMP's team."""
    cache = inputs["cache"]
    lens = torch.tensor([5, 100, 333, 17, 64], dtype=torch.int32)
    out, lse = torch.ops.kvserve.paged_decode(inputs["q"], cache[0], cache[1], inputs["table"], lens, 0.125, 48)
    x = inputs["x"]
    normed, summed = torch.ops.kvserve.add_rms_norm(x, x, torch.ones(576, dtype=torch.bfloat16), 1e-5)
    results = [out, lse, normed, summed]
    if "packed" in inputs:
        results.append(torch.ops.kvserve.amx_linear(x, inputs["packed"], None))
    return results


def as_bytes(tensors: list[torch.Tensor]) -> list[bytes]:
    return [t.contiguous().view(torch.int16).numpy().tobytes() for t in tensors]


def test_pool_and_openmp_give_identical_results(two_threads) -> None:
    inputs = make_inputs(0)
    torch.ops.kvserve.use_worker_pool(False)
    on_openmp = run_kernels(inputs)
    torch.ops.kvserve.use_worker_pool(True)
    on_pool = run_kernels(inputs)
    assert all(torch.equal(a, b) for a, b in zip(on_openmp, on_pool, strict=True))


def test_regions_from_several_threads_at_once(two_threads) -> None:
    # One caller's region holds the pool; another thread's region meanwhile runs on its own thread.
    inputs = {seed: make_inputs(seed) for seed in range(4)}
    expected = {seed: run_kernels(inputs[seed]) for seed in range(4)}
    failures: list[str] = []

    def caller(seed: int) -> None:
        for _ in range(5):
            if not all(torch.equal(a, b) for a, b in zip(run_kernels(inputs[seed]), expected[seed], strict=True)):
                failures.append(f"seed {seed}")

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a region never finished"
    assert failures == []


def _child(inputs: dict[str, torch.Tensor], queue: multiprocessing.Queue) -> None:
    # torch's own ops would hang here: OpenMP's team does not survive a fork (a known libgomp limit).
    queue.put(as_bytes(run_kernels(inputs)))


def test_a_forked_child_starts_its_own_workers(two_threads) -> None:
    inputs = make_inputs(1)
    expected = as_bytes(run_kernels(inputs))  # the parent's workers exist now; the child gets none of them
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(inputs, queue))
    child.start()
    try:
        # With the parent's pool, the child would wait forever for workers it does not have.
        got = queue.get(timeout=120)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert got == expected


def test_kernel_thread_scope_gives_torch_its_threads_back(two_threads) -> None:
    inputs = make_inputs(2)
    outside = run_kernels(inputs)
    scope = KernelThreadScope()
    with scope:
        assert torch.get_num_threads() == 1  # torch's ops on the calling thread; the kernels on both
        assert all(torch.equal(a, b) for a, b in zip(run_kernels(inputs), outside, strict=True))
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError), scope:
        raise ValueError("a failed step")
    assert torch.get_num_threads() == 2
