"""Tensor parallelism for the families with their own sharding rules, on the CPU: 2 gloo rank processes
give the tokens of one process and of HF transformers.

Hybrids (Qwen3.5 dense and MoE): Gated DeltaNet layers split by key heads (and the value heads grouped
under them), gated attention by heads, routed and shared experts by their intermediate sizes; each
rank's state cache holds its heads' states. One engine per family runs chunked prefills (16-token
steps) and a second wave that restores state snapshots at a shared prefix (prefix-cache hits).

gpt-oss: sinks split with their heads, the router replicated, experts (biases, MXFP4 blocks and scales
included) split along their intermediate size, the down bias added by rank 0 only; float and MXFP4
checkpoints (tests/test_gpt_oss.py's builders: sliding windows, YaRN, 6 experts of which 3 a token).

Integer checkpoints (AWQ, GPTQ, compressed-tensors): the GPU's packed layers built on the CPU
(PACKED_INT_ON_CPU), each rank's layers dequantizing to its share of the whole layer's weight; the CPU's
dequantized-at-load path end to end; splits the packed layout cannot hold exactly refused by name.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.parallel.tp import apply_tp
from overnight.parallel.tp_int import RowParallelInt8Linear, RowParallelWeightOnlyIntLinear, check_int_tp
from overnight.parallel.tp_shards import TPShards
from overnight.quant import apply
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_scheme import IntScheme
from tests.int_checkpoints import make_int_checkpoint
from tests.test_gpt_oss import (  # noqa: F401
    _config,
    _hf_greedy,
    _prompts,
    _reference,
    _spread,
    _write,
    float_folder,
    mxfp4_folder,
    write_mxfp4,
)
from tests.tiny_hybrid import make_hybrid_checkpoint
from tests.tp_helpers import check_tp2_two_waves, generate_split, prefix_waves, streamed_equals_sliced

VOCAB = 101
HYBRID = dict(
    device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16,
    max_num_seqs=4, max_model_len=256,
)  # fmt: skip
# 4 attention heads and 1 kv head (shared by both ranks); 2 key heads, 4 value heads: one and two a rank.
HEADS = dict(num_attention_heads=4)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _waves() -> tuple[list[list[int]], list[list[int]]]:
    """The hybrid tests' two prefix waves (test_fp8_hybrid, test_ssm_cache_dtype, test_tp_int_hybrid)."""
    return prefix_waves(VOCAB, 3)


@pytest.mark.parametrize("variant", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_shards_streamed_equal_sliced(tmp_path, variant):
    """Loading rank by rank (checkpoint tensors, or dummy draws replayed whole) gives each rank the
    weights apply_tp cuts from the whole loaded model: Qwen3.5's split and Qwen3-Next's fused
    projections, conv channels, per-head parameters, routed and shared experts."""
    folder = make_hybrid_checkpoint(tmp_path, variant, **HEADS)
    for kind in ("auto", "dummy"):
        source = resolve_source(str(folder), kind)
        for rank in range(2):
            streamed = streamed_equals_sliced(source, rank, seed=3)
    gdn = streamed.model.layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.conv1d.weight.shape[0]) == (1, 2, 2 * 8 + 2 * 6)


def test_hybrid_shards_keep_grouped_heads(tmp_path):
    """Rank r's q|k|v channels are those of its key heads and of the value heads they serve, in every
    layout: the fused in_proj_qkvz (grouped by key head) gives the same rows as the split one."""
    folder = make_hybrid_checkpoint(tmp_path, "qwen3_5", **HEADS)
    arch = resolve_source(str(folder)).arch
    hk, hv, dk, dv = 2, 4, 8, 6
    w = torch.randn(2 * hk * dk + 2 * hv * dv, 40)
    per_key = w.view(hk, -1, 40)  # per key head: q (dk), k (dk), v (2 dv), z (2 dv)
    q, k, v, z = per_key.split([dk, dk, 2 * dv, 2 * dv], dim=1)
    for rank in range(2):
        s = TPShards(arch, rank, 2)
        fused = s.shard("model.layers.0.linear_attn.in_proj_qkvz.weight", w)
        assert torch.equal(fused, per_key[rank])
        split = torch.cat([q.reshape(-1, 40), k.reshape(-1, 40), v.reshape(-1, 40)])
        mine = s.shard("model.layers.0.linear_attn.in_proj_qkv.weight", split)
        assert torch.equal(mine, torch.cat([q[rank], k[rank], v[rank]]))
        assert torch.equal(s.shard("x.linear_attn.in_proj_z.weight", z.reshape(-1, 40)), z[rank])


def test_hybrid_indivisible_linear_heads_are_refused(tmp_path):
    folder = make_hybrid_checkpoint(tmp_path, "qwen3_5", num_attention_heads=4, linear_num_key_heads=1,
                                    linear_num_value_heads=2)  # fmt: skip
    with pytest.raises(ModelLoadError, match="does not divide the model's linear_num_key_heads 1"):
        LLM(str(folder), tensor_parallel_size=2, **HYBRID)


@pytest.mark.slow  # starts tensor-parallel processes
def test_hybrid_tp2_matches_tp1_and_transformers(tmp_path):
    """Qwen3.5-MoE (the dense MLP runs in the image test below)."""
    folder = make_hybrid_checkpoint(tmp_path, "qwen3_5_moe", **HEADS)
    check_tp2_two_waves(folder, HYBRID, VOCAB, seed=3)


@pytest.mark.slow  # starts tensor-parallel processes
def test_hybrid_image_checkpoint_tp2_matches_transformers(tmp_path):
    """Qwen3.5 (dense) from its image checkpoint: the vision tower replicated on every rank, the decoder
    sharded; text-only, one-image and two-image prompts in one batch, 12-token prefill chunks that end
    inside images."""
    from transformers import AutoModelForImageTextToText

    from tests.tiny_vl import hf_greedy as hf_image_greedy
    from tests.tiny_vl import image, make_vl_checkpoint, words

    p, placeholder = 16, "<|vision_start|> <|image_pad|> <|vision_end|>"
    folder = make_vl_checkpoint(tmp_path, "qwen3_5")
    ref = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    cases = [
        (words(7, 0), []),
        (f"{words(3, 1)} {placeholder} {words(4, 2)}", [image(4 * p, 6 * p, 2)]),
        (f"{placeholder} {words(2, 3)} {placeholder} {words(5, 4)}", [image(2 * p, 2 * p, 1), image(4 * p, 6 * p, 2)]),
    ]  # fmt: skip
    llm = LLM(
        folder,
        tensor_parallel_size=2,
        **{**HYBRID, "skip_tokenizer_init": False, "max_num_batched_tokens": 12},
    )
    try:
        prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in cases]
        outs = llm.generate(prompts, _greedy(6), use_tqdm=False)
        tok = llm.get_tokenizer()
    finally:
        llm.engine.shutdown()
    for (text, imgs), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_image_greedy(folder, tok.encode(text), imgs, 6, ref), text


# -- gpt-oss ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def padded_mxfp4(tmp_path_factory):
    """gpt-oss with experts of 96 = 3 scale groups: two ranks hold 2 groups each, rank 1's last one
    zero padding. (folder, its dequantized float twin)."""
    import transformers

    root = tmp_path_factory.mktemp("gpt-oss-96")
    torch.manual_seed(1)
    model = transformers.GptOssForCausalLM(_config(intermediate_size=96)).eval()
    _spread(model, 1)
    return write_mxfp4(_write(root / "float", model), root)


@pytest.mark.parametrize("kind", ["float", "mxfp4", "dummy", "dummy-mxfp4", "padded", "padded-dummy"])
def test_gpt_oss_shards_streamed_equal_sliced(float_folder, mxfp4_folder, padded_mxfp4, kind):  # noqa: F811
    """Each rank's weights loaded from the checkpoint (interleaved gate/up de-interleaved, then sliced)
    equal those apply_tp cuts from the whole loaded model; the down bias is rank 0's alone; MXFP4
    experts of 3 scale groups split 2 + 1 with a group of zero padding."""
    padded = kind.startswith("padded")
    folder = padded_mxfp4[0] if padded else mxfp4_folder[0] if kind.endswith("mxfp4") else float_folder
    dummy = "dummy" in kind
    source = resolve_source(str(folder), "dummy" if dummy else "auto")
    whole_model = load_model(source, torch.float32, "cpu", seed=3)
    whole = dict(whole_model.named_parameters())
    for rank in range(2):
        streamed = streamed_equals_sliced(source, rank, seed=3)
        b = dict(streamed.named_parameters())
        experts = "model.layers.0.mlp.experts."
        bias = b[experts + "down_bias"]
        assert torch.equal(bias, whole[experts + "down_bias"]) if rank == 0 else not bias.any()
        # rank r's gate row i and up row i: unit share * r + i of the whole expert, before any padding
        gate_up, mine = whole[experts + "gate_up_proj"], b[experts + "gate_up_proj"]
        inter, share = gate_up.shape[1] // 2, mine.shape[1] // 2
        start = share * rank
        have = min(share, inter - start)
        assert torch.equal(mine[:, :have], gate_up[:, start : start + have])
        assert torch.equal(mine[:, share : share + have], gate_up[:, inter + start : inter + start + have])
        assert b["model.layers.0.self_attn.sinks"].shape == (2,)
        if kind.endswith("mxfp4"):  # one 32-column scale group of down's input a rank, 16 bytes of blocks
            assert b[experts + "down_scales"].shape[-1] == 1 and b[experts + "down_proj"].shape[-1] == 16
        if padded:  # rank 1: group 3, then zeros (codes, scales, biases)
            down, scales = b[experts + "down_proj"], b[experts + "down_scales"]
            assert down.shape[-1] == 32 and scales.shape[-1] == 2
            tail = [down[..., 16:], scales[..., 1:], mine[:, 32:64], mine[:, 96:]]
            tail.append(b[experts + "gate_up_bias"][:, 32:64])
            assert all(not t.any() for t in tail) == (rank == 1)


def test_gpt_oss_mxfp4_shares_are_whole_scale_groups(mxfp4_folder, padded_mxfp4):  # noqa: F811
    arch = resolve_source(str(padded_mxfp4[0])).arch
    assert [TPShards(arch, r, 2).section("moe") for r in range(2)] == [(0, 64), (64, 64)]
    assert TPShards(arch, 0, 2).local_arch.moe_intermediate_size == 64
    arch = resolve_source(str(mxfp4_folder[0])).arch
    TPShards(arch, 0, 2).check()  # 64 / 2: one group a rank
    with pytest.raises(ModelLoadError, match="more than the 2 32-column scale groups"):
        TPShards(arch, 0, 4).check()


@pytest.mark.slow  # starts tensor-parallel processes
@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_gpt_oss_tp2_matches_tp1_and_transformers(float_folder, padded_mxfp4, kind):  # noqa: F811
    """MXFP4: the checkpoint whose second rank holds a group of padding."""
    folder, reference = (float_folder, float_folder) if kind == "float" else padded_mxfp4
    prompts = _prompts(256)
    options = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    one = LLM(str(folder), **options).generate(prompts, params, use_tqdm=False)
    two = generate_split(str(folder), prompts, params, **options)
    tokens = [list(o.outputs[0].token_ids) for o in two]
    assert tokens == [list(o.outputs[0].token_ids) for o in one]
    ref = _reference(reference)
    assert tokens == [_hf_greedy(ref, p) for p in prompts]


# -- integer checkpoints ---------------------------------------------------------------------------------

INT_LAYOUTS = (
    "awq-g32",
    "gptq-w4-g32-sym",
    "ct-w4-channel-asym",
    "ct-w8-g16-sym",
    "ct-w8a8",
    "ct-w4-g32-asym-gidx",
)


@pytest.fixture(scope="module")
def int_folders(tmp_path_factory):
    from tests.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tp-int")
    src = make_tiny_checkpoint(root / "src", "qwen3")
    return {name: make_int_checkpoint(src, root / name, name)[0] for name in INT_LAYOUTS}


@pytest.mark.parametrize("layout", INT_LAYOUTS[:-1])
def test_int_packed_shards_hold_their_share_of_the_weights(int_folders, layout, monkeypatch):
    """Each rank's packed layers (rows of q/k/v and gate/up; int32 columns and groups of o and down)
    dequantize to exactly its share of the whole layer's weight, whether sliced from a loaded model
    or streamed in rank by rank."""
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    source = resolve_source(str(int_folders[layout]))
    whole = load_model(source, torch.float32, "cpu")
    kind = Int8Linear if layout == "ct-w8a8" else WeightOnlyIntLinear
    layers = {n: m for n, m in whole.named_modules() if isinstance(m, kind)}
    assert len(layers) == 8
    for rank in range(2):
        shards = TPShards(source.arch, rank, 2)
        streamed = streamed_equals_sliced(source, rank)
        for name, layer in layers.items():
            mine = streamed.get_submodule(name)
            assert isinstance(mine, kind)
            row = name.endswith(("o_proj", "down_proj"))
            assert isinstance(mine, (RowParallelWeightOnlyIntLinear, RowParallelInt8Linear)) == row
            share = shards.shard(f"{name}.weight", layer.dequantized_weight())
            assert torch.equal(mine.dequantized_weight(), share), name


@pytest.mark.parametrize("layout", INT_LAYOUTS[:-1])
def test_int_packed_dummy_shards_are_the_unsharded_dummy_model(int_folders, layout, monkeypatch):
    """--load-format dummy on a packed integer checkpoint at TP 2: each rank's codes (drawn whole in the
    unsharded init's order, then cut: rows, int32 columns, int8 weights), scales and zero points
    (constants) are those apply_tp cuts from the unsharded dummy model, bit for bit; the ranks' codes
    are random and their scales and zero points loader/dummy.py's constants."""
    from overnight.loader.dummy import DUMMY_RANGE

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    source = resolve_source(str(int_folders[layout]), "dummy")
    bits = 8 if "w8" in layout else 4
    for rank in range(2):
        streamed = streamed_equals_sliced(source, rank, seed=3)
        layers = [m for m in streamed.modules() if isinstance(m, (WeightOnlyIntLinear, Int8Linear))]
        assert len(layers) == 8 and any(isinstance(m, RowParallelInt8Linear) for m in layers) == (
            layout == "ct-w8a8"
        )
        for m in layers:
            if isinstance(m, Int8Linear):
                assert m.weight.min() < -100 and m.weight.max() > 100
                assert torch.all(m.weight_scale == torch.tensor(DUMMY_RANGE / 128))
                continue
            assert len(m.packed_weight.unique()) > m.packed_weight.numel() // 2  # random words
            assert torch.all(m.group_scale == torch.tensor(DUMMY_RANGE / (1 << (bits - 1))))
            assert m.group_zero is None or torch.all(m.group_zero == 1 << (bits - 1))


def test_int_act_order_dummy_shards_keep_the_whole_permutation(tmp_path, monkeypatch):
    """Act-order column-parallel layers (the row-parallel o_proj and down_proj left float, as an
    act-order one cannot be split) under dummy weights at TP 2: each rank's input permutations are
    the unsharded dummy model's, whole, drawn after every parameter."""
    from tests.tiny_models import make_tiny_checkpoint

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    rows = ("o_proj", "down_proj")
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3")
    folder = make_int_checkpoint(src, tmp_path / "descact", "gptq-w4-g16-asym-descact", keep_float=rows)[0]
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = list(rows)
    (folder / "config.json").write_text(json.dumps(config))
    source = resolve_source(str(folder), "dummy")
    perms = []
    for rank in range(2):
        streamed = streamed_equals_sliced(source, rank, seed=3)
        mine = {n: b for n, b in streamed.named_buffers() if n.endswith("input_perm")}
        assert len(mine) == 4 and all(
            n.endswith(("qkv_proj.input_perm", "gate_up_proj.input_perm")) for n in mine
        )
        for perm in mine.values():
            assert torch.equal(perm.sort().values, torch.arange(64)) and not torch.equal(
                perm, torch.arange(64)
            )
        perms.append(mine)
    assert all(torch.equal(perms[0][n], perms[1][n]) for n in perms[0])


def test_int_splits_the_packed_layout_cannot_hold_are_refused(int_folders, monkeypatch):
    arch = resolve_source(str(int_folders["awq-g32"])).arch
    g32 = IntScheme("awq", bits=4, group_size=32, symmetric=False)
    check_int_tp(g32, arch, 2, packed_experts=False, packed=True)  # o_proj: 32 columns a rank
    with pytest.raises(ModelLoadError, match="16 input columns of o_proj, not whole 32-column groups"):
        check_int_tp(g32, arch, 4, packed_experts=False, packed=True)
    check_int_tp(g32, arch, 4, packed_experts=False, packed=False)  # dequantized at load: float rules
    act_order = IntScheme("gptq", bits=4, group_size=32, symmetric=True, act_order=True)
    with pytest.raises(ModelLoadError, match="act-order"):
        check_int_tp(act_order, arch, 2, packed_experts=False, packed=True)
    # hybrids: tests/test_tp_int_hybrid.py; packed experts: tests/test_tp_int_experts.py
    moe = replace(arch, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2)
    with pytest.raises(ModelLoadError, match="16 columns of the experts' intermediate size 32, not whole 32"):
        check_int_tp(g32, moe, 2, packed_experts=True, packed=True)  # tests/test_tp_int_experts.py
    # the loaded model's act-order o_proj, should it get past the check
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    model = load_model(resolve_source(str(int_folders["ct-w4-g32-asym-gidx"])), torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match="act-order"):
        apply_tp(model, 0, 2)


@pytest.mark.slow  # starts tensor-parallel processes
def test_int_checkpoint_tp2_matches_tp1(int_folders):
    from tests.parity_helpers import PROMPTS

    options = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    folder = str(int_folders["ct-w4-g32-asym-gidx"])  # act-order: dequantized at load on the CPU
    prompts = PROMPTS[:4]
    one = LLM(folder, **options).generate(prompts, params, use_tqdm=False)
    two = generate_split(folder, prompts, params, **options)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
