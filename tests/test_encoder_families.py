"""ModernBERT, EmbeddingGemma and NomicBERT against transformers and sentence-transformers on tiny random
models in fp32, through the encoder engine: ModernBERT embeddings (alternating global and local layers,
prompts longer than the local window, mixed lengths in one batch), its sequence classifier's scores and
classes (CLS and mean pooling heads, biases on), EmbeddingGemma (bidirectional Gemma 3 with sliding
windows, grouped KV heads, mean pooling, two Dense layers, Normalize; Matryoshka cuts through
hf_overrides) and NomicBERT (RoPE, SwiGLU, both config spellings). The references are
SentenceTransformer(folder).encode and transformers' classifier run one text or pair at a time. A few
seconds in all, most of it importing sentence-transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from overnight import LLM, PoolingParams
from overnight.errors import InvalidRequestError, ModelLoadError
from tests.tiny_classifiers import _spread
from tests.tiny_embedders import TEXTS, _bert_tokenizer, _decoder_tokenizer, reference_embeddings

# Longer than ModernBERT's local window of 8 (4 tokens either side) and Gemma's sliding window of 6.
LONG = "the quick brown fox jumps over the lazy dog again and again tonight, token by token, for search"
ALL_TEXTS = [*TEXTS, LONG]


def vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def _modernbert_config(vocab: int, **overrides: Any):
    from transformers import ModernBertConfig

    fields: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=128,
        global_attn_every_n_layers=2,
        local_attention=8,
        global_rope_theta=1000.0,
        local_rope_theta=50.0,
        pad_token_id=0,
        cls_token_id=2,
        sep_token_id=3,
        bos_token_id=2,
        eos_token_id=3,
    )
    return ModernBertConfig(**{**fields, **overrides})


def _modernbert_tokenizer(folder: Path):
    tok = _bert_tokenizer(folder)
    tok.model_input_names = ["input_ids", "attention_mask"]  # no token types, as ModernBERT's
    return tok


def _save_sentence_transformer(root: Path, base: Path, hidden: int, mode: str, dense: list[int]) -> Path:
    pytest.importorskip("sentence_transformers")  # writes the folder, and is the reference
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    modules: list[Any] = [Transformer(str(base)), Pooling(hidden, pooling_mode=mode)]
    width = hidden
    for i, out in enumerate(dense):
        layer = Dense(width, out, bias=False, activation_function=torch.nn.Identity())
        torch.manual_seed(10 + i)
        torch.nn.init.normal_(layer.linear.weight, std=width**-0.5)
        modules.append(layer)
        width = out
    modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(root))
    return root


def make_modernbert_embedder(tmp_path: Path, mode: str) -> Path:
    from transformers import ModernBertModel

    base = tmp_path / f"modernbert-{mode}-hf"
    tok = _modernbert_tokenizer(base)
    torch.manual_seed(0)
    model = ModernBertModel(_modernbert_config(len(tok))).eval()
    _spread(model, 0)
    model.save_pretrained(base)
    tok.save_pretrained(base)
    return _save_sentence_transformer(tmp_path / f"modernbert-{mode}", base, 64, mode, [])


def make_embeddinggemma(tmp_path: Path) -> Path:
    from transformers import Gemma3TextConfig, Gemma3TextModel

    base = tmp_path / "embeddinggemma-hf"
    tok = _decoder_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_bidirectional_attention=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Gemma3TextModel(config).eval()
    _spread(model, 1)
    model.save_pretrained(base)
    tok.save_pretrained(base)
    # EmbeddingGemma's modules: mean pooling, Dense up to 4x and back down, Normalize.
    return _save_sentence_transformer(tmp_path / "embeddinggemma", base, 64, "mean", [256, 48])


def assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("mode", ["cls", "mean"])
def test_modernbert_embeddings_equal_sentence_transformers(tmp_path, mode):
    folder = make_modernbert_embedder(tmp_path, mode)
    llm = LLM(str(folder), device="cpu")
    assert llm.engine.config.model.arch.layer_types[:2] == ("full_attention", "sliding_attention")
    outs = llm.embed(ALL_TEXTS, use_tqdm=False)
    got, ref = vectors(outs), reference_embeddings(folder, ALL_TEXTS)
    assert len(outs[-1].prompt_token_ids) > 12  # past the window: the local layers see part of it
    assert_same(got, ref)
    # One prompt alone gives what it gave in the mixed batch.
    assert_same(vectors(llm.embed([LONG], use_tqdm=False)), ref[-1:])


def test_embeddinggemma_equals_sentence_transformers(tmp_path):
    folder = make_embeddinggemma(tmp_path)
    llm = LLM(str(folder), device="cpu", hf_overrides={"matryoshka_dimensions": [16, 48]})
    assert llm.engine.config.model.arch.is_encoder
    ref = reference_embeddings(folder, ALL_TEXTS)
    assert ref.shape[1] == 48  # the last Dense layer's width
    assert_same(vectors(llm.embed(ALL_TEXTS, use_tqdm=False)), ref)
    cut = vectors(llm.embed(ALL_TEXTS[:3], pooling_params=PoolingParams(dimensions=16), use_tqdm=False))
    raw = reference_embeddings(folder, ALL_TEXTS[:3], normalize_embeddings=False)  # already normalized
    assert_same(cut, F.normalize(raw[:, :16], dim=-1))
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.embed(["a"], pooling_params=PoolingParams(dimensions=32), use_tqdm=False)


@torch.no_grad()
def _classifier_reference(folder: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    return torch.stack([model(**tok(*pair, return_tensors="pt")).logits[0] for pair in pairs])


@pytest.mark.parametrize(("pooling", "num_labels"), [("mean", 1), ("cls", 3)])
def test_modernbert_classifier_equals_transformers(tmp_path, pooling, num_labels):
    from transformers import ModernBertForSequenceClassification

    folder = tmp_path / f"modernbert-cls-{pooling}"
    tok = _modernbert_tokenizer(folder)
    config = _modernbert_config(
        len(tok),
        num_labels=num_labels,
        classifier_pooling=pooling,
        classifier_bias=True,
        attention_bias=True,
        mlp_bias=True,
        norm_bias=True,
    )
    torch.manual_seed(0)
    model = ModernBertForSequenceClassification(config).eval()
    _spread(model, 2)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    llm = LLM(str(folder), device="cpu")
    pairs = [(ALL_TEXTS[i], ALL_TEXTS[-1 - i]) for i in range(len(ALL_TEXTS))]
    logits = _classifier_reference(folder, pairs)
    if num_labels == 1:
        got = torch.tensor([o.outputs.score for o in llm.score(*zip(*pairs), use_tqdm=False)])
        torch.testing.assert_close(got, torch.sigmoid(logits[:, 0]), rtol=0, atol=2e-6)
        assert got.std() > 1e-3
    else:
        outs = llm.classify([p[0] for p in pairs], use_tqdm=False)
        ref = torch.softmax(_classifier_reference_single(folder, [p[0] for p in pairs]), dim=-1)
        torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), ref, rtol=0, atol=2e-6)


@torch.no_grad()
def _classifier_reference_single(folder: Path, texts: list[str]) -> torch.Tensor:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    return torch.stack([model(**tok(t, return_tensors="pt")).logits[0] for t in texts])


def make_nomic_embedder(tmp_path: Path) -> Path:
    from transformers import NomicBertConfig, NomicBertModel

    base = tmp_path / "nomic-hf"
    tok = _bert_tokenizer(base)
    config = NomicBertConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
    )
    torch.manual_seed(0)
    model = NomicBertModel(config).eval()
    _spread(model, 3)
    model.save_pretrained(base)
    tok.save_pretrained(base)
    return _save_sentence_transformer(tmp_path / "nomic", base, 64, "mean", [])


def test_nomic_bert_equals_sentence_transformers(tmp_path):
    import json

    from overnight.models.registry import arch_from_hf_config

    folder = make_nomic_embedder(tmp_path)
    llm = LLM(str(folder), device="cpu", hf_overrides={"is_matryoshka": True})
    ref = reference_embeddings(folder, ALL_TEXTS)
    assert_same(vectors(llm.embed(ALL_TEXTS, use_tqdm=False)), ref)
    cut = vectors(llm.embed(ALL_TEXTS[:2], pooling_params=PoolingParams(dimensions=24), use_tqdm=False))
    assert_same(cut, F.normalize(ref[:2, :24], dim=-1))
    # The published checkpoints' config.json spells the same model in GPT-2 names.
    hf = json.loads((tmp_path / "nomic-hf" / "config.json").read_text())
    published = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "vocab_size": hf["vocab_size"],
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_inner": 96,
        "n_positions": 128,
        "layer_norm_epsilon": hf["layer_norm_eps"],
        "activation_function": "swiglu",
        "rotary_emb_base": 100.0,
        "rotary_emb_fraction": 1.0,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "prenorm": False,
        "rotary_scaling_factor": None,
        "type_vocab_size": 2,
    }
    assert arch_from_hf_config(published) == arch_from_hf_config(hf)
    with pytest.raises(ModelLoadError, match="prenorm|pre-norm"):
        arch_from_hf_config({**published, "prenorm": True})


def test_unsupported_modules_are_refused(tmp_path):
    import json

    folder = make_modernbert_embedder(tmp_path, "mean")
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(
        2, {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}
    )
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="LayerNorm"):
        LLM(str(folder))


def test_dense_modules_are_checked_before_loading(tmp_path):
    """Dense layers run in the encoder engine only, and their widths must chain from the hidden size."""
    import json
    from dataclasses import replace

    from overnight.loader.pooling_config import read_pooler_config
    from overnight.loader.resolve import resolve_source

    folder = make_embeddinggemma(tmp_path)
    source = resolve_source(str(folder))
    dense = read_pooler_config(source).dense
    assert [(d.in_features, d.out_features, d.bias, d.activation) for d in dense] == [
        (64, 256, False, "identity"),
        (256, 48, False, "identity"),
    ]
    with pytest.raises(ModelLoadError, match="encoder models only"):
        read_pooler_config(replace(source, arch=replace(source.arch, is_encoder=False)))
    config = folder / "2_Dense" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "in_features": 32}))
    with pytest.raises(ModelLoadError, match="takes 32 features"):
        read_pooler_config(source)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"classifier_pooling": "max"}, "classifier_pooling"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "RoPE scaling"),
    ],
)
def test_modernbert_configs_it_cannot_run_are_refused(change, message):
    from overnight.models.registry import arch_from_hf_config

    config = {**_modernbert_config(64).to_dict(), "architectures": ["ModernBertModel"]}
    assert arch_from_hf_config(config).layer_types.count("sliding_attention") == 2
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**config, **change})
