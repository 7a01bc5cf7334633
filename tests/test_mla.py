"""MLA runtime: absorbed attention over 576-dim latent rows on tiny DeepSeek-V2 and Kimi Linear."""

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.framework.adapters.mla import check_transformers_for
from kvzoo.framework.attention import detach
from kvzoo.framework.layer import KVLayer
from kvzoo.models import load_model, tiny_deepseek_v2, tiny_kimi_linear
from kvzoo.policies.streaming_llm import StreamingLLM
from tests.greedy import assert_same_greedy, generated_logits

BUILDERS = {"deepseek_v2": tiny_deepseek_v2, "kimi_linear": tiny_kimi_linear}


@pytest.fixture(scope="module", params=list(BUILDERS))
def mla(request):
    model, _ = BUILDERS[request.param]()
    return model


@pytest.fixture(scope="module")
def deepseek():
    return tiny_deepseek_v2()[0]


def _ids(n, seed=0, vocab=512):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache=None, n=32):
    return model.generate(
        ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache=cache,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )


def test_geometry_and_scale(mla):
    attn = [m for m in mla.modules() if hasattr(m, "kv_b_proj")]
    assert attn and all(m.kv_lora_rank == 512 and m.qk_rope_head_dim == 64 for m in attn)
    if mla.config.model_type == "deepseek_v2":
        assert attn[0].scaling == pytest.approx(0.11472, abs=5e-5)  # 192^-1/2 * yarn mscale^2 (Lite)
    else:
        assert mla.config.layer_types == ["linear_attention", "full_attention"] * 2


def test_full_absorbed_matches_transformers(mla):
    """300-token prompt + 32 greedy steps: same tokens, logits within 1e-4 of transformers' own MLA."""
    ids = _ids(300, seed=1)
    detach(mla)
    ref = _generate(mla, ids)
    cache = TieredCache(mla, "full")
    out = _generate(mla, ids, cache)
    assert_same_greedy(ref.sequences, out.sequences, generated_logits(ref), generated_logits(out), atol=1e-4)
    # the cache held latent rows, not decompressed K/V: 576 values per token per MLA layer
    for layer in cache.tiered_layers:
        assert layer.keys.shape[1:] == (1, 331, 576) and layer.values is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_bytes_per_token_and_ratio8(mla, dtype):
    ids = _ids(800, seed=2)
    model = mla.to(dtype)
    try:
        cache = TieredCache(model, StreamingLLM(ratio=8, schedule="block", block_size=10_000))
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        size = torch.empty((), dtype=dtype).element_size()
        for s in cache.stats().layers:
            assert s.resident_bytes == 800 * 576 * size
        cache.compress()
        for s in cache.stats().layers:
            assert s.resident_rows == 100 and s.resident_bytes == 100 * 576 * size
            assert s.dropped_rows == 700 and s.archived_rows == 0  # eviction only: the 700 rows freed
    finally:
        mla.to(torch.float32)


def test_streaming_prefill_peak_and_equivalence(deepseek):
    """4k prompt, chunks of 512: resident rows never exceed budget + chunk; full chunked == one-shot."""
    ids = _ids(4096, seed=3)
    policy = registry.get("streaming_llm", ratio=8)
    budget = 4096 // 8
    seen_peaks = []
    original = KVLayer.update

    def update(layer, *a, **kw):
        out = original(layer, *a, **kw)
        seen_peaks.append(layer.store.n)
        return out

    KVLayer.update = update
    try:
        r = pipeline.generate(deepseek, None, ids[0], ids[0, :4], policy, max_new_tokens=2, chunk_size=512)
    finally:
        KVLayer.update = original
    assert max(seen_peaks) <= budget + 512
    for s in r.stats.layers:
        assert s.peak_resident_rows <= budget + 512 and s.resident_rows == budget
    # full: chunked prefill equals one-shot prefill
    with torch.no_grad():
        one = TieredCache(deepseek, "full")
        ref = deepseek(input_ids=ids, cache=one, use_cache=True).logits
        chunked = TieredCache(deepseek, "full")
        parts = [deepseek(input_ids=ids[:, i : i + 512], cache=chunked, use_cache=True).logits for i in range(0, 4096, 512)]
    assert (torch.cat(parts, dim=1) - ref).abs().max().item() < 1e-4


def test_partition_invariant_mla(mla):
    log = {}
    original = KVLayer.update

    def update(layer, k, v, *a, **kw):
        log.setdefault(layer.layer_idx, []).append(k.clone())
        return original(layer, k, v, *a, **kw)

    KVLayer.update = update
    try:
        cache = TieredCache(mla, StreamingLLM(budget=50, archive=True))
        _generate(mla, _ids(200, seed=4), cache, n=10)
    finally:
        KVLayer.update = original
    for layer in cache.tiered_layers:
        rows = torch.cat(log[layer.layer_idx], dim=2)  # [1, 1, T, 576]
        arc = layer.store.archive.tensors()
        slots = torch.cat([layer.slots, arc["slots"]], dim=2)
        keys = torch.cat([layer.keys, arc["keys"]], dim=2)
        T = rows.shape[2]
        assert layer.keys.shape[2] == 50 and set(arc) == {"keys", "slots", "valid"}
        assert torch.equal(slots.sort(dim=2).values, torch.arange(T).view(1, 1, T))
        assert torch.equal(keys, rows.gather(2, slots[..., None].expand(1, 1, T, 576)))


def test_deepseek_positions_after_eviction(deepseek):
    """Decode after eviction equals a full forward whose last query sees only the kept slots."""
    ids = _ids(301, seed=5)
    cache = TieredCache(deepseek, StreamingLLM(budget=64))
    with torch.no_grad():
        deepseek(input_ids=ids[:, :300], cache=cache, use_cache=True)
        cache.compress()
        kept = cache.tiered_layers[0].slots[0, 0]
        got = deepseek(input_ids=ids[:, 300:], cache=cache, use_cache=True).logits[0, -1]
        allowed = torch.tril(torch.ones(301, 301, dtype=torch.bool))
        allowed[300] = False
        allowed[300, kept] = True
        allowed[300, 300] = True
        detach(deepseek)
        mask4d = torch.zeros(1, 1, 301, 301).masked_fill(~allowed, float("-inf"))
        ref = deepseek(input_ids=ids, attention_mask=mask4d).logits[0, -1]
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", list(registry.available()))
def test_every_policy_runs_on_mla_rows(mla, name):
    params = {} if name == "full" else {"ratio": 8}
    policy = registry.get(name, **params)
    r = pipeline.generate(mla, None, _ids(400, seed=6)[0], _ids(8, seed=7)[0], policy, max_new_tokens=4)
    assert len(r.token_ids) == 4
    for rank, s in enumerate(r.stats.layers):
        if rank < policy.dense_layers:  # quest keeps its first two layers dense (all the tiny models have)
            assert s.resident_rows == s.seen_rows
            continue
        # the context's budget + the question and decode rows a context_end policy adds on top
        # (quest attends to 4 sinks + a 16-row page; vestige keeps per block; full keeps all)
        assert s.resident_rows <= (400 if name == "full" else max(400 // 8, 20)) + 8 + 4


def test_checkpoint_roundtrip(tmp_path, mla):
    mla.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and list(tmp_path.glob("*.safetensors"))
    loaded, tok = load_model(str(tmp_path))
    assert tok is None and loaded.config.model_type == mla.config.model_type
    assert loaded.config.layer_types == mla.config.layer_types if hasattr(mla.config, "layer_types") else True
    ours, theirs = mla.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)  # bit-exact weights
    ids = _ids(64, seed=8)
    with torch.no_grad():
        a = mla(input_ids=ids, cache=TieredCache(mla, "full"), use_cache=True).logits
        b = loaded(input_ids=ids, cache=TieredCache(loaded, "full"), use_cache=True).logits
    # same weights; MoE routing near-ties can amplify float reduction-order noise, hence not == 0
    assert (a - b).abs().max().item() < 1e-3


def test_transformers_too_old_for_kimi():
    with pytest.raises(RuntimeError, match=r"Kimi Linear needs transformers >= 5.18.*5.17.0"):
        check_transformers_for("kimi_linear", "5.17.0")
    check_transformers_for("deepseek_v2", "5.0.0")  # DeepSeek is fine
