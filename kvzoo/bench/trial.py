"""One trial: a policy on one task's prompt, measured (:func:`run_trial`, :class:`TrialMeasurements`).

The context is prefilled (or a :class:`SharedPrefill` continued) and compressed once; forks of the cache measure the
held-out continuation's CE and the reference answer's NLL, and the answer is decoded greedily on the cache itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvzoo import pipeline
from kvzoo.bench import metrics
from kvzoo.bench.planner import TEACHER_FORCING
from kvzoo.bench.tasks import Task
from kvzoo.framework.cache import TieredCache, dense_prefill_problem
from kvzoo.framework.policy import Policy
from kvzoo.framework.stats import LayerStats
from kvzoo.pipeline import QUESTION_POSITIONS, build_prompt


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
    """The prefills of one (model, task, question position), made when a policy first asks and continued by every
    policy that can (``TieredCache.fork_as``): ``dense`` (the context in the trial's chunks), ``attention`` (the same,
    recording each row's received attention, for H2O) and ``block:<size>`` (the context's first block, for VestigeKV
    on a context longer than its block). ``record_window``: the most observation-window queries any of them reads.
    """

    def __init__(self, record_window: int = 0) -> None:
        self.record_window = record_window
        self.key: tuple | None = None
        self.prefills: dict[str, tuple[TieredCache, torch.Tensor, float]] = {}  # kind -> (cache, logits, seconds)

    def clear(self) -> None:
        for base, _, _ in self.prefills.values():
            base.close()
        self.key, self.prefills = None, {}

    @staticmethod
    def one_forward(tokens: int, chunk_size: int | None) -> int | None:
        """The context's length when a policy's own prefill of it is one forward (None when ``chunk_size`` cuts it)."""
        return tokens if chunk_size is None or chunk_size >= tokens else None

    @classmethod
    def kind(cls, policy: Policy, tokens: int, chunk_size: int | None) -> tuple[str, int] | None:
        """Which shared prefill ``policy`` continues on a context of ``tokens`` and over how many of them:
        ``("dense", tokens)``, ``("attention", tokens)``, ``("block:<size>", size)``, or None (its own)."""
        attention = "accumulate" in policy.observes
        if dense_prefill_problem(policy, one_forward=cls.one_forward(tokens, chunk_size),
                                 attention_recorded=attention) is None:
            return ("attention" if attention else "dense"), tokens
        block = policy.block_size if policy.schedule == "block" and policy.closes_each_block else None
        if (block and tokens > block and chunk_size in (None, block)
                and dense_prefill_problem(policy, one_forward=block) is None):
            return f"block:{block}", block
        return None

    @torch.no_grad()
    def fork(self, key: tuple, model: torch.nn.Module, prefix: torch.Tensor, chunk_size: int | None, audit: bool,
             policy: Policy) -> tuple[TieredCache, torch.Tensor, float, bool] | None:
        """``(cache, first_logits, prefill seconds, reused)`` continuing a shared prefill of ``prefix`` as ``policy``,
        its context ended (the shared part made now unless this group's was made already; the prefill seconds are
        the shared part's and, for a ``block`` one, the rest's), or None when ``policy`` cannot share one."""
        n = int(prefix.shape[1])
        kind = self.kind(policy, n, chunk_size)
        if kind is None:
            return None
        name, tokens = kind
        if key != self.key:
            self.clear()
            self.key = key
        reused = name in self.prefills
        if not reused:
            base = TieredCache(model, "full", context_length=n, audit=audit, record_window=self.record_window,
                               record_attention=name == "attention")
            started = time.perf_counter()
            logits = pipeline.prefill(model, base, prefix[:, :tokens], chunk_size if tokens == n else None,
                                      phase=f"shared prefill ({name})")
            self.prefills[name] = (base, logits, time.perf_counter() - started)
        base, logits, seconds = self.prefills[name]
        if tokens < n:  # the first block: its event on the fork, then the rest of the context as the policy's own
            if base.prefill_shared_with(policy, one_forward=True) is not None:
                return None
            cache = base.fork_as(policy, one_forward=True)
            started = time.perf_counter()
            logits = pipeline.prefill(model, cache, prefix[:, tokens:], chunk_size, ends_context=True)
            return cache, logits, seconds + time.perf_counter() - started, reused
        ends = self.one_forward(n, chunk_size) is not None
        if base.prefill_shared_with(policy, ends_context=ends) is not None:
            return None
        return base.fork_as(policy, ends_context=ends), logits, seconds, reused


@dataclass
class TrialMeasurements:
    """What one trial measured, as measured: per-token NLLs, the cache's totals after compression, after the question and
    after decoding, each phase's time; ``to_row()`` turns it into the row's figures."""

    task: Task
    prompt_tokens: int = 0  # the prefix that was compressed (the context; with the question asked before, it too)
    question_tokens: int = 0  # forwarded after compression (question and answer prefix; 0 when asked before)
    answer_nll: list[float] = field(default_factory=list)  # per reference-answer token, one decode step each
    answer_nll_one_forward: list[float] | None = None  # the same, in one forward (None: not measured)
    answer_kv_bytes: int = 0  # KV-path bytes the answer's decode-step fork read
    continuation_nll: list[float] | None = None  # per held-out token (None: question before, or no continuation)
    continuation_nll_one_forward: list[float] | None = None
    compressed: dict[str, Any] = field(default_factory=dict)
    start: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    new_tokens: int = 0  # tokens greedy decoding produced (the last one's forward is not run)
    prediction: str = ""
    later_predictions: list[str] = field(default_factory=list)  # a multi-turn task's answers after the first
    prefill_shared: bool = False  # the prefill was a shared dense one, continued (SharedPrefill)
    seconds: dict[str, float] = field(default_factory=dict)  # per phase: prefill, compress, score, continuation,
    # question, decode, and the whole trial (wall)
    peak_rss_bytes: int = 0

    def to_row(self) -> dict[str, Any]:
        """The trial's figures as the results row has them (without the ΔNLL/ΔCE fields: :func:`add_reference`)."""
        compressed, start, final, seconds = self.compressed, self.start, self.final, self.seconds
        steps = self.new_tokens - 1
        first = metrics.string_match(self.task.metric, self.prediction, self.task.answers)
        turns = [first] + [metrics.string_match(self.task.metric, prediction, turn.answers)
                           for prediction, turn in zip(self.later_predictions, self.task.later_turns)]
        return {
            "prediction": self.prediction,
            "answers": list(self.task.answers),
            "score": sum(turns) / len(turns),  # a multi-turn task: the mean over its turns (turn_scores: each)
            **({"turn_scores": turns, "later_turns_score": sum(turns[1:]) / len(turns[1:]),  # where eviction bites
                "turn_predictions": [self.prediction, *self.later_predictions],
                "turn_answers": [list(self.task.answers), *(list(t.answers) for t in self.task.later_turns)]}
               if self.task.later_turns else {}),
            "teacher_forcing": TEACHER_FORCING,
            "answer_nll": sum(self.answer_nll),
            "answer_nll_one_forward": (None if self.answer_nll_one_forward is None
                                       else sum(self.answer_nll_one_forward)),
            "answer_tokens": len(self.answer_nll),
            "continuation_ce": _mean_or_none(self.continuation_nll),
            "continuation_ce_one_forward": _mean_or_none(self.continuation_nll_one_forward),
            "continuation_tokens": 0 if self.continuation_nll is None else len(self.continuation_nll),
            "prompt_tokens": self.prompt_tokens,
            "question_tokens": self.question_tokens,
            "context_tokens_actual": self.task.context_token_count,
            "needle_depth_actual": self.task.needle_depth,
            "resident_rows": int(compressed["resident_rows"]),
            "seen_rows": int(compressed["seen_rows"]),
            "resident_bytes": metrics.resident_kv_bytes(compressed),
            "bytes_freed": metrics.kv_bytes_freed(compressed),
            "archived_bytes": int(compressed["archived_bytes"]),
            "dropped_rows": int(compressed["dropped_rows"]),
            "peak_resident_rows": int(final["peak_resident_rows"]),
            "decode_steps": steps,
            "kv_bytes_per_step": metrics.kv_bytes_read_per_step(start, final, steps),
            "index_bytes_per_step": metrics.index_bytes_per_step(start, final, steps),
            # every forward after compression reads the KV path: the question's, the decode steps', and the
            # teacher-forced answer's (on its fork)
            "question_kv_bytes": int(start["kv_bytes_read"] - compressed["kv_bytes_read"]),
            "answer_kv_bytes": int(self.answer_kv_bytes),
            "kv_bytes_per_token": (final["kv_bytes_read"] - compressed["kv_bytes_read"]) / max(1, self.new_tokens),
            "fetched_rows_per_step": metrics.rows_fetched_per_step(start, final, steps),
            # a hybrid model's layers the policy does not act on (sliding-window / linear-attention), beside the
            # figures above, which count the tiered layers only (None: every layer is tiered)
            "untiered_resident_bytes": _int_or_none(compressed.get("untiered_resident_bytes")),
            "untiered_kv_bytes_per_step": (None if "untiered_kv_bytes_read" not in final or not steps else
                                           (final["untiered_kv_bytes_read"] - start["untiered_kv_bytes_read"]) / steps),
            "bound_violations": metrics.bound_violations(final),
            "peak_rss_bytes": self.peak_rss_bytes,
            "prefill_s": seconds["prefill"],
            "prefill_shared": self.prefill_shared,
            **{f"{phase}_s": seconds[phase] for phase in ("compress", "score", "continuation", "question", "decode")},
            **({"turns_s": seconds["turns"]} if "turns" in seconds else {}),
            "decode_ms_per_step": 1e3 * seconds["decode"] / steps if steps else None,
            "wall_s": seconds["wall"],
            "policy_info": {k: v for k, v in final.items() if k not in _STAT_FIELDS},
        }


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _mean_or_none(nll: list[float] | None) -> float | None:
    return None if nll is None else metrics.mean_token_nll(nll)


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
    one_forward: bool = True,
) -> dict[str, Any]:
    """Run one trial; its row's figures as a flat dict (:meth:`TrialMeasurements.to_row`, then ΔNLL/ΔCE against
    ``reference``, None without one). ``shared``: a :class:`SharedPrefill` the trial continues from when its policy can."""
    if position not in QUESTION_POSITIONS:
        raise ValueError(f"question position must be one of {QUESTION_POSITIONS}, got {position!r}")
    m = TrialMeasurements(task)
    with _phase(m, "wall"):
        ids, new_tokens_max = _prompt_for(model, tokenizer, task, position, max_new_tokens)
        m.prompt_tokens, m.question_tokens = int(ids.prefix.shape[1]), int(ids.question.shape[1])
        cache, first_logits = _prefill(m, model, ids.prefix, policy, chunk_size, audit, shared, shared_key)
        with _phase(m, "compress"):
            pipeline.compress(cache)
        m.compressed = cache.stats().totals
        with _phase(m, "continuation"):  # the held-out continuation, on forks (question after compression only)
            if position == "after" and ids.continuation.shape[1]:
                m.continuation_nll, m.continuation_nll_one_forward, _ = _teacher_forced(
                    model, cache, ids.question[:, :0], ids.continuation, first_logits, m.compressed, "continuation CE",
                    one_forward)
        # The answer's decode steps follow the question's forward, which greedy decoding follows too: asked once on
        # the cache itself, and the answer forked after it -- the very forward the fork would run when both use the
        # default chunks (teacher_forced_nll asks in those; with a grid chunk_size the fork asks it itself, as before)
        ask_once = chunk_size is None or not m.question_tokens
        with _phase(m, "score"):  # the reference answer, teacher-forced, on forks
            m.answer_nll, m.answer_nll_one_forward, m.answer_kv_bytes = _teacher_forced(
                model, cache, ids.question, ids.answer, first_logits, m.compressed, "answer NLL", one_forward,
                decode_steps=not ask_once)
        with _phase(m, "question"):
            logits = (pipeline.prefill(model, cache, ids.question, chunk_size, phase="question") if m.question_tokens
                      else first_logits)
        if ask_once:
            with _phase(m, "answer"):  # the reference answer's decode steps, on a fork of the asked cache
                m.answer_nll, m.answer_kv_bytes = _decode_steps(model, cache, ids.question[:, :0], ids.answer, logits,
                                                                m.compressed, "answer NLL")
            m.seconds["score"] += m.seconds.pop("answer")
        eos = pipeline.eos_ids(model, tokenizer)

        answered = _answered_rule(tokenizer, eos, task.metric, task.answers, stop_when_answered)
        m.start = cache.stats().totals
        with _phase(m, "decode"):  # the loop reads no statistics: its time is the forwards'
            new_tokens = pipeline.greedy_decode(model, cache, logits, new_tokens_max, eos, stop=answered)
        m.final, m.new_tokens = cache.stats().totals, len(new_tokens)
        m.prediction = tokenizer.decode([t for t in new_tokens if t not in eos], skip_special_tokens=True)
        if task.later_turns:  # on the same cache, after the first turn's question and answer (timed apart)
            with _phase(m, "turns"):
                m.later_predictions = _later_turns(model, tokenizer, cache, task, new_tokens, m.prediction, eos,
                                                   new_tokens_max, chunk_size, stop_when_answered)
        cache.close()
    m.peak_rss_bytes = metrics.peak_rss_bytes()
    row = m.to_row()
    add_reference(row, reference)
    return row


def _answered_rule(tokenizer: Any, eos: set[int], metric: str, answers: tuple[str, ...],
                   enabled: bool) -> Any:
    """Greedy decoding's stop rule: every answer appeared (the score cannot change after that); never when not
    ``enabled``."""

    def answered(tokens: list[int]) -> bool:
        text = tokenizer.decode([t for t in tokens if t not in eos])
        return enabled and metrics.string_match(metric, text, answers) == 1.0

    return answered


def _later_turns(model: torch.nn.Module, tokenizer: Any, cache: TieredCache, task: Task, first_tokens: list[int],
                 first_prediction: str, eos: set[int], max_new_tokens: int, chunk_size: int | None,
                 stop_when_answered: bool) -> list[str]:
    """Ask ``task.later_turns`` one after another on ``cache``, each turn's text forwarded after what the cache holds
    (the context, the earlier questions and the model's own answers) and answered greedily; the predictions."""
    history = [(task.question, task.answer_prefix, first_prediction)]
    pending = first_tokens[-1:] if first_tokens and first_tokens[-1] not in eos else []  # its forward was not run
    predictions = []
    for turn in task.later_turns:
        text = turn_text(tokenizer, task.context, history, turn)
        ids = torch.tensor([pending + tokenizer(text, add_special_tokens=False).input_ids], dtype=torch.long)
        logits = pipeline.prefill(model, cache, ids, chunk_size, phase=f"turn {len(history) + 1}")
        answered = _answered_rule(tokenizer, eos, task.metric, turn.answers, stop_when_answered)
        tokens = pipeline.greedy_decode(model, cache, logits, max_new_tokens, eos, stop=answered)
        prediction = tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
        predictions.append(prediction)
        history.append((turn.question, turn.answer_prefix, prediction))
        pending = tokens[-1:] if tokens and tokens[-1] not in eos else []
    return predictions


def turn_text(tokenizer: Any, context: str, history: list[tuple[str, str, str]], turn: Any) -> str:
    """The text that follows the last answer in ``history`` (``(question, answer prefix, answer)`` per turn) to ask
    ``turn``: with a chat template, what the template puts between that answer and the next assistant reply (the
    end of the answer's message, the user's question, the reply's start), then ``turn.answer_prefix``; without one,
    the plain form :func:`kvzoo.pipeline.build_prompt` uses."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n\n" + turn.question + "\n" + turn.answer_prefix
    messages = []
    for i, (question, prefix, answer) in enumerate(history):
        messages.append({"role": "user", "content": context + "\n\n" + question if i == 0 else question})
        messages.append({"role": "assistant", "content": prefix + answer})
    messages.append({"role": "user", "content": turn.question})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    last = messages[-2]["content"]
    if last not in rendered:
        raise ValueError(f"the chat template changed the previous answer's text ({last!r:.80}): a multi-turn task "
                         "cannot continue the cache after it")
    return rendered[rendered.rindex(last) + len(last):] + turn.answer_prefix


@contextlib.contextmanager
def _phase(m: TrialMeasurements, name: str) -> Iterator[None]:
    """Time the block into ``m.seconds[name]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        m.seconds[name] = time.perf_counter() - started


def _prompt_for(model: torch.nn.Module, tokenizer: Any, task: Task, position: str,
                max_new_tokens: int | None) -> tuple[PromptIds, int]:
    """``task``'s ids with the question where ``position`` puts it (``before``: at the end of the compressed
    prefix, nothing asked after), and the tokens to generate; a ValueError when they overrun the model's positions."""
    ids = encode_prompt(tokenizer, task)
    if position == "before":
        ids = dataclasses.replace(ids, prefix=torch.cat([ids.prefix, ids.question], dim=1),
                                  question=ids.question[:, :0])
    new_tokens_max = pipeline.check_max_new_tokens(max_new_tokens or task.max_new_tokens)
    prompt = ids.prefix.shape[1] + ids.question.shape[1]
    continuation = ids.continuation.shape[1] if position == "after" else 0
    pipeline.check_positions(
        model, max(prompt + max(new_tokens_max - 1, ids.answer.shape[1]), ids.prefix.shape[1] + continuation),
        f"the trial's prompt ({prompt} tokens), its answer ({ids.answer.shape[1]}), held-out continuation "
        f"({continuation}) and max_new_tokens={new_tokens_max}")
    return ids, new_tokens_max


def _prefill(m: TrialMeasurements, model: torch.nn.Module, prefix: torch.Tensor, policy: Policy,
             chunk_size: int | None, audit: bool, shared: SharedPrefill | None,
             shared_key: tuple | None) -> tuple[TieredCache, torch.Tensor]:
    """The cache holding ``prefix`` for ``policy``, and the logits after it: a fork of the shared dense prefill
    when the policy can continue one, else a prefill of its own (timed into ``m``)."""
    forked = None if shared is None else shared.fork(shared_key, model, prefix, chunk_size, audit, policy)
    if forked is not None:
        cache, first_logits, m.seconds["prefill"], m.prefill_shared = forked
        return cache, first_logits
    cache = TieredCache(model, policy, context_length=prefix.shape[1], audit=audit)
    with _phase(m, "prefill"):
        first_logits = pipeline.prefill(model, cache, prefix, chunk_size, ends_context=True)
    return cache, first_logits


def _decode_steps(model: torch.nn.Module, cache: TieredCache, rest: torch.Tensor, target: torch.Tensor,
                  last_logits: torch.Tensor, compressed: dict[str, Any], what: str) -> tuple[list[float], int]:
    """``target``'s per-token NLLs after ``rest``, one decode step per token, on a fork of ``cache``; and the KV-path
    bytes the fork read since compression (``compressed``: the totals then)."""
    with cache.fork() as fork:
        nll = pipeline.teacher_forced_nll(model, fork, rest, target, last_logits, TEACHER_FORCING, phase=what)
        return nll, fork.stats().totals["kv_bytes_read"] - compressed["kv_bytes_read"]


def _teacher_forced(model: torch.nn.Module, cache: TieredCache, rest: torch.Tensor, target: torch.Tensor,
                    first_logits: torch.Tensor, compressed: dict[str, Any],
                    what: str, one_forward: bool = True,
                    decode_steps: bool = True) -> tuple[list[float], list[float] | None, int]:
    """``target``'s per-token NLLs after ``rest``, each on a fork of ``cache``: one decode step per token
    (:func:`_decode_steps`; empty, and 0 bytes, when not ``decode_steps``), and in one forward (None when not
    ``one_forward``); and the KV-path bytes the decode-step fork read since compression (``compressed``: its
    totals). ``what`` names the phase to the progress reporter."""
    steps, kv_bytes = (_decode_steps(model, cache, rest, target, first_logits, compressed, what) if decode_steps
                       else ([], 0))
    if not one_forward:
        return steps, None, kv_bytes
    with cache.fork() as fork:
        forward = pipeline.teacher_forced_nll(model, fork, rest, target, first_logits, "one_forward", phase=what)
    return steps, forward, kv_bytes


# the cache's own counters, carried by name above (LayerStats, so a renamed counter cannot leak into policy_info);
# kv_bytes_read has always been carried in policy_info too, and stays there so that results files compare
_STAT_FIELDS = (set(LayerStats.counters()) - {"kv_bytes_read"}) | {"untiered_resident_bytes", "untiered_kv_bytes_read"}


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

