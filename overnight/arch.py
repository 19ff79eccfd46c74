"""The architecture a checkpoint describes: its HF config.json (and vision_config) as frozen dataclasses,
read once by models/hf_config.py, with the shapes and sizes the engine derives from them (caches,
states, parameter counts). The engine's own settings are in config.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# One value of a RoPE scaling's parameters (ModelArch.rope_scaling).
RopeValue = float | str | bool | tuple[float, ...]


@dataclass(frozen=True)
class VisionArch:
    """A vision tower and how its image tokens sit in the prompt, named as in HF vision_config.
    kind: "qwen2_5_vl" (window attention, RMSNorm, SwiGLU), "qwen2_vl" (2.5's tower without windows,
    with LayerNorms and a quick_gelu fc1 / fc2 MLP), "qwen3_vl" (learned position embeddings,
    LayerNorm, deepstack features), "gemma3" (SigLIP at a fixed image_size, its patch features
    average-pooled to mm_tokens_per_image; the prompt brackets them with vision_start / vision_end,
    Gemma's boi / eoi tokens, and they attend to each other both ways: bidirectional_images) or
    "pixtral" (Mistral 3: Pixtral's tower over images of any size up to image_size on their longest
    edge, a patch merger and a projector; a row of [IMG] tokens per row of merged patches, each row
    closed by [IMG_BREAK], the last by [IMG_END]) or "internvl" (InternVL 3 / 3.5: InternViT over
    image_size tiles of an image (the processor's crop_to_patches plus a thumbnail), pixel shuffle by
    spatial_merge_size = 1 / downsample_ratio and an MLP projector; the grid is (tiles, patches per tile
    side, patches per tile side); vision_start / vision_end are <img> / </img>) or "llama4" (Llama 4:
    its ViT over image_size tiles of an image (a canvas of at most max_patches tiles, plus the whole
    image as one more past one tile), pixel shuffle by spatial_merge_size = 1 / pixel_shuffle_ratio, an
    adapter MLP of projector_hidden_size and a linear projector; the grid is (tiles, patch rows of the
    canvas, patch columns of the canvas); vision_start / vision_end are <|image_start|> /
    <|image_end|>, image_token_id is <|patch|>) or "idefics3" (Idefics3 / SmolVLM: SigLIP over
    image_size frames of an image (a grid of tiles plus the whole image, each its own ImageInput of grid
    (1, patches per side, patches per side)), a pixel shuffle by spatial_merge_size = scale_factor and a
    linear connector: mm_tokens_per_image <image> tokens a frame) or "glm4v" (GLM-4.1V: Qwen2-VL's
    patches and prompt layout, RMSNorm blocks, a learned position table of (image_size / patch)^2
    resampled per image, a strided-conv merge and a SwiGLU merger; vision_start / vision_end are
    <|begin_of_image|> / <|end_of_image|>, image_token_id is <|image|>)."""

    kind: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str
    image_token_id: int
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    rope_theta: float = 10000.0
    window_size: int = 0  # Qwen2.5-VL: window attention in pixels, except fullatt_block_indexes
    fullatt_block_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0  # Qwen3-VL: learned table of side**2 entries, interpolated
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose features feed early layers
    image_size: int = 0  # Gemma 3: every image is resized to it; Mistral 3: the longest edge's bound
    mm_tokens_per_image: int = 0  # Gemma 3: tokens per image (a square number)
    # Gemma 3: SigLIP's LayerNorms and the projector's RMSNorm; Mistral 3: its projector's RMSNorm
    layer_norm_eps: float = 1e-6
    # Mistral 3: the tower's hidden state the projector reads (0: after ln_pre, i: after block i;
    # negative: counted from the end, as HF's vision_feature_layer)
    vision_feature_layer: int = -1
    projector_hidden_act: str = "gelu"  # Mistral 3's projector: linear_1, this, linear_2
    projector_bias: bool = False
    # InternViT: "layer_norm" or "rms_norm" blocks, q / k RMSNorm, q / k / v biases, a LayerNorm after
    # the last block (use_mean_pooling false), learned position embeddings
    norm_type: str = "layer_norm"
    qk_norm: bool = False
    attention_bias: bool = False
    final_norm: bool = False
    position_embeddings: bool = True
    projector_hidden_size: int = 0  # Llama 4: the adapter MLP's width (projector_input / output_dim)

    @property
    def bidirectional_images(self) -> bool:
        """An image's tokens see each other both ways (Gemma 3): each is computed in one prefill chunk."""
        return self.kind == "gemma3"

    def num_parameters(self) -> int:
        """The tower's parameters (models/vision/qwen_vit.py, siglip.py), for the memory check."""
        h, i, out = self.hidden_size, self.intermediate_size, self.out_hidden_size
        if self.kind == "llama4":  # unfold linear, cls + positions, LN pre / post, blocks, adapter, projector
            tokens = (self.image_size // self.patch_size) ** 2 + 1
            embed = self.in_channels * self.patch_size**2 * h + h + tokens * h + 4 * h
            block = 4 * h + 4 * (h * h + h) + 2 * h * i + i + h
            a = self.projector_hidden_size
            return embed + self.depth * block + h * self.spatial_merge_size**2 * a + a * a + a * out
        if self.kind == "internvl":  # cls + conv + positions, blocks, final norm, LN + two linears
            norm = 2 * h if self.norm_type == "layer_norm" else h
            tokens = (self.image_size // self.patch_size) ** 2 + 1
            embed = h + self.in_channels * self.patch_size**2 * h + h
            embed += tokens * h if self.position_embeddings else 0
            qkv = 3 * h * h + (3 * h if self.attention_bias else 0)
            block = 2 * norm + qkv + (2 * h if self.qk_norm else 0) + h * h + h + 2 * h * i + i + h + 2 * h
            wide = h * self.spatial_merge_size**2
            projector = 2 * wide + wide * out + out + out * out + out
            return embed + self.depth * block + (2 * h if self.final_norm else 0) + projector
        if self.kind == "pixtral":  # conv, ln_pre, blocks without biases; norm, merger, two linears
            m = self.spatial_merge_size
            block = 2 * h + 4 * h * h + 3 * h * i
            bias = 2 * out if self.projector_bias else 0
            projector = h + h * m * m * h + h * out + out * out + bias
            return self.in_channels * self.patch_size**2 * h + h + self.depth * block + projector
        if self.kind == "idefics3":  # conv + positions, pre-LN blocks, post-LN, the connector's matrix
            patches = (self.image_size // self.patch_size) ** 2
            embed = self.in_channels * self.patch_size**2 * h + h + patches * h
            block = 4 * h + 4 * (h * h + h) + 2 * h * i + i + h
            return embed + self.depth * block + 2 * h + h * self.spatial_merge_size**2 * out
        if self.kind == "gemma3":  # conv + positions, pre-LN blocks, post-LN, projector norm + matrix
            patches = (self.image_size // self.patch_size) ** 2
            embed = self.in_channels * self.patch_size**2 * h + h + patches * h
            block = 4 * h + 4 * (h * h + h) + 2 * h * i + i + h
            return embed + self.depth * block + 2 * h + h + h * out
        if self.kind == "glm4v":  # conv, positions, blocks, two RMSNorms, downsample, merger
            m, side = self.spatial_merge_size, self.image_size // self.patch_size
            patch = self.in_channels * self.temporal_patch_size * self.patch_size**2 * h + h
            qkv = 3 * h * h + (3 * h if self.attention_bias else 0)
            block = 2 * h + qkv + h * h + 3 * h * out
            downsample = h * m * m * out + out
            glm_merger = out * out + 2 * out + 3 * out * i
            return patch + side * side * h + self.depth * block + 2 * h + downsample + glm_merger
        wide = h * self.spatial_merge_size**2
        qwen3 = self.kind == "qwen3_vl"
        layer_norm = self.kind != "qwen2_5_vl"  # LayerNorms have a bias, Qwen2.5-VL's RMSNorms none
        norms = 4 * h if layer_norm else 2 * h
        mlp = 3 * h * i + 2 * i + h if self.kind == "qwen2_5_vl" else 2 * h * i + i + h  # gated or not
        block = norms + 3 * h * h + 3 * h + h * h + h + mlp
        patch = self.in_channels * self.temporal_patch_size * self.patch_size**2 * h + (h if qwen3 else 0)

        def merger(norm_width: int) -> int:
            return norm_width * (2 if layer_norm else 1) + wide * wide + wide + wide * out + out

        total = patch + self.depth * block + merger(h)
        if qwen3:
            total += self.num_position_embeddings * h + len(self.deepstack_visual_indexes) * merger(wide)
        return total

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Image tokens in the prompt for a patch grid (t, h, w): patches merged merge x merge (Mistral 3:
        and a [IMG_BREAK] / [IMG_END] after each row of them; InternVL: t is the image's tile count;
        Llama 4: every tile's tokens and the separator after each, then <|image|> and the whole image's
        tokens, multimodal/llama4_prompt.py)."""
        t, h, w = grid_thw
        m = self.spatial_merge_size
        if self.kind == "pixtral":
            return (h // m) * (w // m + 1)
        if self.kind == "llama4":
            side = self.image_size // self.patch_size
            per_tile, local = (side // m) ** 2, (h // side) * (w // side)
            return (local * (per_tile + 1) if local > 1 else 0) + 1 + per_tile
        return t * h * w // (m**2)


@dataclass(frozen=True)
class ModelArch:
    """The architecture of a transformer, named as in HF config.json: a decoder, or (is_encoder) a
    BERT-style encoder."""

    architecture: str  # the family's HF model_type ("llama", "qwen3", "phi3"...: models/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # RoPE scaling: HF's rope_parameters less rope_theta, as (key, value) pairs with "rope_type" among
    # llama3, linear, dynamic, yarn, longrope (layers/rotary.py; lists as tuples); pairs without a
    # "rope_type" are llama3's four keys. None means plain RoPE.
    rope_scaling: tuple[tuple[str, RopeValue], ...] | None = None
    max_position_embeddings: int = 4096
    # Positions the RoPE tables cover (models/layer_spec.py); 0: max_position_embeddings. build.py sets
    # the engine's max_model_len when it is shorter (Llama 4's configs say 10M positions).
    rope_positions: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # bias on o_proj (Llama's attention_bias; never Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    qk_norm_after_rope: bool = False  # ...applied to the rotated q and k instead (Hunyuan)
    # Mixture of experts (Qwen3-MoE). num_experts == 0: every layer has the dense MLP of
    # intermediate_size; otherwise the layers that is_moe_layer() names route each token to
    # num_experts_per_tok of num_experts MLPs of moe_intermediate_size, the others stay dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # rescale the chosen experts' softmax weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Per-layer attention kinds, HF's `layer_types` names: "full_attention" or "sliding_attention" (a
    # window of sliding_window tokens, the query's own included), or "chunked_attention" (Llama 4: a
    # query sees its own chunk of attention_chunk_size positions, up to itself). () means every layer
    # is full. Hybrid models add "linear_attention" (a state, no KV cache) and "hybrid" (Falcon-H1:
    # full attention and a Mamba2 state in one layer; has_linear_state, linear_state_index).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    # KV sharing (Gemma 4): the last num_kv_shared_layers layers write no cache of their own and read
    # the cache of the last earlier layer of their kind (kv_source_layer).
    num_kv_shared_layers: int = 0
    # gpt-oss: a learned sink logit per attention head; experts with biases and the clamped SwiGLU
    # (limit swiglu_limit); experts_mxfp4: the checkpoint's experts are MXFP4 (quant/mxfp4.py), which the
    # model keeps packed unless experts_mxfp4_dense: then each is dequantized as it loads (the
    # mxfp4_experts option, build.py) and held in the compute dtype (the 16-bit fused MoE) or, with
    # experts_mxfp4_fp8 too, requantized to e4m3 with one scale per row as it loads (the FP8 fused MoE).
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 7.0
    experts_mxfp4: bool = False
    experts_mxfp4_dense: bool = False
    experts_mxfp4_fp8: bool = False
    # Gemma (2/3/4, models/gemma.py and gemma4.py). attention_scale None: head_dim ** -0.5 (Gemma 2/3:
    # query_pre_attn_scalar ** -0.5; Gemma 4: 1.0). Softcaps: cap * tanh(x / cap) on the attention scores
    # and on the final logits. Sliding layers rotate with local_rope_theta; full layers with rope_theta,
    # their frequencies divided by rope_factor (Gemma 3's linear scaling) and only the first
    # rope_proportion of them kept (Gemma 4's proportional RoPE; the rest are 0: those pairs do not turn).
    # Gemma 4's full layers may have their own head_dim and KV heads (global_head_dim,
    # num_global_key_value_heads; 0: as the sliding ones), share K with V (attention_k_eq_v: no v_proj),
    # take a per-layer input embedding of hidden_size_per_layer_input (0: none), double the MLP of the
    # KV-shared layers (use_double_wide_mlp), and run their experts beside the dense MLP (moe_beside_dense).
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    rope_factor: float = 1.0
    rope_proportion: float = 1.0
    global_head_dim: int = 0
    num_global_key_value_heads: int = 0
    attention_k_eq_v: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False
    moe_beside_dense: bool = False
    # The dense families' variations (Mistral, Phi-3/4, OLMo 2/3, SmolLM3, Granite, GLM-4), read from
    # config.json by models/hf_config.py and into each layer's description by models/layer_spec.py;
    # the defaults are Llama's.
    #   RoPE: the rotated share of head_dim (the rest passes), interleaved pairs (2i, 2i + 1) instead of
    #   rotate-half (GLM-4), sliding-window layers' own theta and scaling (OLMo 3; None: as the full
    #   layers), and layers without RoPE (SmolLM3's NoPE layers).
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: tuple[tuple[str, RopeValue], ...] | None = None
    no_rope_layers: tuple[int, ...] = ()
    #   Granite: the attention scale (None: head_dim ** -0.5), embeddings times embedding_multiplier,
    #   each sub-block's output times residual_multiplier before its residual add, logits / logits_scaling.
    attention_multiplier: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    #   Where the norms sit: "pre" (Llama: before attention and MLP), "post" (OLMo 2/3: after each
    #   sub-block's output, none before), "sandwich" (GLM-4: both). qk_norm_whole: qk_norm spans the whole
    #   q and k projections (OLMo 2/3) instead of each head (Qwen3).
    norm_placement: str = "pre"
    qk_norm_whole: bool = False
    #   Seed-OSS, EXAONE 4, Apertus, Cohere (Command R / R7B / A). norm_placement "parallel" (Cohere):
    #   one norm feeds attention and MLP side by side, x + attn(n) + mlp(n) with n = norm(x); norm_type
    #   "layer": that norm (and the final one) is a mean-centred LayerNorm without bias, of
    #   layer_norm_eps (else RMSNorm of rms_norm_eps). hidden_act "xielu" (Apertus): the MLP is
    #   down(xielu(up(x))), no gate, with the learned alpha_p / alpha_n of each layer (layers/xielu.py);
    #   "silu": the gated SwiGLU. The logits are multiplied by logit_scale (Cohere).
    norm_type: str = "rms"
    hidden_act: str = "silu"
    logit_scale: float = 1.0
    # Hybrid linear attention (Qwen3.5 / Qwen3.6, Qwen3-Next; models/qwen3_next.py): the layers that
    # layer_types names "linear_attention" are Gated DeltaNet layers, which keep a fixed-size state per
    # request (runner/state_cache.py) and no KV cache; the others are full attention with an output
    # gate, (1 + w) RMSNorms and RoPE over the first hybrid_rotary_dim dims of each head.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    hybrid_rotary_dim: int = 0
    # Mamba2 mixers instead of Gated DeltaNet in the "linear_attention" layers (Granite 4.0 hybrids,
    # models/granite_hybrid.py; mamba_n_heads > 0 marks them): in_proj gives z (mamba_intermediate),
    # x|B|C (the conv channels: mamba_intermediate + 2 * n_groups * d_state) and dt (one per head); the
    # conv has a bias (mamba_conv_bias), the projections one with mamba_proj_bias; dt is clamped to
    # mamba_dt_limit after its softplus. mamba_intermediate = mamba_n_heads * mamba_d_head.
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_d_conv: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))
    # The gated RMSNorm before out_proj normalizes each of mamba_norm_groups equal slices of the mixer's
    # width on its own: 1 (Granite: the whole width) or n_groups (Nemotron-H).
    mamba_norm_groups: int = 1
    # Falcon-H1's variations (models/falcon_h1.py): no gated norm at all (mamba_rms_norm False: the output
    # is y * silu(z)), or the norm before the gate (weight * rms_norm(y) * silu(z), per group).
    mamba_rms_norm: bool = True
    mamba_norm_before_gate: bool = False
    # Constants folded into projection weights as the checkpoint loads, by name (Falcon-H1's muP
    # multipliers, models/falcon_h1.py MULTIPLIERS); () for every other family.
    weight_multipliers: tuple[tuple[str, float], ...] = ()
    # LFM2's gated short convolutions in the "linear_attention" layers (models/lfm2.py; short_conv_kernel
    # > 0 marks them, config.json's conv_L_cache): in_proj gives B, C and x (hidden_size each), the layer
    # returns out_proj(C * conv(B * x)), a depthwise causal conv of short_conv_kernel taps without an
    # activation. Its state is the conv's alone (the last K - 1 values of B * x); no recurrent state.
    # short_conv_bias: biases on in_proj, the conv and out_proj (config.json's conv_bias).
    short_conv_kernel: int = 0
    short_conv_bias: bool = False
    # Nemotron-H's layout (models/nemotron_h.py), its hybrid_override_pattern of "M" (Mamba2), "*"
    # (attention), "-" (MLP) and "E" (mixture of experts, Nemotron 3) blocks; "" for every other family.
    # Set, each layer here is a single mixer (the pattern's M and * in order, layer_types) behind one
    # RMSNorm and no MLP; the MLP blocks between them (each its own RMSNorm and up -> relu^2 -> down of
    # intermediate_size, no gate) and the MoE blocks (moe_blocks: its RMSNorm, the grouped sigmoid router,
    # num_experts ungated experts and one ungated shared expert of shared_expert_intermediate_size) are no
    # layers: they hold no KV cache and no state, and is_moe_layer names none.
    block_pattern: str = ""
    # The routed experts' form: gate and up rows (silu(gate) * up and the like), or up rows alone
    # (False: Nemotron-H's relu(up)^2; an expert then has two projections, not three).
    experts_gated: bool = True
    # Latent experts (Nemotron 3 Super): the routed experts run at this width between a down projection
    # from hidden_size and an up projection back (two nn.Linear per MoE block); 0: at hidden_size.
    moe_latent_size: int = 0
    shared_expert_intermediate_size: int = 0  # a sigmoid-gated shared expert beside the routed ones
    # GLM-4.5 / 4.6 (models/glm4_moe.py): the router's sigmoid scores plus a learned per-expert bias
    # choose the experts (among the topk_group best of n_group groups), the unbiased scores weigh them,
    # times routed_scaling_factor (layers/moe_grouped_router.py); its shared experts (of
    # shared_expert_intermediate_size) have no gate (shared_expert_gated False).
    # "softmax" | "sigmoid" (with the correction bias and groups) | "softmax_group" (DeepSeek-V2) |
    # "llama4" (above) | "softmax_bias" (ERNIE 4.5: softmax, the correction bias added for the choice
    # alone, a float32 router; models/ernie4_5_moe.py)
    router_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # what the sigmoid router's renormalization adds to the chosen weights' sum: GLM's 1e-20, LFM2-MoE's
    # 1e-6 (each as transformers computes it)
    router_renorm_eps: float = 1e-20
    shared_expert_gated: bool = True
    # Llama 4 (models/llama4.py): the RoPE layers' q and k L2-normalized per head after the rotation,
    # without a weight (qk_l2_norm, HF's use_qk_norm); the NoPE layers' q scaled by its position,
    # 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)) (attn_temperature_tuning; floor_scale 0:
    # off); each MoE layer's router scores the experts' inputs (router_scoring "llama4": the top-k
    # logits' sigmoids multiply the token before the experts, whose outputs are summed unweighted).
    qk_l2_norm: bool = False
    attn_floor_scale: float = 0.0
    attn_scale: float = 0.0
    # Multi-head latent attention (DeepSeek-V2 / V3, Kimi-K2, Moonlight, GLM-4.7-Flash; models/deepseek.py):
    # kv_lora_rank > 0 marks it. q from q_b(norm(q_a(x))) (q_proj when q_lora_rank is 0), per head
    # qk_nope_head_dim unrotated dims and qk_rope_head_dim rotated ones (head_dim is the rotated part, as
    # HF sets it); the cache holds one row per token, the normalized latent (kv_lora_rank) and the rotated
    # shared key (qk_rope_head_dim): kv_planes 1, no separate V (attention/mla.py). V2's router is a
    # softmax with group-limited choice (router_scoring "softmax_group").
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Encoders (BERT): bidirectional attention over whole prompts, no KV cache, LayerNorm, learned
    # absolute positions and token-type (segment) embeddings.
    is_encoder: bool = False
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-12
    # RoBERTa / XLM-R: position ids start at pad_token_id + 1 (the table has max_position_embeddings +
    # position_offset rows; max_position_embeddings counts the usable positions). 0 for BERT.
    position_offset: int = 0
    # ModernBERT (models/modernbert.py): biases on the MLP and on the LayerNorms. An encoder's sliding
    # layers (layer_types) see a window centred on each token, |i - j| <= sliding_window // 2 (ModernBERT's
    # local_attention, EmbeddingGemma's bidirectional sliding_window: both as config.json writes them).
    mlp_bias: bool = False
    norm_bias: bool = True
    # Sequence classifiers and cross-encoders (...ForSequenceClassification): the classification head's
    # outputs; 0 for every other model.
    num_labels: int = 0
    # Where an encoder classifier's head reads: "CLS" (the first token) or "MEAN" (ModernBERT's
    # classifier_pooling "mean"); the bias of ModernBERT's head dense layer.
    classifier_pooling: str = "CLS"
    classifier_bias: bool = False
    # Vision-language models (models/qwen_vl.py): M-RoPE's split of the head's frequencies between the
    # temporal, height and width positions (layers/mrope.py; () means plain RoPE), and the vision tower.
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    vision: VisionArch | None = None
    # An image model run on text only (limit_mm_per_prompt image 0; build.resolve_model sets it): built,
    # loaded and counted without its vision tower and projector, its decoder the image model's (same
    # class, checkpoint names and M-RoPE, which on text is plain RoPE), image prompts refused.
    text_only: bool = False

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_planes(self) -> int:
        """Cache planes per layer: 2 (K and V), 1 for latent attention (its one row serves as both)."""
        return 1 if self.is_mla else 2

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx`, None for full attention."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_chunk(self, layer_idx: int) -> int | None:
        """The attention chunk of layer `layer_idx` (Llama 4's chunked layers), None for none. Chunked
        layers form KV cache groups of their own, which give back the blocks before a request's
        current chunk (engine/kv_groups.py)."""
        if self.layer_types and self.layer_types[layer_idx] == "chunked_attention":
            return self.attention_chunk_size
        return None

    def kv_source_layer(self, layer_idx: int) -> int:
        """The layer whose KV cache layer `layer_idx` reads: itself, unless KV-shared."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if layer_idx < first_shared:
            return layer_idx
        kind = self.layer_types[layer_idx] if self.layer_types else "full_attention"
        kinds = self.layer_types or ("full_attention",) * self.num_hidden_layers
        return max(i for i in range(first_shared) if kinds[i] == kind)

    def layer_head_dim(self, layer_idx: int) -> int:
        """Head size of layer `layer_idx`'s cache (Gemma 4's full layers have their own; latent
        attention: the latent and the rotated key, one row)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        if self.global_head_dim and self.layer_window(layer_idx) is None:
            return self.global_head_dim
        return self.head_dim

    def layer_num_kv_heads(self, layer_idx: int) -> int:
        if self.is_mla:
            return 1
        if self.num_global_key_value_heads and self.layer_window(layer_idx) is None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def layer_intermediate_size(self, layer_idx: int) -> int:
        """The dense MLP's width in layer `layer_idx` (Gemma 4 doubles it in KV-shared layers)."""
        shared = layer_idx >= self.num_hidden_layers - self.num_kv_shared_layers
        return self.intermediate_size * (2 if self.use_double_wide_mlp and shared else 1)

    def _attention_linear(self, layer_idx: int) -> tuple[int, int]:
        """(weights, output rows) of layer `layer_idx`'s q/k/v/o projections; a KV-shared layer has no
        k/v, and attention_k_eq_v full layers no v."""
        if self.is_mla:
            return self._mla_linear()
        h, d = self.hidden_size, self.layer_head_dim(layer_idx)
        q = self.num_attention_heads * d
        kv = self.layer_num_kv_heads(layer_idx) * d
        if self.kv_source_layer(layer_idx) != layer_idx:
            num_kv = 0
        elif self.attention_k_eq_v and self.layer_window(layer_idx) is None:
            num_kv = 1
        else:
            num_kv = 2
        rows = q + num_kv * kv + h
        return h * (q + num_kv * kv) + q * h, rows

    def _mla_linear(self) -> tuple[int, int]:
        """(weights, output rows) of a latent-attention layer: q_a and q_b (or q_proj), kv_a_proj_with_mqa,
        kv_b_proj and o_proj."""
        h, heads, qr, kvr = self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank
        q_out = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        kv_b_out = heads * (self.qk_nope_head_dim + self.v_head_dim)
        q_params, q_rows = (h * qr + qr * q_out, qr + q_out) if qr else (h * q_out, q_out)
        kv_a = kvr + self.qk_rope_head_dim
        params = q_params + h * kv_a + kvr * kv_b_out + heads * self.v_head_dim * h
        return params, q_rows + kv_a + kv_b_out + h

    def is_linear_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is linear attention (a state per request, no KV cache)."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == "linear_attention"

    def has_linear_state(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` keeps a linear layer's state per request: a linear-attention layer,
        or a "hybrid" one (Falcon-H1: attention with its KV cache and a Mamba2 mixer side by side)."""
        return bool(self.layer_types) and self.layer_types[layer_idx] in ("linear_attention", "hybrid")

    def linear_state_index(self, layer_idx: int) -> int:
        """Layer `layer_idx`'s place among the layers with a state (the state cache's index)."""
        return sum(self.has_linear_state(i) for i in range(layer_idx))

    @property
    def num_linear_layers(self) -> int:
        """The layers with a linear layer's state (the state cache's layers; hybrid ones included)."""
        return sum(self.has_linear_state(i) for i in range(self.num_hidden_layers))

    @property
    def mlp_blocks(self) -> int:
        """Nemotron-H's MLP blocks (block_pattern's "-"), which are no layers here."""
        return self.block_pattern.count("-")

    @property
    def moe_blocks(self) -> int:
        """Nemotron-H's mixture-of-experts blocks (block_pattern's "E"), which are no layers either."""
        return self.block_pattern.count("E")

    @property
    def num_sparse_mlps(self) -> int:
        """The stacks of routed experts: Nemotron-H's MoE blocks, else one per layer is_moe_layer names."""
        if self.block_pattern:
            return self.moe_blocks
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def _expert_shape(self) -> tuple[int, int]:
        """(weights, output rows) of one routed expert's projections (gate/up and down, or up and down),
        at the experts' width (moe_latent_size when latent)."""
        h, i = self.moe_latent_size or self.hidden_size, self.moe_intermediate_size
        return (3 * h * i, 2 * i + h) if self.experts_gated else (2 * h * i, i + h)

    @property
    def is_mamba2(self) -> bool:
        """Whether the linear layers are Mamba2 mixers (else Gated DeltaNet)."""
        return self.mamba_n_heads > 0

    @property
    def is_short_conv(self) -> bool:
        """Whether the linear layers are LFM2's gated short convolutions (a conv state, no recurrence)."""
        return self.short_conv_kernel > 0

    @property
    def is_gated_delta(self) -> bool:
        """Whether the linear layers are Gated DeltaNet's (Qwen3.5 / Qwen3-Next, whose attention layers
        carry an output gate in q_proj)."""
        return bool(self.num_linear_layers) and not self.is_mamba2 and not self.is_short_conv

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_n_heads * self.mamba_d_head

    def linear_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One linear layer's state of one request: (conv (K - 1, conv channels), the recurrent state):
        Gated DeltaNet's delta rule (Hv, dk, dv), or Mamba2's SSM state (heads, d_head, d_state)."""
        if self.is_short_conv:  # the conv over B * x, and no recurrent state (an empty one)
            return (self.short_conv_kernel - 1, self.hidden_size), (0, 0, 0)
        if self.is_mamba2:
            conv = self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_d_state
            return (self.mamba_d_conv - 1, conv), (self.mamba_n_heads, self.mamba_d_head, self.mamba_d_state)
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim
        conv_dim += self.linear_num_value_heads * self.linear_value_head_dim
        ssm = (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)
        return (self.linear_conv_kernel_dim - 1, conv_dim), ssm

    def linear_state_bytes(self, ssm_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one request's states over every linear layer: the conv state in float32, the
        delta-rule state in ssm_dtype (CacheConfig.ssm_state_dtype; runner/state_cache.py says why)."""
        (k, c), (h, dk, dv) = self.linear_state_shapes()
        return self.num_linear_layers * (4 * k * c + ssm_dtype.itemsize * h * dk * dv)

    def _linear_mixer_shape(self) -> tuple[int, int]:
        """(weights, output rows) of one linear layer's projections: Gated DeltaNet's in_proj (q|k|v, z,
        b, a) and out_proj, or Mamba2's in_proj (z, x|B|C, dt) and out_proj."""
        h = self.hidden_size
        (_, conv), _ = self.linear_state_shapes()
        if self.is_short_conv:  # in_proj (B, C, x) and out_proj
            return 4 * h * h, 4 * h
        if self.is_mamba2:
            inner, heads = self.mamba_intermediate, self.mamba_n_heads
            return h * (inner + conv + heads) + inner * h, inner + conv + heads + h
        heads = self.linear_num_value_heads
        value = heads * self.linear_value_head_dim
        return h * (conv + value + 2 * heads) + value * h, conv + value + 2 * heads + h

    def _linear_mixer_extra(self) -> int:
        """One linear layer's weights beside its projections: the conv (and Mamba2's conv bias and
        projection biases), A_log, dt_bias (Mamba2's D) and the output norm."""
        (k1, conv), _ = self.linear_state_shapes()
        if self.is_short_conv:  # the conv's taps; with short_conv_bias, the conv's and projections' biases
            return conv * (k1 + 1) + (conv + 4 * self.hidden_size) * self.short_conv_bias
        if self.is_mamba2:
            _, rows = self._linear_mixer_shape()
            biases = conv * self.mamba_conv_bias + rows * self.mamba_proj_bias
            norm = self.mamba_intermediate if self.mamba_rms_norm else 0  # the gated norm's weight
            return conv * (k1 + 1) + biases + 3 * self.mamba_n_heads + norm
        return conv * (k1 + 1) + 2 * self.linear_num_value_heads + self.linear_value_head_dim

    @property
    def holds_mxfp4_experts(self) -> bool:
        """Whether the built model keeps its experts as MXFP4 blocks and scales (else dequantized at load:
        in the compute dtype, or as e4m3 with experts_mxfp4_fp8)."""
        return self.experts_mxfp4 and not self.experts_mxfp4_dense

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has the sparse MLP (HF's rule for Qwen3-MoE; never with a
        block_pattern, whose MoE blocks are no layers)."""
        return (
            self.num_experts > 0
            and not self.block_pattern
            and (layer_idx + 1) % self.decoder_sparse_step == 0
            and layer_idx not in self.mlp_only_layers
        )

    def mlp_params(self, active_only: bool = False) -> int:
        """Weights of all layers' MLPs, routers included. active_only: only the experts one token goes
        through (num_experts_per_tok per sparse layer), the weights its forward pass multiplies by."""
        expert, expert_rows = self._expert_shape()
        if self.expert_bias:  # gate/up and down biases
            expert += expert_rows
        # The router: a row per expert, and a bias per expert (gpt-oss's, GLM-4.5's correction bias)
        biased = self.expert_bias or self.router_scoring in ("sigmoid", "softmax_bias")
        router = self.num_experts * (self.hidden_size + (1 if biased else 0))
        if self.block_pattern:  # Nemotron-H: the MLP blocks (up and down, no gate) and the MoE blocks
            used = self.num_experts_per_tok if active_only else self.num_experts
            shared = 2 * self.hidden_size * self.shared_expert_intermediate_size  # ungated too
            latent = 2 * self.hidden_size * self.moe_latent_size  # into and out of the latent width
            moe = self.moe_blocks * (router + used * expert + shared + latent)
            return moe + self.mlp_blocks * 2 * self.hidden_size * self.intermediate_size
        total = 0
        for i in range(self.num_hidden_layers):
            moe = self.is_moe_layer(i)
            if moe:
                used = self.num_experts_per_tok if active_only else self.num_experts
                total += router + used * expert
                if self.shared_expert_intermediate_size:  # and its one-output gate
                    total += 3 * self.hidden_size * self.shared_expert_intermediate_size
                    total += self.hidden_size if self.shared_expert_gated else 0
            if not moe or self.moe_beside_dense:
                if self.hidden_act == "xielu":  # up and down, and the activation's alpha_p, alpha_n
                    total += 2 * self.hidden_size * self.layer_intermediate_size(i) + 2
                else:
                    total += 3 * self.hidden_size * self.layer_intermediate_size(i)
        return total

    def rope_scaling_dict(self) -> dict[str, RopeValue] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def rotary_dim(self) -> int:
        """The dims of a head that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """KV-cache bytes one token takes over all layers (K and V, every KV head); a KV-shared layer
        has no cache of its own, a linear-attention layer none at all."""
        per_layer = [
            self.layer_num_kv_heads(i) * self.layer_head_dim(i)
            for i in range(self.num_hidden_layers)
            if self.kv_source_layer(i) == i and not self.is_linear_layer(i)
        ]
        return self.kv_planes * sum(per_layer) * elem_bytes

    def num_linear_parameters(self, active_only: bool = False) -> int:
        """Weights of the projections (q/k/v/o and the MLPs, routers included), all layers; active_only:
        with only the experts one token goes through."""
        n = self.num_hidden_layers
        attention = sum(self._attention_linear(i)[0] for i in range(n) if not self.is_linear_layer(i))
        if self.num_linear_layers:  # hybrid: the linear layers' projections; Qwen's gated attention
            # (q_proj gives q and a gate) too
            if self.is_gated_delta:
                attention += self.hidden_size * self.q_size * (n - self.num_linear_layers)
            attention += self._linear_mixer_shape()[0] * self.num_linear_layers
        return attention + self.mlp_params(active_only)

    def weight_bytes(
        self,
        dtype_bytes: int,
        fp8_linear: bool = False,
        fp8_experts: bool = False,
        int_linear: tuple[int, int, bool] | None = None,
        dense_kept: tuple[int, int] = (0, 0),
        int_zeros: bool = True,
    ) -> int:
        """Bytes of every weight in dtype; fp8_linear: the nn.Linear projections (attention and dense MLPs)
        take one byte each plus a float32 scale per output row (quant/); fp8_experts: the stacked MoE
        experts too, as they are once loaded (they load in dtype and are quantized afterwards, so the
        load itself needs them in dtype). int_linear (bits, group size or 0 for one group per row, whether
        the experts are packed too): the projections packed at `bits` per weight plus a float32 scale
        and (int_zeros: an asymmetric checkpoint) zero point per row and group (quant/int_linear.py,
        quant/int_moe.py; act-order's column order, 8 bytes per input column, is not counted);
        unpacked experts stay in dtype (dequantized at load). dense_kept (weights, output rows): the projections (and
        packed experts) those formats would cover that the checkpoint keeps in dtype, its ignore list's
        (loader/fit.py finds them). MXFP4 experts count as the model holds them: packed, in dtype
        (experts_mxfp4_dense) or e4m3 with row scales (experts_mxfp4_fp8), whatever fp8_experts says."""
        total = self.num_parameters() * dtype_bytes
        if self.router_scoring in ("sigmoid", "softmax_group", "softmax_bias"):  # GLM-4.5's, DeepSeek's and
            # ERNIE 4.5's: float32
            sparse = self.num_sparse_mlps
            biased = self.router_scoring in ("sigmoid", "softmax_bias")
            total += sparse * self.num_experts * (self.hidden_size + biased) * (4 - dtype_bytes)
        if self.holds_mxfp4_experts:  # the stacked experts' weights (not their biases) stay packed: half
            # a byte each plus one scale byte per 32 (quant/mxfp4.py), on every device and while loading
            sparse = self.num_sparse_mlps
            per_expert = self._expert_shape()[0]
            total -= (
                sparse * self.num_experts * (per_expert * dtype_bytes - per_expert // 2 - per_expert // 32)
            )
            fp8_experts = False
        elif self.experts_mxfp4_fp8:  # e4m3 from the build on (models/gpt_oss.py): a byte a weight and a
            # float32 scale per row, while loading too (each expert is requantized as it arrives)
            total -= self._experts_fp8_saving(dtype_bytes)
            fp8_experts = False
        params, rows = self._dense_linear_shape()
        params, rows = params - dense_kept[0], rows - dense_kept[1]
        if int_linear is not None:
            bits, group, experts = int_linear
            if experts and self.experts_gated:  # ungated experts stay unpacked (quant/apply.py)
                expert_params, expert_rows = self._expert_shape()
                params += self.num_sparse_mlps * self.num_experts * expert_params
                rows += self.num_sparse_mlps * self.num_experts * expert_rows
            groups = params // group if group else rows
            return total - params * dtype_bytes + params * bits // 8 + (8 if int_zeros else 4) * groups
        if not fp8_linear:
            return total
        if self.is_mla:  # FP8 keeps kv_b_proj, which absorption reads as a weight (models/deepseek.py)
            kv_b_out = self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim)
            params -= self.num_hidden_layers * self.kv_lora_rank * kv_b_out
            rows -= self.num_hidden_layers * kv_b_out
        if self.num_linear_layers:  # FP8 keeps the Gated DeltaNet b / a projections (models/qwen3_next.py)
            small = 2 * self.linear_num_value_heads
            params -= self.num_linear_layers * small * self.hidden_size
            rows -= self.num_linear_layers * small
        if fp8_experts:
            total -= self._experts_fp8_saving(dtype_bytes)
        return total - params * (dtype_bytes - 1) + 4 * rows

    def _experts_fp8_saving(self, dtype_bytes: int) -> int:
        """Bytes the stacked experts' weights (not their biases) save as e4m3 with a float32 scale per
        expert and row, against the compute dtype."""
        sparse = self.num_sparse_mlps
        per_expert, expert_rows = self._expert_shape()
        return sparse * self.num_experts * (per_expert * (dtype_bytes - 1) - 4 * expert_rows)

    def _dense_linear_shape(self) -> tuple[int, int]:
        """(weights, output rows) of the projections quantized layers replace: attention (a hybrid's Gated
        DeltaNet projections too) and dense MLPs (shared experts too)."""
        h = self.hidden_size
        params = rows = 0
        for i in range(self.num_hidden_layers):
            if self.has_linear_state(i):  # Gated DeltaNet's or Mamba2's in_proj and out_proj
                mixer_params, mixer_rows = self._linear_mixer_shape()
                params += mixer_params
                rows += mixer_rows
            if not self.is_linear_layer(i):  # (a hybrid layer has both)
                attention_params, attention_rows = self._attention_linear(i)  # q/k/v rows and o_proj's
                if self.is_gated_delta:  # Qwen's gated attention: q and a gate
                    attention_params += h * self.q_size
                    attention_rows += self.q_size
                params += attention_params
                rows += attention_rows
            if self.block_pattern:  # Nemotron-H: no MLP in a mixer layer (the MLP blocks come below)
                continue
            if not self.is_moe_layer(i) or self.moe_beside_dense:
                gated = self.hidden_act != "xielu"  # Apertus: up and down only
                params += (3 if gated else 2) * h * self.layer_intermediate_size(i)
                rows += (2 if gated else 1) * self.layer_intermediate_size(i) + h
            elif self.shared_expert_intermediate_size:  # the shared expert: a dense MLP beside the experts
                params += 3 * h * self.shared_expert_intermediate_size
                rows += 2 * self.shared_expert_intermediate_size + h
        params += self.mlp_blocks * 2 * h * self.intermediate_size
        rows += self.mlp_blocks * (self.intermediate_size + h)
        # Nemotron-H's MoE blocks: the ungated shared expert and the latent projections
        shared, latent = self.shared_expert_intermediate_size, self.moe_latent_size
        params += self.moe_blocks * 2 * h * (shared + latent)
        rows += self.moe_blocks * (shared + h + (latent + h if latent else 0))
        return params, rows

    def num_parameters(self) -> int:
        """Every parameter: embeddings, LM head (unless tied), projections, biases and norms."""
        h = self.hidden_size
        norms = {"sandwich": 4, "parallel": 1}.get(self.norm_placement, 2)
        per_layer = norms * h  # the RMSNorms (Cohere: one LayerNorm without bias)
        if self.block_pattern:  # Nemotron-H: one norm a layer, and one in each MLP and MoE block
            per_layer = h
        if self.is_mla:  # q_a / kv_a norms; attention_bias: biases on q_a, kv_a_proj_with_mqa (and o_proj)
            per_layer += self.q_lora_rank + self.kv_lora_rank
            if self.attention_bias:
                per_layer += self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim
        elif self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            per_layer += h
        if self.qk_norm:
            whole = self.qk_norm_whole or self.norm_type == "layer"  # OLMo; Command R+: a row per head
            per_layer += self.q_size + self.kv_size if whole else 2 * self.head_dim
        if self.attention_sinks:
            per_layer += self.num_attention_heads
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        hybrid = 0
        if self.num_linear_layers:  # linear layers: conv, A_log, dt_bias, output norm; no q/k norm
            extra = self._linear_mixer_extra() - (2 * self.head_dim if self.qk_norm else 0)
            hybrid = self.num_linear_layers * extra
        vision = self.vision.num_parameters() if self.vision is not None and not self.text_only else 0
        return hybrid + (
            self.vocab_size * h
            + head
            + self.num_linear_parameters()
            + self.num_hidden_layers * per_layer
            + (self.mlp_blocks + self.moe_blocks) * h
            + h
            + self._gemma_parameters()
            + vision
        )

    def _gemma_parameters(self) -> int:
        """Gemma's weights beyond the Llama-shaped ones counted above: the sandwich norms, per-head
        q/k norms of each layer's own head size, Gemma 4's layer scalars, per-layer input embeddings and
        its routers' norms and scales."""
        if not self.architecture.startswith("gemma"):
            return 0
        h, n = self.hidden_size, self.num_hidden_layers
        total = 2 * h * n  # pre/post-feedforward norms
        for i in range(n):
            d = self.layer_head_dim(i)
            if self.architecture != "gemma2":  # q_norm, and k_norm where the layer has keys
                total += 2 * d if self.kv_source_layer(i) == i else d
            if self.moe_beside_dense and self.is_moe_layer(i):
                total += 3 * h + h + self.num_experts  # three more norms, the router's scale, per expert
        if self.architecture == "gemma4":
            total += n  # layer_scalar
        ple = self.hidden_size_per_layer_input
        if ple:
            total += self.vocab_size_per_layer_input * n * ple + h * n * ple + ple  # table, projection, norm
            total += n * (2 * h * ple + h)  # per layer: gate, projection, norm
        return total
