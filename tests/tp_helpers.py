"""What the tensor-parallel tests share: loading one rank's share both ways and checking they agree."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from overnight import LLM, SamplingParams
from overnight.loader.model_loader import load_model
from overnight.loader.source import ModelSource
from overnight.parallel.tp import apply_tp
from overnight.parallel.tp_load import load_sharded_model


def streamed_equals_sliced(source: ModelSource, rank: int, world: int = 2, seed: int = 0) -> nn.Module:
    """Rank `rank`'s share loaded rank by rank (load_sharded_model: checkpoint tensors sliced as they
    stream in, or dummy draws replayed whole), once checked to hold the same parameters, bit for bit,
    as apply_tp cuts from the whole loaded model (float32, on the CPU)."""
    sliced = apply_tp(load_model(source, torch.float32, "cpu", seed=seed), rank, world)
    streamed = load_sharded_model(source, torch.float32, "cpu", rank, world, seed=seed)
    for tensors in ("named_parameters", "named_buffers"):  # buffers: packed experts' scales and zeros
        a, b = dict(getattr(sliced, tensors)()), dict(getattr(streamed, tensors)())
        assert a.keys() == b.keys()
        for name in a:  # compared as bytes: FP8 and packed integer tensors too
            assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    return streamed


def skip_without_gpus(world: int, device: str = "cuda") -> None:
    """Skip the calling test when `world` ranks on `device` need more GPUs than the host has (rank r
    takes the r-th GPU from the configured one); a CPU device needs none."""
    d = torch.device(device)
    if d.type != "cuda":
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (d.index or 0) + world > have:
        pytest.skip(
            f"{world} tensor-parallel ranks on {device} need {(d.index or 0) + world} GPUs; the host has {have}"
        )


def generate_split(folder: object, prompts: Any, params: Any, world: int = 2, **options: Any) -> list[Any]:
    """`prompts` through LLM(folder, tensor_parallel_size=world, **options), its rank processes shut down
    afterwards, even when generate raises. A `lora_request` in options goes to generate. options must
    name the device: left out, the ranks take cuda:0 .. cuda:world-1 on a GPU host, which may have fewer
    GPUs; "cpu" runs them over gloo anywhere, a "cuda" run skips where the host lacks the GPUs."""
    lora = options.pop("lora_request", None)
    device = options.get("device")
    if device is None:
        raise ValueError("generate_split: name the ranks' device (device='cpu' runs them anywhere)")
    skip_without_gpus(world, device)
    llm = LLM(str(folder), tensor_parallel_size=world, **options)
    try:
        return llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    finally:
        llm.engine.shutdown()  # type: ignore[attr-defined]


def packed_int_worker_main(*args: object) -> None:
    """A tensor-parallel rank process (parallel/workers.py) that keeps integer checkpoints' GPU layout
    on the CPU (quant/apply.py PACKED_INT_ON_CPU; a spawned process does not see the test's setting):
    tests put it in place of workers._worker_main."""
    from overnight.parallel import workers
    from overnight.quant import apply

    apply.PACKED_INT_ON_CPU = True
    workers._worker_main(*args)  # type: ignore[arg-type]


def prefix_waves(vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves of prompts sharing a 41-token system prefix (the second wave hits the prefix cache),
    plus a 3-token prompt in the first."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(41)]
    first = [system + [rng.randrange(3, vocab) for _ in range(k)] for k in (5, 12)] + [[7, 8, 9]]
    second = [system + [rng.randrange(3, vocab) for _ in range(k)] for k in (3, 9)]
    return first, second


def check_tp2_two_waves(folder: object, engine: dict[str, Any], vocab: int, seed: int) -> None:
    """The two prefix waves at TP=2 give the tokens of one process and of transformers (fp32 greedy, 6
    tokens), and the second wave restores both of its prompts past the shared prefix."""
    import transformers

    from tests.test_engine_parity import hf_greedy

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first, second = prefix_waves(vocab, seed)
    one = LLM(str(folder), **engine)
    expected = [one.generate(w, params, use_tqdm=False) for w in (first, second)]
    llm = LLM(str(folder), tensor_parallel_size=2, **engine)
    try:
        got = llm.generate(first, params, use_tqdm=False)
        before = llm.engine.stats().prefix_cache_hits  # type: ignore[attr-defined]
        got_second = llm.generate(second, params, use_tqdm=False)
        hits = llm.engine.stats().prefix_cache_hits - before  # type: ignore[attr-defined]
    finally:
        llm.engine.shutdown()  # type: ignore[attr-defined]
    assert hits >= 2 * 40  # both second-wave prompts restored past the shared 41-token prefix
    for prompts, outs, ones in ((first, got, expected[0]), (second, got_second, expected[1])):
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        assert tokens == [list(o.outputs[0].token_ids) for o in ones]
        assert tokens == [hf_greedy(ref, p, 6)[0] for p in prompts]
