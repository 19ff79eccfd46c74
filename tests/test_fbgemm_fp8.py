"""fbgemm_fp8 checkpoints (Meta's FP8 Llama 3.1 and Llama 4 releases) on the CPU: tiny random Llama and
Llama 4 models written in that layout by the test (transformers' integration's tensor names and scale
shapes: weight e4m3 [N, K] + weight_scale [N, 1]; Llama 4's fused experts gate_up_proj [E, H, 2I] +
gate_up_proj_scale [E, 1, 2I], down_proj [E, I, H] + down_proj_scale [E, H, 1]).

transformers cannot load this format without fbgemm-gpu and a GPU, so the reference is a float checkpoint
holding the dequantized weights (e4m3 x scale), loaded by transformers in fp32. Checked: the loaded e4m3
bytes and scales are the saved ones (scales of amax / 300, so a loader that dequantized and requantized
per row would change the values); modules_to_not_convert stay float, in either naming; our model
dequantized gives transformers' greedy tokens exactly; the FP8 path (per-token activations) agrees
with the float reference by tests/parity_helpers.py's criterion; malformed configs are refused by name.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from overnight.errors import ModelLoadError
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.models.llama4 import Llama4ForCausalLM
from overnight.quant.apply import dequantize_model, ignored
from overnight.quant.linear import Fp8Linear
from overnight.quant.scheme import QuantScheme, scheme_from_hf_config
from tests.fbgemm_checkpoints import write_fbgemm
from tests.parity_helpers import compare, greedy_tokens, hf_greedy, prompts_for
from tests.tiny_models import make_tiny_checkpoint


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _resaved(src: Path, folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A new checkpoint folder: src's files (config, quantization_config, ...) with `tensors` as its
    model.safetensors."""
    folder.mkdir()
    for extra in src.iterdir():
        if extra.name != "model.safetensors":
            (folder / extra.name).write_bytes(extra.read_bytes())
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _hf(folder: Path, cls_name: str) -> nn.Module:
    import transformers

    cls = getattr(transformers, cls_name)
    return cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def _assert_dequantized_greedy_equals_hf(model: nn.Module, hf: nn.Module, prompts: list[list[int]]) -> None:
    ours = greedy_tokens(dequantize_model(copy.deepcopy(model)), prompts, 4)
    assert ours == [hf_greedy(hf, p, 4)[0] for p in prompts]


# -- Llama 3 -------------------------------------------------------------------------------------------

LLAMA_IGNORE = ["model.layers.0.self_attn", "model.layers.1.mlp.down_proj", "lm_head"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("fbgemm-llama")
    src = make_tiny_checkpoint(root, "llama")
    saved = write_fbgemm(src, root / "fp8", root / "deq", LLAMA_IGNORE)
    return root / "fp8", root / "deq", saved


def test_llama_weights_load_as_saved(llama):
    """Every projection holds the checkpoint's e4m3 bytes and scales (q/k/v and gate/up fused by rows);
    the ignored ones (a parent module, an exact name) are nn.Linear with the float weights."""
    fp8, _, saved = llama
    source = resolve_source(str(fp8))
    scheme = source.quantization
    assert isinstance(scheme, QuantScheme) and scheme.method == "fbgemm_fp8" and scheme.prequantized
    assert scheme.activation_scale_ub == 1200.0 and "fbgemm_fp8" in scheme.describe()
    model = load_model(source, torch.float32, "cpu")
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    checked = 0
    for name, layer in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in fused.get(leaf, (leaf,))]
        if isinstance(layer, Fp8Linear):
            weight = torch.cat([saved[f"{p}.weight"] for p in parts])
            scale = torch.cat([saved[f"{p}.weight_scale"][:, 0] for p in parts])
            assert torch.equal(_bytes(layer.weight), _bytes(weight)), name
            assert torch.equal(layer.weight_scale, scale), name
            assert torch.equal(layer.dequantized_weight(), weight.float() * scale[:, None]), name
            checked += 1
        elif type(layer) is nn.Linear and leaf != "lm_head":
            assert all(saved[f"{p}.weight"].dtype == torch.float32 for p in parts), name
            assert torch.equal(layer.weight, torch.cat([saved[f"{p}.weight"] for p in parts])), name
    layers = model.model.layers
    assert type(layers[0].self_attn.qkv_proj) is nn.Linear and type(layers[0].self_attn.o_proj) is nn.Linear
    assert type(layers[1].mlp.down_proj) is nn.Linear and isinstance(layers[1].mlp.gate_up_proj, Fp8Linear)
    assert isinstance(layers[1].self_attn.qkv_proj, Fp8Linear) and isinstance(
        layers[0].mlp.down_proj, Fp8Linear
    )
    assert checked == 4 * len(layers) - 3


def test_llama_greedy_matches_the_dequantized_reference(llama):
    fp8, deq, _ = llama
    model = load_model(resolve_source(str(fp8)), torch.float32, "cpu")
    prompts = prompts_for(model.arch.vocab_size, n=6)
    _assert_dequantized_greedy_equals_hf(model, _hf(deq, "LlamaForCausalLM"), prompts)
    agree = compare(model, load_model(resolve_source(str(deq)), torch.float32, "cpu"))
    assert agree.ok, agree


def test_saved_input_scale_ub_tensors_are_accepted(llama, tmp_path):
    """A writer that saved each layer's input_scale_ub (transformers 4.4x held it as a parameter) gives
    the same model; the bound is not applied (quant/scheme.py)."""
    fp8, _, saved = llama
    ubs = {
        n.replace("weight_scale", "input_scale_ub"): torch.tensor([1200.0])
        for n in saved
        if "weight_scale" in n
    }
    folder = _resaved(fp8, tmp_path / "with-ub", {**saved, **ubs})
    a = dict(load_model(resolve_source(str(fp8)), torch.float32, "cpu").named_parameters())
    b = dict(load_model(resolve_source(str(folder)), torch.float32, "cpu").named_parameters())
    assert ubs and a.keys() == b.keys() and all(torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)


def test_llama_engine_runs_the_checkpoint(llama):
    """Through LLM: the engine's greedy tokens are those of the loaded FP8 model run directly."""
    from overnight import LLM, SamplingParams

    fp8, _, _ = llama
    llm = LLM(
        str(fp8),
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=1 << 20,
        block_size=4,
        skip_tokenizer_init=True,
    )
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[1].mlp.gate_up_proj, Fp8Linear)
    prompts = prompts_for(model.arch.vocab_size, n=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy_tokens(model, prompts, 4)


# -- Llama 4 -------------------------------------------------------------------------------------------

# Maverick-FP8 style: attention of one layer, a shared expert's projection and the routers stay float
LLAMA4_IGNORE = [
    "model.layers.3.self_attn",
    "model.layers.1.feed_forward.shared_expert.down_proj",
    "model.layers.1.feed_forward.router",
    "model.layers.3.feed_forward.router",
]
MIN_TOP1, MAX_DLOGPROB = 0.75, 0.45  # tests/test_fp8_moe.py says why MoE bounds are looser


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    from tests.test_llama4 import make_llama4_checkpoint

    root = tmp_path_factory.mktemp("fbgemm-llama4")
    src = make_llama4_checkpoint(root / "l4")
    saved = write_fbgemm(src, root / "fp8", root / "deq", LLAMA4_IGNORE)
    return root / "fp8", root / "deq", saved


def test_llama4_fused_experts_load_as_saved(llama4):
    """The fused experts keep the checkpoint's e4m3 values and per-row scales, transposed into the
    stacks' [E, out, in] layout (no second rounding); ignored modules stay float under their
    feed_forward names; the routers are float."""
    fp8, _, saved = llama4
    model = load_model(resolve_source(str(fp8)), torch.float32, "cpu")
    for i in (1, 3):
        moe = model.model.layers[i].mlp
        ckpt = f"model.layers.{i}.feed_forward.experts"
        gate_up, down = saved[f"{ckpt}.gate_up_proj"], saved[f"{ckpt}.down_proj"]  # [E, H, 2I], [E, I, H]
        assert torch.equal(_bytes(moe.experts.gate_up_proj), _bytes(gate_up.transpose(1, 2)))
        assert torch.equal(_bytes(moe.experts.down_proj), _bytes(down.transpose(1, 2)))
        assert torch.equal(moe.experts.gate_up_scale, saved[f"{ckpt}.gate_up_proj_scale"][:, 0, :])
        assert torch.equal(moe.experts.down_scale, saved[f"{ckpt}.down_proj_scale"][:, :, 0])
        assert type(moe.router) is nn.Linear
    layers = model.model.layers
    assert type(layers[1].mlp.shared_expert.down_proj) is nn.Linear
    assert isinstance(layers[3].mlp.shared_expert.down_proj, Fp8Linear)
    assert type(layers[3].self_attn.qkv_proj) is nn.Linear and isinstance(
        layers[2].self_attn.qkv_proj, Fp8Linear
    )
    assert isinstance(layers[0].mlp.gate_up_proj, Fp8Linear)  # a dense layer's MLP


def test_llama4_per_expert_layout_loads_the_same_bytes(llama4, tmp_path):
    """The experts stored one e4m3 tensor per expert and projection with weight_scale [rows, 1]
    (experts.E.gate_proj.weight, ...) load into the same stacks, bytes and scales, as the fused ones."""
    fp8, _, saved = llama4
    tensors = dict(saved)
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gate_up, down = tensors.pop(name).transpose(1, 2), tensors.pop(prefix + "down_proj").transpose(1, 2)
        gate_up_scale = tensors.pop(name + "_scale")[:, 0, :]  # [E, 2I]
        down_scale = tensors.pop(prefix + "down_proj_scale")[:, :, 0]  # [E, H]
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            for proj, w, sc in (
                ("gate_proj", gate_up[e, :half], gate_up_scale[e, :half]),
                ("up_proj", gate_up[e, half:], gate_up_scale[e, half:]),
                ("down_proj", down[e], down_scale[e]),
            ):
                tensors[f"{prefix}{e}.{proj}.weight"] = w.contiguous()
                tensors[f"{prefix}{e}.{proj}.weight_scale"] = sc[:, None].contiguous()
    folder = _resaved(fp8, tmp_path / "per-expert", tensors)
    from overnight.parallel.tp_load import load_sharded_model

    def load(folder: Path, rank: int | None) -> nn.Module:
        source = resolve_source(str(folder))
        if rank is None:
            return load_model(source, torch.float32, "cpu")
        return load_sharded_model(source, torch.float32, "cpu", rank, 2)

    for rank in (None, 0, 1):  # whole, then each tensor-parallel rank's slices
        fused, split = load(fp8, rank), load(folder, rank)
        for i in (1, 3):
            a, b = fused.model.layers[i].mlp.experts, split.model.layers[i].mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                assert torch.equal(_bytes(getattr(a, name)), _bytes(getattr(b, name))), (rank, name)
            assert torch.equal(a.gate_up_scale, b.gate_up_scale) and torch.equal(a.down_scale, b.down_scale)


def test_llama4_greedy_matches_the_dequantized_reference(llama4):
    fp8, deq, _ = llama4
    model = load_model(resolve_source(str(fp8)), torch.float32, "cpu")
    prompts = prompts_for(model.arch.vocab_size, n=6)
    _assert_dequantized_greedy_equals_hf(model, _hf(deq, "Llama4ForCausalLM"), prompts)
    agree = compare(
        model, load_model(resolve_source(str(deq)), torch.float32, "cpu"), [p[:12] for p in prompts]
    )
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree


def test_llama4_conditional_checkpoint_in_maverick_names(tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (language_model.model.layers.N.feed_forward.*, the
    tower float and listed, as Maverick-FP8 has it): ignore entries in those names reach our modules,
    the experts load as saved, and the dequantized model's greedy tokens are transformers'."""
    from tests.test_llama4 import make_llama4_checkpoint

    src = make_llama4_checkpoint(tmp_path / "l4", conditional=True)
    ignore = [
        "language_model.model.layers.3.self_attn",
        "language_model.model.layers.1.feed_forward.shared_expert",
        "vision_model",
        "multi_modal_projector",
        "language_model.lm_head",
    ]
    saved = write_fbgemm(src, tmp_path / "fp8", tmp_path / "deq", ignore)
    assert any(n.startswith("language_model.model.layers.1.feed_forward.experts") for n in saved)
    assert all(
        t.dtype == torch.float32 for n, t in saved.items() if n.startswith(("vision_model", "multi_modal"))
    )
    model = load_model(resolve_source(str(tmp_path / "fp8")), torch.float32, "cpu")
    layers = model.model.layers
    assert type(layers[3].self_attn.qkv_proj) is nn.Linear and isinstance(
        layers[2].self_attn.o_proj, Fp8Linear
    )
    assert type(layers[1].mlp.shared_expert.up_proj) is nn.Linear
    assert isinstance(layers[3].mlp.shared_expert.up_proj, Fp8Linear)
    ckpt = "language_model.model.layers.1.feed_forward.experts"
    experts = layers[1].mlp.experts
    assert torch.equal(_bytes(experts.gate_up_proj), _bytes(saved[f"{ckpt}.gate_up_proj"].transpose(1, 2)))
    assert torch.equal(experts.down_scale, saved[f"{ckpt}.down_proj_scale"][:, :, 0])
    prompts = prompts_for(model.arch.vocab_size, n=4)
    _assert_dequantized_greedy_equals_hf(
        model, _hf(tmp_path / "deq", "Llama4ForConditionalGeneration"), prompts
    )


def test_llama4_tp_shards_keep_the_saved_experts(llama4):
    """Rank by rank: each rank's experts are its rows (gate/up) and columns (down) of the saved e4m3
    stacks with the matching scales (down's rows keep all of theirs)."""
    from overnight.parallel.tp_load import load_sharded_model

    fp8, _, saved = llama4
    source = resolve_source(str(fp8))
    ckpt = "model.layers.1.feed_forward.experts"
    gate_up = saved[f"{ckpt}.gate_up_proj"].transpose(1, 2)  # [E, 2I, H]
    down = saved[f"{ckpt}.down_proj"].transpose(1, 2)  # [E, H, I]
    scale = saved[f"{ckpt}.gate_up_proj_scale"][:, 0, :]
    half = gate_up.shape[1] // 2
    for rank in range(2):
        experts = load_sharded_model(source, torch.float32, "cpu", rank, 2).model.layers[1].mlp.experts
        n = half // 2
        rows = torch.cat([torch.arange(rank * n, rank * n + n), half + torch.arange(rank * n, rank * n + n)])
        assert torch.equal(_bytes(experts.gate_up_proj), _bytes(gate_up[:, rows]))
        assert torch.equal(experts.gate_up_scale, scale[:, rows])
        assert torch.equal(_bytes(experts.down_proj), _bytes(down[:, :, rank * n : rank * n + n]))
        assert torch.equal(experts.down_scale, saved[f"{ckpt}.down_proj_scale"][:, :, 0])


# -- names and refusals --------------------------------------------------------------------------------


def test_ignore_list_matches_every_llama4_naming():
    """Maverick's conditional-generation names (language_model.model.layers.N.feed_forward.*) and the
    text model's (model.layers.N.feed_forward.*) both reach our model.layers.N.mlp.* modules; an entry
    naming a parent keeps its children; a layer index does not match a longer one."""
    qc = {
        "quant_method": "fbgemm_fp8",
        "modules_to_not_convert": [
            "language_model.model.layers.0.feed_forward.shared_expert",
            "model.layers.2.self_attn.q_proj",
            "language_model.model.layers.1",
            "language_model.lm_head",
        ],
    }
    scheme = scheme_from_hf_config(qc)
    assert isinstance(scheme, QuantScheme)

    def skips(module: str) -> bool:
        return ignored(Llama4ForCausalLM, scheme, module)  # type: ignore[arg-type]

    assert skips("model.layers.0.mlp.shared_expert.gate_proj") and not skips("model.layers.0.mlp.gate_proj")
    assert skips("model.layers.2.self_attn.q_proj") and not skips("model.layers.2.self_attn.k_proj")
    assert skips("model.layers.1.self_attn.o_proj") and not skips("model.layers.11.self_attn.o_proj")
    assert skips("lm_head")


@pytest.mark.parametrize(
    ("qc", "names"),
    [
        ({"activation_scale_ub": -1.0}, "activation_scale_ub"),
        ({"activation_scale_ub": "1200"}, "activation_scale_ub"),
        ({"activation_scale_ub": float("inf")}, "activation_scale_ub"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
        ({"modules_to_not_convert": ["lm_head", 3]}, "modules_to_not_convert"),
        ({"modules_to_not_convert": ["model.layers.(0"]}, "model.layers.(0"),
        ({"weight_block_size": [128, 128]}, "weight_block_size"),
    ],
)
def test_malformed_configs_are_refused_by_name(qc, names):
    with pytest.raises(ModelLoadError, match=re.escape(names)):
        scheme_from_hf_config({"quant_method": "fbgemm_fp8", **qc})


def test_expert_scales_of_the_wrong_shape_or_missing_are_refused(llama4, tmp_path):
    fp8, _, saved = llama4
    ckpt = "model.layers.1.feed_forward.experts"
    for case, edit in (("shape", lambda t: t[:, :, :-1]), ("missing", None)):
        tensors = dict(saved)
        scale = tensors.pop(f"{ckpt}.gate_up_proj_scale")
        if edit is not None:
            tensors[f"{ckpt}.gate_up_proj_scale"] = edit(scale).contiguous()
        folder = _resaved(fp8, tmp_path / case, tensors)
        expected = (
            "gate_up_proj_scale is" if edit is not None else f"missing: {ckpt.replace('feed_forward', 'mlp')}"
        )
        with pytest.raises(ModelLoadError, match=re.escape(expected)):
            load_model(resolve_source(str(folder)), torch.float32, "cpu")


def test_budget_counts_e4m3_weights(llama4):
    """`overnight budget` (and the fit check, through loader/fit.weight_bytes) sizes an fbgemm_fp8
    checkpoint's weights as FP8: a byte per projection and expert weight plus float32 row scales."""
    from overnight.loader.fit import weight_bytes
    from overnight.options import EngineOptions
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget

    fp8, deq, _ = llama4
    h200 = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))
    plans = {
        folder: plan_budget(
            EngineOptions(model=str(folder), dtype="bfloat16"), resolve_source(str(folder)), h200
        )
        for folder in (fp8, deq)
    }
    source = resolve_source(str(fp8))
    arch, scheme = source.arch, source.quantization
    # the ignore list's layers (layer 3's attention, a shared expert's down_proj) counted in bf16
    assert plans[fp8].weights_bytes == weight_bytes(
        arch, torch.bfloat16, fp8_linear=True, loaded=True, scheme=scheme
    )
    assert plans[fp8].weights_bytes > weight_bytes(arch, torch.bfloat16, fp8_linear=True, loaded=True)
    assert plans[deq].weights_bytes == weight_bytes(arch, torch.bfloat16)
    assert plans[fp8].weights_bytes < 0.7 * plans[deq].weights_bytes
