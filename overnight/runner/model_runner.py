"""The model runner: owns the weights, the KV cache and the sampler; runs one step per call."""

from __future__ import annotations

import torch
from torch import nn

from overnight.attention.metadata import AttentionBackend, AttentionBatch
from overnight.config import EngineConfig
from overnight.engine.step_io import ModelRunnerOutput, SchedulerOutput
from overnight.loader.source import ModelSource
from overnight.runner.inputs import build_sampling_batch, build_step_inputs
from overnight.runner.request_state import RequestStates
from overnight.runner.sampler import Sampler


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from overnight.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "torch":
        from overnight.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (auto, torch, triton)")


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, model: nn.Module | None = None) -> None:
        self.config = config
        self.source = source
        self.device = torch.device(config.runner.device)
        self.block_size = config.cache.block_size
        if model is None:
            from overnight.loader.model_loader import load_model

            model = load_model(source, config.model.dtype, self.device, seed=config.model.seed)
        self.model = model
        self.backend = make_attention_backend(config.runner.attention_backend, self.device)
        self.sampler = Sampler()
        self.states = RequestStates()
        self.kv_caches: list[torch.Tensor] = []
        self.eos_token_ids = tuple(source.eos_token_ids)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.config.model.dtype

    def kv_bytes_per_block(self) -> int:
        arch = self.config.model.arch
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        per_layer = 2 * self.block_size * arch.num_key_value_heads * arch.head_dim * elem
        return per_layer * arch.num_hidden_layers

    def init_kv_cache(self, num_blocks: int) -> None:
        arch = self.config.model.arch
        shape = (2, num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)
        # Uninitialized on purpose: every slot is written before it is read, and touching gigabytes
        # of pages up front costs seconds of start-up.
        self.kv_caches = [
            torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
            for _ in range(arch.num_hidden_layers)
        ]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = self.states.apply(out)
        if not scheduled:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = build_step_inputs(scheduled, self.block_size, self.device)
        attn = AttentionBatch(inputs.meta, self.kv_caches, self.backend)
        hidden = self.model(inputs.input_ids, inputs.positions, attn)
        req_ids: list[str] = []
        tokens: list[int] = []
        logprobs = None
        if inputs.sampled:
            logits = self.model.compute_logits(hidden[inputs.sample_rows]).float()
            batch = build_sampling_batch(inputs.sampled, self.eos_token_ids, self.device)
            sampled, logprobs = self.sampler(logits, batch)
            tokens = sampled.tolist()
            req_ids = [r.req_id for r in inputs.sampled]
        self.states.advance(scheduled, dict(zip(req_ids, tokens)))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens, logprobs=logprobs)

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int, num_seqs: int, max_model_len: int) -> int:
        """Run the largest step this configuration allows (num_tokens prompt tokens in sequences of
        at most max_model_len, then sampling num_seqs rows) on a throwaway cache; return peak bytes."""
        from overnight.attention.torch_backend import build_metadata

        arch = self.config.model.arch
        seq_lens = []
        left = num_tokens
        while left > 0:
            seq_lens.append(min(left, max_model_len))
            left -= seq_lens[-1]
        bs = self.block_size
        tables, next_block = [], 0
        for n in seq_lens:
            nb = -(-n // bs)
            tables.append(list(range(next_block, next_block + nb)))
            next_block += nb
        shape = (2, next_block, bs, arch.num_key_value_heads, arch.head_dim)
        caches = [torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(arch.num_hidden_layers)]
        meta = build_metadata(seq_lens, seq_lens, tables, bs, device=self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in seq_lens])
        hidden = self.model(ids, pos, AttentionBatch(meta, caches, self.backend))
        rows = torch.arange(min(num_seqs, num_tokens), device=self.device)
        logits = self.model.compute_logits(hidden[rows]).float()
        logits.log_softmax(dim=-1)
        del hidden, logits, caches
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return 0
