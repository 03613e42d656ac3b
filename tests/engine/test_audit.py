"""``Engine.audit``: the block accounting as a report, zero everywhere when idle, and a leak shows."""

from __future__ import annotations

from kvserve.offline import LLM
from kvserve.sampling_params import SamplingParams
from tests.support.tiny_models import make_tiny_model


def test_idle_engine_audits_clean_and_a_leaked_block_or_lock_shows(tmp_path) -> None:
    llm = LLM(str(make_tiny_model(tmp_path, "llama")), dtype="float32", num_kv_blocks=32, max_model_len=128)
    engine = llm.engine
    llm.generate([list(range(10, 50)), list(range(10, 45))], SamplingParams(temperature=0.0, max_tokens=4))
    audit = engine.audit()
    assert (audit.ok, audit.num_unfinished, audit.num_used_blocks, audit.num_locked_nodes) == (True, 0, 0, 0)
    assert engine.kv_manager.num_cached_blocks > 0  # what stays cached is not a leak

    pool = engine.kv_manager.pool
    leaked = pool.allocate(1)  # held by nobody the engine knows of
    assert engine.audit().num_used_blocks == 1
    pool.release(leaked)
    tree = engine.kv_manager.prefix_cache.tree
    node = next(iter(tree.root.children.values()))
    tree.lock(node)
    audit = engine.audit()
    assert audit.num_locked_nodes == 1
    tree.unlock(node)
    assert engine.audit().ok
    llm.close()
