"""KV cache groups: how layers of different attention kinds share one pool of blocks.

A sliding-window layer of window W needs only its last W tokens; a chunked-attention layer of chunk C
(Llama 4: a query at p reads floor(p / C) * C .. p) only the tokens of its query's chunk; a
full-attention layer needs them all. A group declares its kind (KVGroup: window or chunk, never both).
Layers of one kind form KV cache groups of G layers each, and every request has one block table per
group. All groups draw from ONE pool: a block id is owned by one group at a time, and the pool's memory
is G physical tensors, each holding one layer of every group (vLLM's layout):

    Gemma-3 shape, 6 layers (5 windowed "w", 1 full "f"): G = 1, six groups of one layer each

      tensor 0: [2, num_blocks, B, Hkv, D]   block 7 -> group f (layer 5), block 8 -> group w0 (layer 0), ...
      request r: table[f] = 7 12 31 40 ...     (every block of its context)
                 table[w0] = - - - 8 19        (-: wholly before the window, given back; the runner's
                                                copy keeps an old id or 0 there, which nothing reads)

    62 layers, 52 windowed + 10 full (Gemma-3-27B): G = 5, groups f0, f1 (5 layers each), w0..w10
    (5 layers each; w10 holds 2 and leaves 3 of its tensor slots unused: 3 of 65 slots, where groups of
    10, the smallest kind's count, would leave 8 of 70: group_size)

      tensor j (j < 5) holds layer j of each group: kv_caches[layer] = tensors[layer_tensor[layer]]

    a model with only full layers: one group of every layer, G = num_layers: today's layout exactly

A block is one slot of B x tensor_elems[j] elements in each of the G tensors, the same bytes for every
group (B tokens, or k x B for a group of block scale k, below), so usage, the pool plan and a block's
bytes stay one number. A windowed group's blocks lying wholly before position num_computed - W + 1
are given back each step, a chunked group's those wholly before floor(num_computed / C) * C, the
step's first query's chunk start (kv_cache_manager.py): a sequence then holds at most W (C) plus one
step's tokens in such a group, in blocks (local_blocks). Layers that share another layer's KV (Gemma
4's last layers) own no cache: they read their source layer's tensor through its group.
Linear-attention layers (Qwen3.5's Gated DeltaNet) own no cache at all: they are in no group and
no tensor (layer_tensor -1; their per-request state lives in runner/state_cache.py).
A window (chunk) at least max_model_len long never gives a block back, so such layers join the full
groups. Llama-4-Scout (36 chunked layers of C = 8192, 12 global): groups of 12 layers, one full and three
chunked; at 128K a sequence holds 8192 + 3 x 512 blocks of 16 tokens instead of 4 x 8192, and on an
H200 with FP8 weights two such sequences fit the pool where none did (tests/test_budget.py).

Layers of different cache shapes (Gemma 4: windowed layers 16 KV heads x 256, full layers 4 x 512,
KV = K there) still share tensors: a tensor's block slot holds B x tensor_elems[j] elements for K and as
many for V, B x the most any of its layers needs per token. A group whose layers need 1/k of the slot
per token (k a power of two) gets a block size of k x B (block_scales[g] = k; vLLM scales a group's
block size the same way so that every group's page holds the same bytes): a block of the pool, the
same bytes for every group, then holds k x B tokens of that group's layers and nothing is padding.
Each layer reads its tensor through a strided view of its own shape and page (runner/model_runner.py,
kernels/kv_layout.py):

    tensor j: [2, num_blocks, B x tensor_elems[j]]       (K plane, V plane)
      layer of group w (16 x 256, k = 1): view [2, num_blocks,  B, 16, 256], block stride B x 4096
      layer of group f ( 4 x 512, k = 2): view [2, num_blocks, 2B,  4, 512], same block stride

Everything that counts a group's blocks uses its own block size (kv_cache_manager.py: tables, give-back,
prefix hits in whole blocks of every group; admission.py; the runner's slot mappings). Where a layer's
shape is not a power-of-two fraction of its slot, the rest of its block stays unused: unused_share(group)
of a block's bytes. With one shape (every model but Gemma 4) k = 1 everywhere: one block size.
Gemma-4-31B at 32K tokens (B = 16, W = 1024): a sequence holds 1024 full blocks + 5 x 65 windowed at
k = 2 against 2048 + 5 x 65 with the full blocks half padding, 1.76x the sequences per pool
(`overnight budget` on an H200: 15 sequences of 32K instead of 8; tests/test_budget.py); the windows
still give back 50 of 60 layers' blocks. The tiny models with these proportions measure it
(tests/test_kv_cache_windows.py: 44 sequences at once against 27; tests/test_kv_cache_windows_gemma4.py:
13 against 9 at 144 tokens, token-exact with transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.arch import ModelArch
from overnight.loader.fit import layer_kv_shape


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _elems(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def _block_scale(ratios: list[int]) -> int:
    """The largest power of two k with k x each layer's elements per token within its slot (ratios:
    slot elements // the layer's, per layer of the group)."""
    k = 1
    while all(2 * k <= r for r in ratios):
        k *= 2
    return k


def read_start(pos: int, window: int | None, chunk: int | None) -> int:
    """The first position a query at `pos` reads in a group of this window or attention chunk (at most
    one of them set; neither: full attention, 0). Queries later in a step read from no earlier a
    position: a step's first query bounds what the whole step reads."""
    if window is not None:
        return max(0, pos - window + 1)
    if chunk is not None:
        return pos // chunk * chunk
    return 0


def local_blocks(window: int | None, chunk: int | None, step: int, block_size: int) -> int | None:
    """Most blocks of block_size tokens a sequence holds in a group of this window or attention chunk
    while a step computes `step` of its tokens (None: full attention, its whole context): the positions
    from the step's first query's read_start on. A window keeps the W - 1 before that query, in blocks
    that may start mid-block; a chunk keeps up to C - 1, from a chunk start, which is a block boundary
    when C is a multiple of block_size."""
    if window is not None:
        return cdiv(window - 1 + step, block_size) + 1
    if chunk is not None:
        return cdiv(chunk - 1 + step, block_size) + (chunk % block_size != 0)
    return None


# The largest share of a block's tensor slots a layout may leave empty to keep its groups few and large.
# An empty slot costs its bytes for every token a sequence holds in that group; each group costs host work
# every step (a block table per request to grow and give back, a slot mapping: bench/preemption_sim.py's
# scheduler alone takes ~0.1 ms a step more per windowed group at 170 running requests), which a large
# model's long steps hide and a small model's short ones may not. Gemma-3-27B's 11.4% is above this and
# Gemma-3-1B's 7.1% (a model whose pool is rarely what limits it) below.
MAX_PAD_SHARE = 0.10


def pool_tokens(num_blocks: int, group_block_sizes: tuple[int, ...]) -> int:
    """Tokens a pool of num_blocks holds while every group holds every token (a sequence within its
    windows): a token takes 1 / its group's block size of a block in each group, a padded group's
    empty slots included (group_size). The engine's pool log line and the throughput bench both say it."""
    return int(num_blocks / sum(1 / bs for bs in group_block_sizes))


def group_size(counts: list[int]) -> int:
    """G, the layers per group, for kinds of these layer counts: the largest divisor of the smallest
    count whose padding (the empty slots of each kind's last group) is at most MAX_PAD_SHARE of all slots
    while every group holds every token (contexts within the window, where padding costs the most).
    Divisors of the smallest count only: that kind (full attention, in every model so far) then fills its
    groups exactly, so long contexts, which the full groups dominate, waste nothing.
    Gemma-3-27B (10 full, 52 windowed): G = 10 leaves 8 of 70 slots empty (11.4%), G = 5 3 of 65 (4.6%),
    so G = 5, 13 groups instead of 7: at contexts within the window a pool holds 70 / 65 = 1.077x the
    sequences. Gemma-3-1B (4, 22): G = 4 leaves 2 of 28 (7.1%), within the share: 7 groups."""
    least = min(counts)
    for size in range(least, 0, -1):
        if least % size == 0:
            slots = sum(cdiv(c, size) * size for c in counts)
            if slots - sum(counts) <= MAX_PAD_SHARE * slots:
                return size
    raise AssertionError("unreachable: a group of one layer pads nothing")


@dataclass(frozen=True)
class KVGroup:
    """One group's layers and their kind: full attention (window and chunk None), a sliding window of W
    (window), or chunked attention of C (chunk: a query at p reads floor(p / C) * C .. p; Llama 4)."""

    window: int | None  # W of its layers; None: no window
    layers: tuple[int, ...]  # the layers whose cache it holds (at most num_tensors of them)
    chunk: int | None = None  # C of its layers; None: no attention chunk

    def __post_init__(self) -> None:
        if self.window is not None and self.chunk is not None:
            raise ValueError(
                f"a KV cache group has a window ({self.window}) or a chunk ({self.chunk}), not both"
            )
        for name, size in (("window", self.window), ("chunk", self.chunk)):
            if size is not None and size < 1:
                raise ValueError(f"a KV cache group's {name} must be >= 1, got {size}")

    @property
    def is_full(self) -> bool:
        """Its layers read the whole context: it gives no block back."""
        return self.window is None and self.chunk is None


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVGroup, ...]  # full-attention groups first
    num_tensors: int  # G: physical cache tensors, each one layer of every group
    layer_group: tuple[int, ...]  # per model layer: the group whose block table it reads (0: linear)
    layer_tensor: tuple[int, ...]  # per model layer: the tensor holding its cache (-1: linear, none)
    layer_source: tuple[int, ...]  # per model layer: the layer whose cache it reads (itself if not shared)
    tensor_elems: tuple[int, ...]  # per tensor: K (or V) elements of one token slot, the most of its layers
    layer_shapes: tuple[tuple[int, int], ...]  # per model layer: (KV heads, head size) of the cache it reads
    # per group: k, its block size in units of the base block size B (a power of two; 1: B).
    block_scales: tuple[int, ...] = ()
    # Cache planes of every tensor: 2 (K and V), 1 for latent attention (one row per token serves as
    # K and, its first kv_lora_rank values, as V: models/deepseek.py, attention/mla.py).
    planes: int = 2

    def __post_init__(self) -> None:
        if not self.block_scales:
            object.__setattr__(self, "block_scales", (1,) * len(self.groups))
        if len(self.block_scales) != len(self.groups):
            raise ValueError(f"{len(self.block_scales)} block scales for {len(self.groups)} groups")
        for g, k in enumerate(self.block_scales):
            if k < 1 or k & (k - 1):
                raise ValueError(f"group {g}'s block scale {k} is not a power of two")
        for i, t in enumerate(self.layer_tensor):
            heads, dim = self.layer_shapes[i]
            k = self.block_scales[self.layer_group[i]] if t >= 0 else 1
            if t >= 0 and k * heads * dim > self.tensor_elems[t]:
                raise ValueError(
                    f"layer {i}'s cache ({k} x {heads} x {dim} per token of a block of B) does not fit "
                    f"tensor {t}'s slot"
                )

    @property
    def token_elems(self) -> int:
        """Cache elements one token of one block takes over all tensors (K and V): a block holds
        block_size x token_elems elements."""
        return sum(self.planes * e for e in self.tensor_elems)

    @property
    def empty_slots(self) -> tuple[int, int]:
        """(empty, all): the tensor slots of one block of every group that no layer fills (each kind's
        last group holding fewer than G layers: group_size), out of all of them."""
        slots = self.num_tensors * self.num_groups
        return slots - sum(len(g.layers) for g in self.groups), slots

    def unused_share(self, group: int) -> float:
        """Share of a block of `group` that none of its layers uses (its shape smaller than the slots
        by more than its block scale makes up for)."""
        used = sum(
            self.planes * self.layer_shapes[i][0] * self.layer_shapes[i][1] for i in self.groups[group].layers
        )
        return 1.0 - self.block_scales[group] * used / self.token_elems

    def group_block_sizes(self, block_size: int) -> tuple[int, ...]:
        """Tokens one block of each group holds, for base block size B = block_size."""
        return tuple(block_size * k for k in self.block_scales)

    def layer_page(self, layer: int, block_size: int) -> int:
        """Tokens per block of the cache `layer` reads (its group's block size)."""
        return block_size * self.block_scales[self.layer_group[layer]]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def chunks(self) -> tuple[int | None, ...]:
        return tuple(g.chunk for g in self.groups)

    @property
    def gives_back(self) -> bool:
        """Some group (a window or a chunk) gives blocks back before a sequence ends."""
        return not all(g.is_full for g in self.groups)

    @property
    def is_uniform(self) -> bool:
        """One group, no shared layers: every layer reads the step's one block table (the fast path)."""
        return self.num_groups == 1 and all(s == i for i, s in enumerate(self.layer_source))

    def blocks_per_sequence(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """Most blocks one sequence of num_tokens holds at once, over all groups, with prefill chunks of
        at most `chunk` tokens: a windowed group keeps the last W - 1 tokens plus the chunk being written,
        a chunked group at most C - 1 plus that chunk (local_blocks)."""
        total = 0
        for g, k in zip(self.groups, self.block_scales, strict=True):
            bs = block_size * k
            full = cdiv(num_tokens, bs)
            local = local_blocks(g.window, g.chunk, min(chunk, num_tokens), bs)
            total += full if local is None else min(full, local)
        return total

    def blocks_for_sequences(self, num_seqs: int, num_tokens: int, chunk: int, block_size: int) -> int:
        """Blocks num_seqs sequences of num_tokens hold at once: each its windows and attention chunks
        (or whole context), plus one step's chunk of at most `chunk` tokens in the windowed and chunked
        groups (a step's tokens are shared by all its sequences, so the chunk is paid once, not per
        sequence)."""
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
            tuple(_elems(layer_kv_shape(arch, layer)) for layer in owners),
            tuple(layer_kv_shape(arch, sources[i]) for i in range(n)),
            planes=arch.kv_planes,
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
        shape = [layer_kv_shape(arch, i) for i in range(n)]

        def bound(size: int | None) -> int | None:
            # A window (chunk) at least max_model_len long never leaves a position behind: full attention.
            return None if size is None or (max_model_len is not None and size >= max_model_len) else size

        def kind(i: int) -> tuple[int | None, int | None]:
            return bound(arch.layer_window(i)), bound(arch.layer_chunk(i))

        kinds: dict[tuple[int | None, int | None], list[int]] = {}
        for i in range(n):
            if sources[i] == i:
                kinds.setdefault(kind(i), []).append(i)
        size = group_size([len(v) for v in kinds.values()])
        # full attention first, then windows, then chunks, each by size
        order = sorted(kinds, key=lambda wc: (wc[1] is not None, wc[0] is not None, wc[0] or 0, wc[1] or 0))
        groups: list[KVGroup] = []
        group_of: dict[int, int] = {}
        tensor_of: dict[int, int] = {}
        slot = [0] * size
        for window, chunk in order:
            layers = kinds[window, chunk]
            for start in range(0, len(layers), size):
                part = tuple(layers[start : start + size])
                for j, layer in enumerate(part):
                    group_of[layer], tensor_of[layer] = len(groups), j
                    slot[j] = max(slot[j], _elems(shape[layer]))
                groups.append(KVGroup(window, part, chunk))
        return cls(
            tuple(groups),
            size,
            tuple(group_of[sources[i]] for i in range(n)),
            tuple(tensor_of[sources[i]] for i in range(n)),
            sources,
            tuple(slot),
            tuple(shape[sources[i]] for i in range(n)),
            tuple(_block_scale([slot[tensor_of[i]] // _elems(shape[i]) for i in g.layers]) for g in groups),
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
                # a hybrid layer (Falcon-H1) is a full-attention layer here; its state is the state cache's
                layer_types=tuple(_attention_kind(arch.layer_types[i]) for i in attn_layers),
            ),
            max_model_len,
        )
        group = [0] * arch.num_hidden_layers
        tensor = [-1] * arch.num_hidden_layers
        shapes = [(0, 0)] * arch.num_hidden_layers  # linear layers read no KV cache
        for j, i in enumerate(attn_layers):
            group[i], tensor[i], shapes[i] = (
                inner.layer_group[j],
                inner.layer_tensor[j],
                inner.layer_shapes[j],
            )
        return cls(
            tuple(KVGroup(g.window, tuple(attn_layers[j] for j in g.layers), g.chunk) for g in inner.groups),
            inner.num_tensors,
            tuple(group),
            tuple(tensor),
            tuple(range(arch.num_hidden_layers)),
            inner.tensor_elems,
            tuple(shapes),
            inner.block_scales,
        )


def _attention_kind(kind: str) -> str:
    return "full_attention" if kind == "hybrid" else kind
