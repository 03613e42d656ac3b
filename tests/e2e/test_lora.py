"""LoRA adapters on the real SmolLM2-135M-Instruct against PEFT's own forward of the same adapter files.

Two random adapters made and saved by PEFT: one on all seven projections (rank 8), one on q/v only (rank 4,
rsLoRA). In float32 kvserve's greedy output equals PEFT's token for token, with base and adapter requests in
one batch, chunked, preempted and speculated (one engine does all three); in bf16 (the default quantised path)
the generated tokens' logprobs stay within a stated distance of PEFT's float32 ones."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.config import CacheConfig, EngineConfig, ModelConfig
from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.model.cpu_kernels import loaded_cpu_kernels
from kvserve.model.ops import torch_lora_add
from kvserve.server.serving import BackgroundServer
from kvserve.serving_config import ServerConfig
from tests.e2e.conftest import CHAT_QUESTIONS, PLAIN_PROMPTS, hf_greedy
from tests.support.lora_adapters import make_adapters

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# bf16 against PEFT's float32: the generated tokens' logprobs differ by at most this much on average (the base
# model alone: 0.02-0.04; the full adapter moves the reference's logprobs by about 0.15 on such text).
BF16_MEAN_LOGPROB_TOLERANCE = 0.06


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def peft_model(hf_reference, lora_root):
    """PEFT's model with both adapters, saved under ``lora_root``; ``set_adapter`` picks the one it runs."""
    return make_adapters(hf_reference, lora_root, {
        "full": {"r": 8, "lora_alpha": 16, "target_modules": ALL_PROJECTIONS},
        "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": True}})


@pytest.fixture(scope="module")
def adapters(peft_model, lora_root) -> dict[str, Path]:
    """Each adapter's directory, as PEFT saved it."""
    return {name: lora_root / name for name in ("full", "qv")}


def reference_model(peft_model, name: str):
    peft_model.set_adapter(name)
    return peft_model


@pytest.fixture(scope="module")
def llm(adapters) -> LLM:
    # 16-token chunks, a pool that cannot hold the mixed batch's nine requests at once, n-gram drafts on decodes.
    return LLM(dtype="float32", num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=12,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 2},
               lora_modules=[f"{name}={path}" for name, path in adapters.items()])


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PLAIN_PROMPTS[:2]]
    text = tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[1]}])
    return [*ids, tok.encode(text, add_special_tokens=False)]


@pytest.fixture(scope="module")
def references(hf_reference, peft_model, prompt_ids) -> dict[str | None, list[list[int]]]:
    """PEFT's (and, for None, the base model's) float32 greedy continuation of each prompt."""
    found: dict[str | None, list[list[int]]] = {None: [hf_greedy(hf_reference, ids, MAX_TOKENS) for ids in prompt_ids]}
    for name in ("full", "qv"):
        model = reference_model(peft_model, name)
        found[name] = [hf_greedy(model, ids, MAX_TOKENS) for ids in prompt_ids]
    return found


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run_mixed(llm: LLM, prompt_ids: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """Every prompt with the base model and each adapter, all in one batch."""
    names: list[str | None] = [None, "full", "qv"]
    jobs = [(name, ids) for ids in prompt_ids for name in names]
    outputs = llm.generate([{"prompt_token_ids": ids} for _, ids in jobs], greedy(),
                           lora_request=[None if name is None else LoRARequest(name) for name, _ in jobs])
    found: dict[str | None, list[list[int]]] = {name: [] for name in names}
    for (name, _), output in zip(jobs, outputs, strict=True):
        found[name].append(output.outputs[0].token_ids)
    return found


def test_each_adapter_equals_peft_in_a_mixed_batch_chunked_preempted_and_speculated(llm, prompt_ids,
                                                                                     references) -> None:
    if loaded_cpu_kernels() is not None:  # the C++ update, not torch's reference, is what runs
        assert llm.engine.model.ops.lora_add is not torch_lora_add
    assert run_mixed(llm, prompt_ids) == references
    # The adapters change what the model says (else the equality above would hold with them ignored).
    for name in ("full", "qv"):
        assert sum(a != b for a, b in zip(references[name], references[None], strict=True)) >= 2
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().num_draft_tokens > 0
    assert llm.engine.audit().ok


def test_an_adapters_kv_is_cached_apart_from_the_base_models(llm) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("Zebras and giraffes share the savanna with many other animals, and each of them has found "
                     "its own way to live there through the long dry season, when water is scarce and")  # run nowhere else
    block = llm.engine.config.cache.block_size
    base = llm.generate([{"prompt_token_ids": ids}], greedy())[0]
    first = llm.generate([{"prompt_token_ids": ids}], greedy(), lora_request=LoRARequest("qv"))[0]
    again = llm.generate([{"prompt_token_ids": ids}], greedy(), lora_request=LoRARequest("qv"))[0]
    other = llm.generate([{"prompt_token_ids": ids}], greedy(), lora_request=LoRARequest("full"))[0]
    base_again = llm.generate([{"prompt_token_ids": ids}], greedy())[0]
    assert base.num_cached_tokens == first.num_cached_tokens == other.num_cached_tokens == 0
    assert again.num_cached_tokens >= len(ids) - block and base_again.num_cached_tokens >= len(ids) - block
    # Served from the cache, each the same as computed cold (the mixed batch above checks those against PEFT).
    assert base.outputs[0].token_ids == base_again.outputs[0].token_ids
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in (base, first, other)}) == 3
    assert llm.engine.audit().ok


def test_an_adapter_loaded_on_first_use_and_an_unknown_one_refused(llm, adapters, prompt_ids, references) -> None:
    path = adapters["qv"]
    out = llm.generate([{"prompt_token_ids": prompt_ids[0]}], greedy(), lora_request=LoRARequest("qv2", 2, str(path)))
    assert out[0].outputs[0].token_ids == references["qv"][0]
    with pytest.raises(InvalidRequest, match="'nope' is not loaded and its request has no lora_path"):
        llm.generate([{"prompt_token_ids": prompt_ids[0]}], greedy(), lora_request=LoRARequest("nope"))
    with pytest.raises(ModelNotFound, match="no LoRA adapter 'nope' is loaded; loaded: full, qv, qv2"):
        llm.engine.add_request({"prompt_token_ids": prompt_ids[0]}, SamplingParams(lora_name="nope"))
    assert llm.engine.remove_lora("qv2") and not llm.engine.remove_lora("qv2")
    assert llm.engine.audit().ok


def test_bf16_quantised_adapter_within_tolerance_of_peft_float32(adapters, peft_model, prompt_ids) -> None:
    path, model = adapters["full"], reference_model(peft_model, "full")
    llm = LLM(lora_modules=[f"full={path}"])  # the defaults: bf16, the GGUF's Q4_1 weights run quantised
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, lora_request=LoRARequest("full"))
    differences = []
    for ids, output in zip(prompt_ids, outputs, strict=True):
        generated = output.outputs[0].token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + generated])).logits[0, len(ids) - 1: -1]
        reference = torch.log_softmax(logits.float(), dim=-1)
        for step, token in enumerate(generated):
            differences.append(abs(output.outputs[0].logprobs[step][token] - float(reference[step, token])))
    assert sum(differences) / len(differences) <= BF16_MEAN_LOGPROB_TOLERANCE, differences


def test_adapters_served_by_name_and_loaded_at_run_time_over_http(adapters, prompt_ids, references) -> None:
    full_path, qv_path = adapters["full"], adapters["qv"]
    server = BackgroundServer(EngineConfig(model=ModelConfig(dtype="float32", lora_modules=(f"full={full_path}",)),
                                           cache=CacheConfig(num_kv_blocks=128)),
                              ServerConfig(port=0, served_model_name=("smol",), allow_runtime_lora_updating=True))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        cards = client.models.list().data
        assert [m.id for m in cards] == ["smol", "full"]
        assert cards[1].model_extra["parent"] == "smol" and cards[1].model_extra["root"] == str(full_path)

        def complete(model: str) -> tuple[str, list[int]]:
            reply = client.completions.create(model=model, prompt=prompt_ids[0], max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                              logprobs=0)
            assert reply.model == model
            tokens = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]
            return reply.choices[0].text, tokens

        info = httpx.get(server.base_url + "/kvserve/info").json()  # what a gateway keys the adapter's KV by
        assert info["lora_cache_keys"] == {"full": server.engine.loras["full"].cache_key.hex()}
        tokenizer = server.engine.tokenizer
        assert complete("full") == (tokenizer.decode(references["full"][0]), references["full"][0])
        assert complete("smol")[1] == references[None][0]
        with pytest.raises(openai.NotFoundError, match="does not exist.*LoRA adapters 'full'"):
            complete("qv")

        http = httpx.Client(base_url=server.base_url, timeout=60)
        # Chat, the Responses API and embeddings name the adapter the same way: the chat reply is the adapter's
        # completion of the rendered conversation, the Responses API's text the chat reply's, the embedding the
        # adapter's hidden state, none of them the base model's.
        chat = [{"role": "user", "content": "Say something."}]
        as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}

        def chat_reply(model: str) -> tuple[str, list[int]]:
            reply = client.chat.completions.create(model=model, messages=chat, max_tokens=MAX_TOKENS, temperature=0,
                                                   logprobs=True, extra_body=as_ids)
            assert reply.model == model
            return reply.choices[0].message.content, [int(t.token.removeprefix("token_id:"))
                                                      for t in reply.choices[0].logprobs.content]

        rendered = http.post("/tokenize", json={"messages": chat}).json()["tokens"]
        completed = client.completions.create(model="full", prompt=rendered, max_tokens=MAX_TOKENS, temperature=0,
                                              logprobs=0, extra_body=as_ids)
        full_text, full_tokens = chat_reply("full")
        assert full_tokens == [int(t.removeprefix("token_id:")) for t in completed.choices[0].logprobs.tokens]
        assert full_tokens != chat_reply("smol")[1]
        response = client.responses.create(model="full", input=chat, max_output_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert response.model == "full" and response.output_text == full_text
        vectors = {name: client.embeddings.create(model=name, input="hello").data[0].embedding
                   for name in ("full", "smol")}
        assert vectors["full"] != vectors["smol"]
        assert client.embeddings.create(model="full", input="hello").data[0].embedding == vectors["full"]

        other_base = http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(qv_path),
                                                               "model": "another-model"})
        assert other_base.status_code == 404 and other_base.json()["error"]["param"] == "model"
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(qv_path),
                                                           "model": "smol"})  # the base model named: loaded
        assert loaded.status_code == 200 and "added" in loaded.text
        assert complete("qv")[1] == references["qv"][0]
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(qv_path)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        base_name = http.post("/v1/load_lora_adapter", json={"lora_name": "smol", "lora_path": str(qv_path)})
        assert base_name.status_code == 400 and "base model's name" in base_name.json()["error"]["message"]
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(qv_path / "nowhere")})
        assert missing.status_code == 400 and "no adapter_config.json" in missing.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("qv")
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 404
        assert [m.id for m in client.models.list().data] == ["smol", "full"]
    finally:
        server.stop()
