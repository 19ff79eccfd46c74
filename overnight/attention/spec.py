"""What distinguishes one layer's attention from plain causal softmax attention.

A model's attention module holds one LayerAttention and passes it on every call (AttentionBatch's
`layer=`); the engine's memory planner reads the same facts from ModelArch (layer_window). Learned sinks
are a tensor, so they travel beside it (`sinks=`).

    scores  s[j] = scale * q . k[j]              for every cached position j the query may see
    softcap s[j] <- cap * tanh(s[j] / cap)       (Gemma 2: logit_softcap)
    window  j > p - W, i.e. the W positions p-W+1 .. p (the query's own included), HF's convention
    chunk   j >= floor(p / C) * C: the query sees only its own chunk of C positions, up to itself
            (Llama 4's chunked local attention, HF's chunked_attention layers); with a window too, a key
            must pass both bounds: j >= max(p - W + 1, floor(p / C) * C)
    sinks   softmax over [s, sink_h]: one more logit per head in the denominator, with no value (gpt-oss)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerAttention:
    sliding_window: int | None = None  # W: the query sees its own and the W-1 previous positions
    logit_softcap: float | None = None  # scores pass through cap * tanh(s / cap) before the softmax
    attention_chunk: int | None = None  # C: the query sees positions floor(p / C) * C .. p

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.attention_chunk is not None and self.attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1, got {self.attention_chunk}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0, got {self.logit_softcap}")


FULL_ATTENTION = LayerAttention()
