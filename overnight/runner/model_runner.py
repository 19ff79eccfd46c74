"""The model runner: owns the weights, the KV cache and the sampler; runs one step per launch.

launch() enqueues a step's work and returns at once on CUDA; result() waits for its sampled tokens.
The engine launches step N+1 before it reads step N's result, so the host's work for one step overlaps
the GPU's work for the previous one. A decode whose input token was sampled by the previous, still
unread step takes it straight from that step's device tensor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from overnight.attention.kv_quant import kv_cache_torch_dtype, load_kv_scales_, new_kv_scales
from overnight.attention.metadata import AttentionBackend, AttentionBatch, AttentionMetadata
from overnight.attention.mla import mla_decode_supported
from overnight.attention.variants import variant_configs
from overnight.config import EngineConfig
from overnight.engine.kv_groups import KVCacheLayout
from overnight.engine.pool_plan import PoolMemoryError, StatePlan, plan_states, reserve_state_bytes
from overnight.engine.step_io import ModelRunnerOutput, SchedulerOutput
from overnight.kernels.kv_layout import is_fp8, kv_cache_view, new_kv_slots
from overnight.loader.source import ModelSource
from overnight.models.interface import CausalLM, as_causal_lm
from overnight.runner.inputs import StepBuffers, StepInputs, build_sampling_batch
from overnight.runner.pooler import ChunkedPooler, PooledStep
from overnight.runner.prompt_logprobs import (
    PendingPromptLogprobs,
    compute_prompt_logprobs,
    wants_prompt_logprobs,
)
from overnight.runner.request_state import RequestStates, RunnerRequest, ScheduledRequest
from overnight.runner.sampler import SampledLogprobs, Sampler, TokenMask
from overnight.runner.state_cache import StateCache

if TYPE_CHECKING:
    from overnight.structured.compiler import GrammarCompiler

if TYPE_CHECKING:
    from overnight.lora.slots import DeviceLoRA, LoRASharding
    from overnight.models.vision.interface import ImageModel
    from overnight.runner.cuda_graph import DecodeGraphs
    from overnight.runner.vision import VisionStep

log = logging.getLogger("overnight")


def check_states_fit(plan: StatePlan, device: torch.device) -> None:
    """Refuse, before allocating it, a linear-attention state pool larger than the device's free memory
    (build_config lowers a default max_num_seqs to fit beside a pool; this catches what the estimate
    there cannot see: other processes, a smaller share than expected)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if plan.total_bytes > free:
        gib = 2**30
        raise PoolMemoryError(
            f"the linear-attention states of {plan.slots - 1} requests and {plan.snapshots} prefix-cache "
            f"snapshots take {plan.total_bytes / gib:.2f} GiB ({plan.total_bytes} bytes, "
            f"{plan.bytes_per_seq / 2**20:.2f} MiB each), but only {free / gib:.2f} GiB is free after the "
            "weights: lower max_num_seqs"
        )


def make_attention_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    fp8_cache = config.cache.kv_cache_dtype != "auto"
    decode_config, prefill_config = variant_configs(config.runner.attention_variant, fp8_cache)
    name = config.runner.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from overnight.attention.triton_backend import TritonAttentionBackend

        arch = config.model.arch
        return TritonAttentionBackend(
            num_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=config.scheduler.max_model_len,
            device=device,
            decode_config=decode_config,
            prefill_config=prefill_config,
            mla_prefill_kernel=config.runner.attention_variant == "mla-prefill-kernel",
        )
    if name == "torch":
        from overnight.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (auto, torch, triton)")


@dataclass
class StepHandle:
    """A launched step. result() blocks until its tokens are on the host (once; then cached)."""

    runner: ModelRunner
    req_ids: list[str]
    tokens_host: torch.Tensor | None
    event: torch.cuda.Event | None
    logprobs: SampledLogprobs | None
    _result: ModelRunnerOutput | None = None
    mask_wait_s: float = 0.0  # structured outputs: waiting for the previous step's tokens
    mask_s: float = 0.0  # structured outputs: advancing matchers, filling and copying the mask
    prompt_logprobs: list[PendingPromptLogprobs] | None = None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            self._result = self.runner._finish(self)
        return self._result


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        model: CausalLM | None = None,
        *,
        calculate_kv_scales: bool | None = None,  # None: from config.cache
        grammars: GrammarCompiler | None = None,  # None: structured outputs are never masked here
        lora_sharding: LoRASharding | None = None,  # a tensor-parallel rank's share of each adapter
    ) -> None:
        self.config = config
        self.source = source
        self.device = torch.device(config.runner.device)
        self.block_size = config.cache.block_size
        if model is None:
            from overnight.loader.model_loader import load_model

            model = as_causal_lm(
                load_model(
                    source,
                    config.model.dtype,
                    self.device,
                    seed=config.model.seed,
                    runner=config.model.runner,
                )
            )
        self.model = model
        # A pooling runner turns each prompt into one vector instead of sampling tokens.
        pooler_config = config.model.pooler if config.model.runner == "pooling" else None
        self.pooler = None
        if pooler_config is not None:
            classify = None
            if pooler_config.classifier is not None:
                from overnight.models.for_pooling import DecoderForPooling

                assert isinstance(model, DecoderForPooling), "a decoder classifier runs for pooling"
                classify = model.classify
            self.pooler = ChunkedPooler(pooler_config, self.device, classify)
        self.backend = make_attention_backend(config, self.device)
        self.sampler = Sampler()
        sched = config.scheduler
        self.grammar_mask = None
        if grammars is not None:
            from overnight.runner.grammar_mask import GrammarMask

            self.grammar_mask = GrammarMask(grammars, sched.max_num_seqs, self.device)
        self.max_blocks_per_req = -(-sched.max_model_len // self.block_size)
        # Which layers share a block table and a cache tensor (engine/kv_groups.py).
        self.kv_layout = KVCacheLayout.from_arch(config.model.arch, sched.max_model_len)
        num_groups = self.kv_layout.num_groups
        self.states = RequestStates(sched.max_num_seqs, self.max_blocks_per_req, num_groups)
        self.buffers = StepBuffers(
            max_tokens=max(sched.max_num_batched_tokens, sched.max_num_seqs),
            max_reqs=sched.max_num_seqs,
            max_blocks=self.max_blocks_per_req,
            block_size=self.block_size,
            device=self.device,
            num_groups=num_groups,
            group_block_sizes=self.kv_layout.group_block_sizes(self.block_size),
        )
        self.lora: DeviceLoRA | None = None  # LoRA adapters: wrapped layers and device slots
        if config.lora is not None:
            from torch import nn

            from overnight.lora.slots import DeviceLoRA

            assert isinstance(model, nn.Module)
            self.lora = DeviceLoRA(
                model,
                config.model.arch,
                config.lora,
                config.model.dtype,
                self.device,
                max_tokens=max(sched.max_num_batched_tokens, sched.max_num_seqs),
                sharding=lora_sharding,
            )
        self.kv_caches: list[torch.Tensor] = []
        # Hybrid models: the linear-attention layers' states, one slot per runner row (state_cache.py).
        self.state_cache: StateCache | None = None
        if config.model.arch.num_linear_layers:
            plan = plan_states(config.model.arch, sched, config.cache)
            check_states_fit(plan, self.device)
            self.state_cache = StateCache(config.model.arch, plan, self.device)
        if calculate_kv_scales is None:
            calculate_kv_scales = config.cache.calculate_kv_scales
        self._init_kv_scales(calculate_kv_scales)
        self.eos_token_ids = tuple(source.eos_token_ids)
        # Image rows (and M-RoPE positions) of vision-language models (runner/vision.py)
        self.vision: VisionStep | None = None
        if getattr(model, "takes_images", False):
            from overnight.runner.vision import VisionStep

            self.vision = VisionStep(
                cast("ImageModel", model), self.device, max_tokens=sched.max_num_batched_tokens
            )
        self.graphs: DecodeGraphs | None = None
        self._prev_index: dict[str, int] = {}  # request -> row of the last launch's samples
        self._prev_tokens: torch.Tensor | None = None
        self._last_handle: StepHandle | None = None
        self._host_tokens = [
            torch.zeros(sched.max_num_seqs, dtype=torch.int64, pin_memory=self.is_cuda) for _ in range(3)
        ]
        self._turn = 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def supports_async(self) -> bool:
        return self.is_cuda

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.config.model.dtype)

    # -- FP8 KV cache scales ----------------------------------------------------------------------

    def _init_kv_scales(self, calculate: bool) -> None:
        """kv_scales [num_layers, 2] (k_scale, v_scale) on the device, for an fp8 cache only: from the
        checkpoint when it ships them, else 1.0; with `calculate`, set once from the first prefill.
        Graphs and kernels read the tensor in place, so it is only ever written, never replaced."""
        self.kv_scales: torch.Tensor | None = None
        self._calibrate_kv_scales = False
        if not is_fp8(self.kv_cache_dtype):
            return
        self.kv_scales = new_kv_scales(self.config.model.arch.num_hidden_layers, self.device)
        load_kv_scales_(self.kv_scales, self.model.checkpoint_kv_scales)
        self._calibrate_kv_scales = calculate

    def _attention_batch(self, inputs: StepInputs, has_prefill: bool) -> AttentionBatch:
        calibrate = self._calibrate_kv_scales and has_prefill
        if calibrate:
            self._calibrate_kv_scales = False  # once: later steps keep the first prefill's scales
        return self.attention_batch(inputs.meta, inputs.group_metas, self.kv_caches, calibrate)

    def attention_batch(
        self,
        meta: AttentionMetadata,
        group_metas: list[AttentionMetadata],
        kv_caches: list[torch.Tensor],
        calibrate: bool = False,
    ) -> AttentionBatch:
        """The step's AttentionBatch; with one KV cache group, every layer reads `meta`."""
        layout = self.kv_layout
        states = self.state_cache.batch(meta.num_reqs) if self.state_cache is not None else None
        if layout.is_uniform:
            return AttentionBatch(meta, kv_caches, self.backend, self.kv_scales, calibrate, states=states)
        return AttentionBatch(
            meta,
            kv_caches,
            self.backend,
            self.kv_scales,
            calibrate,
            group_metas=group_metas,
            layer_group=layout.layer_group,
            layer_source=layout.layer_source,
            states=states,
        )

    def kv_bytes_per_block(self) -> int:
        """One block of the pool: block_size tokens of one slot (K and V) in each of the layout's tensors."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return self.block_size * self.kv_layout.token_elems * elem  # this device's KV heads

    def kv_pool_share(self) -> tuple[int, int]:
        """(bytes the KV pool may take on this device, bytes of one block): runner/kv_pool.py."""
        from overnight.runner.kv_pool import kv_budget_bytes

        sched = self.config.scheduler

        def measure() -> int:
            return self.profile_peak_bytes(
                sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len
            )

        # The state pool is allocated (in __init__) before the measurement: left out of the weights and
        # the peak there, then set aside from the caches' budget by the one function `overnight budget`
        # uses too, so the pool shrinks by exactly the states' bytes whichever way the budget was found.
        held = self.state_cache.nbytes if self.state_cache is not None else 0
        budget = kv_budget_bytes(self.device, self.config.cache, measure, held_bytes=held)
        budget = reserve_state_bytes(budget, self.config.model.arch, sched, self.config.cache)
        return budget, self.kv_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.init_kv_cache(num_blocks)
        self.capture_graphs()

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives in this process."""

    def _new_kv_tensors(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """The layout's cache tensors, each [2, num_blocks, block_size x its slot elements] (kv_groups.py):
        left uninitialized, an FP8 one zeroed (kv_layout.py says why)."""
        return [
            new_kv_slots(
                num_blocks, block_size * elems, self.kv_cache_dtype, self.device, self.kv_layout.planes
            )
            for elems in self.kv_layout.tensor_elems
        ]

    def _layer_caches(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's cache: a view of its shape over the layout's tensor holding it (KV-shared layers:
        their source's), pages of its group's block size, one view per tensor, shape and page."""
        none = torch.empty(0, device=self.device)  # linear-attention layers hold no KV cache
        views: dict[tuple[int, int, int, int], torch.Tensor] = {}
        caches = []
        layout = self.kv_layout
        for i, (t, (heads, dim)) in enumerate(zip(layout.layer_tensor, layout.layer_shapes, strict=True)):
            if t < 0:
                caches.append(none)
                continue
            page = layout.layer_page(i, self.block_size)
            key = (t, heads, dim, page)
            if key not in views:
                views[key] = kv_cache_view(tensors[t], page, heads, dim)
            caches.append(views[key])
        return caches

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self._layer_caches(self._new_kv_tensors(num_blocks, self.block_size))

    def capture_graphs(self) -> None:
        if not self.is_cuda or self.config.runner.enforce_eager or self.pooler is not None:
            return  # graphs serve decode steps, which pooling never runs
        arch = self.config.model.arch
        if arch.is_mla and not mla_decode_supported(arch.kv_lora_rank, arch.qk_rope_head_dim):
            return  # latent attention without its kernel: the PyTorch path reads host lengths
        from overnight.runner.cuda_graph import DecodeGraphs

        max_batch = min(self.config.runner.max_capture_batch_size, self.config.scheduler.max_num_seqs)
        if self.lora is not None:
            self.lora.batch.for_capture()  # the graphs record the LoRA kernels, which read the slot map
        self.graphs = DecodeGraphs(
            self.model,
            self.attention_batch,
            self.kv_caches,
            self.buffers,
            max_batch,
            self.config.scheduler.max_model_len,
        )
        self.graphs.capture()

    # -- a step -----------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle | PooledStep:
        scheduled = self.states.apply(out)
        if self.lora is not None and out.lora_loads:
            self.lora.load(out.lora_loads)
        if self.state_cache is not None:
            self.state_cache.restore(out, self.states)
        if self.pooler is not None:
            self.pooler.drop(out.finished_req_ids)
        if not scheduled:
            return StepHandle(self, [], None, None, None, ModelRunnerOutput([], []))
        sampled = self.states.begin(scheduled)
        decode_only = all(s.num_tokens == 1 for s in scheduled)
        bucket = self.graphs.bucket_for(len(scheduled)) if self.graphs and decode_only else None
        inputs = self.buffers.build(scheduled, self.states, self._prev_index, pad_to=bucket)
        if self.state_cache is not None:
            self.state_cache.fill(scheduled, inputs.meta.num_reqs)
        if inputs.pending_rows is not None:
            assert self._prev_tokens is not None
            self.buffers.ids.index_copy_(0, inputs.pending_rows, self._prev_tokens[inputs.pending_src])
        if self.lora is not None:
            ids, lens = [s.state.lora_id for s in scheduled], [s.num_tokens for s in scheduled]
            self.lora.map_rows(ids, lens, inputs.input_ids.shape[0], decode_only)
        positions, vision_rows = inputs.positions, None
        if self.vision is not None:
            if self.vision.mrope:
                positions = self.vision.positions(scheduled, positions, decode_only)
            vision_rows = None if decode_only else self.vision.rows(scheduled)
            if vision_rows is not None:
                limits = self.vision.key_limits(scheduled, inputs.input_ids.shape[0])
                for m in inputs.group_metas:  # [0] is inputs.meta
                    m.key_limit = limits
        if bucket is not None:
            assert self.graphs is not None
            hidden = self.graphs.replay(bucket)[: len(scheduled)]
        else:
            attn = self._attention_batch(inputs, has_prefill=not decode_only)
            if vision_rows is not None:
                hidden = self.model(inputs.input_ids, positions, attn, vision=vision_rows)  # type: ignore[call-arg]
            else:
                hidden = self.model(inputs.input_ids, positions, attn)
        if self.state_cache is not None and out.state_saves:
            self.state_cache.save(out.state_saves, self.states)
        if self.pooler is not None:
            assert inputs.meta.query_start_loc_cpu is not None
            return self._pool(scheduled, hidden, inputs.meta.query_start_loc_cpu)
        req_ids = [r.req_id for r in sampled]
        prompt_lps = None
        if not decode_only and wants_prompt_logprobs(scheduled):
            vocab = self.config.model.arch.vocab_size
            prompt_lps = compute_prompt_logprobs(hidden, scheduled, self.model.compute_logits, vocab)
        if not sampled:
            if prompt_lps:
                return StepHandle(self, [], None, None, None, prompt_logprobs=prompt_lps)
            return StepHandle(self, [], None, None, None, ModelRunnerOutput([], []))
        rows = hidden if decode_only else hidden[inputs.sample_rows]
        logits = self.model.compute_logits(rows)
        last = self._last_handle
        if last is not None and any(r.params.needs_output_history for r in sampled):
            last.result()  # penalties and bad words read earlier tokens: wait for the step in flight
        batch = build_sampling_batch(sampled, self.eos_token_ids, self.device)
        mask_wait_s = mask_s = 0.0
        if self.grammar_mask is not None and self.states.num_structured:
            batch.token_mask, mask_wait_s, mask_s = self._token_mask(sampled, last)
        tokens, logprobs = self.sampler(logits, batch)
        self._prev_tokens = tokens
        self._prev_index = {rid: j for j, rid in enumerate(req_ids)}
        if not self.is_cuda:
            handle = StepHandle(self, req_ids, tokens, None, logprobs, prompt_logprobs=prompt_lps)
        else:
            host = self._host_tokens[self._turn][: len(req_ids)]
            self._turn = (self._turn + 1) % len(self._host_tokens)
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            handle = StepHandle(self, req_ids, host, event, logprobs, prompt_logprobs=prompt_lps)
        handle.mask_wait_s, handle.mask_s = mask_wait_s, mask_s
        self._last_handle = handle
        return handle

    def _token_mask(
        self, sampled: list[RunnerRequest], last: StepHandle | None
    ) -> tuple[TokenMask | None, float, float]:
        """The grammar mask of this step's structured rows, with (wait, build) seconds. The matchers
        need every token sampled so far, so the previous step's tokens are read first: this step's
        forward pass is already queued, and the device runs it while the host builds the mask."""
        assert self.grammar_mask is not None
        if not any(r.params.structured_outputs is not None for r in sampled):
            return None, 0.0, 0.0
        t0 = time.perf_counter()
        if last is not None:
            last.result()
        t1 = time.perf_counter()
        mask = self.grammar_mask.build(sampled)
        return mask, t1 - t0, time.perf_counter() - t1

    def _pool(
        self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, query_start_loc: torch.Tensor
    ) -> PooledStep:
        assert self.pooler is not None
        qsl = query_start_loc.numpy()[: len(scheduled) + 1].astype(np.int64)
        finished, rows = self.pooler.pool(scheduled, hidden, qsl)
        return PooledStep.launch(finished, rows)

    def _finish(self, handle: StepHandle) -> ModelRunnerOutput:
        if handle.event is not None:
            handle.event.synchronize()
        tokens = handle.tokens_host.tolist() if handle.tokens_host is not None else []
        self.states.resolve(handle.req_ids, tokens)
        logprobs = handle.logprobs.to_host() if handle.logprobs is not None else None
        prompt = {p.req_id: p.to_host() for p in handle.prompt_logprobs} if handle.prompt_logprobs else None
        return ModelRunnerOutput(
            req_ids=handle.req_ids,
            sampled_token_ids=tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt,
            mask_wait_s=handle.mask_wait_s,
            mask_s=handle.mask_s,
        )

    def warm_up_sizes(self, num_tokens: int) -> list[int]:
        """Step sizes run once at start-up after the peak-memory step: the powers of two between the
        largest decode graph (graph capture runs every size up to it) and num_tokens. Kernels whose
        tiles depend on the token count (the MoE GEMMs' tuned configurations) compile those variants
        here instead of in the middle of a job, where each compile stalls the GPU for about a second."""
        runner = self.config.runner
        lo = (
            0
            if runner.enforce_eager
            else min(runner.max_capture_batch_size, self.config.scheduler.max_num_seqs)
        )
        sizes, n = [], 1
        while n < num_tokens:
            if n > lo:
                sizes.append(n)
            n *= 2
        return sizes

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int, num_seqs: int, max_model_len: int) -> int:
        """Run the largest step this configuration allows (num_tokens prompt tokens in sequences of
        at most max_model_len, then sampling num_seqs rows) on a throwaway cache; return peak bytes."""
        from overnight.attention.torch_backend import build_metadata

        def split(n: int) -> list[int]:  # n tokens as sequences of at most max_model_len
            return [min(max_model_len, n - start) for start in range(0, n, max_model_len)]

        seq_lens = split(num_tokens)
        bs = self.block_size
        tables, next_block = [], 0
        for n in seq_lens:
            nb = -(-n // bs)
            tables.append(list(range(next_block, next_block + nb)))
            next_block += nb
        # The real pool's layout (an FP8 cache's K is head-major, kv_layout.py), zeroed: the step runs
        # the kernels as a job will, on finite values. Every KV cache group reads the same tables here.
        caches = [c.zero_() for c in self._new_kv_tensors(next_block, bs)]
        layer_caches = self._layer_caches(caches)

        def forward(n: int) -> torch.Tensor:  # the first n tokens of the sequences above
            lens = split(n)
            # Every group reads the same tables (a group of a larger block size only their first ids).
            sizes = self.kv_layout.group_block_sizes(bs)
            by_size = {
                gbs: build_metadata(lens, lens, tables[: len(lens)], gbs, device=self.device)
                for gbs in set(sizes)
            }
            metas = [by_size[gbs] for gbs in sizes]
            meta = metas[0]
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            pos = torch.cat([torch.arange(length, device=self.device) for length in lens])
            if self.state_cache is not None:
                self.state_cache.fill_scratch(len(lens))
            return self.model(ids, pos, self.attention_batch(meta, metas, layer_caches))

        if self.vision is not None and self.is_cuda:  # the encoder runs inside steps too
            self.vision.run_largest_image(self.source.path if self.source.kind == "hf" else None)
        hidden = forward(num_tokens)
        rows = torch.arange(min(num_seqs, num_tokens), device=self.device)
        if self.pooler is None:  # a pooling runner computes no logits
            logits = self.model.compute_logits(hidden[rows]).float()
            logits.log_softmax(dim=-1)
            del logits
        del hidden
        t0 = time.perf_counter()
        sizes = self.warm_up_sizes(num_tokens)
        for n in sizes:
            forward(n)
        if sizes:
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
            log.info("warm-up: step sizes %s in %.1f s", sizes, time.perf_counter() - t0)
        # The throwaway cache was live at the peak, but the real pool takes its place: not counted.
        cache_bytes = sum(c.numel() * c.element_size() for c in caches)
        caches.clear()  # freed before the real pool is sized (forward() still refers to the lists)
        layer_caches.clear()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - cache_bytes
        return 0
