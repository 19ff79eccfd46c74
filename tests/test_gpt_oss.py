"""gpt-oss on the CPU: the engine against transformers, token-exact greedy in fp32, on tiny random
checkpoints (sinks, a window shorter than the prompts, 6 experts, top-3), from the float layout and from
the published MXFP4 layout; the MXFP4 dequantizer bit-exact against transformers' own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

pytestmark = pytest.mark.slow  # real engines beside transformers

WINDOW = 6
NEW_TOKENS = 10


def _config(**overrides):
    import transformers

    return transformers.GptOssConfig(
        **{
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 6,
            "num_experts_per_tok": 3,
            "sliding_window": WINDOW,
            "max_position_embeddings": 512,
            # YaRN as the published configs have it (truncate false), on a short original context so the
            # prompts reach the scaled band.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
            "bos_token_id": 1,
            "eos_token_id": 2,
            **overrides,
        }
    )


@torch.no_grad()
def _spread(model: torch.nn.Module, seed: int) -> None:
    """Weights with a larger spread than the default init, so greedy picks have no near-ties; the
    experts' gate/up outputs are large enough for the SwiGLU's clamp (limit 7) to act."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
        elif name.endswith(("bias", "sinks")):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "experts.gate_up_proj" in name:  # [E, in, out]
            p.copy_(4 * torch.randn(p.shape, generator=gen) / p.shape[-2] ** 0.5)
        elif "experts.down_proj" in name:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-2] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _write(folder: Path, model) -> Path:
    import transformers

    model.save_pretrained(folder)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2], do_sample=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_config()).eval()
    _spread(model, 0)
    return _write(tmp_path_factory.mktemp("gpt-oss") / "float", model)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory, float_folder):
    """The float checkpoint's experts quantized to MXFP4 (write_mxfp4)."""
    return write_mxfp4(float_folder, tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def write_mxfp4(float_folder: Path, root: Path) -> tuple[Path, Path]:
    """The float checkpoint's experts quantized to MXFP4, written as the published checkpoints are
    (<proj>_blocks [E, out, in/32, 16] and <proj>_scales [E, out, in/32], quantization_config mxfp4);
    returns (folder, the float folder of the same model with the experts dequantized: the reference)."""
    tensors = load_file(str(float_folder / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2).contiguous())  # rows = outputs
            packed[name + "_blocks"] = blocks
            packed[name + "_scales"] = scales
            dequantized[name] = dequantize_mxfp4(packed[name + "_blocks"], scales, t.dtype).transpose(1, 2)
        else:
            packed[name] = dequantized[name] = t
    config = json.loads((float_folder / "config.json").read_text())
    folders = {}
    for kind, data, qc in (
        ("mxfp4", packed, {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}),
        ("dequantized", dequantized, None),
    ):
        folder = root / kind
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in data.items()}, str(folder / "model.safetensors"))
        for extra in ("generation_config.json",):
            (folder / extra).write_text((float_folder / extra).read_text())
        (folder / "config.json").write_text(
            json.dumps({**config, **({"quantization_config": qc} if qc else {})})
        )
        folders[kind] = folder
    return folders["mxfp4"], folders["dequantized"]


def _reference(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            eos_token_id=[],
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, vocab, (2 * WINDOW + 3,), generator=gen).tolist()  # longer than the window
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 4, WINDOW, 3 * WINDOW + 1)]
    prompts += [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (2, 5)]
    return prompts


def _engine_tokens(folder: Path, prompts: list[list[int]], **options) -> list[list[int]]:
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", **options)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_float_checkpoint_token_exact(float_folder):
    ref = _reference(float_folder)
    prompts = _prompts(ref.config.vocab_size)
    expected = [_hf_greedy(ref, p) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1
    # one batch with prefix caching; then chunked prefill across the window edge and a tiny pool
    assert _engine_tokens(float_folder, prompts, kv_cache_memory_bytes=16 << 20) == expected
    chunked = _engine_tokens(
        float_folder, prompts, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=5, max_num_seqs=4
    )
    assert chunked == expected


def test_preemption_keeps_tokens(float_folder):
    ref = _reference(float_folder)
    prompts = _prompts(ref.config.vocab_size)
    expected = [_hf_greedy(ref, p, 24) for p in prompts]
    # A pool of 64 tokens holds about two of these requests at once: admitting whatever fits now
    # (greedy), the scheduler must preempt.
    pool = 64 * 2 * 3 * 2 * 16 * 4  # tokens x K/V x layers x KV heads x head_dim x fp32 bytes
    llm = LLM(
        str(float_folder),
        skip_tokenizer_init=True,
        dtype="float32",
        kv_cache_memory_bytes=pool,
        max_model_len=64,
        admission="greedy",
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_mxfp4_dequantizer_bit_exact_with_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(
            1, 2
        )  # undo their [E, in, out]
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), theirs)
    w = torch.randn(5, 64, generator=gen)
    b, s = quantize_mxfp4(w)
    back = dequantize_mxfp4(b, s, torch.float32)
    assert float((back - w).abs().max()) <= float(w.abs().max()) / 4  # e2m1's spacing at the top, no more


def test_mxfp4_checkpoint_token_exact_with_its_dequantized_model(mxfp4_folder):
    packed, dequantized = mxfp4_folder
    ref = _reference(dequantized)
    prompts = _prompts(ref.config.vocab_size)
    expected = [_hf_greedy(ref, p) for p in prompts]
    assert _engine_tokens(packed, prompts, kv_cache_memory_bytes=16 << 20) == expected


def test_mxfp4_half_pair_is_refused(mxfp4_folder, tmp_path):
    packed, _ = mxfp4_folder
    tensors = load_file(str(packed / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    for f in ("config.json", "generation_config.json"):
        (tmp_path / f).write_text((packed / f).read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj_scales"):
        LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=16 << 20)


def test_mxfp4_experts_through_the_fused_kernels(mxfp4_folder, monkeypatch):
    """The packed experts through the fused Triton GEMMs (decoding MXFP4 tiles in registers; compiled on a
    GPU, the interpreter on the CPU) against the path that dequantizes the experts it runs. Only the MoE
    layer's path flips (router and experts); model, cache and inputs sit on DEVICE, since a kernel on a
    GPU host cannot read CPU tensors."""
    import overnight.layers.moe as moe
    from overnight.attention.metadata import AttentionBatch
    from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata
    from overnight.loader.model_loader import load_model
    from overnight.loader.resolve import resolve_source
    from tests.kernel_helpers import DEVICE

    packed, _ = mxfp4_folder
    model = load_model(resolve_source(str(packed)), torch.float32, DEVICE)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.uint8 and experts.gate_up_scales is not None

    def forward() -> torch.Tensor:
        arch = model.arch
        caches = [
            torch.zeros(2, 8, 4, arch.num_key_value_heads, arch.head_dim, device=DEVICE)
            for _ in range(arch.num_hidden_layers)
        ]
        meta = build_metadata([9, 5], [9, 5], [[5, 2, 7], [1, 3]], 4, device=DEVICE)
        ids = torch.randint(3, arch.vocab_size, (14,), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(9), torch.arange(5)])
        with torch.inference_mode():
            return model.compute_logits(
                model(ids.to(DEVICE), pos.to(DEVICE), AttentionBatch(meta, caches, TorchAttentionBackend()))
            )

    monkeypatch.setattr(moe, "use_kernels", lambda x: False)  # on a GPU it would pick the kernels
    expected = forward()
    monkeypatch.setattr(moe, "use_kernels", lambda x: True)
    got = forward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("mxfp4", [False, True])
def test_weight_bytes_count_what_the_model_holds(mxfp4):
    """ModelArch.weight_bytes (the memory check, `overnight budget`) equals the bytes of the built
    model's parameters, with MXFP4 experts as they are kept (half a byte a weight and a scale per 32)."""
    from overnight.loader.model_loader import build_model
    from overnight.loader.source import ModelSource
    from overnight.models.registry import arch_from_hf_config

    cfg = {**_config().to_dict(), "hidden_size": 64, "intermediate_size": 96}
    if mxfp4:
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
    arch = arch_from_hf_config(cfg)
    assert arch.experts_mxfp4 == mxfp4
    source = ModelSource("dummy", "x", arch, "GptOssForCausalLM", None, (), None, None, "x")
    model = build_model(source, torch.bfloat16, "meta")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert arch.weight_bytes(2) == held
    if not mxfp4:
        assert arch.num_parameters() == sum(p.numel() for p in model.parameters())


def test_gpt_oss_120b_fits_one_h200_in_mxfp4():
    """The published 120b shapes: MXFP4 experts make the weights about 61 GiB, leaving most of an H200's
    141 GiB for the KV pool; in bf16 they would not fit at all."""
    import json

    from overnight.loader.resolve import PRESETS_DIR
    from overnight.models.registry import arch_from_hf_config

    cfg = json.loads((Path(PRESETS_DIR) / "gpt-oss-120b.json").read_text())
    cfg["rope_scaling"] = None  # the byte count does not depend on RoPE
    arch = arch_from_hf_config(cfg)
    gib = arch.weight_bytes(2) / 2**30
    assert 55 < gib < 70, gib
    assert arch.num_parameters() * 2 / 2**30 > 141
