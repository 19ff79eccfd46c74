"""`--lora-modules name=path ...` for run-batch and serve: the adapters a request's `model` may name.

Each becomes a LoRARequest with ids 1, 2, ... in the order given. vLLM's JSON form is read too:
'{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}'.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from overnight.errors import ConfigError, InvalidRequestError
from overnight.lora.adapter import AdapterChecks
from overnight.lora.request import LoRARequest

if TYPE_CHECKING:
    from overnight.config import EngineConfig
    from overnight.loader.source import ModelSource


class _Engine(Protocol):  # what check_adapters reads of an EngineClient (lora/ sits below engine/)
    config: EngineConfig
    source: ModelSource

    def shutdown(self) -> None: ...


def add_lora_modules_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) a request selects by naming them as its model; implies "
        "--enable-lora",
    )


def lora_overrides(adapters: dict[str, LoRARequest]) -> dict[str, bool]:
    """Engine options --lora-modules implies: enable_lora."""
    return {"enable_lora": True} if adapters else {}


def parse_lora_modules(values: Sequence[str] | None) -> dict[str, LoRARequest]:
    """Adapter name -> LoRARequest; ConfigError naming a malformed or repeated entry."""
    adapters: dict[str, LoRARequest] = {}
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    f'--lora-modules {value!r}: the JSON form needs "name" and "path"'
                ) from None
            base = spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {value!r}: expected NAME=PATH")
            base = None
        if name in adapters:
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice")
        adapters[name] = LoRARequest(name, len(adapters) + 1, path, base_model_name=base)
    return adapters


def check_adapters(engine: _Engine, adapters: dict[str, LoRARequest]) -> None:
    """Every --lora-modules folder checked against the engine's model before any request runs;
    ConfigError (after shutting the engine down) naming the first bad one."""
    lora = engine.config.lora
    if not adapters or lora is None:
        return
    checks = AdapterChecks(engine.source.arch, lora.max_lora_rank)
    try:
        for adapter in adapters.values():
            checks.check(adapter)
    except InvalidRequestError as e:
        engine.shutdown()
        raise ConfigError(str(e)) from None
