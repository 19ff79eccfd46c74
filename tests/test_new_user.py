"""Small things a new user hit (issue 20): chat messages LLM.chat accepts are the server's, a second
run-batch on one output file is refused, a batch job's check line gives no advice on its tail, the
request metrics are in order."""

from __future__ import annotations

import logging

import pytest

from overnight.engine.scheduler import SchedulerStats
from overnight.errors import InvalidRequestError
from overnight.sampling_params import SamplingParams
from overnight.tools.check import CheckLog
from tests.engine_helpers import make_engine


def test_finished_time_is_never_before_the_last_token():
    engine, _ = make_engine()
    for i in range(12):
        engine.add_request(str(i), [5 + i, 6, 7], SamplingParams(max_tokens=1 + i % 4, n=1 + i % 2))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert len(done) == 12
    for o in done:
        m = o.metrics
        assert m.first_token_time is not None and m.last_token_time is not None
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_chat_messages_follow_the_servers_rules():
    """LLM.chat renders through render_conversation: the roles and content the server accepts, no more."""
    from overnight.entrypoints.prompts import render_conversation

    for conv, needle in (
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"role": "user", "content": None}], "needs content"),
        ([{"role": "user"}], "needs content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
        ([{"content": "x"}], '"role"'),
    ):
        with pytest.raises(InvalidRequestError, match=needle):
            render_conversation(conv, None)
    with pytest.raises(InvalidRequestError, match="tokenizer"):  # valid messages: only the tokenizer lacks
        render_conversation([{"role": "assistant", "content": None}, {"role": "user", "content": "x"}], None)


def test_an_output_file_is_locked_against_a_second_run(tmp_path):
    from overnight.batch.output import UsageError, lock_output, open_output

    path = str(tmp_path / "out.jsonl")
    first = lock_output(path)
    with pytest.raises(UsageError, match="being written by another run-batch"):
        lock_output(path)
    f, answered = open_output(path, resume=False, overwrite=False, locked=first)
    f.write(b"x\n")
    f.close()  # the lock goes with the file
    lock_output(path).close()


def test_a_batch_tail_gets_no_light_load_advice():
    idle_seats = SchedulerStats(
        num_running=2,
        num_waiting=0,
        kv_cache_usage=0.1,
        num_preemptions_total=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    loud = CheckLog(max_num_seqs=256, interval_s=0.0, logger=logging.getLogger("t"))
    loud.add(idle_seats)
    assert len(loud.lines) == 1 and "light_load" in loud.lines[0] and "send more requests" in loud.lines[0]
    quiet = CheckLog(256, 0.0, logging.getLogger("t"), quiet=("idle", "light_load"))
    quiet.add(idle_seats)
    assert quiet.lines == []
    busy = SchedulerStats(256, 40, 0.5, 0, 0, 0)
    quiet.add(busy)  # other verdicts still speak
    assert len(quiet.lines) == 1 and "max_num_seqs" in quiet.lines[0]


def test_trust_remote_code_is_an_option_like_vllms():
    from overnight.options import EngineOptions

    assert EngineOptions.from_kwargs(model="m", trust_remote_code=True).trust_remote_code is True


def test_the_engine_clamps_max_tokens_to_the_context():
    """The offline class's rule (documented on LLM): no refusal, the request ends by length."""
    engine, _ = make_engine(max_model_len=64)
    engine.add_request("r", list(range(10, 20)), SamplingParams(max_tokens=10**9, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    (out,) = done
    assert len(out.outputs[0].token_ids) == 54 and out.outputs[0].finish_reason == "length"
