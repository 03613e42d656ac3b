"""A request's compiled constraint travels with it from the route to the engine: the engine thread never
compiles (a compile it waited for stalled every running request), even when the compiler's cache has dropped
the constraint in between, as more distinct constraints in flight than the cache holds make it do."""

from __future__ import annotations

import asyncio

from kvserve import LLM
from kvserve.async_engine import AsyncEngine
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams


def test_a_compiled_constraint_dropped_from_the_cache_is_not_compiled_again_by_the_engine() -> None:
    engine = LLM(dtype="float32", grammar_cache_size=1, num_kv_blocks=64).engine
    first = StructuredOutputsParams(choice=("yes", "no"))
    second = StructuredOutputsParams(choice=("left", "right"))
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=first)

    async def run() -> str:
        async_engine = AsyncEngine(engine)
        try:
            grammar = await async_engine.compile_grammar(first)
            await async_engine.compile_grammar(second)  # the cache holds one: the first is dropped
            token_ids, _ = async_engine.prepare("Answer yes or no: is the sky blue?", params)
            compiles = engine.grammars.stats.compiles
            outputs = [o async for o in async_engine.generate(token_ids, params, "r", None, grammar)]
            assert engine.grammars.stats.compiles == compiles  # neither prepare nor the engine compiled it
            return outputs[-1].outputs[0].text
        finally:
            async_engine.shutdown()

    assert asyncio.run(run()) in ("yes", "no")
    assert engine.grammars.stats.compiles == 2  # the two constraints, once each
