"""VestigeKV closes blocks of ``block_size`` rows however the context is fed (issue 36).

A forward that adds more rows than a block (a one-shot prefill, ``model(...)`` on a whole prompt, a chunk larger than
the block) closes each full block in turn, each ranked on its own with its own budget, and leaves the rest open: the
rows kept are those of the same prefill chunked at ``block_size``.
"""

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.framework.policy import RowsView
from kvzoo.models import TINY_FAMILIES, tiny_llama

BUILDERS = TINY_FAMILIES
CONTEXT, BLOCK, RATIO = 600, 256, 8  # two full blocks of 256 (32 rows kept each) and 88 rows left open


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request):
    return BUILDERS[request.param]()[0]


def _ids(model, batch=1):
    return torch.randint(3, model.config.vocab_size, (batch, CONTEXT), generator=torch.Generator().manual_seed(1))


def _prefill(model, ids, chunk, *, ends_context=False, **params):
    policy = registry.get("vestige", **{"ratio": RATIO, "block_size": BLOCK, "retriever": None, **params})
    cache = TieredCache(model, policy)
    pipeline.prefill(model, cache, ids, chunk_size=chunk, ends_context=ends_context)
    return cache


def _kept_slots(cache):
    return [layer.slots.tolist() for layer in cache.tiered_layers]


def _blockwise(policy, keys, layout, branch_dim):
    """The slots a prefill chunked at ``block_size`` keeps of one sequence's group, ``keys [n, D]`` (the rows as they
    were written): each full block closes with the rows kept so far, ranked on its own by ``policy.select``."""
    n, T = keys.shape[0], policy.block_size
    kept = torch.empty(0, dtype=torch.long)
    for start in range(0, n - n % T, T):
        tier = torch.cat([kept, torch.arange(start, start + T)])
        rows = RowsView(keys=keys[tier][None, None], values=None, slots=tier[None, None],
                        valid=torch.ones(1, 1, len(tier), dtype=torch.bool), layer_idx=0, num_layers=1, layout=layout,
                        branch_dim=branch_dim, first_new=len(kept), all_valid=True)
        target = policy.target_rows("block", budget=None, resident=len(tier), block_rows=T)
        kept = tier[policy.select(rows, target)[0, 0]]
    return torch.cat([kept, torch.arange(n - n % T, n)]).tolist()


@pytest.mark.parametrize("retriever", [None, "vestige"])
def test_a_one_shot_prefill_closes_blocks_of_block_size(model, retriever):
    """600 rows in one forward at block_size=256: two blocks of 256 close (32 rows each, 256 / ratio) and 88 stay
    open -- not one block of 600 -- on every layer, the rows those of the blocks ranked one at a time."""
    ids = _ids(model)
    whole = _prefill(model, ids, CONTEXT, block_size=4096)  # nothing closes: every row as the forward wrote it
    cache = _prefill(model, ids, CONTEXT, retriever=retriever)
    policy = cache.policy
    for layer, full in zip(cache.tiered_layers, whole.tiered_layers):
        B, G = layer.store.batch_groups
        assert layer.counts.events == 2 and layer.store.n == 2 * BLOCK // RATIO + CONTEXT - 2 * BLOCK
        assert layer.counts.policy_info["selector_rows_read"] == B * G * 2 * BLOCK  # blocks of 256 read, not one of 600
        keys = full.keys
        want = [[_blockwise(policy, keys[b, g], cache.runtime.geometry.layout, cache.runtime.geometry.branch_dim)
                 for g in range(G)] for b in range(B)]
        assert layer.slots.tolist() == want
        assert layer.store.archive.n == (2 * BLOCK - 2 * BLOCK // RATIO if retriever else 0)


def test_the_kept_rows_do_not_depend_on_the_chunking(model):
    """Blocks close by the row count, not by the forward: chunks of 128 keep the rows chunks of 256 keep, on every
    layer. A one-shot prefill keeps them too on the first compressed layer, whose keys do not depend on what earlier
    layers kept (on later layers a chunked prefill's later chunks attend to the compressed rows, so their keys, and
    what they keep, differ: the one-shot's are checked against the blockwise selection above)."""
    ids = _ids(model)
    by_256, by_128, one_shot = (_kept_slots(_prefill(model, ids, chunk)) for chunk in (BLOCK, BLOCK // 2, CONTEXT))
    assert by_128 == by_256
    assert one_shot[0] == by_256[0]
    assert [len(s[0][0]) for s in one_shot] == [len(s[0][0]) for s in by_256]


def test_the_context_end_closes_the_open_rest(model):
    """At the context's end the 88 open rows close as the last block (88 / 8 = 11 kept): 32 + 32 + 11 rows, the
    same whether the prefill ended the context in one forward or in chunks of 256 (first compressed layer), and the
    same as compress() after the forward."""
    ids = _ids(model)
    ended = _prefill(model, ids, CONTEXT, ends_context=True)
    by_256 = _prefill(model, ids, BLOCK, ends_context=True)
    later = _prefill(model, ids, CONTEXT)
    later.compress()
    for layer in ended.tiered_layers:
        assert layer.counts.events == 3 and layer.store.n == 2 * BLOCK // RATIO + (CONTEXT - 2 * BLOCK) // RATIO
    assert _kept_slots(ended)[0] == _kept_slots(by_256)[0]
    assert _kept_slots(later) == _kept_slots(ended)


def test_padded_batch_closes_the_same_blocks():
    """Left padding: blocks count rows (padding included, as a chunked prefill counts them); each sequence keeps what
    it keeps alone at the same offset."""
    model = tiny_llama()[0]
    ids = _ids(model, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0  # the second sequence is 40 rows shorter, padded on the left
    caches = []
    for chunk in (CONTEXT, BLOCK):
        policy = registry.get("vestige", ratio=RATIO, block_size=BLOCK, retriever=None)
        cache = TieredCache(model, policy)
        with torch.no_grad():
            for start in range(0, CONTEXT, chunk):
                model(input_ids=ids[:, start:start + chunk], attention_mask=mask[:, :start + chunk],
                      use_cache=True, **pipeline.cache_kwargs(model, cache))
        caches.append(cache)
    one_shot, by_256 = caches
    layer = one_shot.tiered_layers[0]
    assert layer.counts.events == 2 and layer.store.n == 2 * BLOCK // RATIO + CONTEXT - 2 * BLOCK
    assert _kept_slots(one_shot)[0] == _kept_slots(by_256)[0]
