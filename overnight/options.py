"""Every engine option, declared once: name, type, default, help, and the values it allows (choices, a
minimum, a fraction, a pattern), checked when the options are made (check_options), so a wrong value is
refused by name before anything loads.

`LLM(**kwargs)` takes these names; every command's argparse flags are generated from this table
(`add_engine_args`), so a flag, its default and its help cannot drift apart. Engine sub-configs
(config.py) take their defaults from here too. None means: the engine picks (by model, device or mode).

Light on purpose: importing this module imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from overnight.errors import ConfigError

T = TypeVar("T")

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "bfloat16", "bf16", "float16", "half", "float32", "float")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# Storage of the linear-attention (Gated DeltaNet) state of hybrid models, vLLM's values (config.py
# ssm_state_dtype maps them; auto: float32).
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("fp8",)
MXFP4_EXPERTS = ("auto", "mxfp4", "dense", "fp8")  # how an MXFP4 checkpoint's experts are held (build.py)
INT_WEIGHTS = ("auto", "packed", "dense")  # how a weight-only integer checkpoint is held (loader/int_form.py)
ATTENTION_BACKENDS = ("auto", "torch", "triton")
ATTENTION_VARIANTS = (
    "default",
    "prefetch",
    "fp16-dots",
    "heads-first",
    "tma",
    "tma-n128",
    "mla-prefill-kernel",
)  # named kernel configs (attention/variants.py)
SCHEDULES = ("lookahead", "fifo")
ADMISSIONS = ("planned", "greedy")  # engine/admission.py
DECODE_ROW_CAPS = ("auto", "off")  # build.py decode_row_caps
# Tokens per KV-cache block when --block-size is not given. An FP8 cache takes 64: its decode kernel read
# 1.28-1.36x faster from pages of 64 tokens (one KV head's page an 8-KB run) than from pages of 16 (2 KB)
# on the H200 (bench/decode_pages_gpu.py); a 16-bit cache already reads at the copy bandwidth from pages
# of 16, which keep prefix-cache hits and the last page's slack finer.
DEFAULT_BLOCK_SIZE = 16
FP8_BLOCK_SIZE = 64
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# How the engine is driven; each picks default limits (limits.py). Commands set it; users do not.
MODES = ("offline", "server", "batch")


# A device option: cpu, cuda, or cuda:N.
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    fraction: bool = False,
    pattern: re.Pattern[str] | None = None,
    normalize: Callable[[Any], Any] | None = None,
    flags: tuple[str, ...] = (),
    cli: bool = True,
) -> Any:
    """A field of an options dataclass with what its flag needs (flags: short aliases such as -tp) and
    what its values may be: one of `choices`, at least `minimum`, a `fraction` in (0, 1], or a full
    match of `pattern`, after `normalize` (the spellings a user may pass, e.g. a torch dtype for dtype)
    turned the value into the one stored. check_options() holds every value to these when the options
    are made."""
    meta = {
        "help": help,
        "choices": choices,
        "minimum": minimum,
        "fraction": fraction,
        "pattern": pattern,
        "normalize": normalize,
        "flags": flags,
        "cli": cli,
    }
    return field(default=default, metadata=meta)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(kind: type) -> str:
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a JSON object (a dict)",
    }.get(kind, kind.__name__)


def _path_text(value: Any) -> Any:
    """A folder or file given as a path object, as text."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _dtype_name(value: Any) -> Any:
    """A dtype as its name: torch.bfloat16, "torch.bfloat16" and "BFloat16" are "bfloat16"."""
    text = str(value) if type(value).__module__ == "torch" else value
    return text.lower().removeprefix("torch.") if isinstance(text, str) else value


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


def _device_text(value: Any) -> Any:
    """A torch.device as its text ("cuda:1")."""
    return str(value) if type(value).__module__ == "torch" else value


DEFAULT_IMAGE_LIMIT = 16  # images per prompt when limit_mm_per_prompt is not given


def image_limit(value: str | None) -> int:
    """limit_mm_per_prompt's image count: a number, or vLLM's JSON {"image": N} (other modalities'
    counts are ignored: overnight takes images only). 0 runs an image model text-only (build.py)."""
    if value is None:
        return DEFAULT_IMAGE_LIMIT
    try:
        parsed = json.loads(value)
    except ValueError:
        raise ConfigError(f"limit_mm_per_prompt must be a number or JSON, got {value!r}") from None
    if isinstance(parsed, dict):
        parsed = parsed.get("image", DEFAULT_IMAGE_LIMIT)
    if not isinstance(parsed, int) or isinstance(parsed, bool) or parsed < 0:
        raise ConfigError(f"limit_mm_per_prompt must give an image count >= 0, got {value!r}")
    return parsed


def _mm_limit_text(value: Any) -> Any:
    """limit_mm_per_prompt as vLLM users pass it to LLM(): a count or a dict ({"image": 0}) becomes its
    JSON text, and the text is checked here, so a bad value is refused before the model loads."""
    if isinstance(value, int | dict) and not isinstance(value, bool):
        value = json.dumps(value)
    if isinstance(value, str):
        image_limit(value)
    return value


# What a JSON object option may hold, as JSON does: config.json's own value types.
_JSON_SCALARS = (str, int, float, bool, type(None))


def _json_object(value: Any, name: str) -> Any:
    """A dict option given as a dict or as JSON text (its command-line flag), as a fresh dict whose values
    are all JSON values; ConfigError naming the key whose value is not (a function, a tensor, a set)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{name} must be a JSON object, got {value!r}: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__} {value!r}")
    if not isinstance(value, dict):
        return value  # check_options names the type it should be
    return _json_value(value, name)


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(f"{where}: key {bad!r} is not a string (keys of config.json are)")
        return {k: _json_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, _JSON_SCALARS):
        return value
    raise ConfigError(
        f"{where} is a {type(value).__name__} ({value!r}): only JSON values are accepted (strings, "
        "numbers, true / false, null, lists and objects), as config.json holds"
    )


def _hf_overrides(value: Any) -> Any:
    return _json_object(value, "hf_overrides")


def _is_a(value: object, kind: type) -> bool:
    """isinstance, but a bool is no number, and an int is a float."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def check_options(opts: Any) -> None:
    """Raise ConfigError naming the first field of the options dataclass `opts` whose value its option()
    declaration does not allow (type, choices, minimum, fraction, pattern). Runs in __post_init__, so
    LLM(...), every command and the server refuse a wrong value before anything is read or loaded."""
    hints = _hints(type(opts))
    for f in fields(opts):
        value = getattr(opts, f.name)
        annotation = hints[f.name]
        if value is None and type(None) in typing.get_args(annotation):
            continue
        kind = _value_type(annotation)
        meta = f.metadata
        normalize = meta.get("normalize")
        if normalize is not None:
            value = normalize(value)
            object.__setattr__(opts, f.name, value)
        if not _is_a(value, kind):
            raise ConfigError(f"{f.name} must be {_type_name(kind)}, not {value!r}")
        choices = meta.get("choices")
        if choices and value not in choices:
            raise ConfigError(
                f"unknown {f.name.replace('_', ' ')} {value!r}: {f.name} must be one of {', '.join(choices)}"
            )
        minimum = meta.get("minimum")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{f.name} must be at least {minimum}, got {value}")
        if meta.get("fraction") and not 0 < value <= 1:
            raise ConfigError(f"{f.name} must be a fraction in (0, 1], got {value}")
        pattern = meta.get("pattern")
        if pattern is not None and not pattern.fullmatch(value):
            raise ConfigError(f"{f.name} must match {pattern.pattern}, not {value!r}")


@dataclass(frozen=True)
class EngineOptions:
    """What a user can set, with the names vLLM users know."""

    model: str | None = option(
        None,
        "HF folder, repo id in the local HF cache, .gguf file, or a preset with --load-format dummy "
        "(default: the embedded SmolLM2-135M-Instruct)",
        normalize=_path_text,
    )
    tokenizer: str | None = option(
        None, "tokenizer folder or .gguf file (default: the model's)", normalize=_path_text
    )
    served_model_name: str | None = option(None, "the model name outputs report (default: --model)")
    dtype: str = option(
        "auto",
        "compute dtype (auto: float32 on the CPU, the checkpoint's on a GPU)",
        choices=DTYPES,
        normalize=_dtype_name,
    )
    load_format: str = option(
        "auto", "dummy: random weights of the named preset or config", choices=LOAD_FORMATS
    )
    seed: int = option(0, "seed of unseeded requests' sampling and of dummy weights", minimum=0)
    max_model_len: int | None = option(
        None, "longest sequence, prompt plus output (default: the model's)", minimum=2
    )
    max_num_seqs: int | None = option(
        None, "sequences in one step (default: by device memory and mode)", minimum=1
    )
    max_num_batched_tokens: int | None = option(
        None, "tokens in one step, prefill chunks included (default: by device memory and mode)", minimum=1
    )
    block_size: int | None = option(
        None, "tokens per KV-cache block (default: 16; 64 with an FP8 cache, see block_size_for)", minimum=1
    )
    # 0.92: vLLM 0.26's default, so a job moved from vLLM keeps its pool (session J: 0.9 left ours 3% smaller)
    gpu_memory_utilization: float = option(
        0.92, "share of GPU memory for weights, activations and the KV pool", fraction=True
    )
    kv_cache_memory_bytes: int | None = option(
        None, "KV pool size in bytes, overriding the utilization", minimum=1
    )
    quantization: str | None = option(
        None,
        "fp8: FP8 weights for every linear layer but the LM head, quantized at load (FP8 checkpoints "
        "load as such without it)",
        choices=QUANTIZATIONS,
        flags=("-q",),
    )
    mxfp4_experts: str = option(
        "auto",
        "MXFP4 checkpoints' experts (gpt-oss): mxfp4 keeps them packed (a quarter of bf16's bytes, decoded "
        "in the GEMM); dense dequantizes them to the compute dtype at load (faster GEMMs, 4x the expert "
        "memory); fp8 dequantizes them at load and stores e4m3 with a scale per row (the FP8 fused MoE, "
        "half the dense expert memory; needs an FP8 GPU, compute capability 8.9+, or the CPU); auto: "
        "dense on a GPU when the whole model in the compute dtype takes at most 0.55 of one GPU's memory "
        "(per tensor-parallel rank), else mxfp4 (auto never picks fp8 yet)",
        choices=MXFP4_EXPERTS,
    )
    int_weights: str = option(
        "auto",
        "weight-only integer checkpoints (AWQ, GPTQ, compressed-tensors W4A16 / W8A16): packed keeps the "
        "integer weights (a quarter / half of bf16's bytes, dequantized inside the GEMM: fastest at small "
        "batches, most room for the KV cache); dense dequantizes them to the compute dtype at load (bf16 "
        "GEMMs: fastest at the large batches of batch jobs); auto: dense on a GPU when the whole model in "
        "the compute dtype takes at most 0.55 of one GPU's memory (per tensor-parallel rank), else packed. "
        "The CPU always runs them dense. W8A8 checkpoints (int8 activations too, an int8 GEMM) are not "
        "weight-only and keep their int8 layers under every choice",
        choices=INT_WEIGHTS,
    )
    kv_cache_dtype: str = option(
        "auto", "KV-cache storage (fp8: e4m3, half the bytes)", choices=KV_CACHE_DTYPES
    )
    calculate_kv_scales: bool = option(
        False,
        "fp8 KV cache: set each layer's scales from the first prefill (default: checkpoint's, else 1.0)",
    )
    mamba_ssm_cache_dtype: str = option(
        "auto",
        "hybrid models (Qwen3.5, Qwen3-Next): storage of each request's linear-attention (delta-rule) "
        "state; bfloat16 or float16 halve its bytes (so the default max_num_seqs doubles), each step "
        "still computing in float32 and rounding once as it stores; auto: float32. Ignored (logged) for "
        "models without linear-attention layers",
        choices=MAMBA_SSM_CACHE_DTYPES,
        normalize=_dtype_name,
    )
    enable_prefix_caching: bool = option(True, "reuse the KV of shared prompt prefixes")
    enable_chunked_prefill: bool = option(True, "split long prompts over steps")
    admission: str = option(
        "planned",
        "when a waiting request starts: planned, only if the running ones can still grow to their end in "
        "the KV pool (no preemption when outputs run to max_tokens); greedy, whenever its prompt fits now",
        choices=ADMISSIONS,
    )
    decode_row_caps: str = option(
        "auto",
        "auto: where the model's packed int4 GEMMs pad a decode batch to whole row tiles, a step that "
        "would pay for a nearly empty tile (e.g. 265 decodes padded to 384 rows) runs the rows of the "
        "full tiles and the last admitted requests wait a step; off: every running request every step",
        choices=DECODE_ROW_CAPS,
    )
    tensor_parallel_size: int = option(1, "GPUs one model is split over", minimum=1, flags=("-tp",))
    data_parallel_size: int = option(
        1, "engines, each with its own copy of the model", minimum=1, flags=("-dp",)
    )
    skip_tokenizer_init: bool = option(False, "no tokenizer: prompts are token ids, outputs have no text")
    trust_remote_code: bool = option(
        False,
        "accepted as vLLM spells it; overnight never runs a checkpoint's own code, so an architecture "
        "it does not implement is an error either way",
    )
    device: str | None = option(
        None,
        "cpu, cuda, cuda:N (default: cuda when available)",
        pattern=DEVICE_PATTERN,
        normalize=_device_text,
    )
    enforce_eager: bool = option(False, "no CUDA graphs")
    attention_backend: str = option(
        "auto", "auto: triton on CUDA, torch elsewhere", choices=ATTENTION_BACKENDS
    )
    attention_variant: str = option(
        "default",
        "Triton attention kernel configs by name (attention/variants.py)",
        choices=ATTENTION_VARIANTS,
    )
    engine_process: bool | None = option(
        None,
        "step the engine in a process of its own, so the caller's threads never hold the GIL its step "
        "needs (default: on for serve and its sweeps, off otherwise)",
    )
    # Submission order of a job known ahead (run-batch, LLM.generate): lookahead groups requests by shared
    # prompt prefix and starts the longest of the last ones first (entrypoints/submission.py).
    schedule: str = option(
        "lookahead",
        "submission order of a batch job: lookahead groups prompts by shared prefix and starts the longest "
        "of the last ones first; fifo keeps input order",
        choices=SCHEDULES,
    )
    lookahead_window: int = option(
        4096, "prompts read ahead of the engine, with --schedule lookahead", minimum=1
    )
    runner: str = option(
        "auto",
        "generate text, or pool each prompt into one vector (embeddings, a classifier's scores); auto: "
        "pooling for encoder-only models (BERT), sequence classifiers and decoders saved without an LM "
        "head, generate otherwise",
        choices=RUNNERS,
    )
    pooling_type: str | None = option(
        None,
        "pooling runner: LAST, MEAN or CLS token (default: the model's sentence-transformers config, "
        "else CLS for encoders and LAST for decoders)",
        choices=POOLING_TYPES,
        normalize=_upper,
    )
    normalize: bool | None = option(
        None,
        "pooling runner: L2-normalize embeddings (default: as the model's sentence-transformers config "
        "says; normalized without one)",
    )
    enable_lora: bool = option(
        False, "serve LoRA adapters (LoRARequest, --lora-modules) beside the base model"
    )
    max_loras: int = option(
        1, "LoRA adapters on the device at once: distinct adapters in one step", minimum=1
    )
    max_lora_rank: int = option(
        16, "largest LoRA rank served (device slots are allocated at this rank)", minimum=1
    )
    max_cpu_loras: int | None = option(
        None,
        "LoRA adapters kept loaded in host memory, least recently used out (default: max_loras)",
        minimum=1,
    )
    # Images (vision-language models): where they may come from and how big they may be.
    allowed_local_media_path: str | None = option(
        None, "folder under which image_url file:// URLs and paths may be read (default: none may be)"
    )
    allow_media_urls: bool = option(
        False, "fetch http(s) image URLs (off by default: a batch file must not make the machine fetch)"
    )
    media_fetch_timeout: float = option(10.0, "seconds an http(s) image fetch may take (allow_media_urls)")
    max_image_bytes: int = option(20 * 1024 * 1024, "largest encoded image accepted (data URI, file or URL)")
    max_image_pixels: int = option(64 * 1024 * 1024, "largest decoded image accepted, width x height")
    limit_mm_per_prompt: str | None = option(
        None,
        'images per prompt at most: a number or JSON as vLLM\'s ({"image": 4}); default 16. 0 runs an '
        "image model text-only: no vision tower loaded or profiled, its memory left to the KV cache",
        normalize=_mm_limit_text,
    )
    hf_overrides: dict[str, Any] | None = option(
        None,
        "JSON object merged over the model's config.json before its architecture is read, as vLLM's "
        '(e.g. a Qwen3-Reranker: {"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}); '
        "keys config.json does not know are kept for the model code",
        normalize=_hf_overrides,
    )
    mode: str = option(
        "offline", "offline | server | batch: picks the default limits", choices=MODES, cli=False
    )

    def __post_init__(self) -> None:
        check_options(self)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(annotation: Any) -> type:
    """int for `int | None`, str for `str`, dict for `dict[str, Any] | None`, ..."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    kind = args[0] if args else annotation
    return typing.get_origin(kind) or kind


def add_option_args(
    parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = ()
) -> None:
    """A flag for every command-line field of the options dataclass `cls` (declared with option())."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title)
    for f in fields(cls):
        meta = f.metadata
        if not meta["cli"] or f.name in skip:
            continue
        kind = _value_type(hints[f.name])
        names = [_flag(f.name), *meta["flags"]]
        default_text = "" if f.default in (None, MISSING) or kind is bool else f" (default: {f.default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"] + default_text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            # A dict is given as JSON text; the option's normalize reads it.
            kwargs["type"] = str if kind is dict else kind
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
        group.add_argument(*names, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """An options dataclass from a namespace add_option_args filled (fields it lacks keep defaults)."""
    ns = vars(args)
    given = {f.name: ns[f.name] for f in fields(cls) if f.name in ns}  # type: ignore[arg-type]
    return cls(**{**given, **overrides})


# Options of the submission order, which only entry points that know their whole job use.
SUBMISSION_OPTIONS = ("schedule", "lookahead_window")


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    add_option_args(parser, EngineOptions, "engine", skip)


def options_from_args(args: argparse.Namespace, mode: str, **overrides: Any) -> EngineOptions:
    return from_args(EngineOptions, args, mode=mode, **overrides)


def options_to_flags(opts: EngineOptions, skip: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags that reproduce `opts` (only options off their default, none of `skip`)."""
    flags: list[str] = []
    for f in fields(EngineOptions):
        value = getattr(opts, f.name)
        if not f.metadata["cli"] or value == f.default or f.name in skip:
            continue
        if isinstance(value, bool):
            flags.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [_flag(f.name), json.dumps(value)]
        else:
            flags += [_flag(f.name), str(value)]
    return flags


def block_size_for(kv_cache_dtype: str, block_size: int | None) -> int:
    """The KV-cache block size an engine runs with: the option's, else the default for the cache."""
    if block_size is not None:
        return block_size
    return DEFAULT_BLOCK_SIZE if kv_cache_dtype == "auto" else FP8_BLOCK_SIZE


# Names of the parsers (overnight/reasoning, overnight/tool_calls), kept here so this module stays light;
# tests/test_chat_messages.py checks them against the registries.
REASONING_PARSER_NAMES = ("deepseek_r1", "glm45", "qwen3")
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "qwen", "qwen3_coder")


@dataclass(frozen=True)
class ChatOptions:
    """How chat outputs are read: reasoning split from the answer, tool calls parsed. Flags of `serve` and
    `run-batch`; keyword arguments of LLM."""

    reasoning_parser: str | None = option(
        None,
        "split <think> reasoning from the answer (message.reasoning_content); structured outputs then "
        "constrain the answer only",
        choices=REASONING_PARSER_NAMES,
    )
    enable_auto_tool_choice: bool = option(
        False, 'let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser'
    )
    tool_call_parser: str | None = option(
        None,
        "the format the model writes tool calls in, for tool_choice auto",
        choices=TOOL_CALL_PARSER_NAMES,
    )

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; known: {', '.join(REASONING_PARSER_NAMES)}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSER_NAMES:
            raise ValueError(
                f"unknown tool-call parser {self.tool_call_parser!r}; known: {', '.join(TOOL_CALL_PARSER_NAMES)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")

    @classmethod
    def split_kwargs(cls, kwargs: dict[str, Any]) -> tuple[ChatOptions, dict[str, Any]]:
        """(these options, the other keyword arguments) of LLM(**kwargs)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names}), {
            k: v for k, v in kwargs.items() if k not in names
        }
