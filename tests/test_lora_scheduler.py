"""Tier (a) for LoRA: the scheduler under adapter pressure with a fake runner (no weights). More
adapters than device slots: every step holds at most max_loras adapters, each one in a slot the runner
was told to load, nobody starves (an adapter that waits is served in arrival order even while others
keep arriving), and each swap is counted. Also the refusals of bad adapter folders, by name."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from overnight.config import LoRAConfig
from overnight.engine.engine import Engine
from overnight.engine.step_io import SchedulerOutput
from overnight.errors import InvalidRequestError
from overnight.lora import LoRARequest
from overnight.metrics.exposure import attach_metrics
from overnight.sampling_params import SamplingParams
from tests.fake_runner import FakeRunner, reference_output
from tests.test_metrics import samples, value
from tests.test_scheduler import VOCAB, make_engine, random_prompts

PREFIX = "base_model.model.model.layers.0"


def write_adapter(folder: Path, r: int = 4, hidden: int = 8, config: dict | None = None, tensors=None) -> str:
    """A PEFT-format adapter for make_engine's one-layer model (hidden 8, q/kv 8, MLP 16)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    if tensors is None:
        tensors = {
            f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.randn(r, hidden),
            f"{PREFIX}.self_attn.q_proj.lora_B.weight": torch.randn(8, r),
            f"{PREFIX}.mlp.down_proj.lora_A.weight": torch.randn(r, 16),
            f"{PREFIX}.mlp.down_proj.lora_B.weight": torch.randn(hidden, r),
        }
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


class SlotRunner(FakeRunner):
    """The fake runner, following the scheduler's slot loads and checking every step against them."""

    def __init__(self, *args, max_loras: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.occupant: list[int | None] = [None] * max_loras
        self.max_loras = max_loras
        self.loads = self.evictions = 0
        self.adapters_per_step: list[set[int]] = []
        self.first_step: dict[str, int] = {}

    def launch(self, out: SchedulerOutput):
        for slot, req in out.lora_loads:
            self.evictions += self.occupant[slot] is not None
            self.occupant[slot] = req.lora_int_id
            self.loads += 1
        handle = super().launch(out)
        ids = {self.states.reqs[rid].lora_id for rid in out.num_scheduled_tokens} - {0}
        assert len(ids) <= self.max_loras, f"{len(ids)} adapters in one step"
        assert ids <= set(self.occupant), f"adapters {ids} not all in slots {self.occupant}"
        self.adapters_per_step.append(ids)
        for rid in out.num_scheduled_tokens:
            self.first_step.setdefault(rid, len(self.adapters_per_step))
        return handle


def lora_engine(
    tmp_path: Path, num_adapters: int, max_loras: int, **kwargs
) -> tuple[Engine, SlotRunner, list]:
    engine, _ = make_engine(**kwargs)
    config = replace(
        engine.config, lora=LoRAConfig(max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_loras)
    )
    runner = SlotRunner(engine.kv.num_blocks, engine.kv.block_size, VOCAB, max_loras=max_loras)
    engine = Engine(config, runner, engine.source, engine.pool_plan)
    loras = [
        LoRARequest(f"a{i}", i + 1, write_adapter(tmp_path / f"a{i}", r=2 + i % 6))
        for i in range(num_adapters)
    ]
    return engine, runner, loras


def test_more_adapters_than_slots_every_request_finishes(tmp_path: Path) -> None:
    engine, runner, loras = lora_engine(tmp_path, 6, max_loras=2, max_num_seqs=6, max_num_batched_tokens=48)
    rng = random.Random(0)
    prompts = random_prompts(60, rng, hi=30)
    metrics = attach_metrics(engine, model_name="fake")
    wants = {}
    for i, p in enumerate(prompts):
        lora = rng.choice([*loras, None])
        m = rng.randint(1, 12)
        engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True), lora_request=lora)
        wants[str(i)] = reference_output(p, m, VOCAB, None)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out.outputs[0].token_ids
        assert len(runner.adapters_per_step) < 5000
    assert results == wants
    stats = engine.stats()
    assert stats.lora_loads_total == runner.loads >= 6
    assert stats.lora_swaps_total == runner.evictions == runner.loads - 2  # every load after the first two
    assert value(samples(metrics.render().decode()), "overnight:lora_swaps_total") == runner.evictions
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_a_waiting_adapter_is_not_starved_by_a_stream_of_others(tmp_path: Path) -> None:
    # Two slots busy with adapters 1 and 2, whose requests keep arriving every step; adapter 3's one
    # request must still start soon: of the requests of the slot it drains that came after it, at most
    # one batch's worth (the grace, max_num_seqs) starts before it.
    engine, runner, loras = lora_engine(tmp_path, 3, max_loras=2, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = loras
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    adapter_of: dict[str, int] = {}

    def add(lora: LoRARequest) -> str:
        rid = f"r{len(adapter_of)}"
        engine.add_request(rid, [10 + len(adapter_of) % 50, 11, 12], params, lora_request=lora)
        adapter_of[rid] = lora.lora_int_id
        return rid

    for _ in range(3):
        add(a), add(b)
    engine.step()
    waiter = add(c)
    later: list[str] = []
    for _ in range(60):
        later += [add(a), add(b)]
        engine.step()
        if waiter in runner.first_step:
            break
    assert waiter in runner.first_step, "the third adapter starved"
    started = runner.first_step[waiter]
    drained = ({1, 2} - runner.adapters_per_step[started - 1]).pop()  # the adapter whose slot it took
    after = [rid for rid in later if adapter_of[rid] == drained and rid in runner.first_step]
    jumped = sum(runner.first_step[rid] < started for rid in after)
    assert jumped <= engine.config.scheduler.max_num_seqs, f"{jumped} later requests jumped the queue"
    # The other adapter's requests kept running meanwhile: the batch was not emptied for the waiter.
    other = 3 - drained
    assert any(
        adapter_of[rid] == other and runner.first_step[rid] < started
        for rid in later
        if rid in runner.first_step
    )
    assert engine.stats().lora_swaps_total == 1
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize(
    "config, tensors, problem",
    [
        ({"r": 16}, None, "rank r=16 exceeds max_lora_rank 8"),
        ({"use_dora": True}, None, "DoRA"),
        ({"bias": "all"}, None, "bias 'all'"),
        ({"lora_bias": True}, None, "lora_bias"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, None, "'embed_tokens' (the embeddings)"),
        ({}, {f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.randn(4, 12),
              f"{PREFIX}.self_attn.q_proj.lora_B.weight": torch.randn(8, 4)}, "does not match the base model"),
        ({}, {"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": torch.randn(4, 8),
              "base_model.model.model.layers.5.self_attn.q_proj.lora_B.weight": torch.randn(8, 4)}, "layer 5"),
        ({}, {f"{PREFIX}.self_attn.fc1.lora_A.weight": torch.randn(4, 8),
              f"{PREFIX}.self_attn.fc1.lora_B.weight": torch.randn(8, 4)}, "target module 'fc1' is not supported"),
        ({}, {"base_model.model.lm_head.lora_A.weight": torch.randn(4, 8)}, "the LM head"),
    ],
)  # fmt: skip
def test_bad_adapters_are_refused_by_name(tmp_path: Path, config, tensors, problem) -> None:
    engine, _, _ = lora_engine(tmp_path, 0, max_loras=1)
    bad = LoRARequest(
        "bad", 7, write_adapter(tmp_path / "bad", r=config.get("r", 4), config=config, tensors=tensors)
    )
    with pytest.raises(InvalidRequestError, match="LoRA adapter 'bad'") as info:
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=2), lora_request=bad)
    assert problem in str(info.value)
    assert not engine.has_unfinished_requests()


def test_missing_folder_and_files(tmp_path: Path) -> None:
    engine, _, _ = lora_engine(tmp_path, 0, max_loras=1)
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        engine.add_request(
            "x", [5], SamplingParams(max_tokens=1), lora_request=LoRARequest("m", 1, str(tmp_path / "nope"))
        )
    folder = tmp_path / "binonly"
    write_adapter(folder)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidRequestError, match="only the safetensors format"):
        engine.add_request(
            "x", [5], SamplingParams(max_tokens=1), lora_request=LoRARequest("b", 2, str(folder))
        )
    with pytest.raises(InvalidRequestError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(folder))


def test_bench_adapters_pass_the_checks(tmp_path: Path) -> None:
    """bench throughput --lora-adapters writes adapters the engine takes (every projection, a MoE
    model's sparse layers skipped)."""
    from overnight.arch import ModelArch
    from overnight.bench.lora import write_random_adapters
    from overnight.lora.adapter import check_adapter

    dense = ModelArch("qwen3", VOCAB, 8, 16, 2, 2, 1, 4)
    moe = replace(dense, architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, mlp_only_layers=(0,))
    for arch in (dense, moe):
        (lora,) = write_random_adapters(arch, 1, 4, str(tmp_path / arch.architecture))
        spec = check_adapter(lora, arch, max_lora_rank=4)
        assert len(spec.tensors) == 7 + (7 if arch is dense else 4)


def test_residency_rules_step_by_step() -> None:
    """One slot, grace 2: the waiting adapter reserves the slot; the resident adapter starts two more
    requests, then waits; base requests always start; once the slot drains the waiter loads (a swap)."""
    from overnight.lora.residency import LoRAResidency

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    res = LoRAResidency(max_loras=1, grace=2)
    res.begin_step([])
    assert res.can_admit(a)
    res.admit(a)
    assert res.take_loads() == [(0, a)]
    assert not res.can_admit(b)  # the slot is pinned: b waits and reserves it
    started = 0
    for _ in range(4):
        if res.can_admit(a):
            res.admit(a)
            started += 1
    assert started == 2 and res.can_admit(None)
    res.begin_step([a, a, a])  # still running: b keeps waiting, a gets no more grace
    assert not res.can_admit(b) and not res.can_admit(a)
    res.begin_step([])  # a's requests finished
    assert res.can_admit(b)
    res.admit(b)
    assert res.take_loads() == [(0, b)] and (res.num_loads, res.num_swaps) == (2, 1)
    assert not res.can_admit(a)  # a now waits for b's slot in turn
