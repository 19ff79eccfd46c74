"""Tier (c) for images: Qwen2.5-VL and Qwen3-VL against transformers, token-exact greedy in fp32, on tiny
random checkpoints: text-only prompts, one image, two images of different sizes, all in one batch; through
LLM.generate with multi_modal_data and LLM.chat with image_url parts. Also the encoder cache: an image
repeated over many prompts is encoded once."""

from __future__ import annotations

import pytest
import torch

from overnight import LLM, SamplingParams
from tests.tiny_vl import IMAGE_PAD, data_uri, hf_greedy, image, make_vl_checkpoint, words

NEW = 8
PLACEHOLDER = "<|vision_start|> <|image_pad|> <|vision_end|>"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def vl(request, tmp_path_factory):
    folder = make_vl_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    # Small chunks: prompts are prefilled in several steps, some ending inside an image's tokens.
    llm = LLM(
        folder, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=24, max_model_len=256
    )
    from transformers import AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, llm, ref


def _cases(kind: str):
    p = 14 if kind == "qwen2_5_vl" else 16
    small, wide = image(2 * p, 2 * p, 1), image(4 * p, 6 * p, 2)
    return [
        (words(7, 0), []),
        (f"{words(3, 1)} {PLACEHOLDER} {words(4, 2)}", [wide]),
        (f"{PLACEHOLDER} {words(2, 3)} {PLACEHOLDER} {words(5, 4)}", [small, wide]),
        (f"{words(20, 5)} {PLACEHOLDER}", [image(6 * p, 4 * p, 3)]),
    ]


def test_generate_multi_modal_data_token_exact(vl):
    kind, folder, llm, ref = vl
    cases = _cases(kind)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text for text, imgs in cases
    ]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for (text, imgs), out in zip(cases, outs):
        expected = hf_greedy(folder, tok.encode(text), imgs, NEW, ref)
        assert out.outputs[0].token_ids == expected, text
        if imgs:
            assert out.prompt_token_ids.count(IMAGE_PAD) > len(imgs)  # placeholders expanded


def test_chat_image_url_parts_match_generate(vl):
    kind, folder, llm, ref = vl
    p = 14 if kind == "qwen2_5_vl" else 16
    img = image(4 * p, 2 * p, 7)
    conv = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(img)}},
                {"type": "text", "text": words(4, 9)},
            ],
        }
    ]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    out = llm.chat(conv, params, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    text = tok.render_chat(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words(4, 9)}]}]
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert out.outputs[0].token_ids == hf_greedy(folder, ids, [img], NEW, ref)


def test_repeated_image_is_encoded_once(vl):
    kind, folder, llm, ref = vl
    runner = llm.engine.runner  # type: ignore[attr-defined]
    p = 14 if kind == "qwen2_5_vl" else 16
    img = image(4 * p, 4 * p, 11)
    before = runner.vision.images_encoded
    prompts = [
        {"prompt": f"{words(i + 1, i)} {PLACEHOLDER}", "multi_modal_data": {"image": img}} for i in range(6)
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(outs) == 6
    assert runner.vision.images_encoded - before == 1


def test_fused_experts_load_from_either_layout():
    """Qwen3-VL-MoE's fused experts: transformers 5 saves [E, 2I, H] / [E, H, I], the published
    checkpoints [E, H, 2I] / [E, I, H]; both split into the same per-expert tensors."""
    from overnight.arch import ModelArch
    from overnight.models.qwen_vl import _per_expert

    arch = ModelArch("qwen3_vl_moe", 10, 8, 16, 1, 2, 2, 4, num_experts=3, moe_intermediate_size=6)
    gate_up, down = torch.randn(3, 12, 8), torch.randn(3, 8, 6)
    names = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    ours = dict(_per_expert(zip(names, (gate_up, down)), arch))
    published = dict(_per_expert(zip(names, (gate_up.transpose(1, 2), down.transpose(1, 2))), arch))
    assert len(ours) == 9 and ours.keys() == published.keys()
    for k in ours:
        assert torch.equal(ours[k], published[k]), k
    assert torch.equal(ours["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 6:])


def test_parameter_count_includes_the_tower(vl):
    """ModelArch.num_parameters (the memory check's count) equals the built model's, tower included."""
    import json

    from overnight.models.registry import arch_from_hf_config, get_model_class

    kind, folder, llm, ref = vl
    with open(f"{folder}/config.json") as f:
        arch = arch_from_hf_config(json.load(f))
    with torch.device("meta"):
        model = get_model_class(arch.architecture)(arch)
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
