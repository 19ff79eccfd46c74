"""When a sweep level is in its steady state, and how long it must run to show it.

Pure functions over clocks and counters, so the rules are tested on synthetic series.

A closed loop of N clients, each asking for `in` prompt tokens and `out` answer tokens, settles into
a state where the server admits a prompt for every answer it finishes: over any stretch of time the
tokens it handles are (in + out) per `out` generated, total/output = (in + out) / out (3.0 for 512 in /
256 out). A window that sees more prompt work than that caught the start (every client's first
prompt at once, the old sweep's 12.3 at 1024 clients); one that sees less caught a drain. And in a
steady state the output rate does not drift: equal sub-windows give equal rates.

    ramp      clients start spread over RAMP_LIFETIMES expected request lifetimes
    warm-up   until the ramp is over and WARMUP_COMPLETIONS x N requests finished (at most a cap)
    lifetime  measured at the end of the warm-up: N x out / output tok/s (Little's law: each
              client makes `out` tokens per lifetime)
    window    WINDOW_LIFETIMES lifetimes (at least --window-s), in SUB_WINDOWS equal parts
    steady    |total/output - expected| within RATIO_TOLERANCE (plus one prompt's worth, for
              windows that hold few prompts) and the sub-windows' output rates within
              SPREAD_TOLERANCE of their mean (plus two steps' worth of tokens, for sub-windows
              that hold few steps); else the window is measured again, once
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# Half a lifetime: the first answers' random lengths already spread the phases (load.py), so the ramp
# only has to spread the first prompts' prefill; a shorter ramp would pile it into a few steps.
RAMP_LIFETIMES = 0.5
# Half the clients have come round once: the admissions are then the steady ones (a finish each).
WARMUP_COMPLETIONS = 0.5
# Two lifetimes: every client finishes about two requests inside the window, so its figures are
# not one request's phase, and a level of 1,024 clients on an H200 (~27 s a request) fits a call.
WINDOW_LIFETIMES = 2.0
SUB_WINDOWS = 4
# Steady-state ratio within 5%: prefill and decode then run in the workload's proportion; the
# transient the old sweep measured was 4x off (12.3 against 3.0).
RATIO_TOLERANCE = 0.05
# Sub-window rates within +-10% of their mean: a quarter of a two-lifetime window at 1,024 clients
# holds ~130k tokens, so a real steady state varies by a few percent (prefill steps, clocks).
SPREAD_TOLERANCE = 0.10
# A window found unsteady is measured once more (the first then counts as warm-up).
MAX_WINDOWS = 2


def ramp_seconds(lifetime_s: float, cap_s: float) -> float:
    return min(RAMP_LIFETIMES * lifetime_s, cap_s)


def next_lifetime(prev_lifetime_s: float, prev_requests_s: float, clients: int) -> float:
    """The expected lifetime at `clients`, from the level before: as long as there (not saturated), or
    what its request rate gives to this many clients (saturated: the rate stops growing). The larger
    of the two: a ramp too long costs a little time, one too short a burst of prefill."""
    if prev_requests_s <= 0:
        return prev_lifetime_s
    return max(prev_lifetime_s, clients / prev_requests_s)


def warmed_up(now: float, ramp_end: float, completions: float, clients: int) -> bool:
    return now >= ramp_end and completions >= WARMUP_COMPLETIONS * clients


def lifetime_from_rate(clients: int, mean_output_len: float, output_tok_s: float) -> float | None:
    """Little's law over tokens; None before any token came."""
    if output_tok_s <= 0:
        return None
    return clients * mean_output_len / output_tok_s


def window_seconds(
    lifetime_s: float | None, min_s: float, max_s: float, lifetimes: float = WINDOW_LIFETIMES
) -> float:
    if lifetime_s is None:
        return min(max(min_s, 0.0), max_s)
    return min(max(min_s, lifetimes * lifetime_s), max_s)


@dataclass(frozen=True)
class Steadiness:
    steady: bool
    total_per_output: float | None  # measured in the window
    expected_total_per_output: float | None  # the workload's, as its finished requests ran
    ratio_ok: bool
    sub_output_tok_s: list[float]
    spread: float | None  # largest deviation of a sub-window from their mean, as a fraction of it
    spread_ok: bool
    reason: str  # "" when steady

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def judge(
    sub_output_tokens: list[float],
    sub_seconds: float,
    prompt_tokens: float,
    expected_ratio: float | None,
    mean_prompt_len: float,
    tokens_per_step: float = 1.0,
) -> Steadiness:
    """sub_output_tokens: output tokens in each equal sub-window; prompt_tokens: prompt tokens credited
    in the whole window; expected_ratio: (prompt + output) / output of the workload (None: unknown, the
    ratio is not judged); tokens_per_step: how many tokens arrive together (a closed loop of N clients:
    N, one per running request each step)."""
    out = sum(sub_output_tokens)
    rates = [round(n / sub_seconds, 2) for n in sub_output_tokens] if sub_seconds > 0 else []
    reasons = []
    if out <= 0:
        return Steadiness(False, None, expected_ratio, False, rates, None, False, "no output in the window")
    ratio = (out + prompt_tokens) / out
    ratio_ok = True
    if expected_ratio is not None:
        # Prompts arrive whole: a window holding k of them may hold k +- 1, worth one prompt's tokens.
        allowed = RATIO_TOLERANCE * expected_ratio + mean_prompt_len / out
        ratio_ok = abs(ratio - expected_ratio) <= allowed
        if not ratio_ok:
            reasons.append(f"total/output {ratio:.2f} against the workload's {expected_ratio:.2f}")
    mean = sum(rates) / len(rates)
    spread = max(abs(r - mean) for r in rates) / mean if mean > 0 else None
    # A sub-window's edges cut a step either way, and a step delivers tokens_per_step at once: two
    # steps' worth matters on a slow CPU's few steps a sub-window, not on an H200's hundreds.
    allowed = SPREAD_TOLERANCE + 2.0 * tokens_per_step * len(sub_output_tokens) / out
    spread_ok = spread is not None and spread <= allowed
    if not spread_ok:
        reasons.append(f"sub-window output rates {rates} vary by {spread or 0:.0%}")
    return Steadiness(
        steady=ratio_ok and spread_ok,
        total_per_output=round(ratio, 3),
        expected_total_per_output=None if expected_ratio is None else round(expected_ratio, 3),
        ratio_ok=ratio_ok,
        sub_output_tok_s=rates,
        spread=None if spread is None else round(spread, 3),
        spread_ok=spread_ok,
        reason="; ".join(reasons),
    )


def sub_windows(w0: float, w1: float, n: int = SUB_WINDOWS) -> list[tuple[float, float]]:
    step = (w1 - w0) / n
    return [(w0 + i * step, w0 + (i + 1) * step) for i in range(n)]


def keeps_up(verdict: Steadiness, requests_s: float, rate: float, window_s: float) -> Steadiness:
    """An open loop is steady only if the server finishes requests as fast as they arrive; else its
    queue grows and every figure depends on how long it ran. Poisson counts of k arrivals vary by
    sqrt(k), so the allowance widens for windows that hold few requests."""
    expected = rate * window_s
    if expected <= 0:
        return verdict
    allowed = RATIO_TOLERANCE + 2.0 / expected**0.5
    if requests_s >= (1.0 - allowed) * rate:
        return verdict
    reason = f"finishes {requests_s:.2f} requests/s of the {rate:g} arriving: the queue grows"
    return replace(verdict, steady=False, reason="; ".join(r for r in (verdict.reason, reason) if r))
