"""kvpress's own press tests run against kvzoo's presses: a pytest plugin (``make test-kvpress`` loads it).

kvpress's tests are not in this repository: ``make`` fetches kvpress 0.5.5's source distribution from the package
index and unpacks its ``tests/`` into ``.kvpress-suite/`` (git-ignored), then runs pytest *there* with
``-p kvzoo_upstream`` (this file's folder on ``PYTHONPATH``). The plugin

1. points the Hugging Face hub at a fake local one (``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE=.kvpress-suite/hub``): a tiny
   random Llama (2 layers, 2 heads, head_dim 6, vocabulary 32,000, the geometry of ``MaxJeblick/llama2-0b-unit-test``
   as kvpress's tests see it) and a word-level tokenizer that splits kvpress's test sentences as Llama-2's does (the
   tests count tokens: "Context Length: 23"), under both spellings of the name the tests load. No network at test time;
   the tests that need another model (danube's exact answer, GPU-only flash-attention models) are not selected;
2. replaces kvpress's ``default_presses`` by ``to_press`` of every press kvzoo offers kvpress (:data:`KVZOO_PRESSES`)
   at ratios 1.25 and 5 (``compression_ratio`` 0.2 and 0.8), plus kvpress's own twins as controls
   (``StreamingLLMPress``, ``SnapKVPress`` as kvpress lists them);
3. runs each test that hard-codes a press (:data:`SWAPS`) once per kvzoo press, the press swapped in for the
   hard-coded class (a factory taking kvpress's ``compression_ratio``), and once unswapped (the control);
4. counts, per test, kvzoo selector runs (``KvzooPress.rows``, which every kvzoo press calls before it selects or
   scores). A test that passes without one ran no kvzoo code -- it returned early for the press -- and is reported
   as a **failure** here ("passed without running kvzoo's press"), never as a pass;
5. prints, per press, how many of kvpress's tests ran it and passed, and writes the counts to
   ``.kvpress-suite/report.json`` (the README's badge table quotes them).

Known and expected (strict ``xfail``, so a change either way is seen): :data:`EXPECTED_FAILURES`.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

SUITE = pathlib.Path.cwd()
HUB = SUITE / "hub"
# set before huggingface_hub is imported (it reads them once)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(HUB)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

HUB_MODEL = "MaxJeblick/llama2-0b-unit-test"
HUB_NAMES = (HUB_MODEL, HUB_MODEL.lower())  # the fixtures load both spellings
HUB_VERSION = "1"  # bump when the fake model or tokenizer changes: the hub is rebuilt
# the sentences of the tests that run: their words are the tokenizer's vocabulary (anything else is <unk>)
SENTENCES = (
    "This is a test article. It was written on 2022-01-01.",
    "When was this article written?",
    "The quick brown fox jumps over the lazy dog. ",
    "What animal jumps over the dog?",
)

# every press kvzoo's to_press accepts, as `make test-kvpress` runs them: (registry params, to_press options)
KVZOO_PRESSES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "streaming_llm": ({}, {"prefill_only": True}),
    "h2o": ({}, {"prefill_only": True}),
    "snapkv": ({}, {}),
    "chunkkv": ({}, {}),
    "vestige": ({"retriever": None}, {}),
    "quest": ({"retriever": None, "dense_layers": 0}, {"prefill_only": True}),
}
RATIOS = (1.25, 5)  # kvzoo's: keep 1/ratio; kvpress's compression_ratio 0.2 and 0.8, as its default_presses
CONTROLS = ("StreamingLLMPress", "SnapKVPress")  # kvpress's own entries kept in default_presses

# the tests that hard-code a press: module -> {test function: the module globals swapped for a kvzoo press}
SWAPS: dict[str, dict[str, tuple[str, ...]]] = {
    "tests.test_pipeline": dict.fromkeys(
        ("test_pipeline", "test_pipeline_with_cache", "test_pipeline_single_or_no_question",
         "test_pipeline_compresses_context"), ("ExpectedAttentionPress",)),
    "tests.test_generate": {"test_generate": ("KnormPress",)},
    # (test_press_call's test_context_manager_adds_and_removes_hook runs no forward: it checks BasePress.__call__'s
    # hooks, which kvzoo's presses inherit unchanged; it would pass without running kvzoo code, so it is not swapped)
    "tests.test_press_call": {"test_context_manager_applies_compression": ("KnormPress",)},
    "tests.test_per_layer_compression_press": {"test_per_layer_compression_press": ("KnormPress",)},
    "tests.presses.test_presses": {"test_composed_press": ("KnormPress",), "test_chunk_press": ("KnormPress",),
                                   "test_chunkkv_press": ("SnapKVPress",)},
    "tests.test_decoding_compression": {
        **dict.fromkeys(("test_decoding_compression", "test_prefill_decoding_press_calls_both_phases",
                         "test_decoding_press_without_prefill", "test_prefill_decoding_press_decoding_only",
                         "test_decoding_press_equivalence", "test_compression_actually_reduces_memory"), ("KnormPress",)),
        "test_decoding_press_reuse_across_sequences": ("KnormPress", "StreamingLLMPress", "TOVAPress"),
    },
}
# the tests parametrized by kvpress's default_presses
DEFAULT_PRESS_TESTS = {("tests.presses.test_presses", "test_presses_run"),
                       ("tests.test_decoding_compression", "test_all_presses_work_with_decoding_press")}
# (module, test, press) -> why it fails, inherent to the press's rule; strict: an unexpected pass is reported too
EXPECTED_FAILURES: dict[tuple[str, str, str], str] = {
    ("tests.test_generate", "test_generate", "h2o"): (
        "inherent to attention-based scores: the pipeline compresses the context and then reads '\\n', "
        "model.generate compresses context + '\\n' at once; H2O's accumulated attention counts the extra query "
        "(and 14 of 24 rows stay instead of 13 of 23), so other rows stay and the greedy answers differ"),
}

CALLS: collections.Counter[str] = collections.Counter()  # kvzoo selector runs per press during the current test
RESULTS_KEY = pytest.StashKey[dict]()


# --- the fake hub -----------------------------------------------------------------------------------------------


def build_hub(hub: pathlib.Path = HUB) -> None:
    """The tiny random model and tokenizer under :data:`HUB_NAMES` in a hub cache at ``hub`` (once; kept)."""
    marker = hub / f".kvzoo-fake-hub-{HUB_VERSION}"
    if marker.is_file():
        return
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab_size = 32000
    # digits one by one, then GPT-2's byte-level split: "2022-01-01." is 11 pieces, as Llama-2's tokenizer cuts it
    pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    vocab = {token: i for i, token in enumerate(("<unk>", "<s>", "</s>"))}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(char, len(vocab))
    for sentence in SENTENCES:
        for piece, _ in pre.pre_tokenize_str(sentence):
            vocab.setdefault(piece, len(vocab))
    filler = 0
    while len(vocab) < vocab_size:  # every id the model can generate decodes to a word
        vocab.setdefault(f"Ġw{filler}", len(vocab))
        filler += 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    context = "<s>" + SENTENCES[0]
    assert len(tokenizer.encode(context, add_special_tokens=False)) == 23, "the fake tokenizer must cut kvpress's " \
        "test sentence into Llama-2's 23 tokens (test_pipeline asserts 'Context Length: 23')"
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=12, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    revision = "0" * 40
    for name in HUB_NAMES:
        repo = hub / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    marker.write_text("a fake hub for kvpress's tests, built by tests/kvpress/upstream/kvzoo_upstream.py\n")


# --- kvzoo's presses as kvpress's tests construct presses --------------------------------------------------------


def default_press_factory(name: str) -> Callable[..., Any]:
    """``default_presses``' ``cls``: ``cls(ratio=r)`` is ``to_press`` of kvzoo's ``name`` at ratio r."""
    from kvzoo import registry
    from kvzoo.integrations.kvpress import to_press

    params, options = KVZOO_PRESSES[name]

    def make(ratio: float) -> Any:
        return to_press(registry.get(name, ratio=ratio, **params), **options)

    make.__name__ = make.__qualname__ = f"kvzoo_{name}"
    make.kvzoo_name = name  # type: ignore[attr-defined]
    return make


def swapped_press_factory(name: str, replaces: str) -> Callable[..., Any]:
    """A stand-in for kvpress's class ``replaces`` as a test calls it (``KnormPress(compression_ratio=0.4)``,
    ``KnormPress()``): kvzoo's ``name`` at kvpress's ``compression_ratio`` (so kvpress's row count)."""
    from kvzoo import registry
    from kvzoo.integrations.kvpress import ratio_for, to_press

    params, options = KVZOO_PRESSES[name]

    def make(compression_ratio: float = 0.0, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"the kvzoo stand-in for {replaces} takes compression_ratio only, got {sorted(kwargs)}")
        policy = registry.get(name, ratio=ratio_for(compression_ratio), **params)
        return to_press(policy, compression_ratio=compression_ratio, **options)

    make.__name__ = make.__qualname__ = f"kvzoo_{name}"
    return make


# --- pytest hooks -----------------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    if not (SUITE / "tests" / "default_presses.py").is_file():
        raise pytest.UsageError(f"kvzoo_upstream runs inside kvpress's unpacked tests (make test-kvpress puts them in "
                                f".kvpress-suite/); {SUITE} has no tests/default_presses.py")
    build_hub()
    sys.path.insert(0, str(SUITE))
    import tests  # kvpress's, not kvzoo's: the run must start in the suite folder

    if pathlib.Path(tests.__file__).resolve().parent != (SUITE / "tests").resolve():
        raise pytest.UsageError(f"`tests` resolves to {tests.__file__}, not kvpress's {SUITE / 'tests'}")
    from kvzoo.integrations.kvpress_presses import KvzooPress
    from tests import default_presses as listed

    controls = [entry for entry in listed.default_presses if entry["cls"].__name__ in CONTROLS]
    kvzoo = [{"cls": default_press_factory(name), "kwargs": [{"ratio": r} for r in RATIOS]} for name in KVZOO_PRESSES]
    listed.default_presses[:] = controls + kvzoo  # in place: the test modules import this very list

    rows = KvzooPress.rows

    def counted_rows(self, *args: Any, **kwargs: Any):
        CALLS[self.policy.name] += 1
        return rows(self, *args, **kwargs)

    KvzooPress.rows = counted_rows
    config.stash[RESULTS_KEY] = {}


def _swaps(module: str, function: str) -> tuple[str, ...] | None:
    return SWAPS.get(module, {}).get(function)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if _swaps(metafunc.module.__name__, metafunc.function.__name__):
        metafunc.parametrize("kvzoo_swap", ["kvpress", *KVZOO_PRESSES], indirect=True,
                             ids=lambda name: name if name == "kvpress" else f"kvzoo-{name}")


@pytest.fixture(autouse=True)
def kvzoo_swap(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The kvzoo press a hard-coded-press test runs with (its classes swapped in the test's module), or None."""
    name = getattr(request, "param", None)
    if name in KVZOO_PRESSES:
        for replaced in _swaps(request.module.__name__, request.function.__name__):
            monkeypatch.setattr(request.module, replaced, swapped_press_factory(name, replaced))
    return name


def press_of(item: pytest.Item) -> str | None:
    """The press an item runs: a kvzoo name, ``kvpress:<Press>`` for a control, None for another test."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "kvzoo_swap" in params:
        name = params["kvzoo_swap"]
        if name == "kvpress":
            return "kvpress:" + "/".join(_swaps(item.module.__name__, item.function.__name__))
        return name
    for key in ("press_dict", "press_config"):
        if key in params:
            cls = params[key]["cls"]
            return getattr(cls, "kvzoo_name", None) or f"kvpress:{cls.__name__}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Only the tests that run a press we swap or list; kvzoo's expected failures marked (strict xfail)."""
    keep, drop = [], []
    for item in items:
        key = (item.module.__name__, item.function.__name__)
        chosen = _swaps(*key) is not None or key in DEFAULT_PRESS_TESTS
        (keep if chosen else drop).append(item)
        press = press_of(item) if chosen else None
        why = EXPECTED_FAILURES.get((*key, press))
        if why:
            item.add_marker(pytest.mark.xfail(reason=why, strict=True))
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    CALLS.clear()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    press = press_of(item)
    if press is None:
        return report
    results = item.config.stash[RESULTS_KEY]
    runs = CALLS[press] if press in KVZOO_PRESSES else None
    if report.when == "call" and press in KVZOO_PRESSES and report.passed and not runs \
            and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (f"passed without running kvzoo's press {press!r} (no selector run: the test returned "
                           "early for it); a vacuous pass counts as not run")
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped and hasattr(report, "wasxfail"):
            outcome = "xfailed"
        elif report.passed and hasattr(report, "wasxfail"):
            outcome = "xpassed"
        else:
            outcome = report.outcome
        results[item.nodeid] = {"press": press, "test": f"{item.module.__name__}::{item.function.__name__}",
                                "outcome": outcome, "selector_runs": runs}
    return report


def summary(results: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Per press: kvpress tests that ran it, and how they ended (``passed`` only where kvzoo's selector ran)."""
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for row in results.values():
        table[row["press"]]["tests"] += 1
        table[row["press"]][row["outcome"]] += 1
    order = [*KVZOO_PRESSES, *sorted(p for p in table if p not in KVZOO_PRESSES)]
    return {press: dict(table[press]) for press in order if press in table}


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS_KEY, None)
    if not results:
        return
    counts = summary(results)
    write = terminalreporter.write_line
    write("")
    write("kvpress 0.5.5's own tests per press (passed = the test ran kvzoo's selector and passed):", bold=True)
    write(f"  {'press':<44} {'tests':>5} {'passed':>6} {'failed':>6} {'xfailed':>7} {'skipped':>7}")
    for press, row in counts.items():
        write(f"  {press:<44} {row.get('tests', 0):>5} {row.get('passed', 0):>6} {row.get('failed', 0):>6} "
              f"{row.get('xfailed', 0):>7} {row.get('skipped', 0):>7}")
    for (module, test, press), why in EXPECTED_FAILURES.items():
        write(f"  expected failure: {press} in {module}::{test}: {why}", yellow=True)
    (SUITE / "report.json").write_text(json.dumps({"per_press": counts, "tests": results}, indent=1))
    write(f"  (written to {SUITE / 'report.json'})")

