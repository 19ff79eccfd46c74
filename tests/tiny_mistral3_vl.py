"""A tiny random Mistral 3 checkpoint with images (Pixtral of 2 layers in 4-pixel patches, merged 2 x 2,
images up to 48 pixels on their longest edge; a 2-layer Mistral decoder) and a word-level tokenizer
holding Mistral's image tokens, with a chat template that writes each image part as [IMG]; plus
transformers' own PixtralProcessor and greedy generate as the reference."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch

from tests.tiny_vl import ProcessorReference, save_word_tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
VOCAB = 256
TOKENS = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB)]
IDS = {t: i for i, t in enumerate(TOKENS)}
WORDS = TOKENS[len(SPECIALS) :]
PATCH, MERGE, LONGEST = 4, 2, 48
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }} {% else %}[IMG] {% endif %}{% endfor %}{% endif %}"
    " [/INST] {% else %}{{ m['content'] }} </s> {% endif %}{% endfor %}"
)


def make_mistral3_vl_checkpoint(root: str | os.PathLike, seed: int = 0, **changes: Any) -> str:
    """The checkpoint folder; `changes` override the top-level Mistral3Config fields."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from tests.tiny_models import _spread_weights

    folder = os.path.join(str(root), "mistral3_vl")
    cfg = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=LONGEST,
            patch_size=PATCH,
            hidden_act="silu",
        ),
        image_token_index=IDS["[IMG]"],
        spatial_merge_size=MERGE,
        tie_word_embeddings=False,
        **changes,
    )
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        _spread_weights(model, seed)
    model.config.eos_token_id = IDS["</s>"]
    model.config.bos_token_id = IDS["<s>"]
    model.save_pretrained(folder)

    save_word_tokenizer(folder, IDS, SPECIALS, CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>")
    # As Mistral publishes it: the unmerged patch size (PixtralProcessor passes patch x merge).
    PixtralImageProcessorPil(
        size={"longest_edge": LONGEST}, patch_size={"height": PATCH, "width": PATCH}
    ).save_pretrained(folder)
    return folder


def pixtral_processor_class() -> Any:
    """transformers' PixtralProcessor. Its module imports a helper from the torchvision image processor's
    module, which the PIL one has too: that module is stood in for when torchvision is absent."""
    name = "transformers.models.pixtral.image_processing_pixtral"
    try:
        import torchvision  # noqa: F401
    except ImportError:
        if name not in sys.modules:
            from transformers.models.pixtral import image_processing_pil_pixtral as pil

            stub = types.ModuleType(name)
            stub.get_resize_output_image_size = pil.get_resize_output_image_size  # type: ignore[attr-defined]
            sys.modules[name] = stub
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    return PixtralProcessor


def hf_reference(folder: str) -> ProcessorReference:
    """transformers' PixtralProcessor (its PIL image processor) and greedy generate."""
    from transformers import AutoTokenizer
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    processor = pixtral_processor_class()(
        image_processor=PixtralImageProcessorPil.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        patch_size=PATCH,
        spatial_merge_size=MERGE,
    )
    return ProcessorReference(folder, processor)
