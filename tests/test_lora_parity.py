"""Tier (c) for LoRA: one `generate` call over six PEFT adapters (ranks 4-16, different targets, alpha
and rsLoRA) and base-model requests, with max_loras=2 so adapters swap between steps, token-exact in
fp32 with transformers running each adapter merged into the base weights (PEFT's merge_and_unload).
Several adapters share one prompt longer than a KV block: the prefix cache must keep their KV apart."""

from __future__ import annotations

import random

import pytest

from overnight import LLM, LoRARequest, SamplingParams
from overnight.errors import ConfigError, InvalidRequestError
from tests.lora_adapters import make_adapter, merged_reference
from tests.test_engine_parity import hf_greedy
from tests.tiny_models import load_reference, make_tiny_checkpoint

pytestmark = pytest.mark.slow  # real models beside transformers and PEFT

NEW_TOKENS = 8
ADAPTERS = [  # (rank, alpha, targets, rslora)
    (8, 16, ("q_proj", "v_proj"), False),
    (4, 8, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    (16, 16, ("gate_proj", "up_proj", "down_proj"), False),
    (8, 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    (4, 4, ("o_proj", "down_proj"), True),
    (16, 8, ("k_proj", "up_proj"), True),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root, "qwen3")
    loras = []
    for i, (r, alpha, targets, rs) in enumerate(ADAPTERS):
        folder = make_adapter(
            base, root / f"adapter{i}", r=r, alpha=alpha, targets=targets, use_rslora=rs, seed=i
        )
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(folder)))
    return base, loras


def test_many_adapters_in_one_generate_match_merged_models(setup) -> None:
    base, loras = setup
    llm = LLM(
        str(base),
        skip_tokenizer_init=True,
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_cpu_loras=3,
        max_num_seqs=6,
    )
    rng = random.Random(0)
    vocab = 384
    shared = [rng.randrange(3, vocab) for _ in range(37)]  # two full blocks of 16, shared by every adapter
    prompts, requests = [], []
    for lora in [*loras, None]:
        for length in (5, 23):
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
            requests.append(lora)
        prompts.append(list(shared))
        requests.append(lora)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)

    references = {None: load_reference(base)}
    for lora in loras:
        references[lora.lora_int_id] = merged_reference(base, lora.lora_path)
    seen = {}
    for prompt, lora, out in zip(prompts, requests, outs):
        key = lora.lora_int_id if lora else None
        want, _ = hf_greedy(references[key], prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == want, f"adapter {key}, prompt of {len(prompt)} tokens"
        if prompt == shared:
            seen[key] = tuple(want)
    assert len(set(seen.values())) == len(seen), "each adapter changes the shared prompt's answer"
    stats = llm.engine.stats()
    assert stats.lora_swaps_total >= len(loras) - 2  # six adapters through two slots
    assert stats.lora_loads_total >= len(loras)
    # generate_stream takes the adapters as an iterable, read lazily like the prompts
    streamed = dict(
        llm.generate_stream(iter(prompts[:6]), params, use_tqdm=False, lora_request=iter(requests[:6]))
    )
    assert [streamed[i].outputs[0].token_ids for i in range(6)] == [o.outputs[0].token_ids for o in outs[:6]]


def test_adapter_options_and_misuse_are_refused(setup) -> None:
    base, loras = setup
    with pytest.raises(ConfigError, match="max_cpu_loras \\(1\\) must be at least max_loras \\(2\\)"):
        LLM(str(base), skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_cpu_loras=1)
    plain = LLM(str(base), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=8 << 20)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        plain.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras[0])
    small = LLM(
        str(base), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=8 << 20,
        enable_lora=True, max_lora_rank=8,
    )  # fmt: skip
    with pytest.raises(InvalidRequestError, match="rank r=16 exceeds max_lora_rank 8"):
        small.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras[2])
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 names adapter"):
        small.generate(
            [[5, 6, 7]] * 2,
            SamplingParams(max_tokens=2),
            use_tqdm=False,
            lora_request=[loras[0], LoRARequest("other", 1, loras[1].lora_path)],
        )
