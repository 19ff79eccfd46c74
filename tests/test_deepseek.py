"""DeepSeek-V2 / V3 and GLM-4.7-Flash (multi-head latent attention, models/deepseek.py) end to end on the
CPU, against transformers, on tiny random checkpoints saved with save_pretrained, in three variants:

    v3     q_lora_rank, YaRN with mscale / mscale_all_dim (the scale's mscale^2), interleaved RoPE, the first
           layer dense, 8 experts top-2 in 2 groups of which 1 is chosen, a random correction bias
    v2     q_proj (no q_lora_rank), plain RoPE (V2's complex pairs), the softmax router with
           group_limited_greedy, 2 shared experts
    glm    Glm4MoeLiteForCausalLM: mlp_layer_types, rotate-half RoPE (rope_interleave false), one group

Checked: greedy tokens identical to transformers' in fp32 through chunked prefills (16-token budget, so
chunks attend to cached latents) and prefix-cache hits; a pool too small for every request (preemptions
and recomputation); the cache holds one 40-value row per token and layer (kv_lora_rank 32 + rope 8);
the absorbed decode against the decompressed form on random inputs; multi-token-prediction layers
skipped; bad configs and unsupported options refused before loading; the GPU path (interpreted) against
the PyTorch path; online FP8 and a block-scaled FP8 checkpoint; TP=2 shards and tokens; the presets'
published sizes, the latent cache in `overnight budget`, and DeepSeek-V3's 671B at FP8 over 8 ranks.
The kernels themselves: tests/test_kernels_mla.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from overnight import LLM, SamplingParams
from overnight.attention.mla import latent_attention_ref, write_latent_ref
from overnight.attention.torch_backend import build_metadata
from overnight.engine.kv_groups import KVCacheLayout
from overnight.errors import ModelLoadError
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.models.deepseek import DeepseekMoE, DeepseekV2TopkRouter
from tests.parity_helpers import hf_greedy
from tests.tiny_moe import (
    ENGINE,
    check_waves_token_exact,
    load_moe_reference,
    make_moe_checkpoint,
    waves,
)

COMMON = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, mscale=1.0,
    mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
)  # fmt: skip
VARIANTS = {
    "v3": (
        "DeepseekV3",
        dict(q_lora_rank=24, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
             routed_scaling_factor=2.5, rope_parameters=YARN),
    ),
    "v2": (
        "DeepseekV2",
        dict(q_lora_rank=None, n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2,
             topk_method="group_limited_greedy", routed_scaling_factor=1.5),
    ),
    "glm": (
        "Glm4MoeLite",
        dict(q_lora_rank=24, n_shared_experts=1, mlp_layer_types=["dense", "sparse", "dense"],
             rope_interleave=False, routed_scaling_factor=1.8),
    ),
}  # fmt: skip
ROW = 32 + 8  # kv_lora_rank + qk_rope_head_dim: one cache row per token and layer


def make_checkpoint(folder: Path, variant: str, seed: int = 0) -> Path:
    family, fields = VARIANTS[variant]
    return make_moe_checkpoint(folder, family, {**COMMON, **fields}, seed)


def load_reference(folder: Path, variant: str):
    return load_moe_reference(folder, VARIANTS[variant][0])


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    return request.param, folder, load_reference(folder, request.param)


def test_engine_greedy_token_exact(variant):
    """Token-exact with transformers in fp32, through 16-token prefill chunks and prefix-cache hits."""
    name, folder, ref = variant
    llm = LLM(str(folder), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    arch = model.arch
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in model.model.layers] == [
        False,
        True,
        name != "glm",
    ]
    assert isinstance(model.model.layers[1].mlp.gate, DeepseekV2TopkRouter) == (name == "v2")
    assert (model.model.layers[0].self_attn.q_proj is None) == (name != "v2")
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    sparse = sum(arch.is_moe_layer(i) for i in range(3))
    buffers = 0 if name == "v2" else sparse * arch.num_experts  # HF's correction bias is a buffer
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters()) + buffers
    # One row of kv_lora_rank + rope values per token and layer, one plane: no V, no per-head K.
    assert arch.kv_bytes_per_token(4) == 3 * ROW * 4
    caches = llm.engine.runner.kv_caches  # type: ignore[attr-defined]
    assert caches[0].shape[0] == 1 and caches[0].shape[2:] == (4, 1, ROW)
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))


def test_preemption_on_a_small_pool_matches_transformers(tmp_path):
    """A pool of 24 blocks of 4 tokens for four requests growing to 40+ tokens each: running requests
    are preempted and recomputed, their tokens unchanged."""
    folder = make_checkpoint(tmp_path / "v3", "v3")
    ref = load_reference(folder, "v3")
    layout = KVCacheLayout.from_arch(resolve_source(str(folder)).arch, 128)
    assert layout.planes == 1 and layout.tensor_elems == (ROW,) * 3
    block = 4 * layout.token_elems * 4  # 4 tokens x one row of each layer x fp32
    engine = {
        **ENGINE,
        "kv_cache_memory_bytes": 24 * block,
        "admission": "greedy",
        "schedule": "fifo",
        "max_model_len": 64,
    }
    llm = LLM(str(folder), **engine)
    assert llm.engine.pool_plan.num_blocks == 24  # type: ignore[attr-defined]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(k)] for k in (17, 23, 30, 9)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions_total > 0  # type: ignore[attr-defined]
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, 24)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_absorbed_decode_equals_decompressed_attention(dtype):
    """The same single-token queries as decodes (W_UK absorbed into q, MQA over the latent rows, W_UV
    after) and as one-token prefill chunks (the rows decompressed to per-head K and V): equal outputs,
    over random rows, block tables with gaps, and contexts of different lengths."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, rank, v_dim, block = 6, 16, 8, 32, 12, 4
    seq_lens = [1, 7, 13, 22]
    tables = [[9], [3, 5], [0, 2, 8, 11], [1, 4, 6, 7, 10, 12]]
    cache = torch.randn(1, 16, block, 1, rank + rope, generator=gen, dtype=dtype)
    w_kv_b = torch.randn(heads * (nope + v_dim), rank, generator=gen, dtype=dtype) / rank**0.5
    w_uk, w_uv = w_kv_b.view(heads, -1, rank).split([nope, v_dim], dim=1)
    n = len(seq_lens)
    q_nope = torch.randn(n, heads, nope, generator=gen, dtype=dtype)
    q_pe = torch.randn(n, heads, rope, generator=gen, dtype=dtype)
    rows = torch.randn(n, rank + rope, generator=gen, dtype=dtype)
    outs = []
    for num_decodes in (n, 0):
        meta = build_metadata([1] * n, seq_lens, tables, block, num_decodes=num_decodes)
        c = cache.clone()
        write_latent_ref(rows, c, meta.slot_mapping)
        outs.append(latent_attention_ref(q_nope, q_pe, c, meta, 0.2, w_uk, w_uv))
    assert outs[0].shape == (n, heads, v_dim) and outs[0].abs().max() > 0.1
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    # The rows were written where slot_mapping says: position p of request i at its table's block.
    meta = build_metadata([1] * n, seq_lens, tables, block, num_decodes=n)
    c = cache.clone()
    write_latent_ref(rows, c, meta.slot_mapping)
    p = seq_lens[3] - 1
    assert torch.equal(c[0, tables[3][p // block], p % block, 0], rows[3])


def test_mtp_layers_are_skipped(tmp_path):
    """A checkpoint with a multi-token-prediction layer (model.layers.3.*, past num_hidden_layers) loads
    the same model."""
    folder = make_checkpoint(tmp_path / "v3", "v3")
    mtp_folder = tmp_path / "mtp"
    shutil.copytree(folder, mtp_folder)
    tensors = load_file(mtp_folder / "model.safetensors")
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, mtp_folder / "model.safetensors")
    a = dict(load_model(resolve_source(str(mtp_folder)), torch.float32, "cpu").named_parameters())
    b = dict(load_model(resolve_source(str(folder)), torch.float32, "cpu").named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"kv_lora_rank": None}, "lacks required field 'kv_lora_rank'"),
        ({"qk_rope_head_dim": 7}, "even qk_rope_head_dim"),
        ({"n_group": 3}, "n_group 3 must split n_routed_experts 8"),
        ({"scoring_func": "softmax"}, "unsupported scoring_func"),
    ],
)
def test_bad_configs_are_refused(tmp_path, change, message):
    folder = make_checkpoint(tmp_path / "v3", "v3")
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        cfg.pop(key, None)
        if value is not None:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


def test_unsupported_options_are_refused_before_loading(tmp_path):
    folder = make_checkpoint(tmp_path / "v2", "v2")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "topk_method": "noaux_tc"}))
    with pytest.raises(ModelLoadError, match="unsupported topk_method 'noaux_tc'"):
        resolve_source(str(folder))
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3 does not divide.*num_attention_heads 4"):
        LLM(str(folder), **{**ENGINE, "tensor_parallel_size": 3})


@pytest.mark.slow  # the fused MoE and router kernels through the Triton interpreter
def test_forward_with_kernels_matches_pytorch_path(tmp_path, monkeypatch):
    """The GPU path (Triton backend: latent write, batched prefill and absorbed decode kernels; RMSNorm,
    RoPE, grouped router and fused-MoE kernels), interpreted on the CPU, against the PyTorch path on the
    same V3 model with kernel-sized widths (rope 16): a prefill of two requests and a decode step of both."""
    from overnight.attention.triton_backend import TritonAttentionBackend
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE, run_steps

    monkeypatch.setitem(VARIANTS, "v3k", ("DeepseekV3", {**VARIANTS["v3"][1], "qk_rope_head_dim": 16}))
    folder = make_checkpoint(tmp_path / "v3k", "v3k")
    model = load_model(resolve_source(str(folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    for prefill_kernel in (False, True):  # prefills decompressed (mla_prefill.py), or absorbed in the kernel
        backend = TritonAttentionBackend(
            4, 4, 16, max_num_seqs=4, max_model_len=64, device=DEVICE, mla_prefill_kernel=prefill_kernel
        )
        got = run_steps(model, backend=backend)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


# -- FP8 ---------------------------------------------------------------------------------------------------

# Measured on the v3 checkpoint: FP8 activations in the two-step q path and the normalized latent move
# the logits more than GLM-4.5's q/k/v do (tests/test_glm4_moe.py: 0.75 / 0.45): 0.89 / 0.55 against
# the dequantized model, 0.94 / 0.16 with the attention projections left in float.
MIN_TOP1, MAX_DLOGPROB = 0.75, 0.8


def _assert_fp8_layout(model) -> None:
    from overnight.quant.linear import Fp8Linear

    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert isinstance(getattr(attn, name), Fp8Linear), name
    # kv_b_proj is read as W_UK / W_UV (attention/mla.py): kept in the compute dtype, as is the router
    assert not isinstance(attn.kv_b_proj, Fp8Linear) and attn.kv_b_proj.weight.dtype == torch.float32
    assert moe.gate.weight.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert isinstance(moe.shared_experts.down_proj, Fp8Linear)


def test_online_fp8(tmp_path):
    import copy

    from overnight.quant.apply import dequantize_model
    from tests.parity_helpers import compare

    folder = make_checkpoint(tmp_path / "v3", "v3")
    model = load_model(resolve_source(str(folder), quantization="fp8"), torch.float32, "cpu")
    _assert_fp8_layout(model)
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree


def test_block_fp8_checkpoint_loads_and_runs(tmp_path):
    """DeepSeek-V3's published format (quant_method fp8, block scales named weight_scale_inv, router and
    correction bias in float): kv_b_proj and the experts dequantized as they load, the engine's tokens
    the loaded model's own, near the float model."""
    from tests.fp8_checkpoints import make_fp8_checkpoint
    from tests.parity_helpers import PROMPTS, compare, greedy_tokens

    folder = make_checkpoint(tmp_path / "v3", "v3")
    fp8 = make_fp8_checkpoint(folder, tmp_path / "fp8", "fp8-block-small")
    stored = load_file(str(fp8 / "model.safetensors"))
    assert stored["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert (
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in stored
    )  # 40 rows: a partial block
    model = load_model(resolve_source(str(fp8)), torch.float32, "cpu")
    _assert_fp8_layout(model)
    agree = compare(model, load_model(resolve_source(str(folder)), torch.float32, "cpu"))
    assert agree.top1 >= 0.6 and agree.mean_dlogprob <= 1.2, agree  # weights and activations in FP8
    llm = LLM(
        str(fp8), skip_tokenizer_init=True, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20
    )
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:6]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_tokens(model, PROMPTS[:6], 4)


# -- tensor parallelism --------------------------------------------------------------------------------


def test_tp_shards_equal_slices_of_the_whole_model(tmp_path):
    """Loading rank by rank gives each rank the weights apply_tp cuts from the whole model: q_b / kv_b
    rows and o_proj columns of its heads, the latent projections and norms whole, experts and shared
    experts by their intermediate sizes; the latent cache row stays whole on every rank."""
    from overnight.parallel.tp_load import load_sharded_model
    from overnight.parallel.tp_shards import TPShards
    from tests.fp8_checkpoints import make_fp8_checkpoint
    from tests.tp_helpers import streamed_equals_sliced

    for variant in ("v3", "v2"):
        source = resolve_source(str(make_checkpoint(tmp_path / variant, variant)))
        for rank in range(2):
            model = streamed_equals_sliced(source, rank)
            attn = model.model.layers[1].self_attn
            assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape == (2 * (16 + 16), 32)
            assert attn.kv_a_proj_with_mqa.weight.shape == (ROW, 64)
            assert attn.o_proj.weight.shape == (64, 2 * 16)
            q = attn.q_proj if variant == "v2" else attn.q_b_proj
            assert q.weight.shape[0] == 2 * (16 + 8)
        local = TPShards(source.arch, 0, 2).local_arch
        assert KVCacheLayout.from_arch(local).tensor_elems == (ROW,) * 3  # replicated latent rows
    # A block-scaled FP8 checkpoint, rank by rank: each head's rows of q_b_proj with their scales, its
    # rows of the dequantized kv_b_proj, the same values as slicing the whole loaded model.
    fp8 = resolve_source(str(make_fp8_checkpoint(tmp_path / "v3", tmp_path / "fp8", "fp8-block-small")))
    whole = load_model(fp8, torch.float32, "cpu").model.layers[1].self_attn
    for rank in range(2):
        attn = load_sharded_model(fp8, torch.float32, "cpu", rank, 2).model.layers[1].self_attn
        rows = slice(rank * 48, (rank + 1) * 48)
        assert torch.equal(
            attn.q_b_proj.weight.view(torch.uint8), whole.q_b_proj.weight[rows].view(torch.uint8)
        )
        assert torch.equal(attn.q_b_proj.weight_scale, whole.q_b_proj.weight_scale[rows])
        assert torch.equal(attn.kv_b_proj.weight, whole.kv_b_proj.weight[rank * 64 : (rank + 1) * 64])


@pytest.mark.slow  # starts tensor-parallel processes
def test_tp2_matches_tp1(tmp_path):
    from tests.tp_helpers import generate_split

    folder = make_checkpoint(tmp_path / "v3", "v3")
    first, second = waves(384)
    prompts = first + second
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    one = LLM(str(folder), **ENGINE).generate(prompts, params, use_tqdm=False)
    two = generate_split(folder, prompts, params, **ENGINE)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


# -- presets and the memory budget ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,total,active",
    [
        ("deepseek-v2-lite", (15.6e9, 15.8e9), (2.3e9, 2.5e9)),
        ("moonlight-16b-a3b", (15.9e9, 16.1e9), (2.5e9, 3.0e9)),
    ],
)
def test_presets_have_published_sizes(name, total, active):
    """The model cards' sizes: DeepSeek-V2-Lite 15.7B (2.4B active), Moonlight 16B ("3B activated");
    active here counts one of the two vocabulary tables (2.45B and 2.58B)."""
    from overnight.loader.model_loader import build_model

    source = resolve_source(name, load_format="dummy")
    arch = source.arch
    assert (arch.kv_lora_rank, arch.qk_rope_head_dim, arch.q_lora_rank) == (512, 64, 0)
    model = build_model(source, torch.bfloat16, "meta")
    count = sum(p.numel() for p in model.parameters())
    assert count == arch.num_parameters() and total[0] < count < total[1]
    used = count - arch.mlp_params() + arch.mlp_params(active_only=True) - arch.vocab_size * arch.hidden_size
    assert active[0] < used < active[1]


def test_budget_counts_the_latent_cache_on_an_h200():
    """`overnight budget` for DeepSeek-V2-Lite on one H200 in bf16: 576 values per token and layer
    (31 KB a token), not 16 heads x (192 + 128) of per-head K and V (276 KB): about 3.2M tokens of pool,
    395 sequences of 8K."""
    from overnight.options import EngineOptions
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget, render

    h200 = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))
    source = resolve_source("deepseek-v2-lite", load_format="dummy")
    opts = EngineOptions(model="deepseek-v2-lite", load_format="dummy", dtype="bfloat16", max_model_len=8192)
    b = plan_budget(opts, source, h200)
    assert b.kv_bytes_per_token == 27 * (512 + 64) * 2
    assert 27 * 16 * (192 + 128) * 2 > 8 * b.kv_bytes_per_token
    assert 29 * GIB < b.weights_bytes < 30 * GIB
    assert b.num_blocks * b.block_size > 3_000_000 and b.seqs_fit >= 350
    text = render(b, "deepseek-v2-lite", source.arch, "bfloat16")
    assert "27 layers x one row of 512 latent + 64 rope values" in text


def test_deepseek_v3_counts_671b_and_fits_eight_h200_in_fp8():
    """DeepSeek-V3's config.json shapes (no preset: its 671B are for tensor parallelism over 8 GPUs):
    671B parameters, 37B active (the model card's numbers, without the MTP layer), a latent cache of
    70 KB a token (71x smaller than 128 heads of per-head K and V), and each of 8 ranks holding about
    80 GiB of FP8 weights (kv_b_proj and the routers in bf16 / float32)."""
    from overnight.models.registry import arch_from_hf_config
    from overnight.parallel.tp_shards import TPShards

    yarn = dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0, type="yarn",
                original_max_position_embeddings=4096)  # fmt: skip
    v3 = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
        intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
        first_k_dense_replace=3, n_group=8, topk_group=4, vocab_size=129280, max_position_embeddings=163840,
        rope_theta=10000, rope_scaling=yarn, routed_scaling_factor=2.5, scoring_func="sigmoid",
        topk_method="noaux_tc", num_nextn_predict_layers=1,
    )  # fmt: skip
    arch = arch_from_hf_config(v3)
    assert 670.5e9 < arch.num_parameters() < 671.5e9
    assert 37e9 < arch.num_parameters() - arch.mlp_params() + arch.mlp_params(active_only=True) < 38e9
    assert arch.kv_bytes_per_token(2) == 61 * 576 * 2 and 61 * 128 * 320 * 2 > 70 * arch.kv_bytes_per_token(2)
    rank = TPShards(arch, 0, 8).rank_weights_arch
    assert 78 * 2**30 < rank.weight_bytes(2, fp8_linear=True, fp8_experts=True) < 82 * 2**30
