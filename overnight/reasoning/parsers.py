"""`<think>...</think>` reasoning, as Qwen3, DeepSeek-R1 and GLM write it, and the registry of parsers by name.

A block is open at the start of the output when the prompt left one open (a template that writes
`<think>\\n` after the assistant's header: DeepSeek-R1, Qwen3 thinking-2507), or when the output itself
starts with the start marker (after whitespace). Inside a block everything up to the end marker is
reasoning; after it, the answer. An output that never closes its block (cut by max_tokens) is all
reasoning. The reasoning is stripped of surrounding whitespace and the answer of leading whitespace
(templates put blank lines around the markers).

    qwen3        no marker at all: the whole output is the answer (enable_thinking false, or a model that
                 skipped thinking)
    deepseek_r1  no marker at all: the whole output is reasoning cut short, as R1's templates always open
                 the block (older ones in the output, newer ones in the prompt)
    glm45        GLM-4.5 / 4.6, GLM-4.5V / 4.6V and GLM-4.1V-Thinking (vLLM's name for their format): the
                 output opens its own <think> block (a template with thinking off writes an empty one
                 into the prompt), else it is all answer, as qwen3. GLM-4.1V-Thinking wraps its answer in
                 <answer> ... </answer>, which stays in the answer text, as vLLM's glm45 parser leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # Whether an output whose prompt holds no marker starts inside a block.
    implicit_open: bool = False

    def starts_in_reasoning(self, prompt: str | None) -> bool:
        """The prompt's last marker decides: an open block means the output continues it; a closed one
        (Qwen3's template with enable_thinking false writes an empty block) means it starts with the
        answer; none leaves it to the model's own marker, or implicit_open."""
        if prompt:
            s, e = prompt.rfind(self.start), prompt.rfind(self.end)
            if s > e:
                return True
            if e > s:
                return False
        return self.implicit_open

    def closed_in_prompt(self, prompt: str | None) -> bool:
        """The prompt already ended reasoning: the answer (and any grammar on it) starts at once."""
        return bool(prompt) and prompt.rfind(self.end) > prompt.rfind(self.start)  # type: ignore[union-attr]

    def split(self, text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a whole output."""
        body = text
        if not starts_in_reasoning:
            lead = text.lstrip()
            if not lead.startswith(self.start):
                return None, text
            body = lead[len(self.start) :]
        i = body.find(self.end)
        if i < 0:
            return body.strip() or None, ""
        return body[:i].strip() or None, body[i + len(self.end) :].lstrip()

    def stream(self, starts_in_reasoning: bool = False) -> ReasoningStream:
        return ReasoningStream(self, _REASONING if starts_in_reasoning else _START)


# Stream states: before knowing whether the output opens a block; inside one; right after its end (the
# answer's leading whitespace is dropped); the answer.
_START, _REASONING, _AFTER, _CONTENT = range(4)


@dataclass
class ReasoningStream:
    """Incremental split: feed(delta) returns (reasoning delta, answer delta); finish() what was held.
    Held back: a possible start of a marker at the end of the text seen, and the reasoning's trailing
    whitespace (dropped if the block ends there)."""

    parser: ReasoningParser
    state: int
    buf: str = ""
    _pending_ws: str = ""
    _reasoning_started: bool = False
    reasoning: list[str] = field(default_factory=list)  # everything emitted, for the final message
    content: list[str] = field(default_factory=list)

    @property
    def in_reasoning(self) -> bool:
        return self.state in (_START, _REASONING)

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        p = self.parser
        r: list[str] = []
        c: list[str] = []
        while True:
            if self.state == _START:
                lead = self.buf.lstrip()
                if lead.startswith(p.start):
                    self.buf = lead[len(p.start) :]
                    self.state = _REASONING
                    continue
                if not final and p.start.startswith(lead):
                    break  # whitespace, or the marker's first characters: wait
                self.state = _CONTENT
                continue
            if self.state == _REASONING:
                i = self.buf.find(p.end)
                if i >= 0:
                    self._reason(self.buf[:i], r, closing=True)
                    self.buf = self.buf[i + len(p.end) :]
                    self.state = _AFTER
                    continue
                keep = 0 if final else partial_suffix(self.buf, p.end)
                self._reason(self.buf[: len(self.buf) - keep], r, closing=final)
                self.buf = self.buf[len(self.buf) - keep :]
                break
            if self.state == _AFTER:
                lead = self.buf.lstrip()
                self.buf = lead
                if not lead:
                    break
                self.state = _CONTENT
                continue
            c.append(self.buf)
            self.buf = ""
            break
        rd, cd = "".join(r), "".join(c)
        if rd:
            self.reasoning.append(rd)
        if cd:
            self.content.append(cd)
        return rd, cd

    def _reason(self, text: str, out: list[str], closing: bool) -> None:
        text = self._pending_ws + text
        self._pending_ws = ""
        if not self._reasoning_started:
            text = text.lstrip()
        if closing:
            text = text.rstrip()
        else:
            kept = text.rstrip()
            self._pending_ws = text[len(kept) :]
            text = kept
        if text:
            self._reasoning_started = True
            out.append(text)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_open=True),
    "glm45": ReasoningParser("glm45"),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser of that name; ValueError naming the known ones otherwise."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return parser
