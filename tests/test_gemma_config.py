"""Gemma config.json -> ModelArch against transformers' own reading of the same configs (the tiny test
checkpoints' and the dummy presets', whose published configs leave most keys to transformers' defaults):
per-layer kinds, windows, head sizes, KV heads, KV sharing, attention scale, RoPE tables, and the
parameter count the memory check uses (against a meta-device transformers model). Then the configs
and checkpoints that are refused, with the reason.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest
import torch

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.loader.model_loader import build_model
from overnight.loader.resolve import PRESETS_DIR, resolve_source
from overnight.models.gemma import GemmaForCausalLM, text_weights
from overnight.models.gemma4 import load_fused_weights
from overnight.models.registry import arch_from_hf_config
from tests.test_gemma import VARIANTS, tiny_gemma

PRESETS = ("gemma-3-27b", "gemma-4-31b", "gemma-4-26b-a4b")


def _hf_text_config(cfg: dict[str, Any]):
    import transformers

    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(cfg["model_type"], **rest).get_text_config()


def config_of(variant: str) -> dict[str, Any]:
    """The tiny test model's config.json as save_pretrained writes it."""
    model = tiny_gemma(variant)
    return {**model.config.to_dict(), "architectures": [type(model).__name__]}


@functools.cache
def _configs() -> dict[str, dict[str, Any]]:
    out = {v: config_of(v) for v in VARIANTS}
    for name in PRESETS:
        with open(os.path.join(PRESETS_DIR, f"{name}.json")) as f:
            out[name] = json.load(f)
    return out


@pytest.fixture(scope="module", params=sorted(_configs()))
def pair(request):
    cfg = _configs()[request.param]
    return request.param, arch_from_hf_config(cfg), _hf_text_config(cfg)


def test_layers_read_as_transformers_does(pair):
    name, arch, text = pair
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(text)
    layers = model.model.layers
    assert arch.num_hidden_layers == len(layers)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        assert arch.layer_window(i) == attn.sliding_window, i
        assert arch.layer_head_dim(i) == attn.head_dim, i
        assert arch.num_attention_heads // arch.layer_num_kv_heads(i) == attn.num_key_value_groups, i
        expected_scale = attn.scaling
        assert (arch.attention_scale or arch.head_dim**-0.5) == pytest.approx(expected_scale), i
        if hasattr(attn, "is_kv_shared_layer"):
            assert (arch.kv_source_layer(i) != i) == attn.is_kv_shared_layer, i
    # Every parameter (Gemma 4's layer_scalar is a transformers buffer, a parameter here).
    hf_params = sum(p.numel() for p in model.parameters())
    hf_params += sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    if arch.vision is not None:  # Gemma 3 with images: the SigLIP tower and projector load too
        hf_params += _tower_parameters(name)
    assert arch.num_parameters() == hf_params


def _tower_parameters(name: str) -> int:
    """Parameters of transformers' Gemma 3 vision tower (without SigLIP's unused pooling head) and
    projector, for config `name`."""
    import transformers

    cfg = _configs()[name]
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        full = transformers.Gemma3ForConditionalGeneration(
            transformers.AutoConfig.for_model(cfg["model_type"], **rest)
        )
    return sum(
        p.numel()
        for n, p in full.named_parameters()
        if ("vision_tower" in n and ".head." not in n) or "multi_modal_projector" in n
    )


def test_rotary_tables_equal_transformers(pair):
    name, arch, text = pair
    if arch.max_position_embeddings > 300_000:
        pytest.skip("table too large for the fast tier")
    import transformers

    module = {"gemma2": "gemma2", "gemma3": "gemma3", "gemma4": "gemma4"}[arch.architecture]
    mod = getattr(transformers.models, module)
    cls = {"gemma2": "Gemma2RotaryEmbedding", "gemma3": "Gemma3RotaryEmbedding"}.get(
        module, "Gemma4TextRotaryEmbedding"
    )
    hf = getattr(getattr(mod, f"modeling_{module}"), cls)(text)
    model = build_model(_dummy_source(arch), torch.float32, "meta")
    positions = torch.tensor([[0, 1, 5, 17, 300, 4000]])
    for i, layer in enumerate(model.model.layers):
        kind = "full_attention" if arch.layer_window(i) is None else "sliding_attention"
        d = arch.layer_head_dim(i)
        ours = type(layer.self_attn.rotary_emb)(
            d,
            4096 + 1,
            layer.self_attn.rotary_emb.theta,
            layer.self_attn.rotary_emb.factor,
            layer.self_attn.rotary_emb.proportion,
        )
        x = torch.zeros(1, d)
        cos, sin = hf(x, positions) if module == "gemma2" else hf(x, positions, kind)
        table = ours.cos_sin_cache[positions[0]]
        torch.testing.assert_close(table[:, : d // 2], cos[0, :, : d // 2], rtol=0, atol=1e-6)
        torch.testing.assert_close(table[:, d // 2 :], sin[0, :, : d // 2], rtol=0, atol=1e-6)
        if i > 6:
            break


def _dummy_source(arch: ModelArch):
    from overnight.loader.source import ModelSource

    return ModelSource(
        kind="dummy",
        path="test",
        arch=arch,
        hf_architecture="",
        tokenizer_path=None,
        eos_token_ids=(),
        bos_token_id=None,
        config_dtype=None,
        served_name="test",
    )


def test_presets_have_the_published_sizes():
    sizes = {name: resolve_source(name, "dummy").arch.num_parameters() / 1e9 for name in PRESETS}
    assert sizes["gemma-3-27b"] == pytest.approx(27.4, abs=0.1)  # 27.0B text model + 0.4B SigLIP tower
    assert sizes["gemma-4-31b"] == pytest.approx(30.7, abs=0.1)
    assert sizes["gemma-4-26b-a4b"] == pytest.approx(25.2, abs=0.1)
    moe = resolve_source("gemma-4-26b-a4b", "dummy").arch
    # 3.8B active: embeddings are looked up, not multiplied
    active = moe.num_parameters() - moe.mlp_params() + moe.mlp_params(active_only=True)
    assert (active - moe.vocab_size * moe.hidden_size) / 1e9 == pytest.approx(3.1, abs=0.2)


def test_kv_cache_of_gemma4_counts_each_kind_and_no_shared_layer():
    arch = arch_from_hf_config(config_of("gemma4"))
    # layers 0/1 own caches (2 heads x 16, 1 head x 24); 2 and 3 read them
    assert arch.kv_bytes_per_token(4) == 2 * (2 * 16 + 1 * 24) * 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "RoPE type"),
        ({"sliding_window": None}, "sliding_window"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"intermediate_size": [80, 80, 80, 80]}, "per-layer intermediate_size"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    cfg = config_of("gemma3")
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**cfg, **change})


def test_bidirectional_gemma3_is_an_encoder_and_other_families_are_refused():
    """EmbeddingGemma (models/gemma_encoder.py): the encoder engine runs it, with its windows."""
    arch = arch_from_hf_config({**config_of("gemma3"), "use_bidirectional_attention": True})
    assert arch.is_encoder and arch.layer_types and arch.sliding_window
    with pytest.raises(ModelLoadError, match="bidirectional"):
        arch_from_hf_config({**config_of("gemma2"), "use_bidirectional_attention": True})


def test_gemma4_shared_layers_need_an_earlier_layer_of_their_kind():
    cfg = config_of("gemma4")
    cfg["layer_types"] = ["full_attention", "full_attention", "sliding_attention", "full_attention"]
    cfg["per_layer_config"] = {str(i): {"head_dim": 24, "num_key_value_heads": 1} for i in (0, 1, 3)}
    with pytest.raises(ModelLoadError, match="no earlier sliding_attention"):
        arch_from_hf_config(cfg)


def test_a_checkpoint_missing_tensors_is_refused_by_name():
    arch = arch_from_hf_config(config_of("gemma4"))
    model = build_model(_dummy_source(arch), torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match=r"missing tensors: .*layer_scalar"):
        load_fused_weights(model, [("model.embed_tokens.weight", torch.zeros(arch.vocab_size, 48))])
    gemma3 = build_model(_dummy_source(arch_from_hf_config(config_of("gemma3"))), torch.float32, "cpu")
    assert isinstance(gemma3, GemmaForCausalLM)
    with pytest.raises(ModelLoadError, match="unexpected tensors: model.layers.0.self_attn.v_norm"):
        gemma3.load_weights([("model.layers.0.self_attn.v_norm.weight", torch.zeros(16))])


def test_multimodal_names_map_to_the_text_model():
    names = [
        "language_model.model.layers.0.mlp.up_proj.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.model.norm.weight",
        "language_model.lm_head.weight",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "model.multi_modal_projector.mm_input_projection_weight",
        "model.embed_audio.embedding_projection.weight",
        "model.layers.1.input_layernorm.weight",
    ]
    assert [n for n, _ in text_weights((n, torch.zeros(())) for n in names)] == [
        "model.layers.0.mlp.up_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.1.input_layernorm.weight",
    ]


@pytest.mark.parametrize("variant", ["gemma3", "gemma4", "gemma4-moe"])
def test_fp8_weights_land_in_each_layers_rows(variant, tmp_path):
    """quantization="fp8": every fused projection, dequantized, is the checkpoint's q/k/v (gate/up)
    stacked in order, with each Gemma 4 layer's own sizes (weights and their per-row scales alike)."""
    from overnight.loader.model_loader import load_model
    from overnight.quant.linear import Fp8Linear

    hf = tiny_gemma(variant)
    hf.save_pretrained(tmp_path)
    model = load_model(resolve_source(str(tmp_path), quantization="fp8"), torch.float32, "cpu")
    checked = 0
    for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        a, b = ours.self_attn, theirs.self_attn
        parts = [b.q_proj.weight] + ([b.k_proj.weight] if getattr(b, "k_proj", None) is not None else [])
        parts += [b.v_proj.weight] if getattr(b, "v_proj", None) is not None else []
        fused = a.qkv_proj if hasattr(a, "qkv_proj") else a.q_proj
        mlp = [theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight]
        for layer, expected in ((fused, torch.cat(parts)), (ours.mlp.gate_up_proj, torch.cat(mlp))):
            assert isinstance(layer, Fp8Linear)
            got = layer.dequantized_weight().float()
            # e4m3 keeps 3 mantissa bits: within 1/16 of each row's largest weight
            bound = expected.abs().amax(dim=1, keepdim=True) / 16
            assert ((got - expected).abs() <= bound).all()
            checked += 1
    assert checked == 8
    if variant == "gemma4-moe":  # the router stays in the compute dtype, the experts are FP8
        assert type(model.model.layers[0].router.proj) is torch.nn.Linear
        assert model.model.layers[0].experts.gate_up_proj.dtype == torch.float8_e4m3fn


def test_kv_shared_layers_read_their_source_layers_cache():
    """Gemma 4's KV-shared layers pass no K/V and attend under their source layer's index (its cache,
    and for an FP8 cache the scales it was written with); the others write their own."""
    from overnight.loader.dummy import init_dummy_weights

    arch = arch_from_hf_config(config_of("gemma4"))
    model = build_model(_dummy_source(arch), torch.float32, "cpu")
    init_dummy_weights(model)
    calls: list[tuple[int, bool]] = []

    def attn(layer_idx, q, k, v, scale, *, layer, sinks=None):
        calls.append((layer_idx, k is None and v is None))
        return torch.zeros_like(q)

    model(torch.tensor([5, 6, 7]), torch.arange(3), attn)
    assert calls == [(0, False), (1, False), (arch.kv_source_layer(2), True), (arch.kv_source_layer(3), True)]
    assert (arch.kv_source_layer(2), arch.kv_source_layer(3)) == (0, 1)
