"""The context's end inside its last forward (``TieredCache.context_end()``): each layer compresses right after its
own attention, before the next layer runs -- the same rows kept and the same tokens as compressing after the forward,
for every registered policy on the three tiny families, with a left-padded batch; and the rows resident at once
during that forward stay within (layers - 1) x budget + one layer's prompt."""

from __future__ import annotations

import functools

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.framework.attention import detach
from kvzoo.models import TINY_FAMILIES
from tests.greedy import assert_same_greedy

PROMPT, STEPS = 96, 5


@functools.cache
def _model(family: str):
    model = TINY_FAMILIES[family]()[0]
    detach(model)
    return model


def _policies() -> list[tuple[str, dict]]:
    out = []
    for name in registry.available():
        cls = registry.policy_class(name)
        params = {} if not getattr(cls, "requires_budget", True) else {"budget": 24}
        if "window" in cls.__dataclass_fields__:
            params["window"] = 8
        if name == "quest":
            params["dense_layers"] = 0
        out.append((name, params))
    return out


def _ids(model, seed=0):
    ids = torch.randint(3, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :11], mask[1, :11] = 0, 0  # the second sequence is left-padded
    return ids, mask


def _run(model, policy, ids, mask, in_forward: bool):
    cache = TieredCache(model, policy, context_length=PROMPT)
    peak = {"rows": 0}

    def watch(module, args, kwargs, output):  # rows resident in every layer after each layer's attention
        peak["rows"] = max(peak["rows"], sum(layer.store.n for layer in cache.tiered_layers))

    hooks = [m.register_forward_hook(watch, with_kwargs=True) for m in cache.adapter.attention_modules().values()]
    with torch.no_grad():
        if in_forward:
            cache.context_end()
        logits = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
        cache.compress()  # after context_end()'s forward: changes nothing
    for hook in hooks:
        hook.remove()
    kept = [layer.slots.sort(dim=-1).values for layer in cache.tiered_layers]
    tokens, chose_from = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
            chose_from.append(logits)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            logits = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
    detach(model)
    return kept, torch.cat(tokens, dim=1), torch.stack(chose_from, dim=1), peak["rows"], cache


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
@pytest.mark.parametrize(("name", "params"), _policies(), ids=[n for n, _ in _policies()])
def test_compressing_inside_the_forward_keeps_what_compressing_after_it_keeps(family, name, params):
    model = _model(family)
    policy = registry.get(name, **params)
    if ("gqa" if family == "llama" else "mla") not in policy.layouts:
        pytest.skip(f"{name} does not run on {family}")
    ids, mask = _ids(model)
    after = _run(model, policy, ids, mask, in_forward=False)
    inside = _run(model, registry.get(name, **params), ids, mask, in_forward=True)
    for layer, (a, b) in enumerate(zip(after[0], inside[0])):
        assert torch.equal(a, b), f"layer {layer}: other rows kept"
    for row in range(2):
        assert_same_greedy(after[1][row], inside[1][row], after[2][row], inside[2][row])
    cache = inside[4]
    layers = len(cache.tiered_layers)
    budget = max(layer.store.n for layer in cache.tiered_layers) if name != "full" else PROMPT
    if name != "full":  # one layer at a time holds its whole prompt
        assert inside[3] <= (layers - 1) * budget + PROMPT, (inside[3], layers, budget)
    assert all(layer.context_ended for layer in cache.tiered_layers) and not cache.runtime.ending


@pytest.mark.parametrize(("name", "params"), [p for p in _policies() if p[0] != "full"], ids=[n for n, _ in _policies()
                                                                                             if n != "full"])
def test_the_pipelines_default_prefill_holds_one_layers_prompt_at_a_time(name, params):
    """kvzoo.pipeline's default mode per policy (:func:`kvzoo.pipeline.prefill_chunk`): the most rows every layer held
    at once during the context's prefill, counted by the cache, stays within (layers - 1) x budget + one layer's
    prompt (compressing after the forward held every layer's whole prompt at once)."""
    from kvzoo import pipeline

    model = _model("llama")
    ids = torch.randint(3, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    result = pipeline.generate(model, None, ids, ids[:4], registry.get(name, **params), max_new_tokens=2)
    layers = len(result.stats.layers)
    budget = params["budget"]
    # the question's 4 rows and the 2 generated ones join afterwards; the peak is the context's
    assert result.stats.peak_cache_rows <= (layers - 1) * budget + PROMPT + 6, result.stats.peak_cache_rows
    detach(model)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_a_token_by_token_prefill_is_chunked_by_default_and_keeps_the_same_rows(family, monkeypatch):
    """StreamingLLM with ``prefill="stream"`` prefills token by token (``multi_token_window``), so its default
    prefill takes chunks (``pipeline.STREAM_CHUNK``: here 32 of a 96-token prompt) and ends with the rows and the
    logits one forward gives; a policy whose cache depends on where a forward ends (StreamingLLM's default dense
    prefill: a chunk reads only the rows kept so far; H2O's accumulated attention) keeps its one forward."""
    from kvzoo import pipeline

    monkeypatch.setattr(pipeline, "STREAM_CHUNK", 32)
    model = _model(family)
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    kept, logits = {}, {}
    for chunk in (None, PROMPT):
        cache = TieredCache(model, registry.get("streaming_llm", budget=24, prefill="stream"), context_length=PROMPT)
        if chunk is None:
            assert pipeline.prefill_chunk(cache, PROMPT) == 32
        logits[chunk] = pipeline.prefill(model, cache, ids, chunk, ends_context=True)
        kept[chunk] = [layer.slots.sort(dim=-1).values for layer in cache.tiered_layers]
    for layer, (a, b) in enumerate(zip(kept[None], kept[PROMPT])):
        assert torch.equal(a, b), f"layer {layer}: a chunked prefill kept other rows"
    torch.testing.assert_close(logits[None], logits[PROMPT], rtol=1e-4, atol=1e-4)
    for name in ("streaming_llm", "h2o"):
        one = TieredCache(model, registry.get(name, budget=24), context_length=PROMPT)
        assert pipeline.prefill_chunk(one, PROMPT) == PROMPT, name
    detach(model)


def _reachable_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through plain objects (modules, i.e. the model's weights, left out)."""
    import gc

    seen, out, stack = set(), [], [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        else:
            stack.extend(gc.get_referents(obj))
    return out


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("name", ["snapkv", "chunkkv", "h2o", "streaming_llm"])
def test_a_compressed_cache_holds_no_buffer_of_the_whole_prompt(name, family):
    """After a context-ending forward an eviction-only policy's cache holds its kept rows, not the prefill's: no
    tensor reachable from it is backed by storage the size of a layer's whole prompt (the keys handed to the model,
    or the window queries as a view of the forward's whole queries, each kept every layer's prompt alive: the peak
    then grew by a layer's prompt per layer)."""
    model = _model(family)
    params = dict(_policies())[name]
    prompt = 256  # past 2 x budget + 64 rows: a store that small shrinks when compressed (framework/buffers.py)
    ids = torch.randint(3, model.config.vocab_size, (2, prompt), generator=torch.Generator().manual_seed(0))
    cache = TieredCache(model, registry.get(name, **params), context_length=prompt)
    with torch.no_grad():
        cache.context_end()
        model(input_ids=ids, cache=cache, use_cache=True)
    layer = cache.tiered_layers[0]
    B, G, _, D = layer.store.rows.get("keys").shape
    prompt_keys = B * G * prompt * D * 4
    big = {t.untyped_storage().nbytes(): tuple(t.shape) for t in _reachable_tensors(cache)
           if t.untyped_storage().nbytes() >= prompt_keys}
    assert not big, f"tensors backed by a prompt-sized storage (bytes: shape): {big}"
    detach(model)


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("name", ["snapkv", "chunkkv", "h2o", "vestige"])
def test_a_prefill_leaves_no_tensor_for_the_garbage_collector(name, family):
    """What a forward allocates is freed when its last reference goes, not at the collector's next pass: a reference
    cycle through a tensor (a view whose window attention closed over the view itself) held every layer's window
    attention and its keys until then -- the prefill's peak grew by them, layer after layer."""
    import gc

    model = _model(family)
    params = dict(_policies())[name]
    ids = torch.randint(3, model.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        cache = TieredCache(model, registry.get(name, **params), context_length=256)
        with torch.no_grad():
            cache.context_end()
            model(input_ids=ids, cache=cache, use_cache=True)
            model(input_ids=ids[:, :1], cache=cache, use_cache=True)
        del cache
        gc.collect()
        cyclic = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not cyclic, f"tensors freed only by the garbage collector: {cyclic[:8]}"
    detach(model)
