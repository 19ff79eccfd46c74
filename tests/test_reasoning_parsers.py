"""Reasoning parsers against outputs in the formats Qwen3, DeepSeek-R1 and GLM-4.1V-Thinking write (from
their model cards),
whole and streamed: for every cut of the text into two or three deltas, the streamed deltas concatenated
equal the whole-text split."""

from __future__ import annotations

import pytest

from overnight.reasoning import get_reasoning_parser

QWEN3_THINKING = (
    "<think>\nOkay, the user asks for 2 + 2. That is basic arithmetic: 4.\n</think>\n\nThe answer is **4**."
)
QWEN3_EMPTY_BLOCK = "<think>\n\n</think>\n\nThe answer is 4."
QWEN3_PLAIN = "The answer is 4."
# DeepSeek-R1's template ends the prompt with "<think>\n": the output starts inside the block.
R1_OPENED_IN_PROMPT = "Okay, so I need to add 2 and 2.\nThat gives 4.\n</think>\n\n**Answer:** 4"
R1_CUT = "Okay, so I need to add 2 and 2. Let me think about </thi"
# GLM-4.1V-Thinking: the output opens its block and wraps the answer in <answer> tags (kept in the answer).
GLM41V = "<think>The image shows two apples and two pears: 4 fruits.</think><answer>There are **4** fruits.</answer>"

CASES = [
    # (parser, output, starts in reasoning, reasoning, content)
    (
        "qwen3",
        QWEN3_THINKING,
        False,
        "Okay, the user asks for 2 + 2. That is basic arithmetic: 4.",
        "The answer is **4**.",
    ),
    ("qwen3", QWEN3_EMPTY_BLOCK, False, None, "The answer is 4."),
    ("qwen3", QWEN3_PLAIN, False, None, QWEN3_PLAIN),
    ("qwen3", "  <think>x</think>y", False, "x", "y"),
    ("qwen3", "<thinking is fun", False, None, "<thinking is fun"),
    (
        "deepseek_r1",
        R1_OPENED_IN_PROMPT,
        True,
        "Okay, so I need to add 2 and 2.\nThat gives 4.",
        "**Answer:** 4",
    ),
    (
        "deepseek_r1",
        QWEN3_THINKING,
        False,
        "Okay, the user asks for 2 + 2. That is basic arithmetic: 4.",
        "The answer is **4**.",
    ),
    ("deepseek_r1", R1_CUT, True, R1_CUT, ""),
    ("qwen3", "<think>\nstill thinking   \n", False, "still thinking", ""),
    (
        "glm45",
        GLM41V,
        False,
        "The image shows two apples and two pears: 4 fruits.",
        "<answer>There are **4** fruits.</answer>",
    ),
    ("glm45", "\n<answer>4</answer>", False, None, "\n<answer>4</answer>"),  # thinking off
]


@pytest.mark.parametrize("name,text,opened,reasoning,content", CASES)
def test_whole_split(name, text, opened, reasoning, content):
    assert get_reasoning_parser(name).split(text, opened) == (reasoning, content)


def _streamed(parser, pieces, opened):
    stream = parser.stream(opened)
    r, c = [], []
    for piece in pieces:
        rd, cd = stream.feed(piece)
        r.append(rd)
        c.append(cd)
    rd, cd = stream.finish()
    return "".join(r) + rd, "".join(c) + cd


@pytest.mark.parametrize("name,text,opened,reasoning,content", CASES)
def test_every_cut_streams_the_whole_split(name, text, opened, reasoning, content):
    parser = get_reasoning_parser(name)
    expected = (reasoning or "", content)
    for i in range(len(text) + 1):
        assert _streamed(parser, [text[:i], text[i:]], opened) == expected, i
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1, 2):
            assert _streamed(parser, [text[:i], text[i:j], text[j:]], opened) == expected, (i, j)
    assert _streamed(parser, list(text), opened) == expected  # one character a delta


def test_no_reasoning_leaks_before_the_end_marker():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<think>\nabc </") == ("abc", "")  # the space and "</" may be the marker's
    assert stream.feed("think>\n\nAns") == ("", "Ans")


def test_the_prompt_decides_where_the_output_starts():
    p = get_reasoning_parser("qwen3")
    assert p.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not p.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert p.closed_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not p.starts_in_reasoning("<|im_start|>assistant\n")
    assert get_reasoning_parser("deepseek_r1").starts_in_reasoning("<｜Assistant｜>")
    glm = get_reasoning_parser("glm45")  # GLM's templates with thinking off close an empty block
    assert glm.closed_in_prompt("<|assistant|>\n<think></think>\n")
    assert not glm.starts_in_reasoning("<|assistant|>\n")


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, glm45, qwen3"):
        get_reasoning_parser("nope")
