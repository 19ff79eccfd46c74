"""Tensor parallelism for quantized Gemma 4 (parallel/tp_gemma4.py): FP8 and packed integer layers split
by their layer's own head sizes and widths, with the other families' rules for scales and packed codes.

tests/test_gemma.py's tiny Gemma 4 (sliding heads of 16, full heads of 24, 2 KV-shared layers with
double-wide MLPs; 2 ranks: o_proj shares of 32 and 48 columns, down_proj shares of 40 and 80): FP8 with
per-channel scales (quantization="fp8"), and compressed-tensors int4 with one group per row, packed on
the CPU (PACKED_INT_ON_CPU).
"""

from __future__ import annotations

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.parallel import workers
from overnight.parallel.tp_gemma4 import check_gemma4_quantized_tp, shard_gemma4_tensor
from overnight.parallel.tp_int import RowParallelWeightOnlyIntLinear
from overnight.parallel.tp_modules import RowParallelFp8Linear
from overnight.parallel.tp_shards import TPShards
from overnight.quant import apply
from overnight.quant.int_linear import WeightOnlyIntLinear
from overnight.quant.linear import Fp8Linear
from tests.int_checkpoints import make_int_checkpoint
from tests.tp_helpers import packed_int_worker_main, streamed_equals_sliced

OPTIONS = dict(
    device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16,
    max_model_len=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(float folder, int4 channel-wise folder, its dequantized twin)."""
    from tests.test_gemma import tiny_gemma

    root = tmp_path_factory.mktemp("gemma4-quant")
    tiny_gemma("gemma4").save_pretrained(root / "model")
    packed, twin = make_int_checkpoint(root / "model", root / "int4", "ct-w4-channel-asym")
    return root / "model", packed, twin


@pytest.fixture
def packed(monkeypatch):
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_quantized_gemma4_shards_hold_their_share_of_the_weights(gemma4, kind, packed):
    """Each rank's FP8 / packed layers dequantize to exactly its share of the whole layer's weight (q|k|v
    rows of the layer's head sizes, double-wide MLP rows, row-parallel columns), streamed or sliced."""
    if kind == "fp8":
        source, layer_type = resolve_source(str(gemma4[0]), quantization="fp8"), Fp8Linear
    else:
        source, layer_type = resolve_source(str(gemma4[1])), WeightOnlyIntLinear
    whole = load_model(source, torch.float32, "cpu")
    layers = {n: m for n, m in whole.named_modules() if isinstance(m, layer_type)}
    # 4 layers: q|k|v or q, o, gate|up, down; FP8 also the per-layer-input projections (replicated)
    assert len(layers) == (25 if kind == "fp8" else 16)
    row_type = RowParallelFp8Linear if kind == "fp8" else RowParallelWeightOnlyIntLinear
    for rank in range(2):
        shards = TPShards(source.arch, rank, 2)
        streamed = streamed_equals_sliced(source, rank)
        for name, layer in layers.items():
            mine = streamed.get_submodule(name)
            assert isinstance(mine, row_type) == name.endswith(("o_proj", "down_proj")), name
            share = shards.shard(f"{name}.weight", layer.dequantized_weight())
            assert torch.equal(mine.dequantized_weight(), share), name


def test_gemma4_row_parallel_block_scales_take_their_columns(gemma4):
    """FP8 block scales of o_proj in a full layer (48 columns a rank of 96): 16-column blocks split
    3 + 3; per-channel scales stay whole; 32-column blocks do not split into 48s: refused by name."""
    arch = resolve_source(str(gemma4[0])).arch
    parts = "model.layers.1.self_attn.o_proj.weight_scale".split(".")  # layer 1: full attention
    blocks = torch.arange(48 * 6, dtype=torch.float32).view(48, 6)
    for rank in range(2):
        got = shard_gemma4_tensor(arch, rank, 2, parts, blocks)
        assert got is not None and torch.equal(got, blocks[:, 3 * rank : 3 * rank + 3])
    channel = torch.ones(48, 1)
    assert shard_gemma4_tensor(arch, 1, 2, parts, channel) is channel
    with pytest.raises(ModelLoadError, match="not whole 32-column weight-scale blocks"):
        shard_gemma4_tensor(arch, 1, 2, parts, torch.ones(48, 3))


def test_gemma4_quantized_splits_that_are_not_whole_groups_are_refused(gemma4):
    arch = resolve_source(str(gemma4[0])).arch
    check_gemma4_quantized_tp(arch, 2, None, (4, 0, True))  # channel-wise int4: 8-column words
    check_gemma4_quantized_tp(arch, 2, 8, None)  # FP8 blocks of 8: 32, 48, 40, 80 columns
    with pytest.raises(
        ModelLoadError, match="40 input columns of Gemma 4's down_proj .layer 0., not whole 16"
    ):
        check_gemma4_quantized_tp(arch, 2, None, (4, 16, True))
    with pytest.raises(
        ModelLoadError, match="40 input columns of Gemma 4's down_proj .layer 0., not whole 32"
    ):
        check_gemma4_quantized_tp(arch, 2, 32, None)


def test_packed_gemma4_split_into_partial_groups_is_refused_before_starting(gemma4, packed, tmp_path):
    """int8 in groups of 16: the dense layers' down_proj shares of 40 columns are not whole groups."""
    folder, _ = make_int_checkpoint(gemma4[0], tmp_path / "int8-g16", "ct-w8-g16-sym")
    with pytest.raises(ModelLoadError, match="40 input columns of .*down_proj, not whole 16-column groups"):
        LLM(str(folder), tensor_parallel_size=2, **OPTIONS)


def test_packed_gemma4_tp1_agrees_with_transformers(gemma4, packed):
    """The baseline the ranks are held to: packed int4 layers in one process against transformers on the
    dequantized twin (exact up to a near-tie, as tests/test_gemma.py holds Gemma)."""
    import transformers

    from tests.parity_helpers import hf_greedy
    from tests.test_gemma import agrees, prompts

    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma4[2], dtype=torch.float32).eval()
    llm = LLM(str(gemma4[1]), **OPTIONS)
    batch = prompts()[:4]
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(batch, outs):
        want, scores = hf_greedy(ref, prompt, 6)
        assert agrees(list(out.outputs[0].token_ids), want, scores), prompt


def _generate(folder, extra: dict, tp: int) -> list[list[tuple[int, dict]]]:
    """Greedy (token, top-3 logprobs) per step of every prompt."""
    from tests.test_gemma import prompts

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    llm = LLM(str(folder), tensor_parallel_size=tp, **OPTIONS, **extra)
    try:
        outs = llm.generate(prompts(), params, use_tqdm=False)
    finally:
        if tp > 1:
            llm.engine.shutdown()
    return [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)) for o in outs]


@pytest.mark.slow  # starts tensor-parallel processes
def test_packed_gemma4_tp2_matches_tp1(gemma4, packed, monkeypatch):
    """Packed int4 over 2 ranks: greedy tokens in fp32 equal one process's over chunked prefills past
    the 7-token window and a shared prefix."""
    monkeypatch.setattr(workers, "_worker_main", packed_int_worker_main)
    one, two = _generate(gemma4[1], {}, 1), _generate(gemma4[1], {}, 2)
    assert [[t for t, _ in steps] for steps in two] == [[t for t, _ in steps] for steps in one]


@pytest.mark.slow  # starts tensor-parallel processes
def test_fp8_gemma4_tp2_agrees_with_tp1(gemma4):
    """FP8 over 2 ranks: each rank quantizes its share of o_proj's and down_proj's inputs per token
    (tests/test_tp.py's FP8 case), so tokens agree until a near-tie: at a first divergence each side's
    token is in the other's top 3, and the logprobs before it stay close."""
    one, two = (_generate(gemma4[0], {"quantization": "fp8"}, tp) for tp in (1, 2))
    gaps = []
    for a, b in zip(one, two, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), len(a))
        gaps += [abs(a[i][1][a[i][0]].logprob - b[i][1][a[i][0]].logprob) for i in range(first)]
        if first < len(a):
            (ta, pa), (tb, pb) = a[first], b[first]
            assert tb in pa and ta in pb
    assert sum(gaps) / len(gaps) < 0.1
