"""Reliability, third round: what crosses a plugin boundary into the framework is checked where it is received,
and a refusal says what was wrong (each test failed on the code before its fix)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.framework import cache as cache_module
from kvzoo.framework.attention import detach
from kvzoo.framework.policy import Policy, RowsView
from kvzoo.models import tiny_deepseek_v2, tiny_kimi_linear, tiny_llama


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()[0]


def _ids(n, seed=0, vocab=256, batch=1):
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


# --- an adapter plugin cannot switch off the wrong-model guard --------------------------------------------------


def test_an_adapter_mapping_no_attention_module_is_refused_naming_it(llama, monkeypatch):
    real = cache_module.adapter_for

    class Blind:
        """A family plugin whose attention_modules() maps nothing (the guard against another model would be off)."""

        name = "blind"

        def __init__(self, inner):
            self.inner = inner
            self.geometry = inner.geometry

        def attach(self):
            self.inner.attach()

        def attention_modules(self):
            return {}

        def untiered_layer(self, i):
            return self.inner.untiered_layer(i)

    monkeypatch.setattr(cache_module, "adapter_for", lambda model, policy: Blind(real(model, policy)))
    with pytest.raises(ValueError, match=r"model-family adapter 'blind' \(.*Blind\): attention_modules\(\) must map every layer"):
        TieredCache(llama, "full")
    detach(llama)


# --- a policy plugin's priority() is held to its contract ---------------------------------------------------------


@dataclasses.dataclass
class Scores(Policy):
    """A plugin policy whose priority() returns what ``make(rows)`` makes."""

    make: object = None
    name: ClassVar[str] = "scores"

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        return self.make(rows)


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda rows: None, TypeError, "got NoneType"),
    (lambda rows: [1.0] * rows.num_rows, TypeError, "got list"),
    (lambda rows: torch.zeros(rows.slots.shape, dtype=torch.long), TypeError, "got a torch.int64 tensor"),
    (lambda rows: torch.zeros(*rows.slots.shape[:2], rows.num_rows - 1), ValueError, "got shape"),
    (lambda rows: torch.zeros(*rows.slots.shape[:2], rows.num_rows + 3), ValueError, "got shape"),
], ids=["None", "list", "int", "N-1", "N+3"])
def test_a_priority_off_its_contract_is_refused_naming_the_policy(llama, make, error, message):
    cache = TieredCache(llama, Scores(budget=8, make=make))
    with torch.no_grad(), pytest.raises(error, match=rf"policy 'scores' .*priority\(\) must return a float tensor.*{message}"):
        llama(input_ids=_ids(20), cache=cache, use_cache=True)
        cache.compress()
    detach(llama)


def test_nan_scores_are_refused_at_the_event(llama):
    cache = TieredCache(llama, Scores(budget=8, make=lambda rows: torch.full(rows.slots.shape, math.nan)))
    with torch.no_grad(), pytest.raises(RuntimeError, match="priority\\(\\) returned NaN scores"):
        llama(input_ids=_ids(20), cache=cache, use_cache=True)
        cache.compress()
    detach(llama)


def test_padding_scored_above_the_valid_rows_is_never_kept_over_them(llama):
    """+inf on padding (a rule breaking the contract): the padded sequence still keeps its valid rows first."""
    def pad_high(rows):
        return torch.where(rows.valid, rows.slots.float(), math.inf)

    ids = _ids(20, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :16] = 0  # 4 real tokens, 16 padding
    cache = TieredCache(llama, Scores(budget=6, make=pad_high))
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        cache.compress()
    for layer in cache.tiered_layers:
        assert int(layer.valid[1].sum(-1).min()) == 4  # all 4 real rows kept, 2 padding rows fill the budget
        assert bool(layer.valid[0].all())
    detach(llama)


# --- refusals that say what was wrong -----------------------------------------------------------------------------


def test_a_model_cast_between_prefill_and_decode_is_refused_naming_both_dtypes():
    model = tiny_llama()[0]  # its own copy: it is cast below
    cache = TieredCache(model, "full")
    with torch.no_grad():
        model(input_ids=_ids(10), cache=cache, use_cache=True)
        model.to(torch.bfloat16)
        with pytest.raises(RuntimeError, match=r"holds torch.float32 rows and received torch.bfloat16 rows"):
            model(input_ids=_ids(1), cache=cache, use_cache=True)
    detach(model)


def test_another_family_on_a_kimi_cache_is_refused_clearly():
    kimi, deepseek = tiny_kimi_linear()[0], tiny_deepseek_v2()[0]
    cache = TieredCache(kimi, "full")
    with torch.no_grad(), pytest.raises(RuntimeError, match="TieredCache belongs to the model it was created for"):
        deepseek(input_ids=_ids(8, vocab=deepseek.config.vocab_size), cache=cache, use_cache=True)
    detach(kimi), detach(deepseek)


def test_fork_as_keeps_the_queries_the_base_recorded(llama):
    cache = TieredCache(llama, "full", record_window=8)
    with torch.no_grad():
        llama(input_ids=_ids(40), cache=cache, use_cache=True)
    twice = cache.fork_as("full").fork_as(registry.get("snapkv", budget=16, window=8))
    assert twice.runtime.observation_window == 8
    detach(llama)


# --- options that would do nothing are refused, naming the option and when it applies ------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"index": "int8", "entry_dtype": "float16"}, "entry_dtype='float16' has no effect with index='int8'"),
    ({"index": "int8", "rank": 8}, "rank=8 has no effect with index='int8'"),
    ({"index": "int8", "page_rows": 8}, "page_rows=8 has no effect with index='int8'"),
    ({"index": "sketch", "fine_pages": 2}, "fine_pages=2 has no effect with index='sketch'"),
    ({"index": "paged", "refit": True}, "refit=True has no effect with index='paged'"),
    ({"tau": 4.0}, "tau=4.0 has no effect"),
])
def test_an_option_the_index_does_not_read_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        registry.build_retriever("vestige", **options)


def test_an_option_the_layouts_index_does_not_read_is_refused_at_the_cache():
    deepseek = tiny_deepseek_v2()[0]
    retriever = registry.build_retriever("vestige", page_rows=8)  # index='auto': the sketch on MLA rows
    with pytest.raises(ValueError, match=r"page_rows=8 has no effect with index='sketch' \(index='auto' on MLA rows\)"):
        TieredCache(deepseek, registry.get("vestige", ratio=4, retriever=retriever))
    detach(deepseek)
