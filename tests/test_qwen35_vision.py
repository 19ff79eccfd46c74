"""Tier (c) for Qwen3.5 with images: Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration against transformers, token-exact greedy in fp32, on tiny random
checkpoints (tests/tiny_vl.py: a hybrid decoder of linear and full attention layers, M-RoPE sections
that reach all three axes): text-only prompts, one image, two images of different sizes, all in one
batch, through LLM.generate with multi_modal_data, LLM.chat with image_url parts and run-batch chat
lines; a prefill chunk that ends inside an image's tokens; preempted image requests; and prefix caching
with images, where a hit restores the linear layers' state snapshot: a repeated image is encoded once,
a shared prefix holding an image is hit by a second wave, the same text with another image of the same
size is not, and a hit may end inside an image. Plus the config reading."""

from __future__ import annotations

import json

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from tests.batch_helpers import chat_line, read_jsonl, write_jsonl
from tests.tiny_vl import IMAGE_PAD, cpu_flags, data_uri, hf_greedy, image, make_vl_checkpoint, words

NEW = 6
P = 16  # patch size: an image of (a P) x (b P) pixels has a * b / 4 tokens
PLACEHOLDER = "<|vision_start|> <|image_pad|> <|vision_end|>"
CHUNK = 12  # prefill tokens per step: a 16-token image always spans two chunks


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def q35(request, tmp_path_factory):
    folder = make_vl_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    llm = LLM(
        folder,
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        block_size=4,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
        max_model_len=256,
    )
    from transformers import AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, llm, ref


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def check(llm: LLM, folder, ref, cases: list[tuple[str, list]]) -> list[list[int]]:
    """Generate every case in one batch; each must equal transformers' greedy tokens."""
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in cases]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    tok = llm.get_tokenizer()
    got = []
    for (text, imgs), out in zip(cases, outs):
        ids = list(out.outputs[0].token_ids)
        assert ids == hf_greedy(folder, tok.encode(text), imgs, NEW, ref), text
        got.append(ids)
    return got


def test_generate_multi_modal_data_token_exact(q35):
    kind, folder, llm, ref = q35
    small, wide = image(2 * P, 2 * P, 1), image(4 * P, 6 * P, 2)
    cases = [
        (words(7, 0), []),
        (f"{words(3, 1)} {PLACEHOLDER} {words(4, 2)}", [wide]),
        (f"{PLACEHOLDER} {words(2, 3)} {PLACEHOLDER} {words(5, 4)}", [small, wide]),
        (f"{words(20, 5)} {PLACEHOLDER}", [image(8 * P, 6 * P, 3)]),
    ]
    outs = check(llm, folder, ref, cases)
    # The image decides the tokens (a test that would pass with the image ignored proves nothing).
    other = check(llm, folder, ref, [(cases[1][0], [image(4 * P, 6 * P, 9)])])
    assert other[0] != outs[1]


def test_prefill_chunk_ends_inside_an_image(q35, monkeypatch):
    kind, folder, llm, ref = q35
    vision = llm.engine.runner.vision  # type: ignore[attr-defined]
    rows_per_step: list[int] = []
    real_rows = vision.rows

    def counting_rows(scheduled):
        out = real_rows(scheduled)
        if out is not None:
            rows_per_step.append(int(out.rows.numel()))
        return out

    monkeypatch.setattr(vision, "rows", counting_rows)
    img = image(8 * P, 8 * P, 4)  # 16 image tokens, more than a chunk
    check(llm, folder, ref, [(f"{words(5, 6)} {PLACEHOLDER} {words(3, 7)}", [img])])
    assert sum(rows_per_step) == 16 and len(rows_per_step) >= 2, rows_per_step


def test_chat_image_url_parts_token_exact(q35):
    kind, folder, llm, ref = q35
    img = image(4 * P, 2 * P, 7)
    text = words(4, 9)
    conv = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(img)}},
                {"type": "text", "text": text},
            ],
        }
    ]
    out = llm.chat(conv, greedy(), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    rendered = tok.render_chat(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    )
    ids = tok.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].token_ids == hf_greedy(folder, ids, [img], NEW, ref)
    assert out.prompt_token_ids.count(IMAGE_PAD) == 2  # (4 x 2 patches) / 4


def test_run_batch_chat_lines_with_images(q35, tmp_path):
    """run-batch builds its own engine from the flags: its chat lines with image_url parts answer as
    LLM.chat does (token-exact with transformers above); a bad image fails its line only."""
    from overnight.cli import main

    kind, folder, llm, ref = q35
    parts = {
        "text": [{"type": "text", "text": words(5, 1)}],
        "two": [
            {"type": "image_url", "image_url": {"url": data_uri(image(2 * P, 2 * P, 13))}},
            {"type": "text", "text": words(3, 2)},
            {"type": "image_url", "image_url": {"url": data_uri(image(4 * P, 6 * P, 14))}},
        ],
        "bad": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}],
    }
    body = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [chat_line(cid, p, **body) for cid, p in parts.items()])
    flags = cpu_flags(folder)
    assert (
        main(["run-batch", "-i", str(inp), "-o", str(out), "--max-model-len", "256", "--no-progress", *flags])
        == 0
    )
    records = {r["custom_id"]: r for r in read_jsonl(out)}
    assert "cannot decode image" in records["bad"]["error"]["message"]
    for cid in ("text", "two"):
        conv = [{"role": "user", "content": parts[cid]}]
        want = llm.chat(conv, greedy(), use_tqdm=False)[0].outputs[0].text
        assert records[cid]["response"]["body"]["choices"][0]["message"]["content"] == want, cid


def test_prefix_cache_with_images_restores_states_and_keys_on_pixels(q35):
    """A system prompt holding an image: the first wave computes it (and saves the linear layers'
    state at its end), the second starts past it from that snapshot, the image encoded once in all.
    The same text with another image of the same size hits nothing past the image's first block; a
    repeated prompt resumes from a snapshot inside its image."""
    kind, folder, llm, ref = q35
    engine = llm.engine  # type: ignore[attr-defined]
    vision = engine.runner.vision
    x, y = image(4 * P, 4 * P, 11), image(4 * P, 4 * P, 12)
    head = words(3, 20)  # 3 tokens, then <|vision_start|>: the image starts at token 4
    system = f"{head} {PLACEHOLDER} {words(14, 21)}"  # 3 + 1 + 4 + 1 + 14 = 23 tokens
    encoded, hits = vision.images_encoded, engine.stats().prefix_cache_hits
    first = check(llm, folder, ref, [(f"{system} {words(k, 30 + k)}", [x]) for k in (3, 6)])
    assert vision.images_encoded - encoded == 1  # one image over the batch
    hits = engine.stats().prefix_cache_hits
    check(llm, folder, ref, [(f"{system} {words(k, 40 + k)}", [x]) for k in (2, 5)])
    assert engine.stats().prefix_cache_hits - hits >= 2 * 20  # both start past 5 of its blocks
    assert vision.images_encoded - encoded == 1
    # Another image, same placeholders: the block hashes differ from the image's first block on, so
    # at most the 4 tokens before it may hit; the image is encoded and the tokens follow it.
    hits = engine.stats().prefix_cache_hits
    again = check(llm, folder, ref, [(f"{system} {words(3, 33)}", [y])])
    assert engine.stats().prefix_cache_hits - hits <= 4
    assert vision.images_encoded - encoded == 2
    assert again[0] != first[0]
    # A prompt run again hits up to its last boundary (16 of its 20 tokens), inside its image (tokens
    # 3-18): the repeat restores the state there and computes the image's last 3 rows and the rest.
    alone = (f"{words(2, 90)} {PLACEHOLDER}", [image(8 * P, 8 * P, 91)])
    solo = check(llm, folder, ref, [alone])
    hits = engine.stats().prefix_cache_hits
    assert check(llm, folder, ref, [alone]) == solo
    assert engine.stats().prefix_cache_hits - hits == 16


def test_preempted_image_requests_resume_token_exact(q35):
    """A pool too small for the batch: requests with images are preempted and resumed (from a zero
    state or a snapshot of their own prefix, their images re-read from the encoder cache)."""
    kind, folder, _, ref = q35
    if kind != "qwen3_5":
        pytest.skip("one family is enough for preemption")
    from overnight.models.registry import arch_from_hf_config

    with open(f"{folder}/config.json") as f:
        arch = arch_from_hf_config(json.load(f))
    seqs, snapshots, blocks = 5, 4, 24  # each request grows to 8-9 blocks of 4 tokens
    state = arch.linear_state_bytes() * (seqs + 1 + snapshots)
    llm = LLM(
        folder,
        dtype="float32",
        kv_cache_memory_bytes=state + blocks * 4 * arch.kv_bytes_per_token(4),
        block_size=4,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=seqs,
        max_model_len=64,
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
    )
    assert llm.engine.pool_plan.num_blocks == blocks  # type: ignore[attr-defined]
    cases = [
        (f"{words(2 + k, 50 + k)} {PLACEHOLDER} {words(3, 60 + k)}", [image(8 * P, 4 * P, 70 + k)])
        for k in range(4)
    ]
    cases.append(
        (f"{PLACEHOLDER} {words(2, 80)} {PLACEHOLDER}", [image(2 * P, 2 * P, 81), image(4 * P, 4 * P, 82)])
    )
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    tok = llm.get_tokenizer()
    for (text, imgs), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(folder, tok.encode(text), imgs, 16, ref), text
    assert llm.engine.stats().num_preemptions_total > 0  # type: ignore[attr-defined]


# -- config.json -> ModelArch ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def q35_config(tmp_path_factory) -> dict:
    folder = make_vl_checkpoint(tmp_path_factory.mktemp("cfg"), "qwen3_5_moe")
    with open(f"{folder}/config.json") as f:
        return json.load(f)


def test_config_reads_tower_and_mrope(q35_config):
    from overnight.models.qwen3_5_vl import Qwen3_5ForConditionalGeneration
    from overnight.models.qwen3_next import Qwen3NextForCausalLM
    from overnight.models.registry import arch_from_hf_config, model_class_for

    arch = arch_from_hf_config(q35_config)
    assert arch.architecture == "qwen3_5_moe" and arch.num_linear_layers == 2
    assert arch.mrope_section == (2, 3, 3) and arch.mrope_interleaved and arch.hybrid_rotary_dim == 16
    assert arch.vision is not None and arch.vision.kind == "qwen3_vl"
    assert arch.vision.deepstack_visual_indexes == ()
    assert model_class_for(arch) is Qwen3_5ForConditionalGeneration
    with torch.device("meta"):
        model = model_class_for(arch)(arch)
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())  # the tower counted
    # transformers' default sections when the config has none
    text = {**q35_config["text_config"]}
    text["rope_parameters"] = {k: v for k, v in text["rope_parameters"].items() if k != "mrope_section"}
    assert arch_from_hf_config({**q35_config, "text_config": text}).mrope_section == (11, 11, 10)
    # no vision_config (the dummy presets): the text model alone
    bare = {k: v for k, v in q35_config.items() if k != "vision_config"}
    text_only = arch_from_hf_config(bare)
    assert text_only.vision is None and not text_only.mrope_section
    assert model_class_for(text_only) is Qwen3NextForCausalLM
    # a CausalLM checkpoint is the text model whatever else its config holds
    causal = arch_from_hf_config({**q35_config, "architectures": ["Qwen3_5MoeForCausalLM"]})
    assert causal.vision is None and model_class_for(causal) is Qwen3NextForCausalLM


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text_config": {"rope_parameters": {"mrope_section": [4, 4]}}}, "mrope_section"),
        ({"vision_config": {"out_hidden_size": 48}}, "out_hidden_size"),
        ({"vision_config": {"num_position_embeddings": 15}}, "num_position_embeddings"),
        ({"image_token_id": None}, "image_token_id"),
    ],
)
def test_config_refuses_bad_vision_fields(q35_config, change, message):
    from overnight.models.registry import arch_from_hf_config

    cfg = json.loads(json.dumps(q35_config))
    for key, value in change.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    cfg[key][sub] = {**cfg[key][sub], **v}
                else:
                    cfg[key][sub] = v
        else:
            cfg[key] = value
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config(cfg)
