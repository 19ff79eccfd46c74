"""KV cache groups: how layers of different attention kinds share one pool of blocks.

A sliding-window layer of window W needs only its last W tokens; a full-attention layer needs them all.
Layers of one kind form KV cache groups of G layers each, and every request has one block table per
group. All groups draw from ONE pool: a block id is owned by one group at a time, and the pool's memory
is G physical tensors, each holding one layer of every group (vLLM's layout):

    Gemma-3 shape, 6 layers (5 windowed "w", 1 full "f"): G = 1, six groups of one layer each

      tensor 0: [2, num_blocks, B, Hkv, D]   block 7 -> group f (layer 5), block 8 -> group w0 (layer 0), ...
      request r: table[f] = 7 12 31 40 ...     (every block of its context)
                 table[w0] = - - - 8 19        (-: wholly before the window, given back; the runner's
                                                copy keeps an old id or 0 there, which nothing reads)

    62 layers, 52 windowed + 10 full: G = 10, groups f (10 layers), w0..w5 (10 layers; w5 holds 2 and
    leaves 8 of its tensor slots unused)

      tensor j (j < 10) holds layer j of each group: kv_caches[layer] = tensors[layer_tensor[layer]]

    a model with only full layers: one group of every layer, G = num_layers: today's layout exactly

A block is G x B tokens x one layer's K/V bytes, the same for every group, so usage, the pool plan and
a block's bytes stay one number. A windowed group's blocks lying wholly before position
num_computed - W + 1 are given back each step (kv_cache_manager.py). Layers that share another layer's
KV (Gemma 4's last layers) own no cache: they read their source layer's tensor through its group.
Linear-attention layers (Qwen3.5's Gated DeltaNet) own no cache at all: they are in no group and
no tensor (layer_tensor -1; their per-request state lives in runner/state_cache.py).
A window at least max_model_len long never gives a block back, so such layers join the full groups.
Sharing a tensor needs one cache shape (KV heads x head size) for every layer: a model whose kinds
differ there (Gemma 4's full layers) gets one tensor per layer of its own shape and one group, its
windows applied only by the kernels (no blocks given back: correct, without the memory gain).
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.config import ModelArch
from overnight.loader.fit import layer_kv_shape


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # W of its layers; None: full attention
    layers: tuple[int, ...]  # the layers whose cache it holds (at most num_tensors of them)


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVGroup, ...]  # full-attention groups first
    num_tensors: int  # G: physical cache tensors, each one layer of every group
    layer_group: tuple[int, ...]  # per model layer: the group whose block table it reads (0: linear)
    layer_tensor: tuple[int, ...]  # per model layer: the tensor holding its cache (-1: linear, none)
    layer_source: tuple[int, ...]  # per model layer: the layer whose cache it reads (itself if not shared)
    tensor_shapes: tuple[tuple[int, int], ...]  # per tensor: (KV heads, head size) of its layers

    @property
    def token_elems(self) -> int:
        """Cache elements one token of one block takes over all tensors (K and V): a block holds
        block_size x token_elems elements."""
        return sum(2 * heads * dim for heads, dim in self.tensor_shapes)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def is_uniform(self) -> bool:
        """One group, no shared layers: every layer reads the step's one block table (the fast path)."""
        return self.num_groups == 1 and all(s == i for i, s in enumerate(self.layer_source))

    def blocks_per_sequence(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """Most blocks one sequence of num_tokens holds at once, over all groups, with prefill chunks of
        at most `chunk` tokens: a windowed group keeps the last W - 1 tokens plus the chunk being written."""
        full = cdiv(num_tokens, block_size)
        total = 0
        for g in self.groups:
            if g.window is None:
                total += full
            else:
                total += min(full, cdiv(g.window - 1 + min(chunk, num_tokens), block_size) + 1)
        return total

    def blocks_for_sequences(self, num_seqs: int, num_tokens: int, chunk: int, block_size: int) -> int:
        """Blocks num_seqs sequences of num_tokens hold at once: each its windows (or whole context),
        plus one step's chunk of at most `chunk` tokens in the windowed groups (a step's tokens are
        shared by all its sequences, so the chunk is paid once, not per sequence)."""
        steady = self.blocks_per_sequence(num_tokens, 1, block_size)
        return num_seqs * steady + self.blocks_per_sequence(num_tokens, chunk, block_size) - steady

    @classmethod
    def uniform(cls, arch: ModelArch) -> KVCacheLayout:
        """One group of full attention, each layer with its own cache (today's layout)."""
        n = arch.num_hidden_layers
        sources = tuple(arch.kv_source_layer(i) for i in range(n))
        owners = tuple(i for i in range(n) if sources[i] == i)
        tensor_of = {layer: j for j, layer in enumerate(owners)}
        return cls(
            (KVGroup(None, owners),),
            len(owners),
            (0,) * n,
            tuple(tensor_of[sources[i]] for i in range(n)),
            sources,
            tuple(layer_kv_shape(arch, layer) for layer in owners),
        )

    @classmethod
    def from_arch(cls, arch: ModelArch, max_model_len: int | None = None) -> KVCacheLayout:
        n = arch.num_hidden_layers
        if not arch.layer_types and not arch.num_kv_shared_layers:
            return cls.uniform(arch)
        if arch.layer_types and len(arch.layer_types) != n:
            raise ValueError(f"layer_types has {len(arch.layer_types)} entries for {n} layers")
        if arch.num_linear_layers:
            return cls._hybrid(arch, max_model_len)
        sources = tuple(arch.kv_source_layer(i) for i in range(n))
        shapes = {layer_kv_shape(arch, i) for i in range(n) if sources[i] == i}
        if len(shapes) > 1:  # layers of different cache shapes cannot share a tensor
            return cls.uniform(arch)

        def window(i: int) -> int | None:
            w = arch.layer_window(i)
            return None if w is None or (max_model_len is not None and w >= max_model_len) else w

        kinds: dict[int | None, list[int]] = {}
        for i in range(n):
            if sources[i] == i:
                kinds.setdefault(window(i), []).append(i)
        size = min(len(v) for v in kinds.values())
        order = sorted(kinds, key=lambda w: (w is not None, w or 0))
        groups: list[KVGroup] = []
        group_of: dict[int, int] = {}
        tensor_of: dict[int, int] = {}
        for w in order:
            layers = kinds[w]
            for start in range(0, len(layers), size):
                chunk = tuple(layers[start : start + size])
                for j, layer in enumerate(chunk):
                    group_of[layer], tensor_of[layer] = len(groups), j
                groups.append(KVGroup(w, chunk))
        return cls(
            tuple(groups),
            size,
            tuple(group_of[sources[i]] for i in range(n)),
            tuple(tensor_of[sources[i]] for i in range(n)),
            sources,
            (shapes.pop(),) * size,
        )

    @classmethod
    def _hybrid(cls, arch: ModelArch, max_model_len: int | None) -> KVCacheLayout:
        """The attention layers' layout, built as if the linear layers were not there, then spread back
        over the model's layer indices with the linear layers owning nothing."""
        from dataclasses import replace

        attn_layers = [i for i in range(arch.num_hidden_layers) if not arch.is_linear_layer(i)]
        if arch.num_kv_shared_layers:
            raise ValueError("KV-shared layers in a hybrid linear-attention model are not supported")
        if not attn_layers:
            raise ValueError("a model of linear-attention layers only is not supported (no KV cache at all)")
        inner = cls.from_arch(
            replace(
                arch,
                num_hidden_layers=len(attn_layers),
                layer_types=tuple(arch.layer_types[i] for i in attn_layers),
            ),
            max_model_len,
        )
        group = [0] * arch.num_hidden_layers
        tensor = [-1] * arch.num_hidden_layers
        for j, i in enumerate(attn_layers):
            group[i], tensor[i] = inner.layer_group[j], inner.layer_tensor[j]
        return cls(
            tuple(KVGroup(g.window, tuple(attn_layers[j] for j in g.layers)) for g in inner.groups),
            inner.num_tensors,
            tuple(group),
            tuple(tensor),
            tuple(range(arch.num_hidden_layers)),
            inner.tensor_shapes,
        )
