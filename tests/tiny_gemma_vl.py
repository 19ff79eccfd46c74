"""A tiny random Gemma 3 checkpoint with images (SigLIP of 2 layers at 56 x 56 pixels in 7-pixel patches,
16 tokens per image, a 2-layer decoder with a sliding layer of window 24) and a word-level tokenizer
holding Gemma's image tokens and "\\n\\n", with a chat template that writes each image part as
<start_of_image>; plus transformers' own processor and greedy generate as the reference."""

from __future__ import annotations

import os
from typing import Any

import torch

SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
VOCAB = 256
TOKENS = [*SPECIALS, "\n\n", "user", "model"] + [f"w{i}" for i in range(len(SPECIALS) + 3, VOCAB)]
IDS = {t: i for i, t in enumerate(TOKENS)}
WORDS = TOKENS[len(SPECIALS) + 3 :]
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE, WINDOW = 56, 7, 16, 24
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn> "
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }} {% else %}<start_of_image> {% endif %}{% endfor %}{% endif %}"
    " <end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)


def make_gemma_vl_checkpoint(
    root: str | os.PathLike, seed: int = 0, tokens_per_image: int = TOKENS_PER_IMAGE
) -> str:
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = os.path.join(str(root), "gemma3_vl")
    cfg = Gemma3Config(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=512,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            vision_use_head=False,
        ),
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=IDS["<start_of_image>"],
        eoi_token_index=IDS["<end_of_image>"],
        image_token_index=IDS["<image_soft_token>"],
        eos_token_id=IDS["<eos>"],
        bos_token_id=IDS["<bos>"],
        pad_token_id=IDS["<pad>"],
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg)
    # Spread the random weights so greedy tokens differ from prompt to prompt (small embeddings: with
    # Gemma's sqrt(hidden) scale and tied logits, larger ones make every prompt repeat its last token).
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, (0.03 if "embed_tokens" in name else 0.2) if p.dim() > 1 else 0.05)
    model.save_pretrained(folder)

    backend = RustTokenizer(WordLevel(IDS, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    backend.add_tokens([AddedToken("\n\n", normalized=False)])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<eos>",
        bos_token="<bos>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    hf_tok.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return folder


class HfReference:
    """transformers' Gemma3Processor (its PIL image processor) and greedy generate, one prompt at a time."""

    def __init__(self, folder: str, tokens_per_image: int = TOKENS_PER_IMAGE) -> None:
        from transformers import AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
        from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

        self.processor = Gemma3Processor(
            image_processor=Gemma3ImageProcessorPil.from_pretrained(folder),
            tokenizer=AutoTokenizer.from_pretrained(folder),
            image_seq_length=tokens_per_image,
        )
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
