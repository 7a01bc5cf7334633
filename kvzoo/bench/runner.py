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

* the reference answer, teacher-forced after the question and RULER's answer prefix: its NLL;
* the held-out continuation of the haystack, teacher-forced (question after compression only): ΔCE;
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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvzoo.bench import metrics
from kvzoo.bench.executors import EXECUTORS, Executor, LocalExecutor, TrialGroup, Work
from kvzoo.bench.report import REFERENCE_POLICY
from kvzoo.bench.tasks import ByteTokenizer, Task, TaskSpec, make_task
from kvzoo.framework import pipeline
from kvzoo.framework.cache import TieredCache, dense_prefill_problem
from kvzoo.framework.names import policy_retriever
from kvzoo.framework.pipeline import QUESTION_POSITIONS, build_prompt
from kvzoo.framework.policy import Policy

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
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio < 1:
                raise ValueError(f"ratios must be numbers >= 1 (keep 1/ratio of the rows), got {ratio!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.models or not self.tasks or not self.positions:
            raise ValueError("a grid needs at least one model, one task and one question position")
        self.ratios = tuple(float(r) for r in self.ratios)

    def settings(self) -> dict[str, Any]:
        """The run settings that change results (recorded in every row, part of each trial's key)."""
        return {"max_new_tokens": self.max_new_tokens, "chunk_size": self.chunk_size,
                "continuation_tokens": self.continuation_tokens, "audit": self.audit, "dtype": self.dtype}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    # `make demo`: every registered policy, one needle in 2k tokens of essay text at 3 depths, 4x and 8x
    "demo": lambda: needle_grid(depths=(0.25, 0.5, 0.75), ratios=(4, 8), positions=("after",)),
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




# Configured variants that the leaderboard runs beside every registered policy (grid.policies=None):
# kvzoo's per-KV-group Quest, so that the equal-bytes comparison with the reference's per-head rule shows.
DEFAULT_VARIANTS: tuple[str, ...] = ("quest(gqa=group)",)


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
    from kvzoo.models import MODEL_NAMES, looks_like_hub_id

    if name in MODEL_NAMES or Path(name).expanduser().is_dir() or looks_like_hub_id(name):
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
    model, tokenizer = load_model(name, DTYPES[dtype])
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
    """The full cache's figures for one (task, position): what ΔNLL and ΔCE subtract."""

    answer_nll: float
    continuation_ce: float | None


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

        with metrics.Stopwatch() as t_score:  # the reference answer, teacher-forced, on a fork
            with cache.fork() as fork:
                answer_nll = pipeline.teacher_forced_nll(model, fork, rest, ids.answer, first_logits)
                answer_kv_bytes = fork.stats().totals["kv_bytes_read"] - compressed["kv_bytes_read"]
        continuation_nll = None
        if position == "after" and ids.continuation.shape[1]:  # the held-out continuation, on a fork
            with cache.fork() as fork:
                continuation_nll = pipeline.teacher_forced_nll(model, fork, rest[:, :0], ids.continuation, first_logits)

        with metrics.Stopwatch() as t_question:
            logits = pipeline.prefill(model, cache, rest, chunk_size) if rest.shape[1] else first_logits
        eos = pipeline.eos_ids(model, tokenizer)

        def answered(tokens: list[int]) -> bool:  # the score cannot change once every answer appeared
            text = tokenizer.decode([t for t in tokens if t not in eos])
            return stop_when_answered and metrics.string_match(task.metric, text, task.answers) == 1.0

        start = cache.stats().totals
        with metrics.Stopwatch() as t_decode:  # the loop reads no statistics: its time is the forwards'
            new_tokens = pipeline.greedy_decode(model, cache, logits, max_new_tokens or task.max_new_tokens, eos,
                                                stop=answered)
        steps = len(new_tokens) - 1  # the last token's forward is not run
        final = cache.stats().totals
        prediction = tokenizer.decode([t for t in new_tokens if t not in eos], skip_special_tokens=True)
        cache.close()

    row: dict[str, Any] = {
        "prediction": prediction,
        "answers": list(task.answers),
        "score": metrics.string_match(task.metric, prediction, task.answers),
        "answer_nll": sum(answer_nll),
        "answer_tokens": len(answer_nll),
        "continuation_ce": None if continuation_nll is None else metrics.mean_token_nll(continuation_nll),
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
        "question_s": t_question.seconds,
        "decode_s": t_decode.seconds,
        "decode_ms_per_step": 1e3 * t_decode.seconds / steps if steps else None,
        "wall_s": wall.seconds,
        "policy_info": {k: v for k, v in final.items() if k not in _STAT_FIELDS},
    }
    add_reference(row, reference)
    return row


_STAT_FIELDS = {
    "seen_rows", "resident_rows", "peak_resident_rows", "resident_bytes", "archived_rows", "archived_bytes",
    "dropped_rows", "events", "fetched_rows",
}


def add_reference(row: dict[str, Any], reference: Reference | None) -> None:
    """Fill ΔNLL, intact and ΔCE of ``row`` against the full cache's figures (None without a reference)."""
    row["full_answer_nll"] = row["delta_nll"] = row["intact"] = None
    row["full_continuation_ce"] = row["delta_ce"] = None
    if reference is None:
        return
    row["full_answer_nll"] = reference.answer_nll
    row["delta_nll"] = metrics.delta_nll(row["answer_nll"], reference.answer_nll)
    row["intact"] = metrics.is_intact(row["answer_nll"], reference.answer_nll)
    if row["continuation_ce"] is not None and reference.continuation_ce is not None:
        row["full_continuation_ce"] = reference.continuation_ce
        row["delta_ce"] = row["continuation_ce"] - reference.continuation_ce


# --- the results file ----------------------------------------------------------------------------


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


def read_results_file(path: str | Path) -> ResultsFile:
    """Parse a JSONL results file line by line; reading never writes.

    A line that is not UTF-8, not JSON, or not a kvzoo row (a JSON object with a ``key``) is
    reported with its line number and skipped -- the tail of a write cut short by an interruption,
    a line somebody added -- and the file is left exactly as it was.
    """
    path = Path(path)
    found = ResultsFile(path)
    if not path.exists():
        return found
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
        if isinstance(row, dict) and "key" in row:
            found.rows.append(row)
        else:
            found.bad_lines.append((number, "JSON, but not a kvzoo results row (no 'key')"))
    return found


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The kvzoo rows of a JSONL results file (none if it does not exist); see :func:`read_results_file`."""
    return read_results_file(path).rows


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


class NotKvzooResults(ValueError):
    """An output file exists and holds something other than kvzoo results: it is not overwritten."""


def check_results_target(path: str | Path, *, force: bool = False) -> ResultsFile:
    """The results file a grid will append to, refused (:class:`NotKvzooResults`) when it is not kvzoo's.

    A file that exists, is not empty and holds no kvzoo row (a README, a markdown table, another
    program's log) is left alone unless ``force``; its bad lines are reported either way.
    """
    found = read_results_file(path)
    if not found.is_kvzoo and not force:
        raise NotKvzooResults(
            f"{found.path} exists and is not a kvzoo results file ({found.nonempty_lines} line(s), none a kvzoo "
            "row): nothing was written to it. Choose another --out, or pass --force to append kvzoo rows to it"
        )
    return found


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
    return Reference(row["answer_nll"], row.get("continuation_ce"))


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
        add_reference(row, Reference(row["answer_nll"], row["continuation_ce"]))
    return row


def make_executor(name: str, **options: Any) -> Executor:
    """An executor by name: ``local`` (no options) or ``ray`` (``address``, ``workers``, ``gpus_per_worker``,
    ``cpus_per_worker``, ``max_attempts``: see :class:`kvzoo.bench.ray_executor.RayExecutor`)."""
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
    appends to another file anyway). ``fresh=True`` deletes a kvzoo results file first. Each
    finished trial is appended to ``results`` at once, by this process only, whichever ``executor``
    ran it (default :class:`~kvzoo.bench.executors.LocalExecutor`: in this process, in plan order;
    see :mod:`kvzoo.bench.executors`). ``on_row`` is called with each new row, after it was written.

    Besides the trial's figures every row says where and how it ran: ``worker`` (``host:pid``),
    ``trial_seconds`` (without ``model_load_s``, the model's loading when this trial came first on its
    worker), ``attempts`` (more than 1 when a worker died under it) and ``attempt_errors``.
    """
    path = Path(results)
    found = check_results_target(path, force=force)
    for problem in found.problems():
        print(f"kvzoo: {problem}", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    trials = plan(grid)
    if fresh and path.exists():  # a kvzoo results file (checked above), started over on request
        path.unlink()
        found = ResultsFile(path)
    latest = {row["key"]: row for row in found.rows}
    done = {t.key for t in trials if latest.get(t.key, {}).get("status") == "ok"}
    run_info = {"settings": grid.settings(), "versions": versions()}
    executor = executor if executor is not None else LocalExecutor()

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
        latest[trial.key] = row
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
