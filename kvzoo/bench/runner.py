"""The leaderboard runner: (model × policy × ratio × task × question before/after) → one JSONL row per trial.

:func:`run_grid` runs a :class:`Grid` and appends each finished trial to a results file as one JSON
line (the policy's full config, the package versions, every metric). Rerun with the same file and
it resumes: trials whose row says ``"status": "ok"`` are not run again; skipped or failed ones are
retried. A progress bar (tqdm, on stderr) shows trials done and the ETA.

Where the trials run is the executor's business (:mod:`kvzoo.bench.executors`): in this process
(the default) or on a Ray cluster (``executor=make_executor("ray", workers=4)``,
:mod:`kvzoo.bench.ray_executor`). Either way this module plans, skips finished trials, and is the
only writer of the results file; the pending trials go out grouped by (model, task, question
position), each group's ``full`` reference first, since the others' ΔNLL and ΔCE need its row.

Policies come from :func:`kvzoo.registry.available` at run time, so a newly registered policy (a
built-in or a plugin's) joins the grid with no code change. A policy whose class does not need a
budget (``full``) runs once per task, without a ratio: it is the reference row, and its answer NLL
and continuation cross-entropy are what ΔNLL and ΔCE are measured against. A policy that
``registry.get(name, ratio=r)`` refuses is recorded as skipped with the error; one that fails while
running is recorded as an error; the grid carries on.

One trial (:func:`run_trial`) is built from ``kvzoo.pipeline``'s steps: it prefills the context into a
:class:`~kvzoo.TieredCache` and compresses it once, then forks the compressed cache
(``TieredCache.fork``) for three continuations -- what ``pipeline.score`` / ``pipeline.generate`` do
from the same point, without paying for the prefill three times:

* the reference answer, teacher-forced after the question and RULER's answer prefix: its NLL (ΔNLL, the
  needle-intact test), one decode step per answer token after the question's forward -- the forwards greedy
  decoding runs, so a retriever's per-step rule is what the NLL sees (``pipeline.teacher_forced_nll``,
  ``mode="decode"``); and again in one forward (``answer_nll_one_forward``: under a retriever's default
  ``multi_token="dense"`` rule that forward reads the whole archive, so it equals ``full``'s by construction);
* the held-out continuation of the haystack, teacher-forced (question after compression only) the same two
  ways: ΔCE (decode steps, the VestigeKV paper's measure) and ``delta_ce_one_forward``;
* the question and the answer prefix, then greedy decoding, stopped at EOS, at ``max_new_tokens``,
  or once every reference answer has appeared (the score cannot change after that): the string-match
  score, and the per-step KV-path bytes and fetched rows.

Trials of one (model, task, question position) also share one prefill across policies where it is the same
prefill (:class:`SharedPrefill`): every policy that prefills densely and acts only at the context's end
(``full``, ``snapkv``, ``chunkkv``, at every ratio) continues from one dense prefill
through ``TieredCache.fork_as`` -- the rows, counters and observation-window queries are that prefill's, bit
for bit, so the row is the one a prefill of its own gives (``prefill_shared`` says it was reused;
``prefill_s`` is the shared prefill's time). StreamingLLM, H2O and Quest (per-step schedules: they evict
after each prefill chunk, and H2O accumulates attention there) and VestigeKV (per block) prefill on their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import itertools
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None

from kvzoo import pipeline
from kvzoo.bench import metrics
from kvzoo.bench.executors import EXECUTORS, Executor, LocalExecutor, TrialGroup, Work
from kvzoo.bench.report import REFERENCE_POLICY
from kvzoo.bench.tasks import ByteTokenizer, Task, TaskSpec, make_task
from kvzoo.framework.cache import TieredCache, dense_prefill_problem
from kvzoo.framework.names import policy_retriever
from kvzoo.framework.policy import Policy
from kvzoo.framework.store import LayerStats
from kvzoo.pipeline import QUESTION_POSITIONS, build_prompt

RESULTS_DIR = Path("results")


# --- the grid ------------------------------------------------------------------------------------


@dataclass
class Grid:
    """What to run. ``policies=None`` means every registered policy at run time.

    ``max_new_tokens=None`` uses each task's own (:data:`kvzoo.bench.tasks.MAX_NEW_TOKENS`).
    ``audit=True`` asks the retrieval tier to count bound violations (slow; see ``TieredCache``).
    """

    models: Sequence[str] = ("smollm2-135m",)
    policies: Sequence[str] | None = None
    ratios: Sequence[float] = (4.0, 8.0)
    tasks: Sequence[TaskSpec] = (TaskSpec(),)
    positions: Sequence[str] = ("after",)
    max_new_tokens: int | None = None
    chunk_size: int | None = None
    continuation_tokens: int = 64
    audit: bool = False
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for position in self.positions:
            if position not in QUESTION_POSITIONS:
                raise ValueError(f"question position {position!r} is not one of {QUESTION_POSITIONS}")
        for ratio in self.ratios:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < float("inf"):
                raise ValueError(f"ratios must be numbers >= 1 (keep 1/ratio of the rows), got {ratio!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.models or not self.tasks or not self.positions:
            raise ValueError("a grid needs at least one model, one task and one question position")
        if self.policies is not None and (isinstance(self.policies, str) or not self.policies):
            raise ValueError(f"policies must be None (every registered policy) or a non-empty list of policy names, "
                             f"got {self.policies!r}")
        for name, value in (("max_new_tokens", self.max_new_tokens), ("chunk_size", self.chunk_size)):
            if value is not None and not _is_int(value, 1):
                raise ValueError(f"{name} must be None (the default) or an int >= 1, got {value!r}")
        if not _is_int(self.continuation_tokens, 0):
            raise ValueError("continuation_tokens must be an int >= 0 (0: no held-out continuation, no ΔCE), "
                             f"got {self.continuation_tokens!r}")
        self.ratios = tuple(float(r) for r in self.ratios)

    def settings(self) -> dict[str, Any]:
        """The run settings that change results (recorded in every row, part of each trial's key).

        ``teacher_forcing`` says how ``answer_nll`` and ``continuation_ce`` were measured (:data:`TEACHER_FORCING`):
        rows written before it existed measured them in one forward, so their keys differ and they are not taken
        for finished trials of this measure."""
        return {"max_new_tokens": self.max_new_tokens, "chunk_size": self.chunk_size,
                "continuation_tokens": self.continuation_tokens, "audit": self.audit, "dtype": self.dtype,
                "teacher_forcing": TEACHER_FORCING}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The answer's NLL and the continuation's CE are teacher-forced one decode step per token (what greedy decoding
# runs: a retriever's per-step rule is what they see); the one-forward figures are kept beside them (*_one_forward)
TEACHER_FORCING = "decode"


def _is_int(value: Any, low: int) -> bool:
    """``value`` is an int (not a bool) >= ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def needle_grid(
    *,
    models: Sequence[str] = ("smollm2-135m",),
    tasks: Sequence[str] = ("niah_single",),
    haystacks: Sequence[str | None] = (None,),
    context_tokens: Sequence[int] = (2000,),
    depths: Sequence[float] = (0.5,),
    seeds: Sequence[int] = (0,),
    **grid: Any,
) -> Grid:
    """A :class:`Grid` over the product of task names, haystacks, lengths, depths and seeds (cwe: one depth)."""
    specs: list[TaskSpec] = []
    for task, haystack, n, depth, seed in itertools.product(tasks, haystacks, context_tokens, depths, seeds):
        spec = TaskSpec(task=task, context_tokens=n, depth=depth, seed=seed, haystack=haystack)
        if spec not in specs:
            specs.append(spec)
    return Grid(models=tuple(models), tasks=tuple(specs), **grid)


PRESETS: dict[str, Callable[[], Grid]] = {
    # `make demo`: every registered policy, one needle in 2k tokens of essay text at 3 depths, 4x and 8x; a 32-token
    # held-out continuation (each token one decode step for ΔCE: the demo's budget)
    "demo": lambda: needle_grid(depths=(0.25, 0.5, 0.75), ratios=(4, 8), positions=("after",),
                                continuation_tokens=32),
    # `make leaderboard`: every RULER task at 2k tokens, the single needle also at 1k and on every haystack,
    # ratios 2-8, question after and before compression (~500 trials, about an hour on 2 CPU cores)
    "leaderboard": lambda: Grid(
        tasks=(
            *(TaskSpec("niah_single", n, d, 0, "essay") for n in (1000, 2000) for d in (0.1, 0.5, 0.9)),
            TaskSpec("niah_single", 2000, 0.5, 0, "noise"),
            TaskSpec("niah_single", 2000, 0.5, 0, "book"),
            TaskSpec("niah_multikey", 2000, 0.5, 0),
            TaskSpec("niah_multivalue", 2000, 0.5, 0),
            TaskSpec("niah_multiquery", 2000, 0.5, 0),
            TaskSpec("vt", 2000, 0.5, 0),
            TaskSpec("cwe", 2000, None, 0),
        ),
        ratios=(2, 4, 8),
        positions=("after", "before"),
        continuation_tokens=32,
    ),
    # the test suite's: a tiny random Llama, two short needle contexts
    "tiny": lambda: needle_grid(
        models=("tiny-llama",), context_tokens=(256,), depths=(0.5,), ratios=(2,), positions=("after", "before"),
    ),
}


@dataclass(frozen=True)
class Trial:
    model: str
    task: TaskSpec
    policy: str
    ratio: float | None
    position: str
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> str:
        ratio = "-" if self.ratio is None else f"{self.ratio:g}"
        settings = ",".join(f"{k}={v}" for k, v in self.settings)
        return f"{self.model}|{self.task.key}|{self.policy}|{ratio}|{self.position}|{settings}"

    @property
    def label(self) -> str:
        ratio = "" if self.ratio is None else f" {self.ratio:g}x"
        return f"{self.policy}{ratio} {self.task.task} d={self.task.depth} q-{self.position}"

    def reference(self) -> Trial:
        """The full-cache trial this one is compared with."""
        return dataclasses.replace(self, policy=REFERENCE_POLICY, ratio=None)




# Configured variants that the leaderboard runs beside every registered policy (grid.policies=None): Quest's
# other reference rule (its kernels' page count; the default `quest` is its evaluation code's), and kvzoo's
# per-KV-group Quest, so that the equal-bytes comparison with the reference's per-head rule shows.
DEFAULT_VARIANTS: tuple[str, ...] = ("quest(rule=kernel)", "quest(gqa=group)")


def needs_ratio(name: str) -> bool:
    """Whether policy ``name`` (a name or a spec such as ``quest(gqa=group)``) takes a budget."""
    from kvzoo import registry

    return bool(getattr(registry.policy_class(registry.parse_spec(name)[0]), "requires_budget", True))


def plan(grid: Grid) -> list[Trial]:
    """Every trial of ``grid``, reference first for each (model, task, position)."""
    from kvzoo import registry

    available = list(registry.available())
    if grid.policies is not None:
        names = list(grid.policies)
    else:
        names = available + [v for v in DEFAULT_VARIANTS if registry.parse_spec(v)[0] in available]
    unknown, unavailable = [], []
    for n in names:
        name = registry.parse_spec(n)[0]
        if name in available:
            continue
        if ":" not in name:
            unknown.append(n)
            continue
        try:  # a namespaced name (kvpress:KnormPress) resolves on demand
            registry.policy_class(name)
        except KeyError as err:  # the message names the namespace's problem (kvpress missing: how to install it)
            unavailable.append(str(err))
    if unknown or unavailable:
        message = f"unknown policies {', '.join(map(repr, unknown))}; registered policies: {', '.join(available)}"
        raise ValueError("; ".join(([message] if unknown else []) + unavailable))
    for model in grid.models:
        check_model_name(model)
    settings = tuple(grid.settings().items())
    trials: list[Trial] = []
    for model, spec, position in itertools.product(grid.models, grid.tasks, grid.positions):
        trials.append(Trial(model, spec, REFERENCE_POLICY, None, position, settings))
        for name in names:
            if name == REFERENCE_POLICY:
                continue
            if not needs_ratio(name):
                trials.append(Trial(model, spec, name, None, position, settings))
                continue
            trials.extend(Trial(model, spec, name, ratio, position, settings) for ratio in grid.ratios)
    return trials


# --- models --------------------------------------------------------------------------------------


def check_model_name(name: str) -> None:
    """Raise a ValueError naming the valid models unless ``name`` is one, a local directory, or a hub id."""
    from kvzoo.models import MODEL_NAMES, looks_like_hub_id, model_dir_problem

    if isinstance(name, str) and Path(name).expanduser().is_dir() and name not in MODEL_NAMES:
        problem = model_dir_problem(name)
        if problem is not None:
            raise ValueError(f"model {name!r}: {problem}; valid models are {', '.join(MODEL_NAMES)}, a local "
                             "directory holding a transformers model, or a hub id")
        return
    if isinstance(name, str) and (name in MODEL_NAMES or looks_like_hub_id(name)):
        return
    raise ValueError(
        f"unknown model {name!r}: valid names are {', '.join(MODEL_NAMES)}, a local directory holding a "
        "transformers model, or a hub id such as 'HuggingFaceTB/SmolLM2-360M-Instruct' (needs a network)"
    )


def load(name: str, dtype: str = "float32") -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` for the leaderboard (:func:`kvzoo.models.load_model`); a
    :class:`ByteTokenizer` stands in for models without a tokenizer."""
    from kvzoo.models import load_model

    check_model_name(name)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model, tokenizer = load_model(name, DTYPES[dtype])
    loaded = next(model.parameters()).dtype
    if loaded != DTYPES[dtype]:  # the row records the grid's dtype: it must be the one that ran
        raise ValueError(f"model {name!r} loaded as {str(loaded).removeprefix('torch.')}, not the {dtype} asked for")
    if tokenizer is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", 0)
        if vocab < 256:
            raise ValueError(f"model {name!r} has no tokenizer and a vocabulary of {vocab} < 256 byte ids")
        tokenizer = ByteTokenizer()
    return model, tokenizer


# --- one trial -----------------------------------------------------------------------------------


@dataclass
class PromptIds:
    """Token ids ``[1, n]`` of one task's prompt, split where compression happens."""

    prefix: torch.Tensor  # chat template + context (compressed)
    question: torch.Tensor  # question + answer prefix (after compression, or before in the other column)
    answer: torch.Tensor  # the reference answer, teacher-forced for the NLL
    continuation: torch.Tensor  # held-out haystack text after the context, teacher-forced for the CE


def encode_prompt(tokenizer: Any, task: Task) -> PromptIds:
    """Split ``task`` into token ids with ``pipeline.build_prompt`` (chat template when the tokenizer has one)."""
    prefix, rest = build_prompt(tokenizer, task.context, task.question)

    def ids(text: str) -> torch.Tensor:
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.long()

    return PromptIds(
        prefix=prefix.long(),
        question=torch.cat([rest.long(), ids(task.answer_prefix)], dim=1),
        answer=ids(task.answer_text),
        continuation=ids(task.continuation),
    )


@dataclass
class Reference:
    """The full cache's figures for one (task, position): what ΔNLL and ΔCE subtract (each measured the same way
    as the figure it is subtracted from: decode steps, and one forward)."""

    answer_nll: float
    continuation_ce: float | None
    answer_nll_one_forward: float | None = None
    continuation_ce_one_forward: float | None = None

    @classmethod
    def of(cls, row: dict[str, Any]) -> Reference:
        """The reference figures of a ``full`` row."""
        return cls(row["answer_nll"], row.get("continuation_ce"), row.get("answer_nll_one_forward"),
                   row.get("continuation_ce_one_forward"))


class SharedPrefill:
    """The latest dense prefill of one (model, task, question position), kept to serve every policy that can
    continue it (``TieredCache.fork_as``). ``record_window``: the most observation-window queries any of
    those policies reads (the prefill keeps that many)."""

    def __init__(self, record_window: int = 0) -> None:
        self.record_window = record_window
        self.key: tuple | None = None
        self.base: TieredCache | None = None
        self.first_logits: torch.Tensor | None = None
        self.seconds = 0.0

    def clear(self) -> None:
        if self.base is not None:
            self.base.close()
        self.key = self.base = self.first_logits = None

    @torch.no_grad()
    def fork(self, key: tuple, model: torch.nn.Module, prefix: torch.Tensor, chunk_size: int | None, audit: bool,
             policy: Policy) -> tuple[TieredCache, torch.Tensor, float, bool] | None:
        """``(cache, first_logits, prefill seconds, reused)`` continuing the dense prefill of ``prefix`` as
        ``policy`` (made now if ``key`` differs from the kept one), or None when ``policy`` cannot share it."""
        if dense_prefill_problem(policy) is not None:
            return None
        reused = key == self.key
        if not reused:
            self.clear()
            base = TieredCache(model, "full", context_length=prefix.shape[1], audit=audit,
                               record_window=self.record_window)
            started = time.perf_counter()
            self.first_logits = pipeline.prefill(model, base, prefix, chunk_size)
            self.seconds = time.perf_counter() - started
            self.key, self.base = key, base
        if self.base.prefill_shared_with(policy) is not None:
            return None
        return self.base.fork_as(policy), self.first_logits, self.seconds, reused


@torch.no_grad()
def run_trial(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    policy: Policy,
    *,
    position: str = "after",
    reference: Reference | None = None,
    max_new_tokens: int | None = None,
    chunk_size: int | None = None,
    audit: bool = False,
    stop_when_answered: bool = True,
    shared: SharedPrefill | None = None,
    shared_key: tuple | None = None,
) -> dict[str, Any]:
    """Run one trial; the metrics as a flat dict (see the module docstring and ``benchmarks/README.md``).

    With ``reference=None`` the ΔNLL/ΔCE fields are None (the runner fills them for the reference row).
    ``shared`` (with ``shared_key``, naming the model, task and position): a :class:`SharedPrefill` the
    trial continues from when its policy can.
    """
    if position not in QUESTION_POSITIONS:
        raise ValueError(f"question position must be one of {QUESTION_POSITIONS}, got {position!r}")
    with metrics.Stopwatch() as wall:
        ids = encode_prompt(tokenizer, task)
        prefix, rest = ids.prefix, ids.question
        if position == "before":
            prefix, rest = torch.cat([prefix, rest], dim=1), rest[:, :0]
        new_tokens_max = pipeline.check_max_new_tokens(max_new_tokens or task.max_new_tokens)
        prompt = prefix.shape[1] + rest.shape[1]
        continuation = ids.continuation.shape[1] if position == "after" else 0
        pipeline.check_positions(
            model, max(prompt + max(new_tokens_max - 1, ids.answer.shape[1]), prefix.shape[1] + continuation),
            f"the trial's prompt ({prompt} tokens), its answer ({ids.answer.shape[1]}), held-out continuation "
            f"({continuation}) and max_new_tokens={new_tokens_max}")
        forked = None if shared is None else shared.fork(shared_key, model, prefix, chunk_size, audit, policy)
        if forked is not None:
            cache, first_logits, prefill_seconds, prefill_shared = forked
        else:
            cache = TieredCache(model, policy, context_length=prefix.shape[1], audit=audit)
            with metrics.Stopwatch() as t_prefill:
                first_logits = pipeline.prefill(model, cache, prefix, chunk_size)
            prefill_seconds, prefill_shared = t_prefill.seconds, False
        with metrics.Stopwatch() as t_compress:
            pipeline.compress(cache)
        compressed = cache.stats().totals

        with metrics.Stopwatch() as t_score:  # the reference answer, teacher-forced, on forks: decode steps, one forward
            with cache.fork() as fork:
                answer_nll = pipeline.teacher_forced_nll(model, fork, rest, ids.answer, first_logits, TEACHER_FORCING)
                answer_kv_bytes = fork.stats().totals["kv_bytes_read"] - compressed["kv_bytes_read"]
            with cache.fork() as fork:
                answer_nll_one_forward = pipeline.teacher_forced_nll(model, fork, rest, ids.answer, first_logits,
                                                                     "one_forward")
        continuation_nll = continuation_nll_one_forward = None
        with metrics.Stopwatch() as t_continuation:
            if position == "after" and ids.continuation.shape[1]:  # the held-out continuation, on forks
                with cache.fork() as fork:
                    continuation_nll = pipeline.teacher_forced_nll(model, fork, rest[:, :0], ids.continuation,
                                                                   first_logits, TEACHER_FORCING)
                with cache.fork() as fork:
                    continuation_nll_one_forward = pipeline.teacher_forced_nll(
                        model, fork, rest[:, :0], ids.continuation, first_logits, "one_forward")

        with metrics.Stopwatch() as t_question:
            logits = pipeline.prefill(model, cache, rest, chunk_size) if rest.shape[1] else first_logits
        eos = pipeline.eos_ids(model, tokenizer)

        def answered(tokens: list[int]) -> bool:  # the score cannot change once every answer appeared
            text = tokenizer.decode([t for t in tokens if t not in eos])
            return stop_when_answered and metrics.string_match(task.metric, text, task.answers) == 1.0

        start = cache.stats().totals
        with metrics.Stopwatch() as t_decode:  # the loop reads no statistics: its time is the forwards'
            new_tokens = pipeline.greedy_decode(model, cache, logits, new_tokens_max, eos, stop=answered)
        steps = len(new_tokens) - 1  # the last token's forward is not run
        final = cache.stats().totals
        prediction = tokenizer.decode([t for t in new_tokens if t not in eos], skip_special_tokens=True)
        cache.close()

    row: dict[str, Any] = {
        "prediction": prediction,
        "answers": list(task.answers),
        "score": metrics.string_match(task.metric, prediction, task.answers),
        "teacher_forcing": TEACHER_FORCING,
        "answer_nll": sum(answer_nll),
        "answer_nll_one_forward": sum(answer_nll_one_forward),
        "answer_tokens": len(answer_nll),
        "continuation_ce": None if continuation_nll is None else metrics.mean_token_nll(continuation_nll),
        "continuation_ce_one_forward": (None if continuation_nll_one_forward is None
                                        else metrics.mean_token_nll(continuation_nll_one_forward)),
        "continuation_tokens": 0 if continuation_nll is None else len(continuation_nll),
        "prompt_tokens": int(prefix.shape[1]),
        "question_tokens": int(rest.shape[1]),
        "context_tokens_actual": task.context_token_count,
        "needle_depth_actual": task.needle_depth,
        "resident_rows": int(compressed["resident_rows"]),
        "seen_rows": int(compressed["seen_rows"]),
        "resident_bytes": metrics.resident_kv_bytes(compressed),
        "bytes_freed": metrics.kv_bytes_freed(compressed),
        "archived_bytes": int(compressed["archived_bytes"]),
        "dropped_rows": int(compressed["dropped_rows"]),
        "peak_resident_rows": int(final["peak_resident_rows"]),
        "decode_steps": steps,
        "kv_bytes_per_step": metrics.kv_bytes_read_per_step(start, final, steps),
        # every forward after compression reads the KV path: the question's, the decode steps', and the
        # teacher-forced answer's (on its fork)
        "question_kv_bytes": int(start["kv_bytes_read"] - compressed["kv_bytes_read"]),
        "answer_kv_bytes": int(answer_kv_bytes),
        "kv_bytes_per_token": (final["kv_bytes_read"] - compressed["kv_bytes_read"]) / max(1, len(new_tokens)),
        "fetched_rows_per_step": metrics.rows_fetched_per_step(start, final, steps),
        "bound_violations": metrics.bound_violations(final),
        "peak_rss_bytes": metrics.peak_rss_bytes(),
        "prefill_s": prefill_seconds,
        "prefill_shared": prefill_shared,
        "compress_s": t_compress.seconds,
        "score_s": t_score.seconds,
        "continuation_s": t_continuation.seconds,
        "question_s": t_question.seconds,
        "decode_s": t_decode.seconds,
        "decode_ms_per_step": 1e3 * t_decode.seconds / steps if steps else None,
        "wall_s": wall.seconds,
        "policy_info": {k: v for k, v in final.items() if k not in _STAT_FIELDS},
    }
    add_reference(row, reference)
    return row


# the cache's own counters, carried by name above (LayerStats, so a renamed counter cannot leak into policy_info);
# kv_bytes_read has always been carried in policy_info too, and stays there so that results files compare
_STAT_FIELDS = set(LayerStats.counters()) - {"kv_bytes_read"}


def add_reference(row: dict[str, Any], reference: Reference | None) -> None:
    """Fill ΔNLL, intact and ΔCE of ``row`` against the full cache's figures (None without a reference): from the
    decode-step figures (``delta_nll``, ``intact``, ``delta_ce``) and from the one-forward ones (``*_one_forward``)."""
    for suffix in ("", "_one_forward"):
        row[f"full_answer_nll{suffix}"] = row[f"delta_nll{suffix}"] = row[f"intact{suffix}"] = None
        row[f"full_continuation_ce{suffix}"] = row[f"delta_ce{suffix}"] = None
    if reference is None:
        return
    pairs = (("", reference.answer_nll, reference.continuation_ce),
             ("_one_forward", reference.answer_nll_one_forward, reference.continuation_ce_one_forward))
    for suffix, answer_nll, continuation_ce in pairs:
        mine = row.get(f"answer_nll{suffix}")
        if mine is not None and answer_nll is not None:
            row[f"full_answer_nll{suffix}"] = answer_nll
            row[f"delta_nll{suffix}"] = metrics.delta_nll(mine, answer_nll)
            row[f"intact{suffix}"] = metrics.is_intact(mine, answer_nll)
        mine = row.get(f"continuation_ce{suffix}")
        if mine is not None and continuation_ce is not None:
            row[f"full_continuation_ce{suffix}"] = continuation_ce
            row[f"delta_ce{suffix}"] = mine - continuation_ce


# --- the results file ----------------------------------------------------------------------------

STATUSES = ("ok", "skipped", "error")
# what every kvzoo row has (trial_row), and what an ok row adds that readers index (ΔNLL's reference, the tables)
ROW_FIELDS: dict[str, type] = {"key": str, "status": str, "model": str, "policy": str, "task": str,
                               "question_position": str}
OK_ROW_NUMBERS = ("answer_nll", "score")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def row_problem(row: Any) -> str | None:
    """Why the JSON value ``row`` is not a kvzoo results row (None: it is one).

    A row is an object with the fields every trial's row has (``key``, ``status``, ``model``, ``policy``,
    ``task``, ``question_position``: strings; ``status`` one of :data:`STATUSES`; ``ratio`` a number or null
    when present), and an ``ok`` row also its ``answer_nll`` and ``score`` (numbers). Another program's JSON
    lines that happen to carry a ``"key"`` are not kvzoo's.
    """
    if not isinstance(row, dict):
        return f"JSON, but not a kvzoo results row (a {type(row).__name__}, not an object)"
    if "key" not in row:
        return "JSON, but not a kvzoo results row (no 'key')"
    missing = [name for name in ROW_FIELDS if name not in row]
    if missing:
        return f"JSON, but not a kvzoo results row (no {', '.join(map(repr, missing))})"
    wrong = [name for name, kind in ROW_FIELDS.items() if not isinstance(row[name], kind)]
    if wrong:
        return (f"JSON, but not a kvzoo results row ({', '.join(f'{n!r} is {type(row[n]).__name__}' for n in wrong)}, "
                "not a string)")
    if row["status"] not in STATUSES:
        return f"JSON, but not a kvzoo results row (status {row['status']!r} is not one of {', '.join(STATUSES)})"
    if row.get("ratio") is not None and not _is_number(row["ratio"]):
        return f"JSON, but not a kvzoo results row (ratio {row['ratio']!r} is not a number or null)"
    if row["status"] == "ok":
        bad = [name for name in OK_ROW_NUMBERS if not _is_number(row.get(name))]
        if bad:
            return f"JSON, but not a kvzoo results row (an ok row without a number for {', '.join(map(repr, bad))})"
    return None


@dataclass
class ResultsFile:
    """What a results file holds: kvzoo's rows, and the lines that are not (reported, never removed)."""

    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (line number, why it was skipped)
    nonempty_lines: int = 0

    @property
    def is_kvzoo(self) -> bool:
        """True for a missing or empty file, or one holding at least one kvzoo row."""
        return self.nonempty_lines == 0 or bool(self.rows)

    def problems(self) -> list[str]:
        return [f"{self.path}:{line}: {why} (skipped; the line stays in the file)" for line, why in self.bad_lines]


class ResultsFileError(ValueError):
    """A results file (or output folder) kvzoo will not use; the message says why and what to do. Nothing was
    written to it."""


class NotKvzooResults(ResultsFileError):
    """An output file exists and holds something other than kvzoo results: it is not overwritten."""


class ResultsFileLocked(ResultsFileError):
    """Another process (a second ``kvzoo leaderboard``) is writing the results file."""


def _not_a_regular_file(path: Path) -> str | None:
    """Why ``path`` (which exists) cannot be read as a results file: a directory, FIFO, socket or device."""
    if path.is_file():
        return None
    if path.is_dir():
        return "is a directory"
    return "is not a regular file (a FIFO, socket or device: reading it could block or never end)"


def read_results_file(path: str | Path) -> ResultsFile:
    """Parse a JSONL results file line by line; reading never writes.

    A line that is not UTF-8, not JSON, or not a kvzoo row (:func:`row_problem`) is reported with its line
    number and skipped -- the tail of a write cut short by an interruption, a line somebody added, another
    program's JSON -- and the file is left exactly as it was. A path that is not a regular file (a directory,
    a FIFO) is refused (:class:`ResultsFileError`) without being read.
    """
    path = Path(path)
    found = ResultsFile(path)
    if not path.exists():
        return found
    problem = _not_a_regular_file(path)
    if problem is not None:
        raise ResultsFileError(f"{path} {problem}: it is not a results file")
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        found.nonempty_lines += 1
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            found.bad_lines.append((number, f"not UTF-8 ({err.reason} at byte {err.start})"))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            found.bad_lines.append((number, f"not JSON ({err.msg})"))
            continue
        why = row_problem(row)
        if why is None:
            found.rows.append(row)
        else:
            found.bad_lines.append((number, why))
    return found


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The kvzoo rows of a JSONL results file (none if it does not exist); see :func:`read_results_file`."""
    return read_results_file(path).rows


def latest_rows(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One row per trial key, in the order keys first appear: a finished trial stays finished.

    The latest ``ok`` row of a trial wins over any ``skipped`` or ``error`` row, before or after it (files
    concatenated in any order, a rerun that failed where an earlier one finished); a trial with no ok row
    keeps its latest row.
    """
    latest: dict[str, dict[str, Any]] = {}
    for row in rows:
        kept = latest.get(row["key"])
        if kept is None or row["status"] == "ok" or kept["status"] != "ok":
            latest[row["key"]] = row
    return latest


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append one row as a JSON line and flush it to disk (an interruption loses at most the trial in flight).

    When the file's last line was cut short (no newline at its end), the row starts on a new line:
    the file is only ever appended to.
    """
    path = Path(path)
    lead = ""
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            lead = "" if fh.read(1) == b"\n" else "\n"
    line = lead + json.dumps(row, default=_json_default) + "\n"
    with _interrupts_deferred(), open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives while a row is written until the line is whole, then raise it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _cannot_create_in(directory: Path) -> str | None:
    """Why no file can be created in the existing ``directory`` (None: one can). Tried for real with an unnamed
    temporary file (nothing appears in the folder), since permission bits do not tell for root or a read-only
    mount."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def check_output_dir(path: str | Path, option: str = "--plot-dir") -> Path:
    """``path`` as a folder kvzoo may write files into (made later if missing); a :class:`ResultsFileError`
    naming ``option`` when it is not a folder, or no file can be created in it (or in the folder it would be
    made in)."""
    path = Path(path)
    base = _existing_ancestor(path)
    if not base.is_dir():
        where = "is" if base == path.absolute() else f"would be made under {base}, which is"
        raise ResultsFileError(f"{option} {path} {where} not a folder: give a folder (or a path where one can be made)")
    problem = _cannot_create_in(base)
    if problem is not None:
        where = "" if base == path.absolute() else f" (it would be made in {base})"
        raise ResultsFileError(f"{option} {path}: no file can be written there{where} ({problem}); give a writable "
                               "folder")
    return path


def check_results_path(path: str | Path, option: str = "--out") -> Path:
    """``path`` as a results file kvzoo can append to: a regular file that opens for appending, or a path where
    one can be created. A :class:`ResultsFileError` naming ``option`` otherwise (a directory, a FIFO or device,
    no permission, a read-only file system); nothing is written, nothing is read."""
    path = Path(path)
    if path.exists():
        problem = _not_a_regular_file(path)
        if problem is not None:
            hint = f": give a file path such as {path / 'results.jsonl'}" if path.is_dir() else \
                ": give the path of a regular file (a .jsonl that exists, or one that does not exist yet)"
            raise ResultsFileError(f"{option} {path} {problem}{hint}")
        try:  # opening for appending writes nothing (and keeps the file's times)
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        except OSError as err:
            raise ResultsFileError(f"{option} {path} is not writable ({type(err).__name__}: {err.strerror or err}); "
                                   "nothing was run. Give a results file you can write, or another --out") from None
        return path
    base = _existing_ancestor(path.parent)
    if not base.is_dir():
        raise ResultsFileError(f"{option} {path} cannot be created: {base} is not a folder")
    problem = _cannot_create_in(base)
    if problem is not None:
        raise ResultsFileError(f"{option} {path} cannot be created: nothing can be written in {base} ({problem}); "
                               "nothing was run. Give a path in a writable folder")
    return path


def check_results_target(path: str | Path, *, force: bool = False, fresh: bool = False) -> ResultsFile:
    """The results file a grid will append to, refused (:class:`ResultsFileError`) when kvzoo may not use it.

    It must be a regular file that can be appended to, or a path where one can be made
    (:func:`check_results_path`). A file that exists, is not empty and holds no kvzoo row (a README, a markdown
    table, another program's JSONL) is refused (:class:`NotKvzooResults`) unless ``force``, which lets kvzoo
    append to it. ``fresh`` (start over) would delete the file: it is refused for a file that is not kvzoo's,
    ``force`` or not, and for a kvzoo file holding lines that are not kvzoo rows (they would be lost); kvzoo
    deletes only a file that holds nothing but its own rows.
    """
    path = check_results_path(path)
    found = read_results_file(path)
    if not found.is_kvzoo:
        lines = f"{found.nonempty_lines} line(s), none a kvzoo row"
        if fresh:
            raise NotKvzooResults(
                f"{found.path} is not a kvzoo results file ({lines}): --fresh would delete it, and kvzoo never "
                f"deletes or truncates a file that is not its own{', whatever --force says (--force only lets it append)' if force else ''}. "
                "Nothing was changed. Choose another --out, or leave out --fresh"
                + ("" if force else " (and pass --force to append kvzoo rows to it)")
            )
        if not force:
            raise NotKvzooResults(
                f"{found.path} exists and is not a kvzoo results file ({lines}): nothing was written to it. Choose "
                "another --out, or pass --force to append kvzoo rows to it"
            )
    elif fresh and found.bad_lines:
        shown = ", ".join(str(line) for line, _ in found.bad_lines[:10]) + (", ..." if len(found.bad_lines) > 10 else "")
        raise NotKvzooResults(
            f"--fresh would delete {found.path}, which holds {len(found.bad_lines)} line(s) that are not kvzoo rows "
            f"(line {shown}; the first: {found.bad_lines[0][1]}): nothing was deleted. Move those lines out of the "
            "file, or choose another --out; without --fresh kvzoo appends to the file and keeps them"
        )
    return found


def _lock_holder(path: Path) -> str:
    """Who holds the ``flock`` on ``path``: ``pid N`` from ``/proc/locks`` (Linux), else a plain phrase."""
    try:
        inode = os.stat(path).st_ino
        table = Path("/proc/locks").read_text()
    except OSError:
        return "pid unknown"
    for line in table.splitlines():
        fields = line.split()[1:]  # "1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF"
        if fields and fields[0] == "->":  # a process waiting for the lock, not holding it
            continue
        if len(fields) >= 5 and fields[0] == "FLOCK" and fields[4].rsplit(":", 1)[-1] == str(inode):
            return f"pid {fields[3]}"
    return "pid unknown"


@contextlib.contextmanager
def results_lock(path: str | Path) -> Iterator[int]:
    """Hold an advisory lock (``flock``) on the results file while a grid appends to it; yields its descriptor.

    A second driver on the same file gets :class:`ResultsFileLocked` naming the first one's pid, instead of
    running and writing the same trials again. The file is created (empty) if missing, and removed again on the
    way out when this call created it and nothing was written. Without ``fcntl`` (Windows) nothing is locked.
    """
    path = Path(path)
    existed = path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ResultsFileLocked(
                    f"{path} is being written by another kvzoo leaderboard ({_lock_holder(path)}): two drivers on one "
                    "results file would run and write the same trials twice. Nothing was run; wait for it to finish "
                    "(then rerun to resume), or choose another --out"
                ) from None
        yield fd
    finally:
        if not existed and os.fstat(fd).st_size == 0:
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    os.unlink(path)
        os.close(fd)  # releases the lock


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return repr(obj)


def versions() -> dict[str, str]:
    """Versions of what produced the numbers: kvzoo, torch, transformers, Python, platform."""
    import transformers

    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "kvzoo": dist("kvzoo"),
        "kvpress": dist("kvpress"),  # kvpress: policies run its presses
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
    }


# --- the grid ------------------------------------------------------------------------------------


class TrialRunner:
    """Runs trials in one process, keeping what they share: the loaded model, built tasks.

    One lives in the driver for the local executor, one in each Ray worker (built there from
    ``functools.partial(TrialRunner, grid)``): a worker loads a model once, not once per trial.
    ``device``: where the model runs (None: where it loads, the CPU; a Ray worker holding a GPU: ``cuda``).
    """

    def __init__(self, grid: Grid, device: str | None = None) -> None:
        self.grid = grid
        self.device = device
        self.models: dict[str, tuple[torch.nn.Module, Any]] = {}
        self.tasks: dict[tuple[str, str], Task] = {}
        self.load_seconds = 0.0  # spent loading models so far (the executors keep it out of trial_seconds)
        self.shared = SharedPrefill(record_window=_widest_window(grid))

    def close(self) -> None:
        """Free the kept prefill."""
        self.shared.clear()

    def model(self, name: str) -> tuple[torch.nn.Module, Any]:
        if name not in self.models:
            self.shared.clear()  # a prefill of the previous model
            self.models.clear()  # one model in memory at a time
            started = time.perf_counter()
            model, tokenizer = load(name, self.grid.dtype)
            self.models[name] = (model.to(self.device) if self.device else model), tokenizer
            self.load_seconds += time.perf_counter() - started
        return self.models[name]

    def task(self, name: str, spec: TaskSpec) -> Task:
        key = (name, spec.key)
        if key not in self.tasks:
            self.tasks[key] = make_task(spec, self.model(name)[1], continuation_tokens=self.grid.continuation_tokens)
        return self.tasks[key]

    def run(self, trial: Trial, reference: Reference | None) -> dict[str, Any]:
        """``trial``'s row (status ok, skipped or error), measured against ``reference`` (the full cache's figures)."""
        return _execute(trial, self, reference)


def _widest_window(grid: Grid) -> int:
    """The widest observation window among the grid's policies that share a dense prefill (0: none)."""
    from kvzoo import registry

    widest = 0
    for name in grid.policies if grid.policies is not None else registry.available():
        try:
            ratios = grid.ratios if needs_ratio(name) else (None,)
        except Exception:  # noqa: BLE001 - a policy the grid will record as skipped shares nothing
            continue
        for ratio in ratios:
            try:
                policy = build_policy(name, ratio)
            except Exception:  # noqa: BLE001 - as above
                continue
            if dense_prefill_problem(policy) is None and "window" in policy.observes:
                widest = max(widest, policy.observation_window)
    return widest


def reference_of(latest: dict[str, dict[str, Any]], trial: Trial) -> Reference | None:
    """The reference figures for ``trial`` from the rows so far (None until its reference row is ok)."""
    row = latest.get(trial.reference().key)
    if not row or row.get("status") != "ok":
        return None
    return Reference.of(row)


def group_trials(trials: Sequence[Trial]) -> list[TrialGroup]:
    """``trials`` (in plan order) grouped by model, task and question position: the trials that share a
    model, a task and a reference row. A group's reference trial, when pending, comes first."""
    groups: dict[str, TrialGroup] = {}
    for trial in trials:
        key = trial.reference().key
        if key not in groups:
            groups[key] = TrialGroup(key, trial.model, [], first_is_reference=trial.key == key)
        groups[key].trials.append(trial)
    return list(groups.values())


def build_policy(name: str, ratio: float | None) -> Policy:
    """``registry.get_spec(name)`` or ``registry.get_spec(name, ratio=ratio)`` (``name`` may carry parameters)."""
    from kvzoo import registry

    return registry.get_spec(name) if ratio is None else registry.get_spec(name, ratio=ratio)


def trial_row(trial: Trial, status: str = "ok", error: str | None = None) -> dict[str, Any]:
    """The fields of ``trial``'s row that say which trial it is (and its status)."""
    return {
        "key": trial.key,
        "status": status,
        "error": error,
        "model": trial.model,
        **trial.task.as_dict(),
        "policy": trial.policy,
        "ratio": trial.ratio,
        "question_position": trial.position,
    }


def _execute(trial: Trial, ctx: TrialRunner, reference: Reference | None) -> dict[str, Any]:
    row = trial_row(trial)
    try:
        policy = build_policy(trial.policy, trial.ratio)
    except (KeyError, TypeError, ValueError) as err:
        row.update(status="skipped", error=f"{type(err).__name__}: {err.args[0] if err.args else err}")
        return row
    row["policy_config"] = policy.config()
    retriever = policy_retriever(policy)
    row["retriever_config"] = None if retriever is None else retriever.config()  # what ran, not the defaults
    try:
        model, tokenizer = ctx.model(trial.model)
        task = ctx.task(trial.model, trial.task)
        row["metric"] = task.metric
        row.update(run_trial(
            model, tokenizer, task, policy,
            position=trial.position,
            reference=reference,
            max_new_tokens=ctx.grid.max_new_tokens,
            chunk_size=ctx.grid.chunk_size,
            audit=ctx.grid.audit,
            shared=ctx.shared,
            shared_key=(trial.model, trial.task.key, trial.position),
        ))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # a failing policy must not stop the grid; the row says what happened
        row.update(status="error", error=f"{type(err).__name__}: {err}")
        return row
    if trial.policy == REFERENCE_POLICY and trial.ratio is None:
        add_reference(row, Reference.of(row))
    return row


def make_executor(name: str, **options: Any) -> Executor:
    """An executor by name: ``local`` (no options) or ``ray`` (``address``, ``workers``, ``gpus_per_worker``,
    ``cpus_per_worker``, ``max_attempts``, ``placement_timeout``: see :class:`kvzoo.bench.ray_executor.RayExecutor`)."""
    if name == "local":
        given = {k: v for k, v in options.items() if v is not None}
        if given:
            raise ValueError(f"the local executor takes no options (got {', '.join(sorted(given))}); "
                             "they belong to --executor ray")
        return LocalExecutor()
    if name == "ray":
        from kvzoo.bench.ray_executor import RayExecutor

        return RayExecutor(**{k: v for k, v in options.items() if v is not None})
    raise ValueError(f"unknown executor {name!r}: valid executors are {', '.join(EXECUTORS)}")


def run_grid(
    grid: Grid,
    results: str | Path,
    *,
    fresh: bool = False,
    force: bool = False,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    executor: Executor | None = None,
) -> list[dict[str, Any]]:
    """Run every trial of ``grid`` not already finished in ``results``; return the grid's rows in plan order.

    ``results`` must be a kvzoo results file or not exist (:func:`check_results_target`; ``force``
    appends to another file anyway). ``fresh=True`` empties a file holding nothing but kvzoo rows first (any
    other file is refused, ``force`` or not). The file is locked while the grid runs (:func:`results_lock`:
    a second driver on it refuses, naming this one's pid). A trial with an ``ok`` row is finished, whatever
    other rows of it say (:func:`latest_rows`). Each
    finished trial is appended to ``results`` at once, by this process only, whichever ``executor``
    ran it (default :class:`~kvzoo.bench.executors.LocalExecutor`: in this process, in plan order;
    see :mod:`kvzoo.bench.executors`). ``on_row`` is called with each new row, after it was written.

    Besides the trial's figures every row says where and how it ran: ``worker`` (``host:pid``),
    ``trial_seconds`` (without ``model_load_s``, the model's loading when this trial came first on its
    worker), ``attempts`` (more than 1 when a worker died under it) and ``attempt_errors``.
    """
    path = check_results_path(results)
    trials = plan(grid)
    path.parent.mkdir(parents=True, exist_ok=True)
    with results_lock(path) as locked:
        found = check_results_target(path, force=force, fresh=fresh)  # read under the lock: nobody else appends
        if fresh and found.rows:  # nothing but kvzoo's rows (checked above), started over on request
            os.ftruncate(locked, 0)
            found = ResultsFile(path)
        for problem in found.problems():
            print(f"kvzoo: {problem}", file=sys.stderr)
        return _run_pending(grid, trials, path, latest_rows(found.rows), progress=progress, on_row=on_row,
                            executor=executor if executor is not None else LocalExecutor())


def _run_pending(grid: Grid, trials: list[Trial], path: Path, latest: dict[str, dict[str, Any]], *, progress: bool,
                 on_row: Callable[[dict[str, Any]], None] | None, executor: Executor) -> list[dict[str, Any]]:
    """:func:`run_grid`'s loop: the trials of ``trials`` not finished in ``latest`` (the file's rows), each new row
    appended to ``path``."""
    done = {t.key for t in trials if latest.get(t.key, {}).get("status") == "ok"}
    run_info = {"settings": grid.settings(), "versions": versions()}

    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(trials), initial=len(done), desc="kvzoo leaderboard", unit="trial",
        disable=not progress, file=sys.stderr, dynamic_ncols=True,
    )
    running: dict[str, str] = {}  # trial key -> label, while a worker has it

    def started(trial: Trial, worker: str) -> None:
        running[trial.key] = trial.label
        shown = trial.label if len(running) == 1 else f"{len(running)} running: {trial.label}, ..."
        bar.set_postfix_str(shown, refresh=True)

    def emit(trial: Trial, row: dict[str, Any], info: dict[str, Any]) -> None:
        running.pop(trial.key, None)
        row.update(info, **run_info,
                   finished_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        append_row(path, row)
        latest[trial.key] = row  # a pending trial has no ok row to keep
        if row["status"] != "ok":
            bar.write(f"{trial.label}: {row['status']}: {row['error']}", file=sys.stderr)
        bar.update(1)
        if on_row is not None:
            on_row(row)

    def failed_row(trial: Trial, cause: str) -> dict[str, Any]:
        return trial_row(trial, "error", cause)

    work = Work(
        groups=group_trials([t for t in trials if t.key not in done]),
        make_runner=functools.partial(TrialRunner, grid),
        reference=functools.partial(reference_of, latest),
        failed_row=failed_row,
        label=lambda trial: trial.label,
        on_start=started,
    )
    try:
        executor.run(work, emit)
    finally:
        bar.close()
    return [latest[t.key] for t in trials if t.key in latest]
