"""Llama 4 (models/llama4.py, models/llama4_config.py) end to end on the CPU, against transformers, on
tiny random checkpoints saved with save_pretrained: 4 layers, of which 0-2 are chunked RoPE layers
(attention_chunk_size 8, q/k L2 norm) and 3 a global NoPE layer (temperature tuning with floor_scale 4,
so the q scale changes every few positions), MoE in layers 1 and 3 (4 experts, a shared expert), dense
MLPs of intermediate_size_mlp in 0 and 2, llama3 RoPE scaling. A second variant routes each token to
two experts (top-2: each expert gets its own scaled input), lists moe_layers explicitly and turns the
q/k norm and the temperature tuning off.

Checked: greedy tokens identical to transformers' in fp32 through one engine run with prompts of up to
four chunks, 16-token prefill chunks (chunk edges inside them) and prefix-cache hits, and again in a
pool of 40 blocks that fits only because the chunked layers give blocks back; a
Llama4ForConditionalGeneration checkpoint (its tower loaded too) and the same run text-only
(limit_mm_per_prompt image 0: the tower's tensors skipped) against transformers' own
ConditionalGeneration model on text prompts (images: test_llama4_vision.py); the chat template
through the tokenizer; the config reader's layer kinds and MoE layers and its refusals; the Scout preset's
published size. The chunked attention itself is checked against a dense loop and the kernels in
tests/test_kernels_attention_chunk.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.loader.fit import weight_bytes
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.llama4 import Llama4MoE
from overnight.models.registry import arch_from_hf_config
from overnight.parallel.tp_shards import TPShards
from overnight.tokenizer.synthetic import save_synthetic_tokenizer_folder
from tests.parity_helpers import hf_greedy
from tests.tiny_models import _spread_weights
from tests.tiny_moe import ENGINE as MOE_ENGINE
from tests.tiny_moe import NEW_TOKENS, check_waves_token_exact, waves

VOCAB = 272
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8,
    floor_scale=4, attn_scale=0.5, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
)  # fmt: skip
VARIANTS = {
    "top1": {},
    "top2": dict(num_experts_per_tok=2, moe_layers=[0, 2], use_qk_norm=False, attn_temperature_tuning=False),
}
# The MoE tests' engine settings, with the tokenizer (the chat template test reads it)
ENGINE = {k: v for k, v in MOE_ENGINE.items() if k != "skip_tokenizer_init"}
# Llama 4's chat format, its special tokens at the top of the synthetic vocabulary
SPECIALS = {266: "<|begin_of_text|>", 267: "<|header_start|>", 268: "<|header_end|>", 269: "<|eot|>"}
CHAT_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|header_start|>' + m.role + '<|header_end|>\n\n' }}"
    "{{ m.content }}{{ '<|eot|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|header_start|>assistant<|header_end|>\n\n' }}{% endif %}"
)


def make_llama4_checkpoint(folder: Path, conditional: bool = False, seed: int = 0, **overrides) -> Path:
    import transformers

    text = transformers.Llama4TextConfig(**{**TEXT, **overrides})
    torch.manual_seed(seed)
    if conditional:
        vision = transformers.Llama4VisionConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, image_size=28,
            patch_size=14, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64,
        )  # fmt: skip
        model = transformers.Llama4ForConditionalGeneration(
            transformers.Llama4Config(text_config=text, vision_config=vision)
        ).eval()
    else:
        model = transformers.Llama4ForCausalLM(text).eval()
    with torch.no_grad():
        _spread_weights(model, seed)
    model.save_pretrained(folder)
    save_synthetic_tokenizer_folder(folder, VOCAB, SPECIALS, eos_token="<|eot|>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def load_reference(folder: Path, conditional: bool = False):
    import transformers

    cls = transformers.Llama4ForConditionalGeneration if conditional else transformers.Llama4ForCausalLM
    return cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = make_llama4_checkpoint(tmp_path_factory.mktemp(request.param) / "l4", **VARIANTS[request.param])
    return request.param, folder


def _waves() -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds sharing a 21-token prefix (the second hits the prefix cache); prompts up to 30
    tokens, four chunks of 8."""
    return waves(250, first=30, last=19)  # ids below the chat format's specials (266-269)


def test_engine_greedy_token_exact(variant):
    """Token-exact with transformers in fp32, through 16-token prefill chunks and prefix-cache hits."""
    name, folder = variant
    llm = LLM(str(folder), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    arch = model.arch
    moe = [isinstance(layer.mlp, Llama4MoE) for layer in model.model.layers]
    assert moe == ([False, True, False, True] if name == "top1" else [True, False, True, False])
    chunks = [layer.self_attn.layer_attention.attention_chunk for layer in model.model.layers]
    assert chunks == [8, 8, 8, None] and arch.no_rope_layers == (3,)
    ref = load_reference(folder)
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters())
    check_waves_token_exact(llm, ref, _waves())


def test_chunked_layers_give_blocks_back_token_exact(top1_folder):
    """A pool of 40 blocks of 4 tokens (one layer each: groups of one layer, kv_groups.py) and
    sequences of up to 61 tokens: keeping every block of every layer, one such sequence needs 64. The
    chunked layers give back the blocks before each step's first query's chunk start, so it runs, with
    preemptions, blocks reused, 16-token prefill steps across chunk edges and prefix hits on a shared
    33-token prefix; greedy tokens stay transformers'."""
    from overnight.engine.kv_groups import local_blocks

    llm = LLM(str(top1_folder), **{**ENGINE, "kv_cache_memory_bytes": 40 * 1024, "max_model_len": 64})
    kv = llm.engine.kv  # type: ignore[attr-defined]
    assert kv.num_blocks == 40 and kv.chunks == (None, 8, 8, 8) and kv.group_block_sizes == (4,) * 4
    peak = [0] * 4  # the most blocks one request held, per group
    allocate = kv.allocate

    def watch(req, n, hit=None):
        out = allocate(req, n, hit)
        for g, row in enumerate(kv.req_blocks.get(req.req_id, [])):
            peak[g] = max(peak[g], sum(b is not None for b in row))
        return out

    kv.allocate = watch
    rng = random.Random(1)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]

    prefix = toks(33)
    first = [toks(41), prefix + toks(4)]
    second = [prefix + toks(3), prefix + toks(6), toks(35), toks(31)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate(first, params, use_tqdm=False)
    hits = kv.prefix_hits
    outs += llm.generate(second, params, use_tqdm=False)
    # The prefix's 8 whole blocks (ending on a chunk edge: the chunked groups need none of them) for
    # the second of the wave's prefix prompts (the small pool evicted the first wave's copy).
    assert kv.prefix_hits - hits >= 32
    engine = llm.engine
    assert engine.scheduler.num_preemptions_total > 0 and kv.pool.num_evictions > 0  # type: ignore[attr-defined]
    assert peak[0] == 15 and max(peak[1:]) <= local_blocks(None, 8, 16, 4) < 15  # 60 tokens computed
    ref = load_reference(top1_folder)
    for prompt, out in zip(first + second, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, 20)[0], (
            f"prompt of {len(prompt)} tokens"
        )


@pytest.mark.slow  # the fused MoE and attention kernels through the Triton interpreter
def test_forward_with_kernels_matches_pytorch_path(variant, monkeypatch):
    """The Triton path (chunked paged prefill and decode, fused experts with routing weight 1, RoPE)
    against the PyTorch path on the same model: prefills of 9 and 12 tokens (across a chunk edge),
    then a decode step of both."""
    from overnight.attention.triton_backend import TritonAttentionBackend
    from overnight.kernels import dispatch
    from overnight.kernels.paged_decode import DecodeConfig
    from overnight.kernels.paged_prefill import PrefillConfig
    from tests.kernel_helpers import DEVICE, run_steps

    _, folder = variant
    model = load_model(resolve_source(str(folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model, max_id=250)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    backend = TritonAttentionBackend(
        4, 2, 16, max_num_seqs=4, max_model_len=512, device=DEVICE,
        decode_config=DecodeConfig(block_n=16), prefill_config=PrefillConfig(16, 16, 4, 1),
    )  # fmt: skip
    got = run_steps(model, 250, backend)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_chat_template_through_the_tokenizer(variant):
    """LLM.chat renders the checkpoint's chat template and generates what transformers generates from
    the same template's ids."""
    from transformers import AutoTokenizer

    _, folder = variant
    messages = [{"role": "user", "content": "How many experts does Scout have?"}]
    llm = LLM(str(folder), **ENGINE)
    out = llm.chat(messages, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))[0]
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|begin_of_text|><|header_start|>user<|header_end|>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == ids and ids[0] == 266
    assert list(out.outputs[0].token_ids) == hf_greedy(load_reference(folder), ids, NEW_TOKENS)[0]


def test_conditional_generation_text_prompts(tmp_path):
    """A Llama4ForConditionalGeneration checkpoint: with its tower and text-only (limit_mm_per_prompt
    image 0: the tower's tensors skipped), tokens equal transformers' ConditionalGeneration model's on
    text prompts; text-only refuses a prompt with an image, naming the limit."""
    folder = make_llama4_checkpoint(tmp_path / "l4v", conditional=True, seed=3)
    source = resolve_source(str(folder))
    assert source.arch.architecture == "llama4" and source.arch.vision is not None
    ref = load_reference(folder, conditional=True)
    prompts = _waves()[0]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for limit in (None, {"image": 0}):
        llm = LLM(str(folder), limit_mm_per_prompt=limit, **ENGINE)
        assert llm.engine.runner.model.takes_images is (limit is None)  # type: ignore[attr-defined]
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, NEW_TOKENS)[0]
    image = {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": "https://example.com/cat.png"}}
    with pytest.raises(InvalidRequestError, match="limit_mm_per_prompt image 0"):
        llm.generate([image], params, use_tqdm=False)


def test_run_batch_refuses_the_image_line_by_name(top1_folder, tmp_path):
    """run-batch (the OpenAI-format path) on the text model (Llama4ForCausalLM): a chat line with an
    image_url part fails saying the model takes no images, the text line beside it runs."""
    pytest.importorskip("pydantic")  # run-batch's request models (the server extra)
    from overnight.cli import main
    from tests.batch_helpers import chat_line, read_jsonl, write_jsonl
    from tests.tiny_vl import cpu_flags, data_uri, image

    picture = {"type": "image_url", "image_url": {"url": data_uri(image(32, 32, 1))}}
    lines = [
        chat_line("text", "how many experts", max_tokens=3, temperature=0),
        chat_line("image", [picture, {"type": "text", "text": "what is this"}], max_tokens=3),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    flags = [*cpu_flags(str(top1_folder)), "--max-model-len", "256", "--no-progress"]
    assert main(["run-batch", "-i", str(inp), "-o", str(out), *flags]) == 0
    records = {r["custom_id"]: r for r in read_jsonl(out)}
    assert records["text"]["error"] is None and records["text"]["response"]["status_code"] == 200
    assert records["image"]["response"]["status_code"] == 400
    assert "does not take images" in records["image"]["error"]["message"]


def test_rope_tables_cover_max_model_len(top1_folder):
    """A max_model_len below the model's context sizes the RoPE tables (Scout's config says 10M
    positions: 5 GB of float32 table); the tokens stay transformers'."""
    llm = LLM(str(top1_folder), **ENGINE, max_model_len=64)
    rotary = llm.engine.runner.model.model.layers[0].self_attn.rotary_emb  # type: ignore[attr-defined]
    assert rotary.cos_sin_cache.shape == (64, 16) and rotary.max_position == 512
    prompt = _waves()[0][0]
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == hf_greedy(load_reference(top1_folder), prompt, NEW_TOKENS)[0]


def test_config_reader_and_refusals():
    text = {**TEXT, "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text"}
    arch = arch_from_hf_config(text)
    assert arch.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
    assert [arch.layer_chunk(i) for i in range(4)] == [8, 8, 8, None]
    assert [arch.layer_window(i) for i in range(4)] == [None] * 4  # chunks, not windows
    assert [arch.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (arch.intermediate_size, arch.moe_intermediate_size, arch.shared_expert_intermediate_size) == (
        96,
        32,
        32,
    )
    assert (arch.rope_interleaved, arch.qk_l2_norm, arch.attn_floor_scale, arch.attn_scale) == (
        True,
        True,
        4.0,
        0.5,
    )
    # no_rope_layers as HF writes it (1: the layer rotates); without a chunk size every layer is full
    custom = arch_from_hf_config({**text, "no_rope_layers": [1, 0, 1, 1], "attention_chunk_size": None})
    assert custom.no_rope_layers == (1,) and custom.layer_types == () and custom.attention_chunk_size is None
    nested = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": TEXT,
    }
    assert arch_from_hf_config(nested) == arch
    bad = {
        "hidden_act": ("gelu", "only silu"),
        "num_experts_per_tok": (5, "num_experts_per_tok must be in 1..num_local_experts"),
        "layer_types": (["sliding_attention"] * 4, "layer_types must name"),
        "moe_layers": ([4], "moe_layers must name layers 0..3"),
        "attention_chunk_size": (0, "attention_chunk_size must be positive"),
        "no_rope_layers": ([1, 1], "no_rope_layers must have one entry per layer"),
    }
    for field, (value, words) in bad.items():
        with pytest.raises(ModelLoadError, match=words):
            arch_from_hf_config({**text, field: value})


def test_scout_preset_has_the_published_shape():
    """Llama-4-Scout-17B-16E's text model: 48 layers, every one MoE (16 experts + a shared one), every
    fourth a global NoPE layer, chunks of 8192; 107.8B weights, 108.6B with the vision tower (34 blocks
    of width 1408 on 336-pixel tiles, 144 tokens a tile)."""
    source = resolve_source("llama-4-scout-17b-16e", load_format="dummy")
    arch = source.arch
    assert (arch.num_hidden_layers, arch.hidden_size, arch.num_experts, arch.num_experts_per_tok) == (
        48,
        5120,
        16,
        1,
    )
    assert all(arch.is_moe_layer(i) for i in range(48)) and arch.no_rope_layers == tuple(range(3, 48, 4))
    assert {arch.layer_chunk(i) for i in range(48)} == {8192, None}
    assert arch.rope_scaling_dict() == {
        "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192.0
    }  # fmt: skip
    model = build_model(source, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    vision = arch.vision
    assert vision is not None and vision.num_tokens((1, 24, 24)) == 1 + 144
    assert (arch.num_parameters() - vision.num_parameters()) / 1e9 == pytest.approx(107.8, abs=0.1)
    assert arch.num_parameters() / 1e9 == pytest.approx(108.6, abs=0.1)
    # 17B active: a token's experts (one routed, the shared one), attention and the embedding tables
    active = arch.num_linear_parameters(active_only=True) + 2 * arch.vocab_size * arch.hidden_size
    assert active / 1e9 == pytest.approx(17.2, abs=0.1)
    TPShards(arch, 0, 8).check()  # 40 q heads, 8 KV heads, 8192 / 16384 wide MLPs: all split 8 ways
    # Dummy weights of the same shape, scaled down: they load and run
    small = replace(
        arch, vision=None, num_hidden_layers=4, vocab_size=272, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, max_position_embeddings=64, attention_chunk_size=8,
    )  # fmt: skip
    from tests.kernel_helpers import DEVICE, run_steps

    assert run_steps(load_model(replace(source, arch=small), torch.float32, DEVICE), 250).isfinite().all()
    # Under FP8 the experts are e4m3 as they load (never a bf16 stack): ~102 GiB, one H200's load check
    loading = weight_bytes(arch, torch.bfloat16, fp8_linear=True)
    assert loading == weight_bytes(arch, torch.bfloat16, fp8_linear=True, loaded=True)
    assert loading < 110 * 2**30 < 200 * 2**30 < weight_bytes(arch, torch.bfloat16)  # bf16: 201 GiB


def test_per_expert_checkpoint_layout_loads_the_same_model(top1_folder, tmp_path):
    """Experts stored one tensor per expert and projection (feed_forward.experts.E.gate_proj.weight
    [I, H], ...: the layout of per-expert conversions) load into the same stacks as the fused HF ones."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "per-expert"
    shutil.copytree(top1_folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gate_up, down = tensors.pop(name), tensors.pop(prefix + "down_proj")  # [E, H, 2I], [E, I, H]
        gate, up = gate_up.transpose(1, 2).chunk(2, dim=1)
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}{e}.gate_proj.weight"] = gate[e].contiguous()
            tensors[f"{prefix}{e}.up_proj.weight"] = up[e].contiguous()
            tensors[f"{prefix}{e}.down_proj.weight"] = down[e].T.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    a = dict(load_model(resolve_source(str(folder)), torch.float32, "cpu").named_parameters())
    b = dict(load_model(resolve_source(str(top1_folder)), torch.float32, "cpu").named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- FP8 and tensor parallelism --------------------------------------------------------------------------

MIN_TOP1, MAX_DLOGPROB = 0.75, 0.45  # tests/test_fp8_moe.py says why MoE bounds are looser


@pytest.fixture(scope="module")
def top1_folder(tmp_path_factory):
    return make_llama4_checkpoint(tmp_path_factory.mktemp("top1") / "l4")


def test_online_fp8_experts_at_load(top1_folder):
    """quantization="fp8": the experts e4m3 from the build on, each transposed HF stack quantized per
    row as it loads (the bytes of quantizing the loaded float stack); the router stays in the compute
    dtype, the shared expert and the projections become FP8 layers; the model stays near the float one."""
    import copy

    from overnight.quant.apply import dequantize_model
    from overnight.quant.fp8 import quantize_stacked_per_channel
    from overnight.quant.linear import Fp8Linear
    from tests.parity_helpers import compare

    source = resolve_source(str(top1_folder), quantization="fp8")
    model = load_model(source, torch.float32, "cpu")
    moe = model.model.layers[1].mlp
    assert type(moe.router) is torch.nn.Linear and isinstance(moe.shared_expert.gate_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    float_experts = (
        load_model(resolve_source(str(top1_folder)), torch.float32, "cpu").model.layers[1].mlp.experts
    )
    for name in ("gate_up_proj", "down_proj"):
        data, scale = quantize_stacked_per_channel(getattr(float_experts, name))
        assert torch.equal(getattr(moe.experts, name).view(torch.uint8), data.view(torch.uint8)), name
        assert torch.equal(getattr(moe.experts, name.replace("_proj", "_scale")), scale), name
    agree = compare(model, dequantize_model(copy.deepcopy(model)), [p[:12] for p in _waves()[0]])
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree


def test_tp_shards_equal_slices_of_the_whole_model(top1_folder):
    """Loading rank by rank gives each rank what apply_tp cuts from the whole model: the experts (from
    the transposed HF stacks) and the shared expert by their intermediate size, the dense MLPs by
    intermediate_size_mlp, the router replicated."""
    from tests.tp_helpers import streamed_equals_sliced

    source = resolve_source(str(top1_folder))
    for rank in range(2):
        model = streamed_equals_sliced(source, rank)
        moe = model.model.layers[1].mlp
        assert moe.router.weight.shape == (4, 64) and moe.experts.gate_up_proj.shape == (4, 32, 64)
        assert moe.shared_expert.gate_proj.weight.shape == (16, 64)
        assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (96, 64)
        assert model.model.layers[3].self_attn.num_heads == 2


@pytest.mark.slow  # starts tensor-parallel processes
def test_tp2_matches_tp1(top1_folder):
    from tests.tp_helpers import generate_split

    first, second = _waves()
    prompts = first + second
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    one = LLM(str(top1_folder), **ENGINE).generate(prompts, params, use_tqdm=False)
    two = generate_split(top1_folder, prompts, params, **ENGINE)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
