"""The checkpoint name layouts of the image models whose text model sits under a language_model and whose
tower and projector sit beside it (InternVL, Mistral 3):

    the model's own       model.*                    <tower>.*          lm_head
    transformers 5        model.language_model.*     model.<tower>.*    lm_head
    transformers 4        language_model.model.*     <tower>.*          language_model.lm_head

rename_tower_checkpoint makes any of them the model's own; tower_checkpoint_names lists, for a module of
the model, the names the layouts give it (quantization ignore lists are written in any of them,
quant/apply.py). Gemma 3 (models/gemma.py: vision_tower.vision_model.*, a pooling head to drop) and Qwen
(models/qwen_vl.py: visual.*, no transformers 4 layout) keep their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from overnight.models.checkpoint import text_model_tensors


def rename_tower_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], tower: tuple[str, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's names made the model's, `tower` the prefixes of the tower's and projector's
    modules, before integer / FP8 conversion and tensor-parallel slicing (loader/model_loader.py) look
    tensors up by those names. Names only: the model's names pass unchanged."""
    for name, tensor in weights:
        bare = name.removeprefix("model.")
        if bare.startswith(tower):
            yield bare, tensor
        else:
            yield from text_model_tensors(((name, tensor),))


def tower_checkpoint_names(module: str, tower: tuple[str, ...]) -> tuple[str, ...]:
    """The names a module of the model may carry in a checkpoint (and its ignore list)."""
    if module.startswith("model."):
        rest = module.removeprefix("model.")
        return module, "model.language_model." + rest, "language_model.model." + rest
    if module.startswith(tower):
        return module, "model." + module
    if module == "lm_head":
        return module, "language_model.lm_head"
    return (module,)
