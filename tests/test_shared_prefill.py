"""One dense prefill serving several policies: TieredCache.fork_as and the runner's SharedPrefill."""

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.bench import runner
from kvzoo.bench.tasks import ByteTokenizer, TaskSpec, make_task
from kvzoo.models import tiny_deepseek_v2

SHAREABLE = {
    "full": lambda: registry.get("full"),
    "snapkv": lambda: registry.get("snapkv", ratio=4),
    "chunkkv": lambda: registry.get("chunkkv", ratio=4),
    "snapkv+sketch": lambda: registry.get("snapkv", ratio=4, retriever="vestige"),
}


def _ids(n, seed, vocab):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _continue(model, cache, logits, question):
    """Compress, ask, decode 4 tokens: the tokens, the compressed rows and the KV bytes read."""
    pipeline.compress(cache)
    rows = [layer.keys.clone() for layer in cache.tiered_layers]
    logits = pipeline.prefill(model, cache, question, None)
    tokens = pipeline.greedy_decode(model, cache, logits, 3, set())
    return tokens, rows, cache.stats().totals


@pytest.mark.parametrize("builder", ["llama", "deepseek_v2"])
def test_fork_as_continues_exactly_as_a_prefill_of_its_own(builder, tiny):
    model = tiny if builder == "llama" else tiny_deepseek_v2()[0]
    vocab = model.config.vocab_size
    context, question = _ids(160, 1, vocab), _ids(4, 2, vocab)
    with torch.no_grad():
        base = TieredCache(model, "full", context_length=160, record_window=32)
        base_logits = pipeline.prefill(model, base, context, 64)
        for name, make in SHAREABLE.items():
            shared = _continue(model, base.fork_as(make()), base_logits, question)
            own_cache = TieredCache(model, make(), context_length=160)
            own = _continue(model, own_cache, pipeline.prefill(model, own_cache, context, 64), question)
            assert shared[0] == own[0], name
            assert all(torch.equal(a, b) for a, b in zip(shared[1], own[1])), name
            assert shared[2] == own[2], name  # resident rows, bytes read, fetched rows, events: all equal
        assert base.stats().totals["events"] == 0  # the base itself never compressed


def test_fork_as_refuses_what_it_cannot_share(tiny):
    ids = _ids(120, 3, tiny.config.vocab_size)
    with torch.no_grad():
        base = TieredCache(tiny, "full", context_length=120)  # keeps no window queries
        pipeline.prefill(tiny, base, ids, None)
        for name, why in [("h2o", "accumulate"), ("quest", "schedule"), ("vestige", "schedule"),
                          ("streaming_llm", "schedule")]:  # acting during a prefill of unknown chunks
            with pytest.raises(ValueError, match=why):
                base.fork_as(registry.get(name, ratio=4))
        for policy, why in [(registry.get("h2o", ratio=4), r"observes \['accumulate'\]"),
                            (registry.get("vestige", ratio=4, block_size=64), "blocks of 64 rows"),
                            (registry.get("streaming_llm", ratio=4, prefill="stream"), "token by token")]:
            with pytest.raises(ValueError, match=why):  # not even when the prefill was one forward
                base.fork_as(policy, ends_context=True)
        for name in ("quest", "vestige", "streaming_llm"):  # a one-forward prefill: they act once, after it
            assert base.fork_as(registry.get(name, ratio=4), ends_context=True).stats().totals["events"] > 0
        with pytest.raises(ValueError, match="record_window=32"):  # snapkv reads 32 queries the base did not keep
            base.fork_as(registry.get("snapkv", ratio=4))
        compressed = base.fork_as("full")
        compressed.compress()
        with pytest.raises(ValueError, match="compressed already"):
            compressed.fork_as("full")
        recorded = TieredCache(tiny, "full", context_length=120, record_attention=True)
        pipeline.prefill(tiny, recorded, ids, None)
        assert recorded.fork_as(registry.get("h2o", ratio=4), ends_context=True).stats().totals["events"] > 0
        with pytest.raises(ValueError, match="differ in rounding"):  # the reference attention's rows, not SDPA's
            recorded.fork_as("full")
    with pytest.raises(ValueError, match="record_window"):
        TieredCache(tiny, "full", record_window=-1)
    with pytest.raises(ValueError, match="record_attention must be True or False"):
        TieredCache(tiny, "full", record_attention=1)


TIMING = {"prefill_s", "compress_s", "score_s", "continuation_s", "question_s", "decode_s", "decode_ms_per_step",
          "wall_s", "turns_s", "peak_rss_bytes", "prefill_shared"}


def _same_row(a: dict, b: dict) -> None:
    """Every figure but the timings equal: counts, predictions and bytes exactly, NLLs to float rounding (the two
    prefills are separate computations of the same operations)."""
    assert a.keys() == b.keys()
    for k in a.keys() - TIMING:
        if isinstance(a[k], float):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
        else:
            assert a[k] == b[k], k


# every registered policy, on a plain model and on a hybrid one (Gemma 3: sliding layers beside the tiered ones);
# whether it continued the shared prefill (a one-forward prefill of 200 tokens) or made its own
SHARES = {"full": False, "streaming_llm": True, "snapkv": True, "h2o": False, "h2o(ratio=8)": True, "chunkkv": True,
          "quest": True, "vestige": True, "vestige(block_size=64)": False, "vestige(block_size=64,ratio=8)": True,
          "streaming_llm(prefill=stream)": False}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_runner_gives_the_same_row_with_a_shared_prefill(family, tiny):
    from kvzoo.bench.planner import build_policy
    from kvzoo.models import TINY_FAMILIES

    assert set(registry.available()) <= {name.split("(")[0] for name in SHARES}  # a new policy is added here
    model = tiny if family == "llama" else TINY_FAMILIES[family]()[0]
    task = make_task(TaskSpec(context_tokens=200, depth=0.5), ByteTokenizer(), continuation_tokens=16)
    shared = runner.SharedPrefill(record_window=32)
    key = (family, "task", "after")
    for name, shares in SHARES.items():
        policy = build_policy(name, None if name == "full" or "ratio" in name else 4)
        with_shared = runner.run_trial(model, ByteTokenizer(), task, policy, max_new_tokens=4, shared=shared,
                                       shared_key=key)
        alone = runner.run_trial(model, ByteTokenizer(), task, policy, max_new_tokens=4)
        _same_row(with_shared, alone)
        # full made the dense prefill, h2o at 4x the one recording attention, vestige with blocks of 64 the first block
        # of the 200-token context (at 8x it reuses that block and prefills the rest itself); the rest reused one
        assert with_shared["prefill_shared"] == shares, name
        assert not alone["prefill_shared"]
    chunked = runner.run_trial(model, ByteTokenizer(), task, registry.get("quest", ratio=4), max_new_tokens=4,
                               shared=shared, shared_key=("chunked",) + key, chunk_size=64)
    assert not chunked["prefill_shared"]  # a per-step policy acts after each chunk: not a dense prefill's
    shared.clear()
