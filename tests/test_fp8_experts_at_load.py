"""FP8 experts held as e4m3 from the build on (experts_fp8_at_load: quant/apply.py, layers/moe.py
store_fp8_ / load_fp8_rows_) for the families that opted in after GLM-4.5: Qwen3.5-MoE and Qwen3-Next
(their ConditionalGeneration checkpoints too), InternVL's and Qwen3-VL's Qwen3-MoE decoders and Gemma 4's
MoE.

Whatever layout the experts arrive in (per-expert tensors as transformers saves most families, stacked
[E, 2I, H] / [E, H, I] tensors as Qwen3.5's and Gemma 4's checkpoints hold them, Qwen's block-scaled FP8
checkpoints whose experts are dequantized as they load, dummy draws), the e4m3 bytes and scales equal
quantizing the float stack the model would otherwise have loaded, unsharded and as one rank's share;
and a float tensor that would land in an e4m3 parameter without the per-row quantization is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.checkpoint import copy_weight
from overnight.models.qwen3_next import Qwen3NextForCausalLM
from overnight.parallel.tp_load import load_sharded_model
from overnight.parallel.tp_shards import TPShards
from overnight.quant.fp8 import quantize_stacked_per_channel

FAMILIES = ("qwen3_5_moe", "qwen3_next", "qwen3_5_moe_vl", "internvl_moe", "gemma4_moe", "qwen3_vl_moe")
# checkpoints transformers saves with the experts stacked already
STACKED = ("gemma4_moe", "qwen3_vl_moe")
PROJECTIONS = ("gate_up_proj", "down_proj")


def _make(root: Path, family: str) -> Path:
    if family in ("qwen3_5_moe", "qwen3_next", "qwen3_5_moe_vl"):
        from tests.test_fp8_hybrid import SIZES
        from tests.tiny_hybrid import make_hybrid_model

        folder = root / family
        sizes = {**SIZES, "hidden_size": 40} if family.endswith("_vl") else SIZES  # the tower's output
        make_hybrid_model(family, 0, **sizes).save_pretrained(folder)
        return folder
    if family == "internvl_moe":
        from tests.tiny_internvl import make_internvl_checkpoint

        text = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        return Path(make_internvl_checkpoint(root / family, text={**text, "decoder_sparse_step": 1}))
    if family == "qwen3_vl_moe":
        from tests.tiny_vl import make_vl_checkpoint

        return Path(make_vl_checkpoint(root / family, "qwen3_vl_moe"))
    from tests.test_gemma import tiny_gemma

    folder = root / family
    tiny_gemma("gemma4-moe").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-at-load")
    return {family: _make(root, family) for family in FAMILIES}


def stacks(model: nn.Module) -> dict[str, Experts]:
    found = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    assert found
    return found


def assert_quantized_stacks(ours: nn.Module, dense: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each e4m3 stack of `ours` holds exactly quantize_stacked_per_channel of its float stack."""
    mine = stacks(ours)
    assert mine.keys() == dense.keys()
    for name, experts in mine.items():
        assert experts.stores_fp8, name
        for proj in PROJECTIONS:
            data, scale = quantize_stacked_per_channel(dense[name][proj])
            got = getattr(experts, proj)
            assert torch.equal(got.view(torch.uint8), data.view(torch.uint8)), (name, proj)
            assert torch.equal(getattr(experts, proj.replace("_proj", "_scale")), scale), (name, proj)


def float_stacks(model: nn.Module, shards: TPShards | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """{stack: {projection: its float stack (or `shards`' share of it)}}."""
    out = {}
    for name, experts in stacks(model).items():
        out[name] = {}
        for proj in PROJECTIONS:
            t = getattr(experts, proj).detach()
            out[name][proj] = t if shards is None else shards.shard(f"{name}.{proj}", t)
    return out


def stacked_copy(folder: Path, dst: Path) -> Path:
    """`folder` with each layer's per-expert tensors replaced by transformers 5's stacked ones
    (mlp.experts.gate_up_proj [E, 2I, H] = [gate | up] rows, mlp.experts.down_proj [E, H, I])."""
    tensors = load_file(str(folder / "model.safetensors"))
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[-1] == "weight" and parts[-3].isdigit():
            stack = ".".join(parts[: parts.index("experts") + 1])
            per_expert.setdefault(stack, {}).setdefault(int(parts[-3]), {})[parts[-2]] = t
        else:
            out[name] = t
    assert per_expert, "no per-expert tensors to stack"
    for stack, experts in per_expert.items():
        order = [experts[e] for e in sorted(experts)]
        out[f"{stack}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in order])
        out[f"{stack}.down_proj"] = torch.stack([x["down_proj"] for x in order])
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    for extra in folder.iterdir():
        if extra.name != "model.safetensors" and extra.is_file():
            (dst / extra.name).write_bytes(extra.read_bytes())
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_loads_the_quantized_float_stack(folders, tmp_path, family):
    """Per-expert and stacked checkpoints, unsharded and as rank 1 of 2: the e4m3 experts (e4m3 from the
    meta build on) hold the float model's stacks quantized per row, bit for bit."""
    folder = folders[family]
    fp8 = resolve_source(str(folder), quantization="fp8")
    meta = next(iter(stacks(build_model(fp8, torch.float32, "meta")).values()))
    assert meta.stores_fp8 and meta.compute_dtype == torch.float32
    whole = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    dense = float_stacks(whole)
    layouts = [folder]
    if family not in STACKED:
        layouts.append(stacked_copy(folder, tmp_path / "stacked"))
        stacked_float = load_model(resolve_source(str(layouts[1])), torch.float32, "cpu")
        assert all(
            torch.equal(a, b)
            for a, b in zip(whole.state_dict().values(), stacked_float.state_dict().values())
        )
    shards = TPShards(fp8.arch, 1, 2)
    share = float_stacks(whole, shards)
    for layout in layouts:
        source = resolve_source(str(layout), quantization="fp8")
        assert_quantized_stacks(load_model(source, torch.float32, "cpu"), dense)
        assert_quantized_stacks(load_sharded_model(source, torch.float32, "cpu", 1, 2), share)


def _not_at_load(monkeypatch):
    """The path before experts_fp8_at_load: float stacks, quantized once loaded (quantize_experts)."""
    monkeypatch.setattr(Qwen3NextForCausalLM, "experts_fp8_at_load", False, raising=False)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_block_fp8_checkpoint_experts_match_quantizing_the_loaded_stack(
    folders, tmp_path, monkeypatch, family
):
    """Qwen's published FP8 layout (128 x 128 blocks, bf16 weight_scale_inv): the experts, dequantized as
    they load and quantized per row into the e4m3 stack, equal the stack loaded dequantized and then
    quantized (the path before the opt-in)."""
    from tests.test_fp8_hybrid import make_fp8_hybrid_checkpoint

    ckpt = make_fp8_hybrid_checkpoint(folders[family], tmp_path / "fp8")
    stored = load_file(str(ckpt / "model.safetensors"))
    assert stored["model.layers.0.mlp.experts.1.up_proj.weight"].dtype == torch.float8_e4m3fn
    source = resolve_source(str(ckpt))
    ours = load_model(source, torch.float32, "cpu")
    with monkeypatch.context() as m:
        _not_at_load(m)
        before = load_model(source, torch.float32, "cpu")
    for name, experts in stacks(before).items():
        mine = stacks(ours)[name]
        for proj in PROJECTIONS:
            a, b = getattr(mine, proj), getattr(experts, proj)
            assert a.dtype == b.dtype == torch.float8_e4m3fn
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, proj)
            scale = proj.replace("_proj", "_scale")
            assert torch.equal(getattr(mine, scale), getattr(experts, scale)), (name, proj)


@pytest.mark.parametrize("family", ["qwen3_next", "internvl_moe", "gemma4_moe"])
def test_dummy_experts_are_the_float_dummy_quantized(folders, family):
    folder = str(folders[family])
    dummy = resolve_source(folder, load_format="dummy")
    fp8 = resolve_source(folder, load_format="dummy", quantization="fp8")
    whole = load_model(dummy, torch.float32, "cpu", seed=3)
    assert_quantized_stacks(load_model(fp8, torch.float32, "cpu", seed=3), float_stacks(whole))
    rank1 = load_sharded_model(fp8, torch.float32, "cpu", 1, 2, seed=3)
    assert_quantized_stacks(rank1, float_stacks(whole, TPShards(fp8.arch, 1, 2)))


def test_a_float_tensor_is_never_cast_into_an_e4m3_parameter(folders):
    """A stacked float tensor for an e4m3 stack that has no per-row path, a float tensor for an FP8
    linear that skipped the checkpoint conversion, and e4m3 expert bytes without their scales are
    refused by name, not copied (a cast without a scale is off by the scale's factor)."""

    class Holder(nn.Module):  # e4m3 like an at-load stack, but not an Experts: no load_fp8_rows_
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(
                torch.zeros(2, 4, 3, dtype=torch.float8_e4m3fn), requires_grad=False
            )

    root = nn.Module()
    root.experts = Holder()
    stacked = torch.randn(2, 4, 3)
    with pytest.raises(ModelLoadError, match="experts.gate_up_proj .* no quantization path"):
        copy_weight(
            root, "experts.gate_up_proj", "experts.gate_up_proj", root.experts.gate_up_proj.data, stacked
        )

    model = load_model(resolve_source(str(folders["qwen3_5_moe"]), quantization="fp8"), torch.float32, "cpu")
    q = model.model.layers[1].self_attn.q_proj
    assert q.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(ModelLoadError, match="q_proj.weight .* no quantization path"):
        model.load_weights([("model.layers.1.self_attn.q_proj.weight", torch.randn(q.weight.shape))])
    experts = model.model.layers[0].mlp.experts
    raw = experts.gate_up_proj.detach().clone()
    with pytest.raises(ModelLoadError, match="experts held as e4m3 while loading"):
        model.load_weights([("model.layers.0.mlp.experts.gate_up_proj", raw)])
