"""How a weight-only integer checkpoint is held (the int_weights option, loader/int_form.py): packed
integer layers, or dequantized at load into plain nn.Linear layers and float experts (IntScheme.dense).

Checked on the CPU:

- the auto decision, from the model's compute-dtype bytes, one GPU's memory and the tensor-parallel
  size, on both sides of loader/fit.DENSE_FRACTION (the rule mxfp4_experts' auto shares), and the
  explicit choices; W8A8 keeps its int8 layers under each; bad values and forms for models that are no
  integer checkpoint are refused by name;
- the option round-trips through the command line (--int-weights) and a wrong value stops a command;
- the module selection (quant/apply.py) for a model built to run on a GPU (the meta device, no CUDA
  needed): packed WeightOnlyIntLinear / IntExperts, or none of them when dense; the sizes the memory
  checks count, and tensor parallelism's checks and shards taking the float rules for the dense form;
- loaded dense where the GPU's packed layout is otherwise kept (PACKED_INT_ON_CPU), tiny AWQ and
  act-order GPTQ checkpoints (tests/int_checkpoints.py) hold their dequantized twin's weights bit for
  bit, and give its greedy tokens in fp32 exactly (the engine against transformers on the twin);
  `packed` on the CPU still loads (dequantized: the CPU always runs dense).

On a GPU (skipped without CUDA): the packed and dense forms of a tiny AWQ checkpoint in bf16 give the
same greedy tokens up to the first divergence, each side's token within the other's top 5 there, with
close logprobs before it.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from overnight.errors import ConfigError, ModelLoadError
from overnight.loader.fit import DENSE_FRACTION, dense_fit, linear_formats, weight_bytes
from overnight.loader.int_form import choose_int_form
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import PRESETS_DIR, resolve_source
from overnight.models.registry import arch_from_hf_config
from overnight.options import EngineOptions, add_engine_args, options_from_args, options_to_flags
from overnight.quant import apply
from overnight.quant.apply import dequantize_model
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.int_scheme import IntScheme
from overnight.quant.scheme import QuantScheme
from tests.int_checkpoints import make_int_checkpoint
from tests.tiny_models import make_tiny_checkpoint

H100 = 80 * 10**9  # bytes an 80-GB H100 reports: 74.5 GiB
H200 = 141 * 10**9
L4 = 24 * 10**9
AWQ = IntScheme(method="awq", bits=4, group_size=128, symmetric=False)
W8A8 = IntScheme(method="compressed-tensors", bits=8, group_size=None, symmetric=True, int8_activations=True)


def _preset(name: str):
    cfg = json.loads((Path(PRESETS_DIR) / f"{name}.json").read_text())
    cfg["rope_scaling"] = None  # the byte count does not depend on RoPE
    return arch_from_hf_config(cfg)


# -- the decision -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "device", "tp", "dense"),
    [
        ("qwen3-8b", H100, 1, True),  # 15.3 GiB in bf16: 20% of the H100
        ("qwen3-8b", L4, 1, False),  # 68% of a 24-GB L4: packed
        ("qwen3-8b", L4, 2, True),  # half the model a GPU: 34%
        ("qwen3-30b-a3b", H100, 1, False),  # 57 GiB in bf16: 76%
        ("qwen3-30b-a3b", H200, 1, True),  # 43%
        ("qwen3-30b-a3b", H100, 2, True),  # 38% a GPU
        ("qwen3-8b", None, 1, False),  # the CPU: the scheme as it is (dequantized at load anyway)
    ],
)
def test_auto_by_model_memory_and_tensor_parallel_size(model, device, tp, dense):
    arch = _preset(model)
    form = choose_int_form(arch, AWQ, "auto", 2, device, tp, "bfloat16")
    assert isinstance(form.scheme, IntScheme)
    assert form.scheme.dense == dense
    assert form.scheme == replace(AWQ, dense=dense)  # nothing else of the checkpoint's scheme changes
    assert ("dequantized to bfloat16" in form.reason) == dense and form.reason.startswith("int_weights auto")
    if device is not None:  # the rule itself, from the bytes
        share = arch.weight_bytes(2) / tp
        assert (share <= DENSE_FRACTION * device) == dense
        assert f"{share / 2**30:.1f} GiB" in form.reason


def test_the_rule_at_its_edge():
    """At most DENSE_FRACTION of one GPU per rank is dense; a byte over is not (one function, which
    mxfp4_experts' auto uses as well)."""
    model = 10 * 10**9
    edge = int(model / DENSE_FRACTION) + 1  # the smallest GPU the model takes at most 0.55 of
    assert dense_fit(model, edge).dense and not dense_fit(model, edge - 2).dense
    assert dense_fit(2 * model, edge, 2).dense and not dense_fit(2 * model, edge - 2, 2).dense
    assert not dense_fit(2 * model, edge, 1).dense
    assert (
        "over 55%" in dense_fit(model, edge - 2).words
        and "each GPU's share" in dense_fit(model, edge, 2).words
    )


def test_explicit_choices_and_refusals():
    arch = _preset("qwen3-30b-a3b")
    assert choose_int_form(arch, AWQ, "dense", 2, H100).scheme == replace(AWQ, dense=True)  # the user's call
    assert choose_int_form(arch, AWQ, "dense", 2, None).scheme == replace(AWQ, dense=True)
    assert choose_int_form(_preset("qwen3-8b"), AWQ, "packed", 2, H200).scheme == AWQ
    cpu = choose_int_form(arch, AWQ, "packed", 2, None)
    assert cpu.scheme == AWQ and "on the CPU" in cpu.reason
    for choice in ("auto", "packed", "dense"):  # not weight-only: its int8 GEMM stays
        w8a8 = choose_int_form(_preset("qwen3-8b"), W8A8, choice, 2, H200)
        assert w8a8.scheme == W8A8 and "W8A8" in w8a8.reason
    for scheme in (None, QuantScheme()):
        assert choose_int_form(arch, scheme, "auto", 2, H100) == choose_int_form(
            arch, scheme, "auto", 2, None
        )
        assert choose_int_form(arch, scheme, "auto", 2, H100).scheme == scheme
        for choice in ("packed", "dense"):
            with pytest.raises(ConfigError, match=f"int_weights '{choice}'.*not one: leave it at auto"):
                choose_int_form(arch, scheme, choice, 2, H100)
    with pytest.raises(ConfigError, match="int_weights must be one of auto, packed, dense"):
        choose_int_form(arch, AWQ, "bf16", 2, H100)
    with pytest.raises(ConfigError, match="int_weights must be one of auto, packed, dense"):
        EngineOptions(int_weights="bf16")
    with pytest.raises(ValueError, match="W8A8"):
        replace(W8A8, dense=True)


def test_option_round_trips_through_the_command_line(capsys):
    from overnight.cli import main

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for choice in ("auto", "packed", "dense"):
        opts = EngineOptions(model="m", int_weights=choice)
        flags = options_to_flags(opts)
        assert ("--int-weights" in flags) == (choice != "auto")  # only off the default
        back = options_from_args(parser.parse_args(flags), mode=opts.mode)
        assert back.int_weights == choice and back == opts
    assert parser.parse_args(["--int-weights", "dense"]).int_weights == "dense"
    with pytest.raises(SystemExit) as stopped:  # argparse's choices, from the one declaration
        main(["budget", "--int-weights", "fp4"])
    assert stopped.value.code == 2
    assert (
        "--int-weights: invalid choice: 'fp4' (choose from 'auto', 'packed', 'dense')"
        in capsys.readouterr().err
    )


# -- the built model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(quantized folder, dequantized twin) by name: Qwen3 in AWQ, act-order GPTQ and W8A8; Qwen3-MoE
    in AWQ and in symmetric GPTQ (as Qwen/Qwen3-30B-A3B-GPTQ-Int4)."""
    root = tmp_path_factory.mktemp("int-form")
    dense_src = make_tiny_checkpoint(root / "src", "qwen3")
    moe_src = make_tiny_checkpoint(root / "src-moe", "qwen3_moe")
    out = {
        name: make_int_checkpoint(dense_src, root / name, name)
        for name in ("awq-g32", "gptq-w4-g16-asym-descact", "ct-w8a8")
    }
    out["moe-awq-g32"] = make_int_checkpoint(moe_src, root / "moe-awq-g32", "awq-g32")
    out["moe-gptq-w4-g32-sym"] = make_int_checkpoint(moe_src, root / "moe-gptq", "gptq-w4-g32-sym")
    return out


PACKED = ["awq-g32", "gptq-w4-g16-asym-descact", "moe-awq-g32", "moe-gptq-w4-g32-sym"]  # packed on a GPU


def _kinds(model: nn.Module) -> dict[type, int]:
    counts: dict[type, int] = {}
    for module in model.modules():
        counts[type(module)] = counts.get(type(module), 0) + 1
    return counts


@pytest.mark.parametrize("name", PACKED)
def test_module_selection_for_a_gpu(checkpoints, name):
    """Built shapeless to run on CUDA (the seam the loader and tensor parallelism use): the packed
    scheme's integer layers, and none with the dense one; the bytes the memory checks count for each
    are what the model holds."""
    source = resolve_source(str(checkpoints[name][0]))
    scheme = source.quantization
    assert isinstance(scheme, IntScheme) and not scheme.dense
    packed = _kinds(build_model(source, torch.bfloat16, "meta", runs_on="cuda"))
    dense_source = replace(source, quantization=replace(scheme, dense=True))
    model = build_model(dense_source, torch.bfloat16, "meta", runs_on="cuda")
    dense = _kinds(model)
    assert packed.get(WeightOnlyIntLinear, 0) >= 2 * 2  # qkv and o per layer at least
    assert WeightOnlyIntLinear not in dense and IntExperts not in dense and Int8Linear not in dense
    moe = name.startswith("moe")
    assert (IntExperts in packed) == moe
    if moe:
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.down_proj.dtype == torch.bfloat16
    assert dense[nn.Linear] == packed.get(nn.Linear, 0) + packed[WeightOnlyIntLinear]
    assert linear_formats(dense_source.quantization, "cuda") == (False, None)
    assert linear_formats(scheme, "cuda")[1] is not None
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(source.arch, torch.bfloat16, scheme=dense_source.quantization) == held


def test_w8a8_keeps_its_int8_layers_on_a_gpu(checkpoints):
    source = resolve_source(str(checkpoints["ct-w8a8"][0]))
    form = choose_int_form(source.arch, source.quantization, "dense", 2, H100)
    model = build_model(replace(source, quantization=form.scheme), torch.bfloat16, "meta", runs_on="cuda")
    assert _kinds(model).get(Int8Linear, 0) == 2 * 4


def test_tensor_parallel_checks_take_the_float_rules_when_dense(checkpoints):
    """Act-order columns cannot be split for the packed row-parallel layers; dequantized at load they
    shard as float weights."""
    from overnight.build import check_int_parallel

    source = resolve_source(str(checkpoints["gptq-w4-g16-asym-descact"][0]))
    with pytest.raises(ModelLoadError, match="act-order"):
        check_int_parallel(source, 2, linear_formats(source.quantization, "cuda")[1])
    dense = replace(source, quantization=replace(source.quantization, dense=True))
    check_int_parallel(dense, 2, linear_formats(dense.quantization, "cuda")[1])


# -- loaded: weights and tokens ---------------------------------------------------------------------


def _same_weights(model: nn.Module, twin: Path) -> None:
    reference = load_model(resolve_source(str(twin)), torch.float32, "cpu").state_dict()
    ours = model.state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("name", PACKED)
def test_dense_load_is_the_twin(checkpoints, name, monkeypatch):
    """Where the GPU's packed layout is kept (PACKED_INT_ON_CPU), the dense scheme still loads plain
    layers holding the dequantized twin's weights bit for bit (act-order columns in the input's order),
    with the twin's greedy tokens; and the packed model, dequantized afterwards, holds the same."""
    from tests.parity_helpers import PROMPTS, greedy_tokens

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = checkpoints[name]
    source = resolve_source(str(quantized))
    assert isinstance(source.quantization, IntScheme)
    dense = replace(source, quantization=replace(source.quantization, dense=True))
    model = load_model(dense, torch.float32, "cpu")
    assert not any(isinstance(m, (WeightOnlyIntLinear, IntExperts)) for m in model.modules())
    _same_weights(model, twin)
    packed = load_model(source, torch.float32, "cpu")
    assert any(isinstance(m, WeightOnlyIntLinear) for m in packed.modules())
    reference = dequantize_model(copy.deepcopy(packed)).state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in model.state_dict().items())
    ref = load_model(resolve_source(str(twin)), torch.float32, "cpu")
    assert greedy_tokens(model, PROMPTS[:4], 4) == greedy_tokens(ref, PROMPTS[:4], 4)


@pytest.mark.parametrize("name", ["gptq-w4-g16-asym-descact", "moe-awq-g32", "moe-gptq-w4-g32-sym"])
def test_dense_shards_are_the_float_shards(checkpoints, name, monkeypatch):
    """Tensor parallelism of the dense form (act-order included, which the packed form refuses): each
    rank, streamed in, holds plain layers with exactly the dequantized twin's float shares."""
    from overnight.parallel.tp_load import load_sharded_model
    from tests.tp_helpers import streamed_equals_sliced

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = checkpoints[name]
    source = resolve_source(str(quantized))
    assert isinstance(source.quantization, IntScheme)
    dense = replace(source, quantization=replace(source.quantization, dense=True))
    for rank in range(2):
        streamed = streamed_equals_sliced(dense, rank)
        assert not any(isinstance(m, (WeightOnlyIntLinear, IntExperts)) for m in streamed.modules())
        float_share = load_sharded_model(resolve_source(str(twin)), torch.float32, "cpu", rank, 2)
        ours, theirs = streamed.state_dict(), float_share.state_dict()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(t, theirs[k]) for k, t in ours.items())


def test_packed_on_the_cpu_still_loads(checkpoints):
    """--int-weights packed on the CPU: resolved, loaded dequantized (the CPU's only form), the twin's
    weights."""
    from overnight.build import resolve_model

    quantized, twin = checkpoints["awq-g32"]
    opts = EngineOptions(model=str(quantized), int_weights="packed", device="cpu", skip_tokenizer_init=True)
    source = resolve_model(opts).source
    assert isinstance(source.quantization, IntScheme) and not source.quantization.dense
    model = load_model(source, torch.float32, "cpu")
    assert not any(isinstance(m, WeightOnlyIntLinear) for m in model.modules())
    _same_weights(model, twin)


def _engine_tokens(folder: Path, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    from overnight import LLM, SamplingParams

    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu",
              kv_cache_memory_bytes=4 << 20, **kwargs)  # fmt: skip
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert not any(isinstance(m, (WeightOnlyIntLinear, IntExperts)) for m in model.modules())
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", PACKED)
def test_engine_dense_greedy_equals_transformers(checkpoints, name, monkeypatch):
    """The engine with --int-weights dense where packed layers would otherwise be built (resolve_model
    decides, the runner loads): fp32 greedy tokens equal transformers' on the dequantized twin."""
    from tests.parity_helpers import hf_greedy, prompts_for
    from tests.tiny_models import load_reference

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = checkpoints[name]
    ref = load_reference(twin)
    prompts = prompts_for(ref.config.vocab_size, n=6)
    ours = _engine_tokens(quantized, prompts, int_weights="dense")
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(ref, prompt, 8)[0], f"prompt of {len(prompt)} tokens"


# -- on a GPU -----------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_and_dense_agree_on_a_gpu(checkpoints):
    """bf16 on a GPU, the real choice: the packed W4A16 layers (Triton GEMMs, CUDA graphs) and the
    dense bf16 ones give the same greedy tokens up to the first divergence, and there each side's token
    is within the other's top 5; before it the chosen tokens' logprobs agree closely."""
    import gc

    from overnight import LLM, SamplingParams
    from tests.parity_helpers import prompts_for

    quantized, _ = checkpoints["awq-g32"]
    vocab = resolve_source(str(quantized)).arch.vocab_size
    prompts = prompts_for(vocab, n=8, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    results = {}
    for choice in ("packed", "dense"):
        llm = LLM(str(quantized), skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
                  int_weights=choice, kv_cache_memory_bytes=64 << 20)  # fmt: skip
        model = llm.engine.runner.model  # type: ignore[attr-defined]
        assert any(isinstance(m, WeightOnlyIntLinear) for m in model.modules()) == (choice == "packed")
        results[choice] = [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
        llm.engine.shutdown()
        del llm, model
        gc.collect()
        torch.cuda.empty_cache()
    gaps = []
    for packed, dense in zip(results["packed"], results["dense"]):
        assert packed.logprobs is not None and dense.logprobs is not None
        for a, b, lp_a, lp_b in zip(packed.token_ids, dense.token_ids, packed.logprobs, dense.logprobs):
            if a != b:
                assert a in lp_b and b in lp_a, f"{packed.token_ids} vs {dense.token_ids}"
                break
            gaps.append(abs(lp_a[a].logprob - lp_b[b].logprob))
    assert len(gaps) >= len(prompts) * 12 / 2, f"{len(gaps)} steps before divergences"
    assert sum(gaps) / len(gaps) < 0.05, f"mean logprob gap {sum(gaps) / len(gaps):.3f}"


def test_too_large_dense_names_the_packed_form(monkeypatch):
    """An explicit dense form that does not fit a GPU: the refusal offers the packed form's bytes (and
    not fp8, which an integer checkpoint refuses)."""
    from overnight.loader import fit

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    arch = _preset("qwen3-8b")  # 15.3 GiB in bf16, ~6 GiB packed
    dense = replace(AWQ, dense=True)
    words = fit._what_fits(arch, torch.bfloat16, torch.device("cuda"), 8 * 2**30, 1, False, None, dense)
    packed = weight_bytes(arch, torch.bfloat16, int_linear=linear_formats(AWQ, "cuda")[1], scheme=AWQ)
    assert f"--int-weights packed ({packed / 2**30:.1f} GiB)" in words
    assert "fp8" not in words
    assert "--int-weights" not in fit._what_fits(
        arch, torch.bfloat16, torch.device("cuda"), 8 * 2**30, 1, False
    )


def test_budget_counts_the_form_held(checkpoints):
    """`overnight budget` and the weight-fit check read the resolved scheme: dense weights count their
    compute-dtype bytes (the plain model's), packed ones their codes, scales and zeros."""
    from overnight.build import resolve_model
    from overnight.tools.budget import DeviceMemory, plan_budget

    gpu = DeviceMemory("H200", H200, H200)
    quantized, _ = checkpoints["awq-g32"]
    weights = {}
    for choice in ("packed", "dense"):
        opts = EngineOptions(
            model=str(quantized), int_weights=choice, device="cpu", dtype="bfloat16", skip_tokenizer_init=True
        )
        source = resolve_model(opts).source
        assert isinstance(source.quantization, IntScheme) and source.quantization.dense == (choice == "dense")
        weights[choice] = plan_budget(opts, source, gpu).weights_bytes
    assert weights["dense"] == resolve_source(str(quantized)).arch.weight_bytes(2)
    assert weights["packed"] is not None and weights["packed"] < weights["dense"]
