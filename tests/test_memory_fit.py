"""The weights are checked against the device's free memory before any is allocated:
a model too large stops with a sentence that says what would fit."""

from __future__ import annotations

import pytest
import torch

import overnight.loader.fit as fit
from overnight.arch import ModelArch
from overnight.errors import ConfigError
from overnight.loader.resolve import resolve_source

GIB = 2**30


def qwen3_8b() -> ModelArch:
    return resolve_source("qwen3-8b", "dummy").arch


def test_weight_bytes_is_parameters_times_dtype_size():
    arch = qwen3_8b()
    assert 8.1e9 < arch.num_parameters() < 8.3e9
    assert fit.weight_bytes(arch, torch.float32) == 4 * arch.num_parameters()
    assert fit.weight_bytes(arch, torch.bfloat16) == 2 * arch.num_parameters()


def test_too_large_names_the_gap_and_what_fits(monkeypatch):
    arch = qwen3_8b()
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: 20 * GIB)
    with pytest.raises(ConfigError) as info:
        fit.check_weights_fit(arch, torch.float32, torch.device("cpu"), "qwen3-8b")
    msg = str(info.value)
    assert "qwen3-8b does not fit" in msg and "30.5 GiB in float32" in msg and "20.0 GiB free" in msg
    assert "--dtype bfloat16 (15.3 GiB)" in msg and "a smaller model" in msg
    # Enough memory: no error; bf16 at 20 GiB fits.
    fit.check_weights_fit(arch, torch.bfloat16, torch.device("cpu"), "qwen3-8b")
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: None)  # unknown: no check
    fit.check_weights_fit(arch, torch.float32, torch.device("cpu"), "qwen3-8b")


def test_nothing_fits_says_so(monkeypatch):
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: 4 * GIB)
    with pytest.raises(ConfigError) as info:
        fit.check_weights_fit(qwen3_8b(), torch.float32, torch.device("cpu"), "qwen3-8b")
    assert "--dtype" not in str(info.value) and "a smaller model" in str(info.value)


def test_cpu_available_memory_is_read():
    free = fit.available_memory_bytes(torch.device("cpu"))
    assert free is not None and free > 0


def test_llm_stops_before_any_weight_is_allocated(monkeypatch):
    import overnight.loader.model_loader as model_loader
    from overnight import LLM

    def no_load(*a, **k):
        raise AssertionError("the weights must not start loading")

    monkeypatch.setattr(model_loader, "load_model", no_load)
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: 2 * GIB)
    with pytest.raises(ConfigError, match="qwen3-8b does not fit"):
        LLM("qwen3-8b", load_format="dummy", device="cpu")


def test_fp8_weights_are_counted_and_suggested_on_hopper(monkeypatch):
    arch = qwen3_8b()
    fp8 = fit.weight_bytes(arch, torch.bfloat16, fp8_linear=True)
    # the projections take a byte each (plus a scale per row); embeddings and the LM head stay bf16
    assert 0.5 * fit.weight_bytes(arch, torch.bfloat16) < fp8 < 0.65 * fit.weight_bytes(arch, torch.bfloat16)
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: 12 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError) as info:
        fit.check_weights_fit(arch, torch.bfloat16, gpu, "qwen3-8b")
    assert f"--quantization fp8 ({fp8 / GIB:.1f} GiB)" in str(info.value)
    fit.check_weights_fit(arch, torch.bfloat16, gpu, "qwen3-8b", fp8_linear=True)  # fits as FP8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # no FP8 cores
    with pytest.raises(ConfigError) as info:
        fit.check_weights_fit(arch, torch.bfloat16, gpu, "qwen3-8b")
    assert "--quantization" not in str(info.value)


MOE_PRESETS = (
    "qwen3-30b-a3b", "qwen3.5-35b-a3b", "glm-4.5-air", "minimax-m2", "gemma-4-26b-a4b", "deepseek-v2-lite",
    "moonlight-16b-a3b",
)  # fmt: skip


def _expert_bytes(arch: ModelArch) -> tuple[int, int]:
    """(the experts' parameters, their FP8 per-row scales' bytes)."""
    experts = sum(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers)) * arch.num_experts
    params = experts * 3 * arch.hidden_size * arch.moe_intermediate_size
    return params, experts * 4 * (2 * arch.moe_intermediate_size + arch.hidden_size)


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_fp8_moe_experts_count_as_fp8_while_loading(preset):
    """Every MoE family holds its FP8 experts as e4m3 from the start (experts_fp8_at_load): the fit
    check counts for the load what stays once loaded. (gpt-oss keeps its MXFP4 experts either way.)"""
    arch = resolve_source(preset, "dummy").arch
    assert fit._experts_fp8_at_load(arch), preset
    bf16 = fit.weight_bytes(arch, torch.bfloat16)
    loading = fit.weight_bytes(arch, torch.bfloat16, fp8_linear=True)
    assert loading == fit.weight_bytes(arch, torch.bfloat16, fp8_linear=True, loaded=True)
    assert 0.4 * bf16 < loading < 0.65 * bf16, preset


def test_gpt_oss_alone_loads_its_experts_in_the_compute_dtype():
    """Every MoE family holds its FP8 experts as e4m3 while loading unless it opts out; gpt-oss does
    (models/gpt_oss.py says why), so its dense experts count in the compute dtype for the load."""
    arch = resolve_source("gpt-oss-20b", "dummy").arch
    assert arch.num_experts and not fit._experts_fp8_at_load(arch)


def test_experts_loaded_in_the_compute_dtype_count_so(monkeypatch):
    """A family that loads its experts in the compute dtype and quantizes them afterwards (gpt-oss's
    dense-expert forms; here Qwen3.5-MoE made one by its class attribute): the fit check counts the load (experts in bf16), the pool plan what
    stays (experts in FP8: one byte instead of two, plus the scales)."""
    from overnight.models.qwen3_next import Qwen3NextForCausalLM

    arch = resolve_source("qwen3.5-35b-a3b", "dummy").arch
    at_load = fit.weight_bytes(arch, torch.bfloat16, fp8_linear=True)
    monkeypatch.setattr(Qwen3NextForCausalLM, "experts_fp8_at_load", False, raising=False)
    loading = fit.weight_bytes(arch, torch.bfloat16, fp8_linear=True)
    loaded = fit.weight_bytes(arch, torch.bfloat16, fp8_linear=True, loaded=True)
    params, scale_bytes = _expert_bytes(arch)
    assert loading - loaded == params - scale_bytes and loaded == at_load


# Qwen3-Next-80B-A3B-Instruct's config.json (the fields overnight reads)
QWEN3_NEXT_80B = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_theta=10000000, partial_rotary_factor=0.25, full_attention_interval=4,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, decoder_sparse_step=1, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
    mlp_only_layers=[],
)  # fmt: skip


def test_qwen3_next_80b_in_fp8_fits_one_h200(tmp_path, monkeypatch):
    """80B parameters, 77B of them experts: ~75 GiB in FP8 with the experts e4m3 from the load on, so one
    H200 (~139 GiB free) takes it; loading the experts in bf16 first (~146 GiB) would not."""
    import json

    from overnight.models.qwen3_next import Qwen3NextForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_80B))
    arch = resolve_source(str(tmp_path), "dummy").arch
    assert 79e9 < arch.num_parameters() < 82e9
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: int(139.3 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = torch.device("cuda", 0)
    fp8 = fit.weight_bytes(arch, torch.bfloat16, fp8_linear=True)
    assert 70 * GIB < fp8 < 80 * GIB
    fit.check_weights_fit(arch, torch.bfloat16, gpu, "qwen3-next-80b", fp8_linear=True)
    monkeypatch.setattr(Qwen3NextForCausalLM, "experts_fp8_at_load", False, raising=False)
    with pytest.raises(ConfigError, match="does not fit"):
        fit.check_weights_fit(arch, torch.bfloat16, gpu, "qwen3-next-80b", fp8_linear=True)


def test_a_rank_share_counts_what_the_rank_really_holds(monkeypatch):
    """Under tensor parallelism a rank holds more than 1/tp of the weights where parts are replicated
    (KV heads when there are fewer than ranks, norms): qwen3-8b over 16 GPUs, 0.954 GiB by division but
    0.989 GiB on rank 0 (TPShards.rank_weights_arch, what apply_tp leaves). A GPU with 0.97 GiB free
    passes the division and must fail the real share."""
    from overnight.parallel.tp_shards import TPShards

    arch = resolve_source("qwen3-8b", "dummy").arch
    rank_arch = TPShards(arch, 0, 16).rank_weights_arch
    divided = fit.weight_bytes(arch, torch.bfloat16) / 16
    held = fit.weight_bytes(rank_arch, torch.bfloat16)
    assert divided < 0.97 * GIB < held
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: int(0.97 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 16)
    gpu = torch.device("cuda", 0)
    fit.check_weights_fit(arch, torch.bfloat16, gpu, "qwen3-8b", 16)  # the division alone: fits
    with pytest.raises(ConfigError, match="a 1/16 share"):
        fit.check_weights_fit(arch, torch.bfloat16, gpu, "qwen3-8b", 16, rank_arch=rank_arch)
