"""The import contracts (pyproject.toml, checked by lint-imports in `make lint`) stay complete, and the
option table stays the one place options are declared."""

from __future__ import annotations

import argparse
import pkgutil
import tomllib
from dataclasses import fields
from pathlib import Path

import overnight
from overnight.options import (
    EngineOptions,
    add_engine_args,
    block_size_for,
    options_from_args,
    options_to_flags,
)

ROOT = Path(__file__).resolve().parents[1]


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}


def test_kernels_contract_forbids_every_other_package():
    # A new top-level package must be added to the kernels contract, or kernels could import it unseen.
    top = {f"overnight.{m.name}" for m in pkgutil.iter_modules(overnight.__path__)} - {
        "overnight.kernels",
        "overnight.__main__",
    }
    kernels = next(c for name, c in _contracts().items() if name.startswith("kernels are leaves"))
    assert set(kernels["forbidden_modules"]) == top


def test_every_option_gets_a_flag_and_round_trips():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    cli = {f.name for f in fields(EngineOptions) if f.metadata["cli"]}
    assert dests == cli  # every command-line option of the table, and nothing else
    opts = EngineOptions(
        model="m", max_num_seqs=7, enable_prefix_caching=False, enforce_eager=True, tensor_parallel_size=2
    )
    again = options_from_args(parser.parse_args(options_to_flags(opts)), mode=opts.mode)
    assert again == opts


def test_defaults_are_declared_once():
    # The engine's sub-configs take their defaults from the table (no second literal to drift).
    from overnight.config import CacheConfig, ParallelConfig, RunnerConfig

    opts = EngineOptions()
    assert CacheConfig().block_size == block_size_for(opts.kv_cache_dtype, opts.block_size)
    assert CacheConfig().gpu_memory_utilization == EngineOptions().gpu_memory_utilization
    assert ParallelConfig().tensor_parallel_size == EngineOptions().tensor_parallel_size
    assert RunnerConfig().attention_backend == EngineOptions().attention_backend
    # the old copies: `block_size: int = 16` in config, builder and budget
    copies = [str(p) for p in (ROOT / "overnight").rglob("*.py") if "block_size: int = 16" in p.read_text()]
    assert copies == []
