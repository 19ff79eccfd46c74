"""Images through every entry point of a vision-language model (a tiny random Qwen3-VL): where images
may come from (data URIs, files under --allowed-local-media-path, http(s) only with --allow-media-urls),
the limits, the prefix cache keyed by the pixels, run-batch lines and the server with the official
client. A bad image fails its own line or request with the reason, never the run."""

from __future__ import annotations

import json
import os

import pytest

from overnight import LLM, SamplingParams
from overnight.multimodal.media import MediaError, MediaPolicy, load_image
from overnight.multimodal.processor import parse_image_limit
from tests.batch_helpers import chat_line, read_jsonl, write_jsonl
from tests.tiny_vl import cpu_flags, data_uri, hf_greedy, image, make_vl_checkpoint, png_bytes, words

PLACEHOLDER = "<|vision_start|> <|image_pad|> <|vision_end|>"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


# ---- where images may come from (no model) -------------------------------------------------------


def test_media_sources_and_refusals(tmp_path):
    allowed = tmp_path / "imgs"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png_bytes(image(32, 32, 0)))
    (tmp_path / "secret.png").write_bytes(png_bytes(image(32, 32, 1)))
    policy = MediaPolicy(allowed_local_media_path=str(allowed), max_image_pixels=64 * 64)
    assert load_image(data_uri(image(40, 20, 2)), policy).size == (40, 20)
    assert load_image(str(allowed / "a.png"), policy).size == (32, 32)
    assert load_image("file://" + str(allowed / "a.png"), policy).size == (32, 32)
    refusals = {
        "data:image/png;base64,aGVsbG8gd29ybGQ=": "cannot decode image",
        "data:image/png;base64,@@@": "not valid base64",
        "http://example.com/cat.png": "--allow-media-urls",
        str(tmp_path / "secret.png"): "outside the allowed folder",
        str(allowed / ".." / "secret.png"): "outside the allowed folder",
        data_uri(image(100, 100, 3)): "over the limit",
        "ftp://x/y.png": "not supported",
    }
    for source, reason in refusals.items():
        with pytest.raises(MediaError, match=reason):
            load_image(source, policy)
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        load_image(str(allowed / "a.png"), MediaPolicy())
    with pytest.raises(MediaError, match="max_image_bytes"):
        load_image(data_uri(image(32, 32, 4)), MediaPolicy(max_image_bytes=100))
    assert parse_image_limit(None) == 16
    assert parse_image_limit('{"image": 2}') == 2
    assert parse_image_limit("3") == 3


def test_http_images_only_when_allowed_with_size_and_time_limits():
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = png_bytes(image(40, 30, 5))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/slow.png":
                time.sleep(1.0)
            try:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the client gave up (the timeout case)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(MediaError, match="--allow-media-urls"):
            load_image(url + "/a.png", MediaPolicy())
        assert load_image(url + "/a.png", MediaPolicy(allow_media_urls=True)).size == (40, 30)
        with pytest.raises(MediaError, match="max_image_bytes"):
            load_image(url + "/a.png", MediaPolicy(allow_media_urls=True, max_image_bytes=len(body) - 1))
        with pytest.raises(MediaError, match="cannot fetch image"):
            load_image(url + "/slow.png", MediaPolicy(allow_media_urls=True, fetch_timeout=0.2))
    finally:
        server.shutdown()


# ---- the model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_vl_checkpoint(tmp_path_factory.mktemp("vl"), "qwen3_vl")


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    # Chunks of 8 tokens: an image of 9 tokens is always prefilled over two or three steps.
    return LLM(
        folder,
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_model_len=256,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        limit_mm_per_prompt="2",
    )


def test_prefix_cache_is_keyed_by_the_pixels(llm, folder):
    """Same placeholder tokens, different pixels: no KV shared; the same image again: its blocks hit."""
    text = f"{words(3, 0)} {PLACEHOLDER} {words(30, 1)}"
    a, b = image(96, 96, 21), image(96, 96, 22)  # same size: the same token ids (9 image tokens)
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)[0]
    assert first.prompt_token_ids == other.prompt_token_ids
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0  # the image's tokens sit in the first block
    ids = llm.get_tokenizer().encode(text)
    assert other.outputs[0].token_ids == hf_greedy(folder, ids, [b], 6)


def test_bad_prompts_are_refused_with_the_reason(llm):
    one = image(32, 32, 5)
    with pytest.raises(ValueError, match="1 image placeholders .* but 2 images"):
        llm.generate(
            {"prompt": PLACEHOLDER, "multi_modal_data": {"image": [one, one]}}, GREEDY, use_tqdm=False
        )
    with pytest.raises(ValueError, match="limit-mm-per-prompt"):
        llm.generate(
            {"prompt": PLACEHOLDER * 3, "multi_modal_data": {"image": [one] * 3}}, GREEDY, use_tqdm=False
        )
    with pytest.raises(ValueError, match="prompt 0: .*--allow-media-urls"):
        llm.chat(
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}],
                }
            ],
            GREEDY,
            use_tqdm=False,
        )


def _chat(cid: str, parts: list, **body) -> dict:
    return chat_line(cid, parts, max_tokens=6, temperature=0, **body)


def _img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


def test_run_batch_lines_with_images(llm, folder, tmp_path, monkeypatch, capsys):
    from overnight.cli import main
    from overnight.models.qwen_vl import QwenVLForConditionalGeneration

    encoded: list[tuple[int, int, int]] = []  # every image the tower runs on, over the whole run
    embed = QwenVLForConditionalGeneration.embed_images

    def counting(self, pixel_values, grid_thw):
        encoded.extend(grid_thw)
        return embed(self, pixel_values, grid_thw)

    monkeypatch.setattr(QwenVLForConditionalGeneration, "embed_images", counting)

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    local = allowed / "local.png"
    local.write_bytes(png_bytes(image(48, 32, 8)))
    (tmp_path / "outside.png").write_bytes(png_bytes(image(32, 32, 9)))
    small, wide, repeated = image(32, 32, 6), image(64, 96, 7), image(64, 64, 10)
    good = {
        "text": [_text(words(5, 1))],
        "one": [_img(data_uri(wide)), _text(words(3, 2))],
        "two": [_img(data_uri(small)), _text(words(2, 3)), _img(data_uri(wide))],
        "local": [_img(str(local)), _text(words(2, 4))],
        **{f"rep{i}": [_img(data_uri(repeated)), _text(words(i + 1, 5))] for i in range(4)},
    }
    bad = {
        "undecodable": ([_img("data:image/png;base64,aGVsbG8=")], "cannot decode image"),
        "http": ([_img("http://example.com/a.png")], "--allow-media-urls"),
        "outside": ([_img(str(tmp_path / "outside.png"))], "outside the allowed folder"),
        "huge": ([_img(data_uri(image(300, 300, 11)))], "over the limit"),
        "three": ([_img(data_uri(small))] * 3, "limit-mm-per-prompt"),
    }
    lines = [_chat(cid, parts) for cid, parts in good.items()] + [
        _chat(cid, p) for cid, (p, _) in bad.items()
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    flags = cpu_flags(folder)
    flags += ["--max-model-len", "256", "--no-progress", "--allowed-local-media-path", str(allowed)]
    flags += ["--max-image-pixels", str(200 * 200), "--limit-mm-per-prompt", '{"image": 2}']
    # --validate-only decodes and checks the images without loading weights: the bad lines only fail.
    assert main(["run-batch", "-i", str(inp), "-o", str(out), "--validate-only", *flags]) == 1
    reported = capsys.readouterr().err
    assert all(f"({cid}): invalid_" in reported for cid in bad)
    assert not any(f"({cid})" in reported for cid in good)
    assert main(["run-batch", "-i", str(inp), "-o", str(out), *flags]) == 0
    # 9 images in the good lines, 4 distinct (the wide one in two lines, the repeated one in four):
    # each distinct image runs through the tower once.
    assert len(encoded) == 4
    records = {r["custom_id"]: r for r in read_jsonl(out)}
    assert set(records) == set(good) | set(bad)
    for cid, (_, reason) in bad.items():
        r = records[cid]
        assert r["response"]["status_code"] == 400 and reason in r["error"]["message"], (cid, r)
    # The good lines answer as LLM.chat does on the same conversations (itself token-exact with
    # transformers, test_vision_parity.py); a local file becomes a data URI for LLM.chat, which is not
    # given the folder.
    good["local"] = [_img(data_uri(image(48, 32, 8))), _text(words(2, 4))]
    convs = [[{"role": "user", "content": parts}] for parts in good.values()]
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = [o.outputs[0].text for o in llm.chat(convs, params, use_tqdm=False)]
    for cid, text in zip(good, expected):
        r = records[cid]
        assert r["error"] is None, r
        assert r["response"]["body"]["choices"][0]["message"]["content"] == text, cid


@pytest.mark.slow
def test_server_with_the_openai_client(llm, folder):
    import openai

    from overnight.server.background import BackgroundServer
    from overnight.server.cli import ServerOptions, make_app

    img = image(64, 32, 12)
    conv = [{"role": "user", "content": [_img(data_uri(img)), _text(words(4, 6))]}]
    expected = llm.chat(conv, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0].text
    app = make_app(llm.engine, ServerOptions(), images=llm._images)
    with BackgroundServer(app) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=conv, max_tokens=6, temperature=0)
        assert reply.choices[0].message.content == expected
        stream = client.chat.completions.create(
            model=model, messages=conv, max_tokens=6, temperature=0, stream=True
        )
        # (the toy word-level tokenizer's incremental decoding may lead with a space)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed.strip() == expected
        bad = [{"role": "user", "content": [_img("data:image/png;base64,aGVsbG8="), _text("w20")]}]
        with pytest.raises(openai.BadRequestError, match="cannot decode image"):
            client.chat.completions.create(model=model, messages=bad, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="allowed-local-media-path"):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": [_img("/etc/passwd")]}], max_tokens=2
            )
        again = client.chat.completions.create(model=model, messages=conv, max_tokens=6, temperature=0)
        assert again.choices[0].message.content == expected  # the server kept serving


def test_caption_folder_example_resumes(folder, tmp_path):
    """examples/caption_folder.py: a folder with a broken file in, captions out; a second run resumes
    (no line runs twice) and the captions file stays whole."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("caption_folder", "examples/caption_folder.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    image(64, 48, 30).save(photos / "a.png")
    image(32, 32, 31).save(photos / "sub" / "b.jpg")
    (photos / "broken.jpg").write_bytes(b"not a jpeg")
    out = str(tmp_path / "captions.jsonl")
    argv = [str(photos), *cpu_flags(folder), "-o", out, "--max-tokens", "4", "--max-model-len", "256"]
    argv.append("--no-progress")
    assert example.main(argv) == 0
    first = [json.loads(x) for x in open(out)]
    assert [r["image"] for r in first] == ["a.png", "broken.jpg", os.path.join("sub", "b.jpg")]
    assert "cannot decode image" in first[1]["error"] and first[0]["caption"] and first[2]["caption"]
    assert example.main(argv) == 0  # resumes: every line already answered
    assert [json.loads(x) for x in open(out)] == first
    assert len(open(out + ".results.jsonl").readlines()) == 3


def test_generate_stream_with_images_in_input_order(llm):
    """generate_stream prepares image prompts ahead in threads; outputs equal generate's, and a bad
    prompt still names its index."""
    prompts = [
        {
            "prompt": f"{words(i + 2, 40 + i)} {PLACEHOLDER}",
            "multi_modal_data": {"image": image(32 + 16 * (i % 3), 32, i)},
        }
        for i in range(20)
    ]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    streamed = dict(llm.generate_stream(iter(prompts), GREEDY, use_tqdm=False))
    assert [streamed[i].outputs[0].token_ids for i in range(20)] == expected
    bad = prompts[:3] + [{"prompt": "w20", "multi_modal_data": {"image": image(32, 32, 1)}}]
    with pytest.raises(ValueError, match="prompt 3: the prompt has 0 image placeholders"):
        list(llm.generate_stream(iter(bad), GREEDY, use_tqdm=False))
