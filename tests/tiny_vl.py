"""What the image tests share: a word-level tokenizer builder, transformers' processor-and-generate
reference, the token-exact check against it, and one run-batch / server test body (InternVL, Mistral 3,
Gemma 3 and Qwen use them); images, data URIs, words and CLI flags. And the tiny random Qwen2-VL / Qwen2.5-VL /
Qwen3-VL / Qwen3.5 (dense and MoE) checkpoints (vision towers of depth 2, width 32) with a tokenizer
holding Qwen's image special tokens and a chat template that renders image parts as
<|vision_start|><|image_pad|><|vision_end|>, plus the image processor's preprocessor_config.json."""

from __future__ import annotations

import base64
import io
import os
import random
from typing import Any

import numpy as np
import pytest
import torch

from tests.tiny_hybrid import LINEAR_LAYERS

SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
ROLES = ["system", "user", "assistant"]
VOCAB = 256
WORDS = [f"w{i}" for i in range(len(SPECIALS) + len(ROLES), VOCAB)]
TOKENS = SPECIALS + ROLES + WORDS
IMAGE_PAD = TOKENS.index("<|image_pad|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }} {% else %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% endif %}{% endfor %}{% endif %} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
PATCH = {
    "qwen2_vl": 14,
    "qwen2_5_vl": 14,
    "qwen3_vl": 16,
    "qwen3_vl_moe": 16,
    "qwen3_5": 16,
    "qwen3_5_moe": 16,
}
# Qwen3.5's hybrid decoder: linear and full attention layers; M-RoPE over half of each head (rotary 16,
# sections [2, 3, 3] fill its 8 frequencies, so all three axes turn some).
HYBRID_TEXT: dict[str, Any] = dict(
    head_dim=32,
    **LINEAR_LAYERS,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)


def save_word_tokenizer(
    folder: str,
    ids: dict[str, int],
    specials: list[str],
    chat_template: str,
    added: tuple[str, ...] = (),
    **named: Any,
) -> None:
    """A word-level tokenizer saved in folder: one token per whitespace-separated word of `ids`
    (decoded joined by spaces), `specials` its special tokens, `added` plain tokens kept verbatim
    (Gemma's "\n\n"); `named` PreTrainedTokenizerFast's token roles (eos_token=..., and so on)."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = RustTokenizer(WordLevel(ids, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    if added:
        backend.add_tokens([AddedToken(t, normalized=False) for t in added])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", chat_template=chat_template, **named
    )
    hf_tok.save_pretrained(folder)


class ProcessorReference:
    """transformers' own processor for a model (its PIL image processor) and greedy generate, one
    prompt at a time: the reference of the image tests."""

    def __init__(self, folder: str, processor: Any) -> None:
        from transformers import AutoModelForImageTextToText

        self.processor = processor
        self.model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()

    def greedy(
        self, text: str, images: list[Any], new_tokens: int
    ) -> tuple[list[int], list[int], list[float]]:
        """(the processor's prompt ids, the generated ids, each generated token's logprob)."""
        out = self.processor(text=text, images=images or None, return_tensors="pt")
        ids = out.pop("input_ids")
        with torch.inference_mode():
            gen = self.model.generate(
                ids,
                eos_token_id=[],
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
                **out,
            )
        tokens = gen.sequences[0, ids.shape[1] :].tolist()
        lps = [float(s[0].log_softmax(-1)[t]) for s, t in zip(gen.scores, tokens)]
        return ids[0].tolist(), tokens, lps


def check_greedy(out: Any, ref: ProcessorReference, text: str, imgs: list, new_tokens: int) -> None:
    """One output of ours (greedy, logprobs=0) token-exact with transformers' on the same prompt: the
    processor's prompt ids (its expansion of each image into the model's image tokens), the generated
    ids, and each token's logprob within 1e-4."""
    ids, tokens, lps = ref.greedy(text, imgs, new_tokens)
    assert out.prompt_token_ids == ids, text
    assert out.outputs[0].token_ids == tokens, text
    ours = [
        next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
        for d, t in zip(out.outputs[0].logprobs, tokens)
    ]
    np.testing.assert_allclose(ours, lps, atol=1e-4)


def make_vl_checkpoint(root: str | os.PathLike, kind: str, seed: int = 0) -> str:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = os.path.join(str(root), kind)
    ids = {t: i for i, t in enumerate(TOKENS)}
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=None,
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, spatial_merge_size=2
    )
    torch.manual_seed(seed)
    if kind == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        # Qwen2-VL's vision_config: embed_dim is the tower's width, hidden_size the merger's output.
        cfg = Qwen2VLConfig(
            text_config=text,
            vision_config=dict(
                depth=2,
                embed_dim=32,
                mlp_ratio=2,
                num_heads=2,
                hidden_size=64,
                spatial_merge_size=2,
                patch_size=14,
            ),
            **common,
        )
        model: Any = Qwen2VLForConditionalGeneration(cfg)
    elif kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        cfg = Qwen2_5_VLConfig(
            text_config=text,
            # MLP width 58 (7B's is 3420): not a multiple of qwen_vit.WIDTH_MULTIPLE, so loading pads it
            vision_config={
                **vision,
                "intermediate_size": 58,
                "patch_size": 14,
                "window_size": 56,
                "fullatt_block_indexes": [1],
            },
            **common,
        )
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        import transformers

        from tests.tiny_models import _spread_weights

        text.update(HYBRID_TEXT)
        qwen35_vision = {**vision, "patch_size": 16, "num_position_embeddings": 16}
        if kind == "qwen3_5":
            text["intermediate_size"] = 96
            cfg = transformers.Qwen3_5Config(text_config=text, vision_config=qwen35_vision, **common)
            model = transformers.Qwen3_5ForConditionalGeneration(cfg)
        else:
            text.update(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=32,
            )
            cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=qwen35_vision, **common)
            model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
        # The hybrid tests' spread (unit-variance projections, norms near 1): the delta rule stays tame.
        with torch.no_grad():
            _spread_weights(model, seed)
        model.eval()
    elif kind == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        text["head_dim"] = 16
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        }
        cfg = Qwen3VLMoeConfig(
            text_config=text,
            vision_config={
                **vision,
                "patch_size": 16,
                "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0, 1],
            },
            **common,
        )
        model = Qwen3VLMoeForConditionalGeneration(cfg)
    else:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        text["head_dim"] = 16
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        }
        cfg = Qwen3VLConfig(
            text_config=text,
            vision_config={
                **vision,
                "patch_size": 16,
                "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0, 1],
            },
            **common,
        )
        model = Qwen3VLForConditionalGeneration(cfg)
    if kind not in ("qwen3_5", "qwen3_5_moe"):
        # Spread the random weights so greedy tokens differ from prompt to prompt.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2 if p.dim() > 1 else 0.05)
    model.save_pretrained(folder)

    save_word_tokenizer(folder, ids, SPECIALS, CHAT_TEMPLATE, eos_token="<|im_end|>")
    p = PATCH[kind]
    Qwen2VLImageProcessorPil(
        patch_size=p, merge_size=2, temporal_patch_size=2, min_pixels=(2 * p) ** 2, max_pixels=(8 * p) ** 2
    ).save_pretrained(folder)
    return folder


def image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def cpu_flags(folder: str) -> list[str]:
    """The engine flags of the image tests' CLI runs: the tiny checkpoint in float32 on the CPU, an
    8 MiB KV pool."""
    return [
        "--model",
        folder,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--kv-cache-memory-bytes",
        str(8 << 20),
    ]


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(img) -> str:
    """The image as a PNG data URI, as a chat message's image_url carries it."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def words(n: int, seed: int, vocabulary: list[str] = WORDS) -> str:
    """n words of the tokenizer's vocabulary (each one token), drawn with `seed`."""
    rng = random.Random(seed)
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def hf_greedy(
    folder: str, ids: list[int], images: list[Any], new_tokens: int, model: Any = None
) -> list[int]:
    """transformers' greedy generate on one prompt (ids with one image pad per image), its images
    preprocessed by the same HF image processor."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = model or AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    kwargs: dict[str, Any] = {}
    expanded = list(ids)
    if images:
        proc = Qwen2VLImageProcessorPil.from_pretrained(folder)
        out = proc(images=images, return_tensors="pt")
        kwargs["pixel_values"] = out["pixel_values"]
        kwargs["image_grid_thw"] = out["image_grid_thw"]
        counts = (out["image_grid_thw"].prod(-1) // 4).tolist()
        expanded = []
        k = 0
        for t in ids:
            if t == IMAGE_PAD:
                expanded.extend([IMAGE_PAD] * counts[k])
                k += 1
            else:
                expanded.append(t)
    input_ids = torch.tensor([expanded])
    kwargs["mm_token_type_ids"] = (input_ids == IMAGE_PAD).int()
    with torch.inference_mode():
        gen = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            eos_token_id=[],
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return gen[0, input_ids.shape[1] :].tolist()


def check_run_batch_and_server(
    llm: Any, folder: str, vocabulary: list[str], tmp_path: Any, max_model_len: int, new_tokens: int
) -> None:
    """run-batch lines (an engine of their own, built from the flags) and the server through the official
    client answer image chats as llm.chat does (text only, two images, a bad image); the bad image fails
    its line or its request only. Skips without the openai client or the server's packages."""
    openai = pytest.importorskip("openai")  # the official client
    pytest.importorskip("fastapi")  # the server's packages (the `server` extra)
    pytest.importorskip("uvicorn")
    from overnight import SamplingParams
    from overnight.cli import main
    from overnight.server.background import BackgroundServer
    from overnight.server.cli import ServerOptions, make_app
    from tests.batch_helpers import chat_line, read_jsonl, write_jsonl

    def picture(w: int, h: int, seed: int) -> dict:
        return {"type": "image_url", "image_url": {"url": data_uri(image(w, h, seed))}}

    parts = {
        "text": [{"type": "text", "text": words(5, 11, vocabulary)}],
        "two": [picture(70, 35, 13), {"type": "text", "text": words(3, 12, vocabulary)}, picture(40, 90, 14)],
        "bad": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}],
    }
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    want = {
        cid: llm.chat([{"role": "user", "content": parts[cid]}], params, use_tqdm=False)[0].outputs[0].text
        for cid in ("text", "two")
    }
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    write_jsonl(inp, [chat_line(cid, p, **body) for cid, p in parts.items()])
    argv = [
        "run-batch",
        "-i",
        str(inp),
        "-o",
        str(out),
        "--max-model-len",
        str(max_model_len),
        "--no-progress",
    ]
    assert main([*argv, *cpu_flags(folder)]) == 0
    records = {r["custom_id"]: r for r in read_jsonl(out)}
    assert "cannot decode image" in records["bad"]["error"]["message"]
    for cid, text in want.items():
        assert records[cid]["response"]["body"]["choices"][0]["message"]["content"] == text, cid

    app = make_app(llm.engine, ServerOptions(), images=llm._images)
    with BackgroundServer(app) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        conv = [{"role": "user", "content": parts["two"]}]
        reply = client.chat.completions.create(
            model=model, messages=conv, max_tokens=new_tokens, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].message.content == want["two"]
        with pytest.raises(openai.BadRequestError, match="cannot decode image"):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": parts["bad"]}], max_tokens=2
            )
