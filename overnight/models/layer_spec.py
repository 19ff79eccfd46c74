"""What each decoder layer is, read once from the architecture: its attention kind (window or chunk) and
its RoPE table (theta, scaling, rotated dims, pair layout) or none. A family with windowed or RoPE-less layers
(Mistral, OLMo 3, SmolLM3) thus adds no flags to the blocks; the engine's memory planner reads the same
windows from ModelArch.layer_window.
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.arch import ModelArch, RopeValue
from overnight.attention.spec import LayerAttention
from overnight.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: layers with equal specs share it."""

    theta: float
    scaling: tuple[tuple[str, RopeValue], ...] | None
    rotary_dim: int
    interleaved: bool


@dataclass(frozen=True)
class LayerSpec:
    attention: LayerAttention  # the window or chunk (and softcap) of the layer's attention
    rope: RopeSpec | None  # None: no position encoding at all (SmolLM3's NoPE layers)


def layer_specs(arch: ModelArch) -> list[LayerSpec]:
    """Each decoder layer's attention kind and RoPE: sliding layers take sliding_rope_theta/_scaling when
    the architecture has them (OLMo 3), layers in no_rope_layers none."""
    specs = []
    for i in range(arch.num_hidden_layers):
        window = arch.layer_window(i)
        rope = None
        if i not in arch.no_rope_layers:
            if window is not None and arch.sliding_rope_theta is not None:
                theta, scaling = arch.sliding_rope_theta, arch.sliding_rope_scaling
            else:
                theta, scaling = arch.rope_theta, arch.rope_scaling
            rope = RopeSpec(theta, scaling, arch.rotary_dim, arch.rope_interleaved)
        attention = LayerAttention(sliding_window=window, attention_chunk=arch.layer_chunk(i))
        specs.append(LayerSpec(attention, rope))
    return specs


def rotary_embeddings(arch: ModelArch, specs: list[LayerSpec]) -> dict[RopeSpec, RotaryEmbedding]:
    """One table per distinct RopeSpec (registered under each layer that uses it, stored once)."""
    tables: dict[RopeSpec, RotaryEmbedding] = {}
    for spec in specs:
        if spec.rope is not None and spec.rope not in tables:
            r = spec.rope
            scaling = dict(r.scaling) if r.scaling else None
            tables[r] = RotaryEmbedding(
                arch.head_dim,
                arch.max_position_embeddings,
                r.theta,
                scaling,
                rotary_dim=r.rotary_dim,
                interleaved=r.interleaved,
                table_positions=arch.rope_positions or None,
            )
    return tables
