"""Pooling in seconds: the engine's pooling requests with a fake runner (chunks, prefix cache,
preemption, one step ahead), the runner's chunked pooling against its reference, the encoder's batching,
the sentence-transformers config, validation, and a tiny BERT against transformers."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from overnight import LLM, PoolingParams, SamplingParams
from overnight.arch import ModelArch
from overnight.config import CacheConfig, EngineConfig, ModelConfig, PoolerConfig, SchedulerConfig
from overnight.encoder.batching import EncoderRequest, LengthQueue
from overnight.engine.engine import Engine
from overnight.engine.kv_cache_manager import KVCacheManager
from overnight.engine.pool_plan import PoolPlan
from overnight.engine.request import NO_SAMPLING, Request, RequestStatus
from overnight.engine.scheduler import Scheduler
from overnight.engine.step_io import ModelRunnerOutput
from overnight.entrypoints.pooling_prompts import tokenize_for_pooling
from overnight.errors import ConfigError, InvalidRequestError, ModelLoadError
from overnight.layers.pooler import embedding_head, pool
from overnight.loader.pooling_config import read_pooler_config
from overnight.loader.source import ModelSource
from overnight.outputs import PoolingRequestOutput
from overnight.runner.pooler import ChunkedPooler
from overnight.runner.request_state import RunnerRequest, ScheduledRequest
from tests.fake_runner import FakeRunner, pooled_vector

VOCAB = 500


# -- the engine with a fake runner ---------------------------------------------------------------


def pooling_engine(
    num_blocks: int, async_mode: bool, caching: bool = True, budget: int = 16, admission: str = "planned"
):
    arch = ModelArch("qwen3", VOCAB, 8, 16, 1, 1, 1, 8)
    config = EngineConfig(
        model=ModelConfig("fake", arch, torch.float32, runner="pooling", pooler=PoolerConfig("LAST", True)),
        cache=CacheConfig(block_size=4, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64, admission=admission
        ),
    )
    runner = FakeRunner(num_blocks, 4, VOCAB, async_mode=async_mode)
    source = ModelSource("dummy", "fake", arch, "Qwen3ForCausalLM", None, (3,), None, None, "fake")
    return Engine(config, runner, source, PoolPlan(num_blocks, 0, 0, False)), runner


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
@pytest.mark.parametrize("num_blocks", [16, 200], ids=["tight-pool", "roomy-pool"])
def test_pooling_requests_end_in_their_own_vector_and_free_their_blocks(num_blocks, async_mode):
    # Greedy admission: started prompts outgrow the tight pool, so preemption is exercised too
    # (planned admission starts a prompt only when all of it fits).
    engine, runner = pooling_engine(num_blocks, async_mode, admission="greedy")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, VOCAB) for _ in range(rng.randint(1, 64))] for _ in range(40)]
    prompts += prompts[-5:]  # equal prompts: prefix-cache hits (recent enough to be still cached)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p)  # no params: a pooling engine's default is PoolingParams()
    got: dict[str, PoolingRequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert isinstance(out, PoolingRequestOutput) and out.finished and out.request_id not in got
            got[out.request_id] = out
    assert len(got) == len(prompts)
    for i, p in enumerate(prompts):
        assert got[str(i)].outputs.data.tolist() == pooled_vector(p)
        assert got[str(i)].prompt_token_ids == p
    assert max(len(c) for c in runner.chunks.values()) > 1  # prompts were split over steps
    assert engine.kv.pool.num_free == num_blocks and not engine.parents
    stats = engine.stats()
    if num_blocks > 100:
        assert stats.prefix_cache_hits > 0
    elif async_mode:  # a step run ahead holds blocks the next one needs
        assert stats.num_preemptions_total > 0


def test_abort_of_a_pooling_request_frees_it():
    engine, _ = pooling_engine(64, async_mode=False, budget=4)
    engine.add_request("a", list(range(10, 40)))
    engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.kv.pool.num_free == 64
    assert engine.step() == []


def test_vector_of_a_request_preempted_while_its_last_chunk_ran_still_counts():
    kv = KVCacheManager(16, 4, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32), kv)
    req = Request("p", [5] * 10, NO_SAMPLING, 0, frozenset(), 11, 0.0, pooling_params=PoolingParams())
    sched.add(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"p": 10} and req.num_pending == 1 and req.num_remaining == 0
    sched._preempt(req)  # as a later step would, while this one ran ahead
    _, finished = sched.update(out, ModelRunnerOutput([], [], pooled_req_ids=["p"], pooled=[torch.ones(3)]))
    assert finished == [req] and req.status is RequestStatus.FINISHED_STOPPED
    assert not sched.waiting and not sched.running and kv.pool.num_free == 16


def test_a_pooling_engine_refuses_generation_and_the_other_way_round():
    engine, _ = pooling_engine(64, async_mode=False)
    with pytest.raises(InvalidRequestError, match="does not generate"):
        engine.add_request("g", [10, 11], SamplingParams())
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        engine.add_request("d", [10, 11], PoolingParams(dimensions=4))
    engine.add_request("ok", list(range(10, 74)))  # a pooled prompt may fill max_model_len
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long", list(range(10, 75)))


# -- the runner's chunked pooling against the whole-batch reference ------------------------------


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_chunked_pooling_equals_whole_prompt_pooling(kind):
    torch.manual_seed(0)
    lens = [5, 1, 9, 4]
    hidden = torch.randn(sum(lens), 8)
    qsl = torch.tensor([0, *np.cumsum(lens)])
    dims = [None, 3, None, None]
    norm = [True, True, False, True]
    want = embedding_head(pool(hidden, qsl, kind), dims, norm)

    pooler = ChunkedPooler(PoolerConfig(kind, normalize=True), torch.device("cpu"))
    states = [
        RunnerRequest(str(i), [0] * n, n, NO_SAMPLING, 0, i, 0, 0, pooling=PoolingParams(d, nm))
        for i, (n, d, nm) in enumerate(zip(lens, dims, norm))
    ]
    got: dict[str, torch.Tensor] = {}
    done = [0] * len(lens)
    while len(got) < len(lens):  # at most 3 tokens of each prompt a step
        scheduled, rows = [], []
        for i, st in enumerate(states):
            if done[i] < lens[i]:
                k = min(3, lens[i] - done[i])
                scheduled.append(ScheduledRequest(st, k, done[i], samples=done[i] + k == lens[i]))
                start = int(qsl[i]) + done[i]
                rows.append(hidden[start : start + k])
                done[i] += k
        step_qsl = np.concatenate([[0], np.cumsum([s.num_tokens for s in scheduled])])
        finished, vectors = pooler.pool(scheduled, torch.cat(rows), step_qsl)
        for st, v in zip(finished, vectors):
            got[st.req_id] = v
    for i in range(len(lens)):
        torch.testing.assert_close(got[str(i)], want[i])
    assert not pooler.carried


# -- the encoder's batches ------------------------------------------------------------------------


def test_length_queue_takes_the_oldest_and_its_length_neighbours_within_budget():
    q = LengthQueue()
    rng = random.Random(1)
    lengths = [rng.randint(1, 100) for _ in range(300)]
    for i, n in enumerate(lengths):
        q.add(EncoderRequest(str(i), None, [1] * n, PoolingParams(), float(i)))
    q.remove("0")
    seen: set[str] = set()
    padding = tokens = 0
    while len(q):
        oldest = q.ids()[0]
        batch = q.take(max_tokens=512, max_seqs=16)
        ids = [r.request_id for r in batch]
        assert oldest in ids and len(batch) <= 16 and not seen & set(ids)
        longest = max(r.num_tokens for r in batch)
        assert len(batch) == 1 or len(batch) * longest <= 512
        padding += len(batch) * longest - sum(r.num_tokens for r in batch)
        tokens += sum(r.num_tokens for r in batch)
        seen |= set(ids)
    assert len(seen) == 299
    assert padding < 0.1 * tokens  # sorted neighbours: little padding (random batches pad ~50%)


# -- sentence-transformers files ------------------------------------------------------------------


def st_folder(tmp_path, modules: list[str], pooling: dict | None, config: dict | None = None):
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps(config or {}))
    entries = [{"idx": i, "name": str(i), "path": p, "type": t} for i, (t, p) in enumerate(modules)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    arch = ModelArch("qwen3", VOCAB, 8, 16, 1, 1, 1, 8)
    return ModelSource("hf", str(tmp_path), arch, "Qwen3ForCausalLM", None, (), None, None, "m")


TRANSFORMER = ("sentence_transformers.models.Transformer", "")
POOLING = ("sentence_transformers.sentence_transformer.modules.pooling.Pooling", "1_Pooling")
NORMALIZE = ("sentence_transformers.base.modules.normalize.Normalize", "2_Normalize")


def test_pooling_config_from_sentence_transformers_files(tmp_path):
    legacy = st_folder(tmp_path / "a", [TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True})
    assert read_pooler_config(legacy) == PoolerConfig("MEAN", normalize=False)
    modern = st_folder(
        tmp_path / "b",
        [TRANSFORMER, POOLING, NORMALIZE],
        {"pooling_mode": "lasttoken"},
        {"is_matryoshka": True},
    )
    assert read_pooler_config(modern) == PoolerConfig("LAST", True, is_matryoshka=True)
    assert read_pooler_config(modern, "CLS").pooling_type == "CLS"
    dims = st_folder(tmp_path / "c", [TRANSFORMER], None, {"matryoshka_dimensions": [64, 32]})
    assert read_pooler_config(dims) == PoolerConfig("LAST", False, True, (32, 64))
    weighted = st_folder(tmp_path / "d", [TRANSFORMER, POOLING], {"pooling_mode": "weightedmean"})
    with pytest.raises(ModelLoadError, match="weightedmean"):
        read_pooler_config(weighted)
    assert read_pooler_config(weighted, "MEAN").pooling_type == "MEAN"  # the option overrides
    dense = st_folder(tmp_path / "e", [TRANSFORMER, ("sentence_transformers.models.Dense", "2_Dense")], None)
    with pytest.raises(ModelLoadError, match="Dense"):
        read_pooler_config(dense)
    bare = ModelSource("dummy", "qwen3-0.6b", dense.arch, "Qwen3ForCausalLM", None, (), None, None, "m")
    assert read_pooler_config(bare) == PoolerConfig("LAST", True)


# -- a tiny BERT against transformers -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from tests.tiny_embedders import _bert_tokenizer, make_tiny_bert

    folder = tmp_path_factory.mktemp("bert") / "tiny-bert"  # no sentence-transformers files: CLS, normalized
    model = make_tiny_bert()
    model.save_pretrained(folder)
    _bert_tokenizer(folder).save_pretrained(folder)
    return folder, model


def test_tiny_bert_cls_embeddings_equal_transformers(tiny_bert):
    folder, model = tiny_bert
    llm = LLM(str(folder))  # runner auto: an encoder pools
    assert llm.engine.config.model.runner == "pooling"
    texts = ["the quick brown fox", "a dog", "jumps over the lazy dog", "xyz"]
    outs = llm.embed(texts, use_tqdm=False)
    tok = llm.get_tokenizer().hf
    with torch.inference_mode():
        enc = tok(texts, padding=True, return_tensors="pt")
        ref = F.normalize(model(**enc).last_hidden_state[:, 0], dim=-1)
    got = torch.tensor([o.outputs.embedding for o in outs])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert [o.prompt_token_ids for o in outs] == [tok(t).input_ids for t in texts]
    streamed = dict(llm.embed_stream(iter(texts), use_tqdm=False, max_in_flight=2))
    assert sorted(streamed) == [0, 1, 2, 3]
    torch.testing.assert_close(torch.tensor(streamed[2].outputs.embedding), got[2])
    raw = LLM(str(folder), normalize=False, pooling_type="mean").encode(texts[:1], use_tqdm=False)
    with torch.inference_mode():
        mean = model(**tok(texts[:1], return_tensors="pt")).last_hidden_state[0].mean(0)
    torch.testing.assert_close(raw[0].outputs.data, mean, rtol=1e-4, atol=1e-5)


def test_bert_refuses_generation(tiny_bert):
    folder, _ = tiny_bert
    with pytest.raises(ConfigError, match="encoder-only"):
        LLM(str(folder), runner="generate")
    with pytest.raises(InvalidRequestError, match="prompt 1: .*maximum context length"):
        LLM(str(folder)).embed(["a dog", "dog " * 100], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="does not generate"):
        LLM(str(folder)).generate(["a dog"], use_tqdm=False)


def test_truncation_keeps_special_tokens_and_cuts_ids_on_the_same_side(tiny_bert):
    folder, _ = tiny_bert
    llm = LLM(str(folder))
    tok = llm.engine.tokenizer
    out = list(tokenize_for_pooling(["dog " * 100, [7] * 80, {"prompt": "a dog"}], tok, 64, -1))
    assert len(out[0][1]) == 64 and out[0][1][0] == 2 and out[0][1][-1] == 3  # [CLS] ... [SEP]
    assert out[1] == (None, [7] * 64)
    assert out[2] == ("a dog", tok.encode("a dog"))
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        list(tokenize_for_pooling(["a"], tok, 64, 65))
