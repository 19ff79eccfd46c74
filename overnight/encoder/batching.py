"""Which waiting prompts go into the next encoder batch.

Attention sees a batch padded to its longest prompt, so a batch should hold prompts of similar lengths.
Each batch starts from the oldest waiting prompt (so none waits forever, whatever its length) and grows
with its nearest neighbours by length, each time taking the side that adds the least padding, until one
more would exceed the token budget (batch size x longest prompt) or max_num_seqs. With many prompts
waiting, as in batch jobs, batches come out nearly uniform in length.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from overnight.pooling_params import PoolingParams


@dataclass(slots=True)
class EncoderRequest:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: PoolingParams
    arrival_time: float
    first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class LengthQueue:
    _by_id: dict[str, EncoderRequest] = field(default_factory=dict)  # arrival order
    _sorted: list[tuple[int, int, str]] = field(default_factory=list)  # (length, arrival number, id)
    _order: dict[str, int] = field(default_factory=dict)
    _next: int = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def ids(self) -> list[str]:
        return list(self._by_id)

    def add(self, req: EncoderRequest) -> None:
        self._by_id[req.request_id] = req
        self._order[req.request_id] = self._next
        bisect.insort(self._sorted, (req.num_tokens, self._next, req.request_id))
        self._next += 1

    def remove(self, request_id: str) -> EncoderRequest | None:
        req = self._by_id.pop(request_id, None)
        if req is not None:
            key = (req.num_tokens, self._order.pop(request_id), request_id)
            del self._sorted[bisect.bisect_left(self._sorted, key)]
        return req

    def take(self, max_tokens: int, max_seqs: int) -> list[EncoderRequest]:
        """The next batch (see the module docstring); empty when nothing waits. The oldest prompt is
        always taken, even alone past the budget (the engine's limits keep that from happening)."""
        if not self._by_id:
            return []
        oldest = next(iter(self._by_id.values()))
        s = self._sorted
        lo = bisect.bisect_left(s, (oldest.num_tokens, self._order[oldest.request_id], oldest.request_id))
        hi = lo + 1
        longest = oldest.num_tokens
        while hi - lo < max_seqs:
            count = hi - lo
            options = []  # (padding it adds, side); a shorter prompt is padded, a longer one pads the rest
            if lo > 0 and (count + 1) * longest <= max_tokens:
                options.append((longest - s[lo - 1][0], -1))
            if hi < len(s) and (count + 1) * s[hi][0] <= max_tokens:
                options.append(((s[hi][0] - longest) * count, 1))
            if not options:
                break
            if min(options)[1] < 0:
                lo -= 1
            else:
                longest = s[hi][0]
                hi += 1
        taken = [self._by_id.pop(rid) for _, _, rid in s[lo:hi]]
        for req in taken:
            del self._order[req.request_id]
        del s[lo:hi]
        return taken
