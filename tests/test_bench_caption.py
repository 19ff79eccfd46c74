"""The captioning workload (overnight/bench/caption.py, workloads.py) and what makes vLLM's side of it the
same work: deterministic prompts and pixels, the published image preprocessing for presets that ship no
preprocessor_config.json (multimodal/qwen_pixels.py), the processor folder bench/vllm_throughput.py
hands vLLM (bench/processor_folder.py), and `overnight bench throughput --workload caption-448` on a
reduced Qwen2-VL / Qwen2.5-VL / Qwen3-VL config with dummy weights on the CPU."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest

from overnight.bench.caption import caption_prompt_ids
from overnight.bench.processor_folder import write_processor_files
from overnight.bench.workloads import WORKLOADS
from overnight.cli import main
from overnight.loader.resolve import PRESETS_DIR, resolve_source
from overnight.multimodal.media import MediaPolicy
from overnight.multimodal.processor import ImageProcessor
from tests.tiny_vl import image

PRESETS = ["qwen2-vl-7b", "qwen2.5-vl-7b", "qwen3-vl-8b"]
# Image tokens of one 448 x 448 image: (448 / 28)^2 on Qwen2(.5)-VL (patch 14), (448 / 32)^2 on Qwen3-VL.
TOKENS_448 = {"qwen2-vl-7b": 256, "qwen2.5-vl-7b": 256, "qwen3-vl-8b": 196}
PAD, START, END = 151655, 151652, 151653


def arch_of(preset: str):
    return resolve_source(preset, "dummy").arch


def ours(vision, folder, ids, img) -> list[int]:
    proc = ImageProcessor(vision, folder, MediaPolicy())
    try:
        return proc.process(ids, [img])[0]
    finally:
        proc.close()


def test_caption_workload_is_deterministic():
    arch = arch_of("qwen2.5-vl-7b")
    w = replace(WORKLOADS["caption-448"], num_requests=3)
    first, again = w.prompts(arch), w.prompts(arch)
    pixels = [np.asarray(p["multi_modal_data"]["image"]) for p, _ in first]
    for (p, n), (q, m), px in zip(first, again, pixels):
        assert p["prompt_token_ids"] == q["prompt_token_ids"] and n == m == 128
        assert np.array_equal(px, np.asarray(q["multi_modal_data"]["image"]))
        assert p["multi_modal_data"]["image"].size == (448, 448)
        ids = p["prompt_token_ids"]
        assert ids.count(PAD) == 1 and ids[ids.index(PAD) - 1] == START and ids[ids.index(PAD) + 1] == END
    # every request its own picture; the warm-up's pictures are none of the timed ones
    assert not np.array_equal(pixels[0], pixels[1]) and pixels[0].std() > 10
    warm = [np.asarray(p["multi_modal_data"]["image"]) for p in w.warmup_prompts(arch, 2)]
    assert not any(np.array_equal(a, b) for a in warm for b in pixels)
    # another seed, other pixels; the first requests do not depend on how many there are
    other = replace(w, seed=5).prompts(arch)[0][0]["multi_modal_data"]["image"]
    assert not np.array_equal(np.asarray(other), pixels[0])
    assert np.array_equal(
        np.asarray(replace(w, num_requests=1).prompts(arch)[0][0]["multi_modal_data"]["image"]), pixels[0]
    )
    with pytest.raises(ValueError, match="image workload"):
        w.requests(arch.vocab_size)
    with pytest.raises(ValueError, match="takes no images"):
        caption_prompt_ids(arch_of("qwen3-8b"))
    # text workloads keep their ids: prompts() wraps requests()
    text = replace(WORKLOADS["seed-512-256"], num_requests=2)
    assert [p["prompt_token_ids"] for p, _ in text.prompts(arch)] == [
        i for i, _ in text.requests(arch.vocab_size)
    ]


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_without_preprocessor_config_preprocess_as_published(preset):
    """No preprocessor_config.json (a dummy preset): the published checkpoint's pixel bounds and
    normalization, not transformers' Qwen2-VL defaults (max 1003520 pixels, min 3136, CLIP mean)."""
    vision = arch_of(preset).vision
    ids = caption_prompt_ids(arch_of(preset))
    assert ours(vision, None, ids, image(448, 448, 0)).count(PAD) == TOKENS_448[preset]
    proc = ImageProcessor(vision, None, MediaPolicy())
    size, mean = proc.hf.size, list(proc.hf.image_mean)
    proc.close()
    if preset in ("qwen2-vl-7b", "qwen2.5-vl-7b"):
        assert (size.shortest_edge, size.longest_edge) == (3136, 12845056)
        assert mean == pytest.approx([0.48145466, 0.4578275, 0.40821073])
        # 1400 x 1400 fits the published max (12.8M pixels) as it is: 50 x 50 patches of 28 px
        assert ours(vision, None, ids, image(1400, 1400, 1)).count(PAD) == 2500
    else:
        assert (size.shortest_edge, size.longest_edge) == (65536, 16777216)
        assert mean == pytest.approx([0.5, 0.5, 0.5])
        # 100 x 100 is scaled up to the published min of 65536 pixels: 256 x 256, 8 x 8 tokens
        assert ours(vision, None, ids, image(100, 100, 1)).count(PAD) == 64


def _hf_processor(folder, kind, monkeypatch):
    """transformers' Qwen processor on the folder's tokenizer and image processor, as vLLM builds it. Its
    video processor needs torchvision, absent here: the processor is built without one (no video is
    sent); bench/vllm_throughput.py repeats this check with AutoProcessor on the GPU machine."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def without_video(self, name, arg):
        return None if name == "video_processor" and arg is None else check(self, name, arg)

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", without_video)
    cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}.get(kind, Qwen3VLProcessor)
    tok = AutoTokenizer.from_pretrained(folder)
    return cls(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder), tokenizer=tok, video_processor=None
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_processor_folder_for_vllm_expands_like_ours(preset, tmp_path, monkeypatch):
    folder = str(tmp_path / preset)
    os.makedirs(folder)
    shutil.copy(os.path.join(PRESETS_DIR, f"{preset}.json"), os.path.join(folder, "config.json"))
    specials = write_processor_files(folder)
    arch = arch_of(preset)
    hf = _hf_processor(folder, arch.vision.kind, monkeypatch)
    tok = hf.tokenizer
    # what vLLM looks up: vocab[image_token], the encoding of the placeholder strings, the max token id
    assert hf.image_token == "<|image_pad|>" and tok.get_vocab()["<|image_pad|>"] == PAD == hf.image_token_id
    assert tok.get_vocab()["<|video_pad|>"] == 151656  # Qwen2.5-VL looks it up too (vocab[video_token])
    for name, i in specials.items():
        assert tok.encode(name, add_special_tokens=False) == [i]
    assert max(tok.get_vocab().values()) == arch.vocab_size - 1
    with open(os.path.join(folder, "video_preprocessor_config.json")) as f:
        assert json.load(f)["video_processor_type"].endswith("VideoProcessor")
    # vLLM's dummy text for one image: Qwen2(.5)-VL the pad alone, Qwen3-VL with its start / end tokens
    text = hf.image_token if preset != "qwen3-vl-8b" else "<|vision_start|><|image_pad|><|vision_end|>"
    ids = caption_prompt_ids(arch)
    for img in (image(448, 448, 0), image(640, 360, 1)):
        out = hf(text=[text], images=[img], return_tensors="pt")
        theirs = out["input_ids"][0].tolist().count(PAD)
        assert theirs == int(out["image_grid_thw"].prod()) // 4
        # ours, with the folder's preprocessor_config.json and with none (the preset as ours runs it)
        assert (
            ours(arch.vision, folder, ids, img).count(PAD)
            == theirs
            == ours(arch.vision, None, ids, img).count(PAD)
        )
    assert theirs != TOKENS_448[preset]  # the 640 x 360 image is not the square's count


def _reduced_config(preset: str, folder: str) -> str:
    """The preset's config.json with every size cut down (the same structure: window attention and
    full-attention blocks, deepstack, M-RoPE sections over a head of 16)."""
    with open(os.path.join(PRESETS_DIR, f"{preset}.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    text.update(num_key_value_heads=2)
    text["rope_scaling"]["mrope_section"] = [2, 3, 3]
    if "head_dim" in text:
        text["head_dim"] = 16
    v = cfg["vision_config"]
    if "embed_dim" in v:  # Qwen2-VL: the tower's width is embed_dim, hidden_size its output's
        v.update(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64)
    else:
        v.update(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    if "fullatt_block_indexes" in v:
        v["fullatt_block_indexes"] = [1]
    if "deepstack_visual_indexes" in v:
        v.update(deepstack_visual_indexes=[0, 1], num_position_embeddings=16)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


@pytest.mark.parametrize("preset", PRESETS)
def test_bench_throughput_caption_on_reduced_config(preset, tmp_path, capsys):
    folder = _reduced_config(preset, str(tmp_path / preset))
    out_file = tmp_path / "bench.jsonl"
    n = 2
    argv = ["bench", "throughput", "--model", folder, "--load-format", "dummy", "--workload", "caption-448"]
    argv += ["--num-prompts", str(n), "--device", "cpu", "--dtype", "float32", "--max-model-len", "4096"]
    argv += ["--kv-cache-memory-bytes", str(32 << 20), "--json-out", str(out_file)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "one 448x448 image each" in printed and "images/s" in printed
    (r,) = json.loads(out_file.read_text().splitlines()[-1])["results"]
    assert r["images"] == r["requests"] == n and r["images_s"] > 0
    assert r["output_tokens"] == n * 128
    # each prompt: 25 text tokens and the image's tokens
    assert r["input_tokens"] == n * (25 + TOKENS_448[preset])


def test_image_workload_refuses_text_only_modes():
    for flag in (["--compare", "transformers"], ["--json-schema", "x.json"]):
        with pytest.raises(SystemExit, match="image workload"):
            main(["bench", "throughput", "--workload", "caption-448", *flag])


@pytest.fixture()
def vllm_stand_in(monkeypatch):
    """bench/vllm_throughput.py with a stand-in for vLLM (not installable here) that records how the LLM
    is built and what generate gets; run(argv) runs the script's main and returns (LLM kwargs, the
    generate calls' prompts, the JSON record). A typo in the script would cost the GPU call."""
    import importlib.util
    import sys
    import types

    import torch

    spec = importlib.util.spec_from_file_location("vllm_throughput", "bench/vllm_throughput.py")
    assert spec and spec.loader
    vt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vt)
    built: list[dict] = []
    seen: list[list] = []

    class LLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

        def generate(self, prompts, params, use_tqdm=False, lora_request=None):
            seen.append(prompts)
            assert len(prompts) == len(params) and not any(sp.detokenize for sp in params)
            outs = []
            for p, sp in zip(prompts, params):
                out = types.SimpleNamespace(token_ids=[7] * sp.max_tokens)
                outs.append(types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[out]))
            return outs

    fake = types.ModuleType("vllm")
    fake.LLM = LLM
    fake.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(vt, "require_torchvision", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def check(folder, prompt, arch):  # AutoProcessor needs torchvision: the processor test covers it
        assert os.path.isfile(os.path.join(folder, "video_preprocessor_config.json"))
        image = prompt["multi_modal_data"]["image"]
        return ours(arch.vision, folder, prompt["prompt_token_ids"], image).count(PAD)

    monkeypatch.setattr(vt, "check_expansion", check)
    # unset for the script, and whatever main() sets is undone after the test (setenv records the original)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")

    def run(argv: list[str], capsys) -> tuple[dict, list[list], dict]:
        monkeypatch.setattr(sys, "argv", ["vllm_throughput.py", *argv])
        assert vt.main() == 0
        (kwargs,) = built
        return kwargs, seen, json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    return run


def test_vllm_side_gets_our_images_and_a_tokenizer(vllm_stand_in, capsys):
    kwargs, (warm, timed), record = vllm_stand_in(["--workload", "caption-448", "--num-prompts", "3"], capsys)
    assert kwargs["skip_tokenizer_init"] is False and kwargs["load_format"] == "dummy"
    assert kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    mine = replace(WORKLOADS["caption-448"], num_requests=3).prompts(arch_of("qwen2.5-vl-7b"))
    assert len(timed) == 3 and len(warm) == 8
    for p, (q, _) in zip(timed, mine):
        assert p["prompt_token_ids"] == q["prompt_token_ids"]
        a, b = p["multi_modal_data"]["image"], q["multi_modal_data"]["image"]
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert record["images"] == 3 and record["images_s"] > 0 and record["image_tokens"] == 256
    assert record["model"] == "qwen2.5-vl-7b" and record["requests"] == 3
    # vLLM's engine core hung at start-up in its own process with images: it runs in this one
    assert record["engine_core"] == "in-process" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_vllm_side_of_a_text_workload_is_unchanged(vllm_stand_in, capsys):
    """A text workload still runs without a tokenizer, images off on a VL checkpoint, our token ids."""
    argv = ["--workload", "seed-512-256", "--model", "qwen3-vl-8b", "--num-prompts", "2"]
    kwargs, (warm, timed), record = vllm_stand_in(argv, capsys)
    assert kwargs["skip_tokenizer_init"] is True
    assert kwargs["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    ids = [i for i, _ in replace(WORKLOADS["seed-512-256"], num_requests=8).requests(151936)]
    assert [p["prompt_token_ids"] for p in timed] == ids[:2] and [p["prompt_token_ids"] for p in warm] == ids
    assert "images" not in record and record["output_tok_s"] > 0
    assert record["engine_core"] == "own process"  # vLLM's default, as in every text row


def test_vllm_side_runs_several_workloads_on_one_engine(vllm_stand_in, capsys):
    """--workload A,B: one LLM (one start-up), each workload warmed and timed, a JSON line each."""
    argv = ["--workload", "seed-512-256,long-1024-1024", "--num-prompts", "2"]
    kwargs, seen, last = vllm_stand_in(argv, capsys)
    assert kwargs["skip_tokenizer_init"] is True
    assert len(seen) == 4  # warm-up and timed run of each workload
    seed = [i for i, _ in replace(WORKLOADS["seed-512-256"], num_requests=2).requests(151936)]
    long = [i for i, _ in replace(WORKLOADS["long-1024-1024"], num_requests=2).requests(151936)]
    assert [p["prompt_token_ids"] for p in seen[1]] == seed
    assert [p["prompt_token_ids"] for p in seen[3]] == long
    assert last["workload"] == "long-1024-1024" and last["requests"] == 2


def test_vllm_side_refuses_an_unknown_workload(vllm_stand_in, capsys):
    with pytest.raises(SystemExit, match="unknown workload nope"):
        vllm_stand_in(["--workload", "seed-512-256,nope"], capsys)


# Parameters of the published checkpoints (their safetensors, as transformers builds them from the
# config), and the tower's share.
PARAMETERS = {
    "qwen2-vl-7b": (8_291_375_616, 675_759_104),
    "qwen2.5-vl-7b": (8_292_166_656, 676_550_144),
    "qwen3-vl-8b": (8_767_123_696, 576_388_336),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_vl_presets_have_published_shapes(preset):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from overnight.loader.model_loader import build_model

    source = resolve_source(preset, "dummy")
    assert source.kind == "dummy" and source.tokenizer_path is None
    model = build_model(source, torch.bfloat16, "meta")
    total, tower = PARAMETERS[preset]
    assert sum(p.numel() for p in model.parameters()) == total
    assert sum(p.numel() for p in model.visual.parameters()) == tower
    with open(os.path.join(PRESETS_DIR, f"{preset}.json")) as f:
        cfg = AutoConfig.for_model(**json.load(f))
    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(cfg)
    assert sum(p.numel() for p in hf.parameters()) == total
    assert source.arch.vision.image_token_id == PAD
    qwen2 = preset in ("qwen2-vl-7b", "qwen2.5-vl-7b")  # Qwen2's decoder, else Qwen3's
    rope = (1e6, (16, 24, 24), False) if qwen2 else (5e6, (24, 20, 20), True)
    assert (source.arch.rope_theta, source.arch.mrope_section, source.arch.mrope_interleaved) == rope
    assert source.arch.attention_bias == qwen2 and source.arch.qk_norm == (not qwen2)


def test_vllm_side_reports_its_output_spread_and_can_draw_weights_as_ours(vllm_stand_in, capsys, monkeypatch):
    """The JSON line counts the distinct tokens emitted at a few positions (the stand-in emits 7 for
    every request: one), and --dummy-weights overnight installs the plugin that draws vLLM's dummy
    weights as ours (bench/vllm_dummy.py) before the engine is built."""
    from bench import vllm_dummy

    installed: list[bool] = []
    monkeypatch.setattr(vllm_dummy, "install", lambda: installed.append(True) or "folder")
    argv = ["--workload", "seed-512-256", "--num-prompts", "3", "--dummy-weights", "overnight"]
    _, _, record = vllm_stand_in(argv, capsys)
    assert installed == [True]
    assert record["dummy_weights"] == "overnight"
    assert record["distinct_tokens"] == {"0": 1, "255": 1}  # 256 outputs: position 511 is past them
