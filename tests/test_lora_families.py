"""LoRA beyond Llama / Qwen: each family's checkpoint projection names mapped onto our fused modules
(overnight/lora/targets.py).

  - tier (c), slow: per family a tiny random transformers model and a random PEFT adapter (rank 8, every
    projection the family lets LoRA adapt, B non-zero), our engine in fp32 token-exact against PEFT's
    merged model, the base model's requests in the same batch against the base model; Phi-3's adapter on
    its fused qkv_proj / gate_up_proj with a second adapter (unfused-order check: q, k, v and gate, up
    rows as Phi-3 fuses them); Gemma 3's, Mistral 3's and Qwen3.5's image checkpoints through
    language_model. keys; the hybrids on every kind of layer they have (Qwen3.5 / Qwen3-Next's gated
    attention and Gated DeltaNet, Granite 4.0-H's and Nemotron-H's Mamba2, LFM2's short conv), Gemma 4's
    KV-shared and K=V layers, Llama 4's and LFM2's checkpoint names (feed_forward, w1 / w3 / w2);
    Phi-3's and Qwen3.5's adapters through the Triton interpreter's LoRA kernels;
  - fast: the refusals (experts and routers of MoE layers, target_parameters, a vision tower, names of
    another family, families without LoRA, a projection on a layer of the other kind, B rows of an
    ungated q_proj, LoRA with tensor parallelism on the single-device families) on adapters written by
    hand, a fused projection's B split across our slices, Gemma 4's and Nemotron-H's per-layer placement.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from overnight import LLM, LoRARequest, SamplingParams
from overnight.arch import ModelArch
from overnight.errors import ConfigError, InvalidRequestError
from overnight.lora.adapter import check_adapter, load_adapter
from overnight.lora.targets import FAMILY_TARGETS, locate
from tests.lora_adapters import make_adapter, merged_reference
from tests.parity_helpers import hf_greedy

NEW_TOKENS = 6
_ATTN = "q_proj|k_proj|v_proj|o_proj"
_MLP = "gate_proj|up_proj|down_proj"
_GATED_DELTA = "in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj"
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _tiny(family: str) -> torch.nn.Module:
    """transformers' tiny random model of `family`, from the families' own test helpers."""
    if family.startswith(("gemma2", "gemma3", "gemma4")):
        from tests.test_gemma import tiny_gemma

        return tiny_gemma(family)
    if family in ("seed_oss", "exaone4", "apertus", "cohere", "cohere2"):
        from tests.dense_family_checks import make_model

        return make_model(family)
    if family in (*HYBRIDS, "qwen3_5_vl"):
        from tests.tiny_hybrid import make_hybrid_model

        return make_hybrid_model(family)
    if family.startswith("granitemoehybrid"):
        from tests.tiny_granite import make_granite_model

        return make_granite_model("moe" if family.endswith("moe") else "dense")
    if family.startswith("nemotron_h"):
        from tests import tiny_nemotron_h

        make = "make_nemotron_h_moe_model" if family.endswith("moe") else "make_nemotron_h_model"
        return getattr(tiny_nemotron_h, make)()
    if family.startswith("lfm2"):
        from tests.tiny_lfm2 import make_lfm2_model

        return make_lfm2_model("moe" if family == "lfm2_moe" else "biased")
    if family == "gpt_oss":
        import transformers

        from tests.test_gpt_oss import _config, _spread

        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM(_config()).eval()
        _spread(model, 0)
        return model
    from tests.tiny_families import make_family_model

    return make_family_model({"mistral": "mistral-window"}.get(family, family))


# MoE families whose tests save their checkpoints: family -> (transformers prefix, writer)
def _moe_writers() -> dict[str, tuple[str, Any]]:
    from tests.test_ernie4_5 import make_ernie_moe_checkpoint
    from tests.test_glm4_moe import make_glm_checkpoint
    from tests.test_llama4 import make_llama4_checkpoint
    from tests.test_olmoe import FIELDS as OLMOE
    from tests.test_qwen2_moe import make_qwen2_moe_checkpoint
    from tests.tiny_moe import make_moe_checkpoint

    return {
        "qwen2_moe": ("Qwen2Moe", make_qwen2_moe_checkpoint),
        "olmoe": ("Olmoe", lambda folder: make_moe_checkpoint(folder, "Olmoe", OLMOE)),
        "glm4_moe": ("Glm4Moe", make_glm_checkpoint),
        "ernie4_5_moe": ("Ernie4_5_Moe", make_ernie_moe_checkpoint),
        "llama4": ("Llama4", make_llama4_checkpoint),
    }


def _checkpoint(family: str, folder: Path) -> tuple[int, Any]:
    """Save the tiny `family` model in folder; (its vocabulary size, a loader of it as transformers')."""
    moe = _moe_writers().get(family)
    if moe is not None:
        import transformers

        prefix, write = moe
        write(folder)
        cls = getattr(transformers, f"{prefix}ForCausalLM")
    else:
        model = _tiny(family)
        model.save_pretrained(folder)
        cls = type(model)
    vocab = json.loads((folder / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
    return vocab, _loader(cls)


# family -> PEFT target_modules (a regex over module paths where an image model's tower must stay out)
CASES: dict[str, str] = {
    "mistral": f"{_ATTN}|{_MLP}",
    "ministral3": f"{_ATTN}|{_MLP}",
    "mixtral": _ATTN,  # experts: refused (test_expert_and_router_targets_are_refused)
    "gpt_oss": _ATTN,
    "qwen2_moe": _ATTN,
    "olmoe": _ATTN,
    "glm4_moe": _ATTN,
    "ernie4_5_moe": _ATTN,
    "phi3": "qkv_proj|o_proj|gate_up_proj|down_proj",
    "glm4": f"{_ATTN}|gate_up_proj|down_proj",
    "olmo2": f"{_ATTN}|{_MLP}",
    "olmo3": f"{_ATTN}|{_MLP}",
    "smollm3": f"{_ATTN}|{_MLP}",
    "granite": f"{_ATTN}|{_MLP}",
    "seed_oss": f"{_ATTN}|{_MLP}",
    "exaone4": f"{_ATTN}|{_MLP}",
    "apertus": f"{_ATTN}|up_proj|down_proj",
    "cohere": f"{_ATTN}|{_MLP}",
    "cohere2": f"{_ATTN}|{_MLP}",
    "gemma2": f"{_ATTN}|{_MLP}",
    "gemma3": f"{_ATTN}|{_MLP}",
    "gemma3-multimodal": f".*language_model.*\\.({_ATTN}|{_MLP})",
    "mistral3": f".*language_model.*\\.({_ATTN}|{_MLP})",
    # KV-shared layers (q_proj alone), K=V full layers (no v_proj), a double-wide MLP; the MoE layers'
    # dense MLP beside their experts
    "gemma4": f"{_ATTN}|{_MLP}",
    "gemma4-moe": f"{_ATTN}|{_MLP}",
    "gemma4-multimodal": f".*language_model.*\\.({_ATTN}|{_MLP})",
    # the dense layers' MLPs and the MoE layers' shared expert (feed_forward in the checkpoint)
    "llama4": f".*layers\\.\\d+\\.(self_attn\\.({_ATTN})|feed_forward\\.(shared_expert\\.)?({_MLP}))",
    # Mamba2 layers' in_proj / out_proj, the shared MLP (beside the routed experts in the MoE variant)
    "granitemoehybrid": f"{_ATTN}|in_proj|out_proj|input_linear|output_linear",
    "granitemoehybrid-moe": f"{_ATTN}|in_proj|out_proj|input_linear|output_linear",
    # blocks, each one mixer: attention, Mamba2, the ungated MLP; MoE blocks (their shared experts) not.
    # PEFT refuses Mamba's out_proj on nemotron_h (Granite's case covers Mamba2's out_proj).
    "nemotron_h": r".*mixer\.(q_proj|k_proj|v_proj|o_proj|in_proj|up_proj|down_proj)",
    "nemotron_h_moe": r".*mixer\.(q_proj|k_proj|v_proj|o_proj|in_proj|up_proj|down_proj)",
    # attention's out_proj, feed_forward w1 / w3 / w2, the short conv's in_proj / out_proj (with biases)
    "lfm2": "q_proj|k_proj|v_proj|out_proj|w1|w2|w3|in_proj",
    "lfm2_moe": r".*layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|conv\.(in_proj|out_proj)|feed_forward\.(w1|w2|w3))",
    # q_proj's rows are [q | gate] per head; the linear layers' Gated DeltaNet projections
    "qwen3_5": f"{_ATTN}|{_GATED_DELTA}|{_MLP}",
    # every layer sparse: the shared expert's gate/up/down_proj beside the stacked routed experts. Not on
    # Qwen3-Next: PEFT resolves a regex to leaf names and adds its routed experts' stacked tensors as
    # target_parameters (refused) for any gate_proj / up_proj / down_proj. Its in_proj_qkvz / in_proj_ba
    # are fused by key head, as the checkpoint holds them.
    "qwen3_5_moe": f"{_ATTN}|{_GATED_DELTA}|shared_expert\\.({_MLP})",
    "qwen3_next": f"{_ATTN}|in_proj_qkvz|in_proj_ba|out_proj",
    # an image checkpoint's language model (the tower's attention refused: its keys are model.visual.)
    "qwen3_5_vl": f".*language_model.*\\.({_ATTN}|{_GATED_DELTA}|{_MLP})",
}


def _regex(targets: str) -> str:
    return targets if targets.startswith(".*") else f".*\\.({targets})"


def _loader(cls: type):
    def load(folder: Any) -> torch.nn.Module:
        return cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()

    return load


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_family_adapter_matches_peft(family: str, tmp_path: Path) -> None:
    base = tmp_path / "base"
    vocab, load = _checkpoint(family, base)
    adapters = [make_adapter(base, tmp_path / "a0", r=8, alpha=16, targets=_regex(CASES[family]), load=load)]
    if family == "phi3":  # a second adapter beside the first and the base model: fused qkv only, rsLoRA
        adapters.append(
            make_adapter(base, tmp_path / "a1", r=4, alpha=8, targets=".*qkv_proj", use_rslora=True,
                         seed=1, load=load)
        )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 13)]
    llm = LLM(
        str(base), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=8 << 20,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    loras = [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(adapters)]
    batch = [(p, lora) for lora in [*loras, None] for p in prompts]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([p for p, _ in batch], params, use_tqdm=False, lora_request=[r for _, r in batch])
    refs = {None: load(base)} | {
        lora.lora_int_id: merged_reference(base, lora.lora_path, load) for lora in loras
    }
    got: dict[int | None, list[list[int]]] = {}
    for (prompt, lora), out in zip(batch, outs):
        key = lora.lora_int_id if lora else None
        want, _ = hf_greedy(refs[key], prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == want, f"{family}: adapter {key}, prompt of {len(prompt)} tokens"
        got.setdefault(key, []).append(want)
    for lora in loras:
        assert got[lora.lora_int_id] != got[None], f"{family}: adapter {lora.lora_int_id} changes nothing"


# --- fast checks on hand-written adapters ---------------------------------------------------------------

_DENSE = ModelArch("llama", 64, 16, 24, 2, 4, 2, 4)  # vocab, hidden, inter, layers, heads, kv heads, head_dim
_MIXTRAL = replace(
    _DENSE, architecture="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
)


def _hybrid(arch: ModelArch) -> ModelArch:
    """`arch` as a Qwen3.5-style hybrid: layer 0 linear attention, layer 1 full attention."""
    return replace(
        arch, layer_types=("linear_attention", "full_attention"), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=3, linear_conv_kernel_dim=4,
    )  # fmt: skip


# Gemma 4's layer kinds: sliding, full (head size 8, one KV head, values = keys), KV-shared sliding.
_GEMMA4 = replace(
    _DENSE, architecture="gemma4", num_hidden_layers=3, sliding_window=8, num_kv_shared_layers=1,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"), attention_k_eq_v=True,
    global_head_dim=8, num_global_key_value_heads=1,
)  # fmt: skip


_MAMBA = dict(mamba_n_heads=2, mamba_d_head=4, mamba_d_state=2, mamba_d_conv=4)  # in_proj: 8 + 12 + 2 rows
_GRANITE_H = replace(
    _DENSE, architecture="granitemoehybrid", layer_types=("linear_attention", "full_attention"), **_MAMBA
)
# Nemotron-H's blocks Mamba2, attention, MLP, MoE: two ModelArch layers, four model.layers
_NEMOTRON_H = replace(
    _DENSE, architecture="nemotron_h", block_pattern="M*-E", layer_types=("linear_attention", "full_attention"),
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, **_MAMBA,
)  # fmt: skip


def _write(folder: Path, arch: ModelArch, tensors: dict[str, tuple[int, int]], **config: Any) -> LoRARequest:
    """An adapter folder of rank 2 holding `tensors` (key -> shape), random."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    save_file(
        {k: torch.randn(s, generator=gen) for k, s in tensors.items()}, folder / "adapter_model.safetensors"
    )
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config})
    )
    return LoRARequest(folder.name, 1, str(folder))


def _pair(
    path: str, d_in: int, d_out: int, layer: int = 0, prefix: str = "model."
) -> dict[str, tuple[int, int]]:
    key = f"base_model.model.{prefix}layers.{layer}.{path}"
    return {f"{key}.lora_A.weight": (2, d_in), f"{key}.lora_B.weight": (d_out, 2)}


@pytest.mark.parametrize(
    "arch,tensors,config,match",
    [
        (_MIXTRAL, _pair("block_sparse_moe.experts.0.w1", 16, 8), {}, "'block_sparse_moe.experts.0.w1' of layer 0: adapting a mixture of experts"),
        (_MIXTRAL, _pair("mlp.gate", 16, 4), {}, "'mlp.gate' of layer 0: adapting a mixture of experts"),
        (_MIXTRAL, _pair("mlp.gate_proj", 16, 24, layer=1), {}, "adapting a mixture of experts .*supported: q_proj, k_proj, v_proj, o_proj on mixtral"),
        (replace(_MIXTRAL, architecture="qwen2_moe"), _pair("mlp.shared_expert.up_proj", 16, 24), {}, "'mlp.shared_expert.up_proj' of layer 0: adapting a mixture of experts"),
        (replace(_DENSE, architecture="glm4_moe"), _pair("mlp.gate_proj", 16, 24), {}, r"'gate_proj' is not supported \(layer 0 mlp.gate_proj; supported: q_proj, k_proj, v_proj, o_proj on glm4_moe"),
        (replace(_MIXTRAL, architecture="gpt_oss"), _pair("self_attn.q_proj", 16, 16), {"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
        (replace(_DENSE, architecture="phi3"), _pair("self_attn.q_proj", 16, 16), {}, r"'q_proj' is not supported \(layer 0 self_attn.q_proj; supported: qkv_proj, o_proj, gate_up_proj, down_proj on phi3"),
        (replace(_DENSE, architecture="glm4"), _pair("mlp.gate_proj", 16, 24), {}, "'gate_proj' is not supported .*gate_up_proj"),
        (replace(_DENSE, architecture="apertus"), _pair("mlp.gate_proj", 16, 24), {}, "'gate_proj' is not supported \\(layer 0 mlp.gate_proj; supported: q_proj, k_proj, v_proj, o_proj, up_proj, down_proj on apertus"),
        (replace(_DENSE, architecture="gemma3"), _pair("encoder.layers.0.self_attn.q_proj", 16, 16, prefix="model.vision_tower.vision_model."), {}, "adapts the vision tower"),
        (replace(_DENSE, architecture="phi3"), _pair("self_attn.qkv_proj", 16, 17), {}, r"qkv_proj.lora_B has shape \[17, 2\], this base model needs \[32, 2\]"),
        (replace(_DENSE, architecture="minimax_m2"), _pair("self_attn.q_proj", 16, 16), {}, "LoRA is not supported on 'minimax_m2' models \\(supported families: llama, .*phi3"),
        (_hybrid(replace(_DENSE, architecture="qwen3_5")), _pair("self_attn.q_proj", 16, 32), {}, "adapts self_attn.q_proj, but layer 0 of the base model is a linear-attention layer without it"),
        (_hybrid(replace(_DENSE, architecture="qwen3_5")), _pair("linear_attn.out_proj", 12, 16, layer=1), {}, "layer 1 of the base model is a full-attention layer without it"),
        (_hybrid(replace(_DENSE, architecture="qwen3_5")), _pair("self_attn.q_proj", 16, 16, layer=1), {}, r"q_proj.lora_B has shape \[16, 2\], this base model needs \[32, 2\]"),
        (_hybrid(replace(_DENSE, architecture="qwen3_next")), _pair("linear_attn.in_proj_qkv", 16, 28), {}, r"'in_proj_qkv' is not supported \(layer 0 linear_attn.in_proj_qkv; supported: .*in_proj_qkvz, in_proj_ba, out_proj"),
        (_hybrid(replace(_MIXTRAL, architecture="qwen3_5_moe")), _pair("mlp.shared_expert_gate", 16, 1), {}, "'mlp.shared_expert_gate' of layer 0: adapting a mixture of experts"),
        (_hybrid(replace(_DENSE, architecture="qwen3_5")), _pair("blocks.0.attn.qkv", 16, 48, prefix="model.visual."), {}, "adapts the vision tower"),
        (replace(_MIXTRAL, architecture="llama4"), _pair("feed_forward.router", 16, 4), {}, "'feed_forward.router' of layer 0: adapting a mixture of experts"),
        (replace(_DENSE, architecture="llama4"), _pair("feed_forward.shared_expert.up_proj", 16, 8), {}, "layer 0 of the base model is a layer without it"),
        (replace(_MIXTRAL, architecture="llama4"), _pair("feed_forward.down_proj", 24, 16), {}, "'feed_forward.down_proj' of layer 0: adapting a mixture of experts"),
        (replace(_DENSE, architecture="llama4"), _pair("mlp.down_proj", 24, 16), {}, r"'down_proj' is not supported \(layer 0 mlp.down_proj; supported: q_proj, .*down_proj on llama4"),
        (_GRANITE_H, _pair("self_attn.q_proj", 16, 16), {}, "layer 0 of the base model is a linear-attention layer without it"),
        (_GRANITE_H, _pair("mamba.in_proj", 16, 21), {}, r"in_proj.lora_B has shape \[21, 2\], this base model needs \[22, 2\]"),
        (_GRANITE_H, _pair("block_sparse_moe.router.layer", 16, 4), {}, "'block_sparse_moe.router.layer' of layer 0: adapting a mixture of experts"),
        (_GRANITE_H, _pair("mamba.conv1d", 4, 12), {}, r"'conv1d' is not supported \(layer 0 mamba.conv1d; supported: q_proj, k_proj, v_proj, o_proj, in_proj, out_proj, input_linear, output_linear on granitemoehybrid"),
        (replace(_DENSE, architecture="lfm2"), _pair("self_attn.o_proj", 16, 16), {}, r"'o_proj' is not supported \(layer 0 self_attn.o_proj; supported: q_proj, k_proj, v_proj, self_attn.out_proj, w1, w3, w2, conv.in_proj, conv.out_proj on lfm2"),
        (replace(_DENSE, architecture="lfm2"), _pair("conv.in_proj", 16, 48), {}, "layer 0 of the base model is a layer without it"),
        (_NEMOTRON_H, _pair("mixer.q_proj", 16, 16), {}, "layer 0 of the base model is a Mamba2 block without it"),
        (_NEMOTRON_H, _pair("mixer.in_proj", 16, 22, layer=2), {}, "layer 2 of the base model is an MLP block without it"),
        (_NEMOTRON_H, _pair("mixer.up_proj", 16, 24, layer=3), {}, "'mixer.up_proj' of layer 3: adapting a mixture of experts"),
        (_NEMOTRON_H, _pair("mixer.gate", 16, 4, layer=3), {}, "'mixer.gate' of layer 3: adapting a mixture of experts"),
        (_NEMOTRON_H, _pair("mixer.up_proj", 16, 24, layer=4), {}, "is for layer 4, but the base model has 4 layers"),
        (_GEMMA4, _pair("self_attn.k_proj", 16, 8, layer=2), {}, r"layer 2 of the base model is a KV-shared layer \(its keys and values are layer 0's\) without it"),
        (_GEMMA4, _pair("self_attn.v_proj", 16, 8, layer=1), {}, r"layer 1 of the base model is a full-attention layer whose values are its keys"),
        (_GEMMA4, _pair("self_attn.q_proj", 16, 16, layer=1), {}, r"q_proj.lora_B has shape \[16, 2\], this base model needs \[32, 2\]"),
        (_GEMMA4, _pair("per_layer_input_gate", 16, 8), {}, r"'per_layer_input_gate' is not supported \(layer 0 per_layer_input_gate; supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj on gemma4"),
    ],
)  # fmt: skip
def test_refusals_name_the_problem(arch, tensors, config, match, tmp_path: Path) -> None:
    req = _write(tmp_path / "adapter", arch, tensors, **config)
    with pytest.raises(InvalidRequestError, match=match):
        check_adapter(req, arch, max_lora_rank=8)


def test_fused_projection_splits_b_across_our_slices(tmp_path: Path) -> None:
    """Phi-3's qkv_proj LoRA: one A in each of q, k, v's slices, B's rows cut at q | k | v (sizes 16, 8,
    8); gate_up_proj's at gate | up; language_model. keys (an image checkpoint's) land on the same layers."""
    arch = replace(_DENSE, architecture="phi3")
    tensors = _pair("self_attn.qkv_proj", 16, 32) | _pair(
        "mlp.gate_up_proj", 16, 48, layer=1, prefix="model.language_model."
    )
    spec = check_adapter(_write(tmp_path / "phi", arch, tensors), arch, max_lora_rank=2)
    adapter = load_adapter(spec, torch.float32)
    from safetensors.torch import load_file

    raw = load_file(str(tmp_path / "phi" / "adapter_model.safetensors"))
    scale = 4 / 2
    for layer, module, name, edges in [
        (0, "self_attn.qkv_proj", "model.layers.0.self_attn.qkv_proj", (0, 16, 24, 32)),
        (1, "mlp.gate_up_proj", "model.language_model.layers.1.mlp.gate_up_proj", (0, 24, 48)),
    ]:
        parts = adapter.weights[(layer, module)]
        a, b = raw[f"base_model.model.{name}.lora_A.weight"], raw[f"base_model.model.{name}.lora_B.weight"]
        assert [s for s, _, _ in parts] == list(range(len(edges) - 1))
        for s, a_s, b_s in parts:
            assert torch.equal(a_s, a)
            assert torch.allclose(b_s, scale * b[edges[s] : edges[s + 1]])


def test_every_family_table_is_writable_and_checks(tmp_path: Path) -> None:
    """bench's random adapters (every target of the family) pass the checks on each supported family."""
    from overnight.bench.lora import write_random_adapters

    layered = {  # families whose layers differ: their kinds of layer (blocks) as the tests above build them
        "gemma4": _GEMMA4,
        "granitemoehybrid": _GRANITE_H,
        "nemotron_h": _NEMOTRON_H,
        "lfm2": replace(_GRANITE_H, architecture="lfm2"),
    }
    for family, targets in FAMILY_TARGETS.items():
        moe = family in ("mixtral", "gpt_oss", "qwen3_moe", "qwen3_5_moe", "qwen3_next", "llama4")
        moe_arch = replace(_MIXTRAL, shared_expert_intermediate_size=12)
        arch = layered.get(family) or replace(moe_arch if moe else _DENSE, architecture=family)
        if family in HYBRIDS:
            arch = _hybrid(arch)
        (lora,) = write_random_adapters(arch, 1, 2, str(tmp_path / family))
        spec = check_adapter(lora, arch, max_lora_rank=2)
        layers = range(len(arch.block_pattern) or arch.num_hidden_layers)
        want = sum(locate(arch, n, i) is not None for n in targets for i in layers)
        assert len(spec.tensors) == want, family
        kinds = {(t.layer, targets[t.name].kind) for t in spec.tensors}
        has_mlp = any(w.kind == "mlp" for w in targets.values())
        for i in layers:  # a hybrid's layer: attention or its mixer; Nemotron-H's block: one of three
            found = [kind for kind in ("attention", "mixer", "mlp") if (i, kind) in kinds]
            if arch.block_pattern:
                assert len(found) == (arch.block_pattern[i] != "E"), (family, i)
                continue
            if arch.layer_types and family != "gemma4":
                assert ("attention" in found) != ("mixer" in found), (family, i)
            assert ("mlp" in found) == (has_mlp and not arch.is_moe_layer(i)), (family, i)


def test_enable_lora_on_a_family_without_lora_is_refused(tmp_path: Path) -> None:
    from overnight.build import lora_config
    from overnight.options import EngineOptions

    class Source:
        arch = replace(_DENSE, architecture="minimax_m2")

    with pytest.raises(
        ConfigError,
        match="LoRA adapters run on generating llama, .*gemma3.*phi3.* models, not on 'minimax_m2'",
    ):
        lora_config(EngineOptions(model="x", enable_lora=True), Source(), "generate")  # type: ignore[arg-type]


@pytest.mark.slow  # the interpreter compiles the LoRA shrink and expand kernels (~5 s on two shared cores)
@pytest.mark.parametrize("family", ["phi3", "qwen3_5"])
def test_adapter_on_the_kernel_path(family: str, tmp_path: Path, monkeypatch) -> None:
    """Phi-3's fused-projection adapter, and Qwen3.5's on a hybrid's two kinds of layer (gated attention,
    Gated DeltaNet), in a device slot: every wrapped layer's LoRA kernels (through the Triton interpreter
    without a GPU) equal the torch path on a batch of adapter and base rows."""
    from overnight.config import LoRAConfig
    from overnight.kernels import dispatch
    from overnight.lora.slots import DeviceLoRA
    from tests.parity_helpers import cpu_model
    from tests.tiny_families import make_family_model
    from tests.tiny_hybrid import make_hybrid_model

    if family == "phi3":
        model = make_family_model("phi3", num_hidden_layers=1)
    else:
        layers = ["linear_attention", "full_attention"]
        model = make_hybrid_model(family, num_hidden_layers=2, layer_types=layers)
    model.save_pretrained(tmp_path / "base")
    folder = make_adapter(tmp_path / "base", tmp_path / "a", r=8, alpha=16, targets=_regex(CASES[family]),
                          load=_loader(type(model)))  # fmt: skip
    ours = cpu_model(tmp_path / "base")
    device = next(ours.parameters()).device
    lora = DeviceLoRA(ours, ours.arch, LoRAConfig(2, 8, 2), torch.float32, device, max_tokens=16)
    lora.load([(1, LoRARequest("a", 7, str(folder)))])
    lora.map_rows([7, 0, 7], [5, 3, 2], 10, decode_only=False)
    rows = torch.tensor([1] * 5 + [0] * 3 + [1] * 2, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    for (_, path), module in lora.modules.items():
        x = torch.randn(10, module.in_features, generator=gen)
        with torch.no_grad():
            monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
            got = module(x)
            monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
            want, plain = module(x), module.base(x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[~rows], plain[~rows])
        assert not torch.allclose(got[rows], plain[rows]), path
    if family != "phi3":  # every projection of both layer kinds wrapped (a dense model: no shared expert)
        targets = FAMILY_TARGETS[family].values()
        assert {path for _, path in lora.modules} == {w.module for w in targets if w.kind != "shared_expert"}


def test_tensor_parallel_lora_on_a_hybrid_is_refused() -> None:
    from overnight.build import lora_config
    from overnight.options import EngineOptions

    class Source:
        arch = _hybrid(replace(_DENSE, architecture="qwen3_next"))

    opts = EngineOptions(model="x", enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(
        ConfigError, match="LoRA on 'qwen3_next' models with tensor_parallel_size > 1 is not supported"
    ):
        lora_config(opts, Source(), "generate")  # type: ignore[arg-type]


def test_gemma4_layers_place_each_projection_by_kind(tmp_path: Path) -> None:
    """q_proj: a slice of qkv_proj (q | k | v, or q | k where values are keys), or q_proj of its own in
    a KV-shared layer; B's rows follow each layer's head size."""
    tensors = (
        _pair("self_attn.q_proj", 16, 16) | _pair("self_attn.k_proj", 16, 8) | _pair("self_attn.v_proj", 16, 8)
        | _pair("self_attn.q_proj", 16, 32, layer=1) | _pair("self_attn.k_proj", 16, 8, layer=1)
        | _pair("self_attn.q_proj", 16, 16, layer=2) | _pair("mlp.down_proj", 24, 16, layer=2)
    )  # fmt: skip
    spec = check_adapter(_write(tmp_path / "g4", _GEMMA4, tensors), _GEMMA4, max_lora_rank=2)
    assert [(t.layer, t.name, t.module, t.slices, t.rows) for t in spec.tensors] == [
        (0, "k_proj", "self_attn.qkv_proj", (1,), (8,)),
        (0, "q_proj", "self_attn.qkv_proj", (0,), (16,)),
        (0, "v_proj", "self_attn.qkv_proj", (2,), (8,)),
        (1, "k_proj", "self_attn.qkv_proj", (1,), (8,)),
        (1, "q_proj", "self_attn.qkv_proj", (0,), (32,)),
        (2, "down_proj", "mlp.down_proj", (0,), (16,)),
        (2, "q_proj", "self_attn.q_proj", (0,), (16,)),
    ]


def test_nemotron_h_blocks_place_each_mixer(tmp_path: Path) -> None:
    """Nemotron-H's adapter keys index blocks (published ones under backbone.): block 0's Mamba2 in_proj,
    block 1's attention (q/k/v fused here), block 2's ungated MLP, each in its block's own module."""
    tensors = (
        _pair("mixer.in_proj", 16, 22, prefix="backbone.") | _pair("mixer.out_proj", 8, 16)
        | _pair("mixer.v_proj", 16, 8, layer=1) | _pair("mixer.o_proj", 16, 16, layer=1)
        | _pair("mixer.up_proj", 16, 24, layer=2) | _pair("mixer.down_proj", 24, 16, layer=2)
    )  # fmt: skip
    spec = check_adapter(_write(tmp_path / "nh", _NEMOTRON_H, tensors), _NEMOTRON_H, max_lora_rank=2)
    assert [(t.layer, t.module, t.slices, t.rows) for t in spec.tensors] == [
        (0, "mixer.in_proj", (0,), (22,)),
        (0, "mixer.out_proj", (0,), (16,)),
        (1, "mixer.o_proj", (0,), (16,)),
        (1, "mixer.qkv_proj", (2,), (8,)),
        (2, "mixer.down_proj", (0,), (16,)),
        (2, "mixer.up_proj", (0,), (24,)),
    ]


def test_image_checkpoint_key_layouts_map_to_the_decoder_layers(tmp_path: Path) -> None:
    """transformers 5 saves an image model's decoder as model.language_model.layers, 4.x as
    language_model.model.layers: both name our model.layers."""
    arch = replace(_DENSE, architecture="gemma3")
    tensors = _pair("self_attn.q_proj", 16, 16, prefix="model.language_model.") | _pair(
        "mlp.down_proj", 24, 16, layer=1, prefix="language_model.model."
    )
    spec = check_adapter(_write(tmp_path / "g", arch, tensors), arch, max_lora_rank=2)
    assert [(t.layer, t.module, t.slices) for t in spec.tensors] == [
        (0, "self_attn.qkv_proj", (0,)),
        (1, "mlp.down_proj", (0,)),
    ]
