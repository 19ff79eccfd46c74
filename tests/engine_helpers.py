"""What the engine-logic tests share: engines over a fake runner (one that answers slowly or fails, for the
server's tests), and the sampler's inputs."""

from __future__ import annotations

import time

import torch

from overnight import SamplingParams
from overnight.arch import ModelArch
from overnight.config import DENSE_TAIL_SHARE, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from overnight.engine.engine import Engine
from overnight.engine.pool_plan import PoolPlan
from overnight.loader.source import ModelSource
from overnight.runner.inputs import build_sampling_batch
from overnight.runner.request_state import RunnerRequest
from overnight.runner.sampler import Sampler
from tests.fake_runner import FakeRunner

# ---------------------------------------------------------------- engines over a fake runner

VOCAB = 500

EOS = 3


def make_engine(
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    caching: bool = True,
    chunked: bool = True,
    async_mode: bool = False,
    admission: str = "planned",
    tail_share: float = DENSE_TAIL_SHARE,
    decode_row_caps: tuple[tuple[int, int], ...] = (),
) -> tuple[Engine, FakeRunner]:
    arch = ModelArch("llama", VOCAB, 8, 16, 1, 1, 1, 8)
    import torch

    config = EngineConfig(
        model=ModelConfig(model="fake", arch=arch, dtype=torch.float32),
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            admission=admission,
            admission_tail_share=tail_share,
            decode_row_caps=decode_row_caps,
        ),
    )
    runner = FakeRunner(num_blocks, block_size, VOCAB, async_mode=async_mode)
    source = ModelSource("dummy", "fake", arch, "LlamaForCausalLM", None, (EOS,), None, None, "fake")
    engine = Engine(config, runner, source, PoolPlan(num_blocks, block_bytes=0, budget_bytes=0, capped=False))
    return engine, runner


def run_all(engine: Engine, check=None) -> dict[str, list[int]]:
    results: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished
            results[out.request_id] = out.outputs[0].token_ids
        if check:
            check(engine)
        steps += 1
        assert steps < 100_000, "engine made no progress"
    return results


def peak_long_running(
    engine, prompts: list[list[int]], params: SamplingParams, long_tokens: int
) -> tuple[int, dict[str, list[int]]]:
    """Run `prompts` (request ids "0", "1", ...) to the end on a built engine: the most requests
    running at once with long_tokens or more computed (what a KV layout's room shows), and each
    request's output tokens."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    peak, done = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running = engine.scheduler.running
        peak = max(peak, sum(r.num_computed_tokens >= long_tokens for r in running))
    return peak, done


class SlowRunner:
    """The fake runner, taking `delay` seconds a step so requests stay in flight long enough to watch."""

    def __init__(self, inner, delay: float, fail_at_step: int | None = None) -> None:
        self.inner = inner
        self.delay = delay
        self.fail_at_step = fail_at_step
        self.steps = 0
        self.supports_async = inner.supports_async

    def _tick(self) -> None:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("simulated device failure")
        time.sleep(self.delay)

    def execute(self, out):
        self._tick()
        return self.inner.execute(out)

    def launch(self, out):
        self._tick()
        return self.inner.launch(out)

    def shutdown(self) -> None:
        self.inner.shutdown()


def slow_engine(delay: float = 0.0, fail_at_step: int | None = None, async_mode: bool = False, **kw):
    """async_mode: the engine runs one step ahead of the host, as it does on a GPU."""
    engine, runner = make_engine(async_mode=async_mode, **kw)
    engine.runner = SlowRunner(runner, delay, fail_at_step)
    return engine


# ---------------------------------------------------------------- the real runner's KV cache

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32


# ---------------------------------------------------------------- the sampler

V = 64


def req(params: SamplingParams, seed: int = 0, prompt=(1, 2, 3), output=()) -> RunnerRequest:
    return RunnerRequest(
        req_id="r",
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        params=params,
        seed=seed,
        slot=0,
        num_blocks=0,
        num_computed_tokens=0,
    )


def sample(logits: torch.Tensor, reqs: list[RunnerRequest], eos=(0,)):
    batch = build_sampling_batch(reqs, eos, torch.device("cpu"))
    tokens, lps = Sampler()(logits.clone(), batch)
    return tokens, (lps.to_host() if lps is not None else None)
