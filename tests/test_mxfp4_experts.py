"""MXFP4 experts held dense (the mxfp4_experts option, loader/expert_form.py): the form "auto" picks for a
model and a GPU size, the bytes the memory checks count, and the dequantized-at-load model against the
packed one on the CPU tiny gpt-oss checkpoints (tests/test_gpt_oss.py's builders): MXFP4 values are exact
in fp32, and the CPU path of the packed model dequantizes the same rows per step, so the two agree to the
bit; under tensor parallelism each rank dequantizes its own share.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ConfigError
from overnight.loader.expert_form import choose_expert_form
from overnight.loader.fit import DENSE_FRACTION
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import PRESETS_DIR, resolve_source
from overnight.models.registry import arch_from_hf_config
from overnight.options import EngineOptions
from tests.test_gpt_oss import _config, _prompts, _spread, _write, write_mxfp4

GIB = 2**30
H100 = 80 * 10**9  # bytes an 80-GB H100 reports: 79.2 GiB
H200 = 141 * 10**9


def _preset(name: str):
    cfg = json.loads((Path(PRESETS_DIR) / f"{name}.json").read_text())
    cfg["rope_scaling"] = None  # the byte count does not depend on RoPE
    return arch_from_hf_config(cfg)


@pytest.mark.parametrize(
    ("model", "device", "tp", "dense"),
    [
        ("gpt-oss-20b", H100, 1, True),  # 39 GiB in bf16: 49% of the H100
        ("gpt-oss-20b", H200, 1, True),
        ("gpt-oss-20b", 40 * 10**9, 1, False),  # an A100-40GB: packed
        ("gpt-oss-20b", 40 * 10**9, 2, True),  # half the model a GPU
        ("gpt-oss-120b", H200, 1, False),  # 218 GiB in bf16
        ("gpt-oss-120b", H100, 8, True),  # 27 GiB a GPU
        ("gpt-oss-120b", H100, 4, False),  # 55 GiB a GPU: 68%
        ("gpt-oss-20b", None, 1, False),  # the CPU keeps them packed
    ],
)
def test_auto_form_by_model_and_memory(model, device, tp, dense):
    arch = _preset(model)
    form = choose_expert_form(arch, "auto", 2, device, tp)
    assert form.arch.experts_mxfp4_dense == dense
    assert form.arch.holds_mxfp4_experts == (not dense)
    assert ("dequantized" in form.reason) == dense
    if device is not None:  # the rule itself, from the bytes
        share = replace(arch, experts_mxfp4_dense=True).weight_bytes(2) / tp
        assert (share <= DENSE_FRACTION * device) == dense


def test_explicit_forms_and_refusals():
    arch = _preset("gpt-oss-120b")
    assert choose_expert_form(arch, "dense", 2, H100).arch.experts_mxfp4_dense  # the user's call
    assert not choose_expert_form(_preset("gpt-oss-20b"), "mxfp4", 2, H200).arch.experts_mxfp4_dense
    dense_model = replace(arch, experts_mxfp4=False)
    assert choose_expert_form(dense_model, "auto", 2, H100).arch == dense_model
    for choice in ("dense", "mxfp4"):
        with pytest.raises(ConfigError, match="experts are not MXFP4"):
            choose_expert_form(dense_model, choice, 2, H100)
    with pytest.raises(ConfigError, match="mxfp4_experts must be one of auto, mxfp4, dense"):
        EngineOptions(mxfp4_experts="bf16")


def test_budget_counts_the_form_held():
    """`overnight budget` and the weight-fit check read the resolved arch: dense experts count their
    compute-dtype bytes, packed ones half a byte and a scale per 32."""
    from overnight.build import resolve_model
    from overnight.tools.budget import DeviceMemory, plan_budget

    gpu = DeviceMemory("H200", H200, H200)
    weights = {}
    for form in ("mxfp4", "dense"):
        opts = EngineOptions(
            model="gpt-oss-20b", load_format="dummy", mxfp4_experts=form, device="cpu", dtype="bfloat16"
        )
        source = resolve_model(opts).source
        assert source.arch.experts_mxfp4_dense == (form == "dense")
        weights[form] = plan_budget(opts, source, gpu).weights_bytes
        assert weights[form] == source.arch.weight_bytes(2)
    experts = 24 * 32 * 3 * 2880 * 2880
    assert weights["dense"] - weights["mxfp4"] == experts * 2 - experts // 2 - experts // 32
    assert 38 < weights["dense"] / GIB < 40 and 12 < weights["mxfp4"] / GIB < 14


def test_dense_model_holds_what_weight_bytes_count():
    from overnight.loader.model_loader import build_model
    from overnight.loader.source import ModelSource

    cfg = {**_config().to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    arch = replace(arch_from_hf_config(cfg), experts_mxfp4_dense=True)
    source = ModelSource("dummy", "x", arch, "GptOssForCausalLM", None, (), None, None, "x")
    model = build_model(source, torch.bfloat16, "meta")
    assert model.model.layers[0].mlp.experts.gate_up_scales is None
    assert arch.weight_bytes(2) == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """(MXFP4 folder, its dequantized float twin) of a tiny gpt-oss with 96-wide experts: 3 scale groups,
    so two tensor-parallel ranks split them 2 + 1 with a group of zero padding."""
    import transformers

    root = tmp_path_factory.mktemp("gpt-oss-dense")
    torch.manual_seed(2)
    model = transformers.GptOssForCausalLM(_config(intermediate_size=96)).eval()
    _spread(model, 2)
    return write_mxfp4(_write(root / "float", model), root)


def _dense_source(folder: Path):
    source = resolve_source(str(folder))
    return replace(source, arch=replace(source.arch, experts_mxfp4_dense=True))


def test_dense_load_equals_the_dequantized_twin(mxfp4_pair):
    """Every parameter of the model loaded dense from the MXFP4 checkpoint equals, bit for bit, that of
    the float checkpoint holding the dequantized experts; the forward matches the packed model's."""
    packed, twin = mxfp4_pair
    dense = load_model(_dense_source(packed), torch.float32, "cpu")
    reference = dict(load_model(resolve_source(str(twin)), torch.float32, "cpu").named_parameters())
    mine = dict(dense.named_parameters())
    assert mine.keys() == reference.keys()
    for name, p in mine.items():
        assert p.dtype == torch.float32 and torch.equal(p, reference[name]), name
    packed_model = load_model(resolve_source(str(packed)), torch.float32, "cpu")
    assert packed_model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.uint8
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    for a, b in zip(dense.model.layers, packed_model.model.layers, strict=True):
        assert torch.equal(a.mlp(x), b.mlp(x))


def test_dense_bf16_values_are_exact(mxfp4_pair):
    packed, twin = mxfp4_pair
    dense = load_model(_dense_source(packed), torch.bfloat16, "cpu")
    reference = load_model(resolve_source(str(twin)), torch.float32, "cpu")
    a = dense.model.layers[1].mlp.experts.down_proj
    b = reference.model.layers[1].mlp.experts.down_proj
    assert a.dtype == torch.bfloat16 and torch.equal(a.float(), b)


def test_each_rank_dequantizes_its_share(mxfp4_pair):
    """Dense experts under tensor parallelism: the packed rows are sliced (whole scale groups, rank 1's
    last one padding) and dequantized per rank; the result equals the slices of the whole dense model."""
    from tests.tp_helpers import streamed_equals_sliced

    source = _dense_source(mxfp4_pair[0])
    for rank in range(2):
        model = streamed_equals_sliced(source, rank)
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape[1] == 2 * 64
        assert (not experts.down_proj[..., 32:].any()) == (rank == 1)  # the padded group: zeros


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.slow  # engines, and tensor-parallel processes
def test_engine_forms_token_exact_and_tp2(mxfp4_pair):
    from tests.tp_helpers import generate_split

    packed, _ = mxfp4_pair
    prompts = [{"prompt_token_ids": p} for p in _prompts(256)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    expected = _tokens(LLM(str(packed), mxfp4_experts="mxfp4", **options).generate(prompts, params))
    llm = LLM(str(packed), mxfp4_experts="dense", **options)
    assert llm.engine.config.model.arch.experts_mxfp4_dense
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    two = generate_split(str(packed), prompts, params, mxfp4_experts="dense", **options)
    assert _tokens(two) == expected
