"""FP8 weights on a mixture-of-experts model (tiny random Qwen3-MoE, CPU): online quantization keeps the
router in the compute dtype and makes the stacked experts e4m3 with one scale per expert and row, and FP8
checkpoints in each layout load with their expert tensors dequantized with their scales and then
requantized per row (layers/moe.py's quantize_fp8_), exactly that and nothing else.

Agreement with the dequantized model (tests/test_fp8_weights.py's harness) is looser here than for dense
models: the FP8 attention's activation rounding moves router logits, and on this random 8-expert model
7.7% of the (token, layer) top-2 choices differ between the two models, each a discrete jump in that
token's MLP output. Measured (teacher-forced on the reference's greedy tokens): top-1 0.83-0.89, mean
|dlogprob| 0.16-0.33 nats; the bounds are top-1 >= 0.75 and |dlogprob| <= 0.45. Identical greedy
continuations (7-11 of 16 prompts) compound those flips and are not bounded here. The expert weights
themselves are checked bit for bit against the per-row requantization of the checkpoint's dequantized
tensors, and to within e4m3's rounding against those tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from overnight.errors import ModelLoadError
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.quant.apply import dequantize_model
from overnight.quant.fp8 import dequantize_weight, expand_block_scales, quantize_weight_per_channel
from overnight.quant.linear import Fp8Linear
from tests.fp8_checkpoints import make_fp8_checkpoint
from tests.parity_helpers import compare
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # real checkpoints and models

LAYOUTS = ("fp8-block-small", "fp8-tensor-static", "ct-channel-dynamic")
MIN_TOP1, MAX_DLOGPROB = 0.75, 0.45


def assert_agrees_with_dequantized(model: nn.Module) -> None:
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def checkpoints(moe_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8moe-ckpt")
    return {layout: make_fp8_checkpoint(moe_folder, root / layout, layout) for layout in LAYOUTS}


def test_online_quantization_keeps_the_router(moe_folder):
    source = resolve_source(str(moe_folder), quantization="fp8")
    model = load_model(source, torch.float32, "cpu")
    moe = model.model.layers[0].mlp
    assert type(moe.gate) is nn.Linear  # the router: compute dtype
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    experts = moe.experts
    arch = model.arch
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_scale.shape == (arch.num_experts, 2 * arch.moe_intermediate_size)
    assert experts.down_scale.shape == (arch.num_experts, arch.hidden_size)
    # The same weights as the float model's experts, quantized row by row.
    float_experts = (
        load_model(resolve_source(str(moe_folder)), torch.float32, "cpu").model.layers[0].mlp.experts
    )
    for e in (0, arch.num_experts - 1):
        data, scale = quantize_weight_per_channel(float_experts.down_proj[e])
        assert torch.equal(experts.down_proj[e].view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(experts.down_scale[e], scale)
    assert_agrees_with_dequantized(model)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_moe_checkpoint_requantizes_experts_per_row(checkpoints, layout):
    folder = checkpoints[layout]
    source = resolve_source(str(folder))
    scheme = source.quantization
    assert scheme is not None and scheme.prequantized
    model = load_model(source, torch.float32, "cpu")
    stored = load_file(str(folder / "model.safetensors"))
    arch = model.arch
    inter = arch.moe_intermediate_size
    experts = model.model.layers[1].mlp.experts
    for e in (0, arch.num_experts - 1):
        for proj, loaded in (
            ("gate_proj", experts.gate_up_proj[e, :inter]),
            ("up_proj", experts.gate_up_proj[e, inter:]),
            ("down_proj", experts.down_proj[e]),
        ):
            name = f"model.layers.1.mlp.experts.{e}.{proj}"
            weight, scale = stored[f"{name}.weight"], stored[f"{name}.{scheme.scale_name}"]
            assert weight.dtype == torch.float8_e4m3fn
            rows = weight.shape[0]
            if scheme.weight_block is not None:
                scale = expand_block_scales(scale, scheme.weight_block[0], rows)
            else:
                scale = scale.reshape(-1).expand(rows)
            exact = dequantize_weight(weight, scale)
            want_data, want_scale = quantize_weight_per_channel(exact)
            row0 = inter if proj == "up_proj" else 0
            scales = (
                experts.down_scale[e] if proj == "down_proj" else experts.gate_up_scale[e, row0 : row0 + rows]
            )
            assert torch.equal(loaded.view(torch.uint8), want_data.view(torch.uint8)), name
            assert torch.equal(scales, want_scale), name
            # e4m3 keeps 3 mantissa bits: the requantized weight is within half a step of each value.
            err = (loaded.float() * scales[:, None] - exact).abs()
            assert bool((err <= exact.abs() * 2**-4 + want_scale[:, None] * 2**-9).all()), name
    assert type(model.model.layers[1].mlp.gate) is nn.Linear
    assert_agrees_with_dequantized(model)


def test_missing_expert_scale_is_named(checkpoints, tmp_path):
    folder = checkpoints["fp8-block-small"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.3\.down_proj\.weight_scale_inv"):
        load_model(resolve_source(str(broken)), torch.float32, "cpu")


def test_engine_runs_an_fp8_moe_checkpoint(checkpoints, tmp_path):
    """The engine on the FP8 MoE checkpoint: its greedy tokens are the loaded model's own (the harness of
    tests/test_fp8_weights.py runs the same model outside the engine)."""
    from overnight import LLM, SamplingParams
    from tests.parity_helpers import PROMPTS, greedy_tokens

    folder = str(checkpoints["fp8-block-small"])
    llm = LLM(folder, skip_tokenizer_init=True, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20)
    assert llm.engine.config.model.quantization == "fp8"
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    model = load_model(resolve_source(folder), torch.float32, "cpu")
    assert [o.outputs[0].token_ids for o in outs] == greedy_tokens(model, PROMPTS, 4)
