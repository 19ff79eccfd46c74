"""A pooling model's own pooling, read from its folder: the sentence-transformers files, and the
Matryoshka sizes of its config.json; for a sequence classifier (cross-encoder), its labels and the
activation its scores take.

    modules.json                    [Transformer, Pooling (path 1_Pooling), Dense*, Normalize?]
    1_Pooling/config.json           pooling_mode: "lasttoken" | "mean" | "cls" (sentence-transformers 6),
                                    or pooling_mode_{lasttoken,mean_tokens,cls_token}: true (earlier)
    2_Dense/config.json, ...        in_features, out_features, bias, activation_function (Identity or
                                    Tanh, the default), weights beside it (EmbeddingGemma's two)
    config.json                     is_matryoshka / matryoshka_dimensions (optional; hf_overrides apply)

A folder without modules.json pools as its kind usually does: the CLS token for encoders (BERT), the
last token for decoders (Qwen3-Embedding), normalized. Modules that would change the vector and are not
implemented here (LayerNorm, ...) are refused rather than skipped: skipping them would give vectors that
look right and are not. Dense layers run in the encoder engine only (encoder/runner.py).

A sequence classifier pools as its head does (the first token for BERT / XLM-R heads, the first or the
mean for ModernBERT's, as its classifier_pooling says; the last for decoders). Its activation is what sentence-transformers' CrossEncoder applies: config.json's
sentence_transformers.activation_fn (or the older sbert_ce_default_activation_function), else sigmoid
for one label; several labels get softmax (class probabilities, as vLLM's classify returns).
"""

from __future__ import annotations

import json
import os
from typing import Any

from overnight.config import ClassifierConfig, DenseLayer, PoolerConfig
from overnight.errors import ConfigError, ModelLoadError
from overnight.loader.hf_overrides import apply_hf_overrides
from overnight.loader.source import ModelSource

_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_LEGACY_MODES = {
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# Modules that leave the vector as the Transformer and Pooling modules made it, and Dense layers.
_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
_HEAD_READS = {"CLS": "first token", "LAST": "last token", "MEAN": "mean over the prompt"}
_DENSE_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh"}
# sentence-transformers' activation classes (by their last name) -> ClassifierConfig.activation
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Softmax": "softmax", "Identity": "none"}


def default_pooling_type(source: ModelSource) -> str:
    if source.arch.is_encoder:
        return source.arch.classifier_pooling if source.arch.num_labels else "CLS"
    return "LAST"


def read_pooler_config(source: ModelSource, pooling_type: str | None = None) -> PoolerConfig:
    """The pooling `source` declares (see the module docstring), with `pooling_type` (the option) in
    place of its own; raises ModelLoadError for files it cannot honour."""
    folder = source.path if os.path.isdir(source.path) else None
    if source.arch.num_labels:
        return _classifier_pooler(source, folder, pooling_type)
    if folder is None:  # a preset or a GGUF file: no sentence-transformers files
        return PoolerConfig(pooling_type or default_pooling_type(source), normalize=True)
    declared, normalize, dense = _sentence_transformers(folder, parse_mode=pooling_type is None)
    if dense and not source.arch.is_encoder:
        raise ModelLoadError(
            f"{folder}: sentence-transformers Dense modules are supported on encoder models only "
            f"(not yet on {source.hf_architecture})"
        )
    _check_dense_chain(folder, dense, source.arch.hidden_size)
    pooling_type = pooling_type or declared
    is_matryoshka, dims = _matryoshka(folder, source)
    return PoolerConfig(
        pooling_type or default_pooling_type(source),
        normalize=normalize,
        is_matryoshka=is_matryoshka,
        matryoshka_dimensions=dims,
        dense=dense,
    )


def _classifier_pooler(source: ModelSource, folder: str | None, pooling_type: str | None) -> PoolerConfig:
    own = default_pooling_type(source)  # where the head reads: the first token, or the last
    if pooling_type is not None and pooling_type != own:
        raise ConfigError(
            f"{source.served_name} is a sequence classifier ({source.hf_architecture}) whose head reads its "
            f"{_HEAD_READS[own]}: pooling_type {pooling_type} cannot apply"
        )
    config = (_read(os.path.join(folder, "config.json")) if folder else None) or {}
    if folder is not None:  # what resolve_source read: config.json with the hf_overrides over it
        config = apply_hf_overrides(config, source.hf_overrides)
    n = source.arch.num_labels
    id2label = config.get("id2label") or {}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
    st = config.get("sentence_transformers") or {}
    declared = st.get("activation_fn") or config.get("sbert_ce_default_activation_function")
    if declared is None:
        activation = "sigmoid" if n == 1 else "softmax"
    else:
        activation = _ACTIVATIONS.get(str(declared).rsplit(".", 1)[-1], "")
        if not activation:
            raise ModelLoadError(
                f"{folder}/config.json: the activation {declared!r} is not supported "
                f"(supported: {', '.join(_ACTIVATIONS)})"
            )
    return PoolerConfig(own, normalize=False, classifier=ClassifierConfig(n, activation, labels))


def _sentence_transformers(folder: str, parse_mode: bool) -> tuple[str | None, bool, tuple[DenseLayer, ...]]:
    """(pooling type or None, normalize, Dense layers) from modules.json; (None, True, ()) without one."""
    modules = _read(os.path.join(folder, "modules.json"))
    if modules is None:
        return None, True, ()
    if not isinstance(modules, list):
        raise ModelLoadError(f"{folder}/modules.json is not a list of modules")
    pooling_type = None
    normalize = False
    dense: list[DenseLayer] = []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _MODULES:
            raise ModelLoadError(
                f"{folder}: the sentence-transformers module {module.get('type')!r} is not supported "
                f"(supported: {', '.join(_MODULES)})"
            )
        if normalize and kind != "Normalize":
            raise ModelLoadError(f"{folder}: a {kind} module after Normalize is not supported")
        if kind == "Normalize":
            normalize = True
        elif kind == "Dense":
            dense.append(_dense(folder, str(module.get("path", ""))))
        elif dense:
            raise ModelLoadError(f"{folder}: a {kind} module after a Dense module is not supported")
        elif kind == "Pooling" and parse_mode:
            config = _read(os.path.join(folder, str(module.get("path", "")), "config.json")) or {}
            pooling_type = _pooling_mode(folder, config)
    return pooling_type, normalize, tuple(dense)


def _dense(folder: str, path: str) -> DenseLayer:
    where = os.path.join(folder, path)
    config = _read(os.path.join(where, "config.json"))
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: a Dense module needs its config.json")
    if config.get("use_residual"):
        raise ModelLoadError(f"{where}: Dense with use_residual is not supported")
    name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if name not in _DENSE_ACTIVATIONS:
        raise ModelLoadError(
            f"{where}: the Dense activation {name!r} is not supported (supported: {', '.join(_DENSE_ACTIVATIONS)})"
        )
    try:
        return DenseLayer(
            where,
            int(config["in_features"]),
            int(config["out_features"]),
            bool(config.get("bias", True)),
            _DENSE_ACTIVATIONS[name],
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}/config.json lacks required field {e.args[0]!r}") from None


def _check_dense_chain(folder: str, dense: tuple[DenseLayer, ...], hidden_size: int) -> None:
    width = hidden_size
    for layer in dense:
        if layer.in_features != width:
            raise ModelLoadError(
                f"{layer.folder}: the Dense layer takes {layer.in_features} features, but the vector before "
                f"it has {width}"
            )
        width = layer.out_features


def _pooling_mode(folder: str, config: dict[str, Any]) -> str:
    mode = config.get("pooling_mode")
    if mode is None:  # before sentence-transformers 6: one boolean per mode
        modes = [name for key, name in _LEGACY_MODES.items() if config.get(key)]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _MODES:
        raise ModelLoadError(
            f"{folder}: sentence-transformers pooling {mode!r} is not supported "
            f"(supported: {', '.join(_MODES)}); choose one with --pooling-type"
        )
    return _MODES[mode]


def _matryoshka(folder: str, source: ModelSource) -> tuple[bool, tuple[int, ...] | None]:
    config = apply_hf_overrides(_read(os.path.join(folder, "config.json")) or {}, source.hf_overrides)
    dims = config.get("matryoshka_dimensions")
    if dims:
        return True, tuple(sorted(int(d) for d in dims))
    return bool(config.get("is_matryoshka", False)), None


def _read(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
