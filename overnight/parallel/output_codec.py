"""Engine outputs as plain tuples for the pipe from an engine process to its front.

A streaming server gets one output per running request per step: 1,024 of them a step at saturation.
Pickled as dataclasses they cost ~20 ms a step each way (1,024 deltas, the prompt's ids in every
one); as tuples of builtins, under 1 ms. The prompt (text and ids) does not cross at all: the front
kept it when it sent the request, and puts it back (`prompts`).

    RequestOutput  -> (request_id, finished, delta, num_cached_tokens, metrics, completions, prompt_lps)
    metrics        -> (arrival, first_scheduled, first_token, last_token, finished) or None
    completion     -> (index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason)
    logprobs       -> per token: ((token_id, logprob, rank, decoded_token), ...) or None
    prompt_lps     -> the same per prompt token (None for the first), or None when not asked
    PoolingRequestOutput -> (request_id, vector, num_cached_tokens, metrics): four fields, not seven
"""

from __future__ import annotations

from collections.abc import Callable

from overnight.outputs import (
    CompletionOutput,
    EngineOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)

PackedOutput = tuple


def pack(outputs: list[EngineOutput]) -> list[PackedOutput]:
    return [_pack_pooled(o) if isinstance(o, PoolingRequestOutput) else _pack_one(o) for o in outputs]


def unpack(
    packed: list[PackedOutput], prompts: Callable[[str], tuple[str | None, list[int]] | None]
) -> list[EngineOutput]:
    """prompts(request_id): the (prompt text, prompt token ids) the front sent, or None when it
    forgot the request (aborted meanwhile): such outputs are dropped."""
    out: list[EngineOutput] = []
    for item in packed:
        prompt = prompts(item[0])
        if prompt is None:
            continue
        if len(item) == 4:
            rid, vector, cached, metrics = item
            out.append(
                PoolingRequestOutput(
                    request_id=rid,
                    prompt=prompt[0],
                    prompt_token_ids=prompt[1],
                    outputs=PoolingOutput(vector),
                    metrics=_metrics(metrics),
                    num_cached_tokens=cached,
                )
            )
            continue
        rid, finished, delta, cached, metrics, comps, prompt_lps = item
        out.append(
            RequestOutput(
                request_id=rid,
                prompt=prompt[0],
                prompt_token_ids=prompt[1],
                outputs=[_unpack_completion(c) for c in comps],
                finished=finished,
                metrics=_metrics(metrics),
                num_cached_tokens=cached,
                delta=delta,
                prompt_logprobs=None if prompt_lps is None else [_unpack_logprobs(p) for p in prompt_lps],
            )
        )
    return out


def _pack_metrics(m: RequestMetrics | None) -> tuple | None:
    if m is None:
        return None
    return (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time)


def _metrics(packed: tuple | None) -> RequestMetrics | None:
    return RequestMetrics(*packed) if packed is not None else None


def _pack_pooled(o: PoolingRequestOutput) -> PackedOutput:
    return (o.request_id, o.outputs.data, o.num_cached_tokens, _pack_metrics(o.metrics))


def _pack_one(o: RequestOutput) -> PackedOutput:
    metrics = _pack_metrics(o.metrics)
    comps = [
        (
            c.index,
            c.text,
            c.token_ids,
            c.cumulative_logprob,
            None if c.logprobs is None else [_pack_logprobs(step) for step in c.logprobs],
            c.finish_reason,
            c.stop_reason,
        )
        for c in o.outputs
    ]
    prompt_lps = (
        None
        if o.prompt_logprobs is None
        else [None if step is None else _pack_logprobs(step) for step in o.prompt_logprobs]
    )
    return (o.request_id, o.finished, o.delta, o.num_cached_tokens, metrics, comps, prompt_lps)


def _pack_logprobs(step: dict[int, Logprob]) -> tuple:
    return tuple((tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in step.items())


def _unpack_completion(c: tuple) -> CompletionOutput:
    index, text, token_ids, cumulative, logprobs, reason, stop = c
    lps: SampleLogprobs | None = None
    if logprobs is not None:
        lps = [{tid: Logprob(v, rank, dec) for tid, v, rank, dec in step} for step in logprobs]
    return CompletionOutput(index, text, token_ids, cumulative, lps, reason, stop)


def _unpack_logprobs(step: tuple | None) -> dict[int, Logprob] | None:
    if step is None:
        return None
    return {tid: Logprob(v, rank, dec) for tid, v, rank, dec in step}
