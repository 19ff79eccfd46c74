"""Qwen3-MoE end to end on the CPU: the engine against transformers, token-exact greedy in fp32, on tiny
random checkpoints (8 experts, top-2) with every layer sparse, with a dense layer among sparse ones
(mlp_only_layers), and with every other layer sparse (decoder_sparse_step=2); plus the configuration
and checkpoint errors a user of such a model can meet, and the dummy preset's shapes.

The layer-level parity (prefill logits, decode, batching, chunked prefill) runs with the dense families
in test_models.py (qwen3_moe is one of tests/tiny_models.py's FAMILIES).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from overnight import LLM, SamplingParams
from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts, fused_experts_ref, router_topk_ref
from overnight.loader.dummy import DUMMY_RANGE, init_dummy_weights
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock
from tests.parity_helpers import hf_greedy, prompts_for
from tests.tiny_models import load_reference, make_tiny_checkpoint, tiny_config

pytestmark = pytest.mark.slow  # real engines beside transformers

NEW_TOKENS = 12
VARIANTS = {
    "all-sparse": {},
    "mlp-only-layer": {"mlp_only_layers": [1]},
    "sparse-step-2": {"decoder_sparse_step": 2, "num_hidden_layers": 4, "norm_topk_prob": False},
}


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory, moe_folder):
    overrides = VARIANTS[request.param]
    folder = (
        make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), "qwen3_moe", **overrides)
        if overrides
        else moe_folder
    )
    return folder, overrides


def test_layer_kinds_follow_the_config(variant):
    folder, overrides = variant
    model = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    ref = load_reference(folder)
    ours = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers]
    theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in ref.model.layers]
    assert ours == theirs
    assert any(ours) and all(ours) == (not overrides)


def test_engine_greedy_token_exact_in_one_batch(variant):
    folder, _ = variant
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=16 << 20)
    ref = load_reference(folder)
    prompts = prompts_for(ref.config.vocab_size)
    assert len(prompts) >= 8
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    distinct = set()
    for prompt, out in zip(prompts, outs):
        tokens, scores = hf_greedy(ref, prompt, NEW_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        for step, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert abs(lp[tok].logprob - scores[step][tok].item()) < 1e-2
        distinct.update(tokens)
    assert len(distinct) > 20  # the outputs are varied, so a mixed-up batch would show


def test_reference_path_equals_transformers_block():
    """Router and experts of one sparse block against transformers' Qwen3MoeSparseMoeBlock on the same
    weights, bit for bit in fp32 (same ops on the same rows)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as HFBlock

    config = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    hf = HFBlock(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    ours = Qwen3MoeSparseMoeBlock(
        ModelArch(
            "qwen3_moe",
            vocab_size=1,
            hidden_size=config.hidden_size,
            intermediate_size=1,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=1,
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
        )
    )
    ours.load_state_dict(
        {
            "gate.weight": hf.gate.weight,
            "experts.gate_up_proj": hf.experts.gate_up_proj,
            "experts.down_proj": hf.experts.down_proj,
        }
    )
    x = torch.randn(37, config.hidden_size, generator=gen)
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x[None])[0])


def test_router_ref_renormalizes_and_orders():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 5.5, -1.0, 0.0]])
    w, ids = router_topk_ref(logits, 2, renormalize=True)
    assert ids.dtype == torch.int32 and ids.tolist() == [[1, 3], [1, 0]]
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    w_raw, _ = router_topk_ref(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(w_raw, probs.gather(1, ids.long()))


def test_experts_ref_is_the_weighted_sum_of_chosen_experts():
    gen = torch.Generator().manual_seed(0)
    experts = Experts(4, 8, 6)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3, 8, generator=gen)
    ids = torch.tensor([[2, 0], [1, 2], [3, 1]], dtype=torch.int32)
    w = torch.rand(3, 2, generator=gen)
    out = fused_experts_ref(x, experts.gate_up_proj, experts.down_proj, w, ids)

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:
        gate, up = (experts.gate_up_proj[e] @ v).chunk(2)
        return experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)

    for t in range(3):
        want = sum(w[t, j] * expert(int(ids[t, j]), x[t]) for j in range(2))
        torch.testing.assert_close(out[t], want.detach())


# -- errors and presets ----------------------------------------------------------------------------------


def test_missing_expert_tensor_is_named(tmp_path, moe_folder):
    folder = tmp_path / "broken"
    shutil.copytree(moe_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    tensors["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)  # only 8 experts
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError) as err:
        load_model(resolve_source(str(folder)), torch.float32, "cpu")
    message = str(err.value)
    assert "missing tensors: model.layers.1.mlp.experts.5.up_proj.weight" in message
    assert "unexpected tensors: model.layers.0.mlp.experts.8.gate_proj.weight" in message


def test_misshapen_expert_tensor_is_named(tmp_path, moe_folder):
    folder = tmp_path / "misshapen"
    shutil.copytree(moe_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.2.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 16)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"experts\.3\.down_proj\.weight: checkpoint has \[64, 16\]"):
        load_model(resolve_source(str(folder)), torch.float32, "cpu")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be in 1..num_experts"),
        ({"moe_intermediate_size": None}, "lacks required field 'moe_intermediate_size'"),
        ({"num_local_experts": None, "num_experts": None}, "lacks required field 'num_experts'"),
        ({"decoder_sparse_step": 0}, "must be positive"),
    ],
)
def test_bad_moe_configs_are_refused(tmp_path, moe_folder, change, message):
    folder = tmp_path / "cfg"
    shutil.copytree(moe_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        cfg.pop(key, None)
        if value is not None:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


def test_qwen3_30b_a3b_preset_has_published_shapes():
    source = resolve_source("qwen3-30b-a3b", load_format="dummy")
    arch = source.arch
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (128, 8, 768)
    assert arch.norm_topk_prob and arch.qk_norm and arch.mlp_only_layers == ()
    model = build_model(source, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == 30_532_122_624  # "30.5B" on the model card
    mlp = model.model.layers[47].mlp
    assert mlp.experts.gate_up_proj.shape == (128, 2 * 768, 2048)
    assert mlp.experts.down_proj.shape == (128, 2048, 768)
    assert mlp.gate.weight.shape == (128, 2048)
    # 3.3B activated parameters: attention, the router and 8 experts per layer, embeddings and head.
    active = (
        sum(p.numel() for p in model.parameters()) - arch.mlp_params() + arch.mlp_params(active_only=True)
    )
    assert 3.3e9 < active < 3.4e9


def test_dummy_init_fills_stacked_experts():
    """Every expert gets its own draw (not one expert's weights repeated), in the dummy range, seeded."""
    preset = resolve_source("qwen3-30b-a3b", load_format="dummy").arch
    arch = dataclasses.replace(
        preset, num_hidden_layers=1, vocab_size=64, hidden_size=32, moe_intermediate_size=8
    )
    model = Qwen3MoeForCausalLM(arch)
    init_dummy_weights(model, seed=3)
    w = model.model.layers[0].mlp.experts.gate_up_proj
    assert w.abs().max() <= DUMMY_RANGE and w.abs().min() >= 0
    assert not torch.equal(w[0], w[1])
    again = Qwen3MoeForCausalLM(arch)
    init_dummy_weights(again, seed=3)
    assert torch.equal(
        again.model.layers[0].mlp.experts.down_proj, model.model.layers[0].mlp.experts.down_proj
    )


# -- GGUF ----------------------------------------------------------------------------------------------


def write_moe_gguf(path: str, folder, quantize: frozenset[str] = frozenset()) -> None:
    """The tiny checkpoint in llama.cpp's layout: experts stacked per projection, the router as
    ffn_gate_inp; layers without experts keep ffn_gate/up/down."""
    import gguf
    import numpy as np

    from tests.parity_helpers import to_gguf_name

    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    w.add_eos_token_id(2)
    out: dict[str, np.ndarray] = {}
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp"
        if f"{prefix}.gate.weight" not in tensors:
            continue
        out[f"blk.{layer}.ffn_gate_inp.weight"] = tensors.pop(f"{prefix}.gate.weight").numpy()
        for proj, gguf_proj in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            names = [f"{prefix}.experts.{e}.{proj}.weight" for e in range(cfg["num_local_experts"])]
            out[f"blk.{layer}.ffn_{gguf_proj}_exps.weight"] = np.stack(
                [tensors.pop(n).numpy() for n in names]
            )
    out.update({to_gguf_name(name): t.numpy() for name, t in tensors.items()})
    for name, a in out.items():
        if name in quantize:
            q = gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_the_same_model(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe", mlp_only_layers=[1])
    path = str(tmp_path / "moe.gguf")
    write_moe_gguf(path, folder)
    source = resolve_source(path)
    hf_arch = resolve_source(str(folder)).arch
    # GGUF has no decoder_sparse_step: the dense layers are found by their missing router.
    assert source.arch == dataclasses.replace(
        hf_arch, max_position_embeddings=source.arch.max_position_embeddings
    )
    assert source.arch.mlp_only_layers == (1,) and source.hf_architecture == "Qwen3MoeForCausalLM"
    a = dict(load_model(source, torch.float32, "cpu").named_parameters())
    b = dict(load_model(resolve_source(str(folder)), torch.float32, "cpu").named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_gguf_quantized_experts_dequantize(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe")
    path = str(tmp_path / "moe-q8.gguf")
    write_moe_gguf(path, folder, quantize=frozenset({"blk.0.ffn_down_exps.weight"}))
    from overnight.loader.gguf import iter_gguf_weights

    got = dict(iter_gguf_weights(path))
    ref = load_file(folder / "model.safetensors")
    assert got.keys() == ref.keys()
    for e in range(8):
        name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        torch.testing.assert_close(got[name], ref[name], atol=0.02 * float(ref[name].abs().max()), rtol=0)
