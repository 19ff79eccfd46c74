"""LoRA under tensor parallelism on the CPU: 2 gloo rank processes, each holding its share of every
adapter (B split by output rows on column-parallel layers, A by input columns on row-parallel ones, the
partial x @ A^T summed over ranks), give the tokens of one process for a mixed batch of adapters and the
base model. With one KV head, both ranks hold a copy of its k/v adapter rows; Phi-3's adapters on its
fused qkv_proj / gate_up_proj are split into our slices before each rank takes its share; Llama 4's
(feed_forward in the checkpoint) land on its dense layers' MLPs and its MoE layers' shared experts."""

from __future__ import annotations

import pytest

from overnight import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import make_adapter
from tests.tiny_families import make_family_checkpoint
from tests.tiny_models import load_reference, make_tiny_checkpoint
from tests.tp_helpers import generate_split

pytestmark = pytest.mark.slow  # starts tensor-parallel processes

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Each adapter's targets by family: every projection, k/v-ish + down, o + up-ish.
TARGETS = {
    "qwen3": (ALL, ("k_proj", "v_proj", "down_proj"), ("o_proj", "up_proj")),
    "llama": (ALL, ("k_proj", "v_proj", "down_proj"), ("o_proj", "up_proj")),
    "phi3": (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), ("qkv_proj", "down_proj"), ("o_proj", "gate_up_proj")),
    # Llama 4: attention, the dense layers' feed_forward and the MoE layers' shared expert (its down_proj
    # row-parallel)
    "llama4": (
        r".*layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|feed_forward\.(shared_expert\.)?(gate_proj|up_proj|down_proj))",
        r".*self_attn\.(k_proj|v_proj)|.*feed_forward\.(shared_expert\.)?down_proj",
        r".*self_attn\.o_proj|.*layers\.\d+\.feed_forward\.up_proj",
    ),
}  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9, 10] * k + [20 + k] for k in range(1, 5)] + [[3, 1, 4, 1, 5, 9, 2, 6]] * 2
OPTIONS = dict(
    device="cpu", dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16,
    enable_lora=True, max_loras=2, max_lora_rank=8,
)  # fmt: skip


@pytest.mark.parametrize("family, kv_heads", [("qwen3", 2), ("llama", 1), ("phi3", 2), ("llama4", 2)])
def test_tp2_with_adapters_matches_tp1(tmp_path, family: str, kv_heads: int) -> None:
    load = load_reference
    if family == "phi3":
        base = make_family_checkpoint(tmp_path, "phi3")
    elif family == "llama4":
        from tests.test_llama4 import load_reference as load
        from tests.test_llama4 import make_llama4_checkpoint

        base = make_llama4_checkpoint(tmp_path / "llama4")
    else:
        base = make_tiny_checkpoint(tmp_path, family, num_key_value_heads=kv_heads)
    every, kv, o = TARGETS[family]
    loras = [
        LoRARequest("all", 1, str(make_adapter(base, tmp_path / "all", r=8, targets=every, seed=1, load=load))),
        LoRARequest("kv", 2, str(make_adapter(base, tmp_path / "kv", r=4, targets=kv, seed=2, load=load))),
        LoRARequest("o", 3, str(make_adapter(base, tmp_path / "o", r=8, targets=o, use_rslora=True, seed=3, load=load))),
    ]  # fmt: skip
    requests = [loras[i % 3] if i % 4 != 3 else None for i in range(len(PROMPTS))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    one = LLM(str(base), **OPTIONS).generate(PROMPTS, params, use_tqdm=False, lora_request=requests)
    two = generate_split(str(base), PROMPTS, params, **OPTIONS, lora_request=requests)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    plain = LLM(str(base), device="cpu", dtype="float32", skip_tokenizer_init=True)
    without = plain.generate(PROMPTS, params, use_tqdm=False)
    changed = [a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(one, without)]
    assert changed == [r is not None for r in requests]  # adapters matter, base rows are the base model
