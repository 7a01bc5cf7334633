"""Question-after-compression generation and teacher-forced scoring, and the steps they are made of.

A user-layer module: it drives a :class:`~kvzoo.framework.cache.TieredCache` through its public methods only. The
context is prefilled and compressed *before* the question exists, so a policy cannot use the question to decide what
to keep (``question_position="before"`` is the other column); the benchmark runner builds its trials from the same
public steps. A library call prints nothing: progress goes to a tqdm bar only inside :func:`reporting` or with
``progress=True``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import numbers
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvzoo.framework.cache import CacheStats, TieredCache
from kvzoo.framework.policy import Policy

QUESTION_POSITIONS = ("after", "before")
# How a known text is teacher-forced after compression (teacher_forced_nll): "decode" feeds each token as its own
# decode step -- what generation does, so a retriever's per-step rule is what the NLL sees; "one_forward" feeds
# the text in one multi-token forward (under a retriever's default multi_token="dense" rule it reads the whole
# archive: the NLL of a policy with a retriever then equals full's by construction).
TEACHER_FORCING = ("decode", "one_forward")
TokenInput = str | Sequence[int] | torch.Tensor


@dataclass
class GenerationResult:
    answer: str
    token_ids: list[int]
    stats: CacheStats
    timings: dict[str, float]
    context_tokens: int
    question_tokens: int
    cache: TieredCache = field(repr=False)


@dataclass
class ScoreResult:
    """Teacher-forced negative log-likelihood (nats) of the answer tokens after compression."""

    nll: float  # summed over answer tokens
    token_nll: list[float]
    stats: CacheStats
    answer_tokens: int
    cache: TieredCache = field(repr=False)


# --- progress ------------------------------------------------------------------------------------


class Progress:
    """Where a run is, phase by phase, on a tqdm bar (stderr): ``phase("decode", total=24)`` then ``advance()``.

    The steps report to the one :func:`reporting` set (a context variable), else to nothing. ``position`` and ``leave``
    are tqdm's; ``disable=None`` shows it only when ``file`` is a terminal, so logs do not fill with redrawn lines.
    """

    def __init__(self, label: str = "", *, position: int | None = None, leave: bool = False,
                 disable: bool | None = None, file: Any = None) -> None:
        from tqdm.auto import tqdm

        self.label = label
        self.bar = tqdm(total=None, desc=label, position=position, leave=leave, disable=disable,
                        file=file if file is not None else sys.stderr, dynamic_ncols=True, bar_format=self.PLAIN)

    PLAIN = "{desc} [{elapsed}]"  # a phase without steps to count (compress)
    COUNTED = "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}]"

    def phase(self, name: str, total: int | None = None, unit: str = "steps") -> None:
        """A new phase: ``name`` (e.g. ``"prefill chunk 2/4"``), counting ``total`` ``unit`` from 0."""
        self.bar.reset()
        self.bar.total = total  # reset(total=None) would keep the last phase's
        self.bar.unit = unit
        self.bar.bar_format = self.PLAIN if total is None else self.COUNTED
        self.bar.set_description_str(f"{self.label} | {name}" if self.label else name, refresh=True)

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)

    def relabel(self, label: str) -> None:
        self.label = label

    def close(self) -> None:
        self.bar.close()


_PROGRESS: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("kvzoo_progress", default=None)


@contextlib.contextmanager
def reporting(progress: Progress | None) -> Iterator[Progress | None]:
    """The pipeline's steps inside this block report to ``progress`` (None: to nothing)."""
    token = _PROGRESS.set(progress)
    try:
        yield progress
    finally:
        _PROGRESS.reset(token)


@contextlib.contextmanager
def _own_progress(enabled: bool, label: str) -> Iterator[None]:
    """A bar of a function's own (``progress=True``) unless a caller's :func:`reporting` is already in effect."""
    if not enabled or _PROGRESS.get() is not None:
        yield
        return
    progress = Progress(label)
    try:
        with reporting(progress):
            yield
    finally:
        progress.close()


def _phase(name: str, total: int | None = None, unit: str = "steps") -> None:
    progress = _PROGRESS.get()
    if progress is not None:
        progress.phase(name, total, unit)


def _advance() -> None:
    progress = _PROGRESS.get()
    if progress is not None:
        progress.advance()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (the first ``layers`` ModuleList in it; none found: [])."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return list(layers)
    return []


@contextlib.contextmanager
def _layer_ticks(model: torch.nn.Module) -> Iterator[int]:
    """While a reporter is set, advance it after each decoder layer of a forward (a long prefill chunk shows it
    moves); yields the layer count (0: nothing to tick, or no reporter)."""
    if _PROGRESS.get() is None:
        yield 0
        return
    layers = _decoder_layers(model)
    handles = [layer.register_forward_hook(lambda *_: _advance()) for layer in layers]
    try:
        yield len(layers)
    finally:
        for handle in handles:
            handle.remove()


def build_prompt(tokenizer: Any, context: TokenInput, question: TokenInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[1, n]`` of the prefix (everything before the question) and of the rest."""
    if not isinstance(context, str) and not isinstance(question, str):
        return _as_ids(context), _as_ids(question)
    if tokenizer is None:
        raise ValueError("context/question given as text need a tokenizer; pass token ids to run without one")
    if not isinstance(context, str) or not isinstance(question, str):
        raise TypeError("give context and question both as text or both as token ids")
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": context + "\n\n" + question}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        split = rendered.rindex(question)
        prefix_text, rest_text = rendered[:split], rendered[split:]
        prefix = tokenizer(prefix_text, add_special_tokens=False, return_tensors="pt").input_ids
        rest = tokenizer(rest_text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        prefix = tokenizer(context + "\n\n", return_tensors="pt").input_ids
        rest = tokenizer(question + "\n", add_special_tokens=False, return_tensors="pt").input_ids
    return prefix, rest


_IDS_VALID = "token ids are ints (a list of int, or an integer tensor)"


def _as_ids(x: TokenInput) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x
    else:
        values = list(x)
        odd = next((v for v in values if isinstance(v, bool) or not isinstance(v, (numbers.Integral, Sequence))), None)
        if odd is not None:
            raise ValueError(f"{_IDS_VALID}, got {type(odd).__name__} {odd!r}: a float or bool id is not a token "
                             "(it would be truncated to another one)")
        try:
            t = torch.tensor(values)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"{_IDS_VALID}, got {values!r:.80} ({err})") from None
        if not values:
            t = t.long()
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        example = t.flatten()[:1].tolist()
        raise ValueError(f"{_IDS_VALID}, got a {str(t.dtype).removeprefix('torch.')} tensor"
                         f"{f' (first value {example[0]!r})' if example else ''}: a float or bool id is not a token "
                         "(it would be truncated to another one)")
    t = t.long()
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[0] != 1:
        raise ValueError(f"token ids must be a 1-D sequence or a [1, n] tensor, got shape {tuple(t.shape)}")
    return t


def cache_kwargs(model: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """``{"cache": cache}``, or ``{"past_key_values": cache}`` for a model whose forward predates the rename.

    transformers 5.x renamed the forward's ``past_key_values=`` to ``cache=``; the transformers that
    kvpress 0.5.5 pins (< 5.3) knows only the old name, and silently ignores ``cache=`` (it would
    build a cache of its own). Read from the model's signature, so either works.
    """
    return {"cache": cache} if "cache" in _forward_parameters(type(model)) else {"past_key_values": cache}


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


STREAM_CHUNK = 512  # a token-by-token prefill's chunk: its peak is the budget + one chunk per layer
FEED_FORWARD_ROWS = 1024  # a prefill forward's feed-forward runs on at most this many tokens at a time


def _feed_forward_in_pieces(forward: Callable[..., torch.Tensor], rows: int, hidden: torch.Tensor, *args: Any,
                            **kwargs: Any) -> torch.Tensor:
    """``forward(hidden)`` of a token-wise module, ``rows`` tokens at a time, written into one output."""
    if hidden.dim() < 2 or hidden.shape[-2] <= rows:
        return forward(hidden, *args, **kwargs)
    out = None
    for start in range(0, hidden.shape[-2], rows):
        piece = forward(hidden[..., start : start + rows, :], *args, **kwargs)
        if not isinstance(piece, torch.Tensor) or piece.shape[-2] != min(rows, hidden.shape[-2] - start):
            raise TypeError(f"{forward!r} returned {type(piece).__name__} {getattr(piece, 'shape', '')}: a feed-forward "
                            "split by tokens must return one tensor per token (pass feed_forward_rows=0)")
        if out is None:
            out = piece.new_empty((*piece.shape[:-2], hidden.shape[-2], piece.shape[-1]))
        out[..., start : start + rows, :] = piece
    return out


@contextlib.contextmanager
def feed_forward_in_pieces(model: torch.nn.Module, rows: int | None = FEED_FORWARD_ROWS) -> Iterator[int]:
    """While inside, each decoder layer's feed-forward (its ``mlp``, token-wise) runs on at most ``rows`` tokens at a
    time; yields how many layers it wraps (0: ``rows`` 0/None, or none).

    A long prefill's largest activations are the feed-forward's (SmolLM2-135M at 8k tokens: ~190 MiB against ~12 MiB
    of keys and values); in pieces the forward's peak is the attention's, and each token's output is the same
    (tests/test_prefill_memory.py). transformers' ``apply_chunking_to_forward`` is the same idea.
    """
    wrapped = []
    if rows:
        for layer in _decoder_layers(model):
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, torch.nn.Module) and "forward" not in vars(mlp):
                mlp.forward = functools.partial(_feed_forward_in_pieces, type(mlp).forward.__get__(mlp), rows)
                wrapped.append(mlp)
    try:
        yield len(wrapped)
    finally:
        for mlp in wrapped:
            del mlp.forward


def prefill_chunk(cache: Cache, tokens: int) -> int:
    """The chunk a prefill of ``tokens`` takes by default: the one that bounds the cache's peak for its policy.

    A block policy (VestigeKV past its ``block_size``) goes a block at a time, each compressed as it closes; a
    token-by-token one (:meth:`Policy.multi_token_window`) ends with the same cache whatever the chunking, so it takes
    :data:`STREAM_CHUNK` tokens; every other policy (its cache depends on where a forward ends) takes the whole context
    in one forward that compresses each layer right after its attention (:meth:`TieredCache.context_end`).
    """
    policy = getattr(cache, "policy", None)
    block = getattr(policy, "block_size", None) if getattr(policy, "schedule", None) == "block" else None
    if block and tokens > block:
        return block
    if policy is not None and policy.multi_token_window(2) is not None and tokens > STREAM_CHUNK:
        return STREAM_CHUNK
    return max(1, tokens)


@torch.no_grad()
def prefill(model: torch.nn.Module, cache: Cache, ids: torch.Tensor, chunk_size: int | None = None, *,
            phase: str = "prefill", ends_context: bool = False,
            feed_forward_rows: int | None = FEED_FORWARD_ROWS) -> torch.Tensor:
    """Run ``ids [B, n]`` through the model into ``cache`` (in chunks of ``chunk_size``, by default
    :func:`prefill_chunk`'s); the last position's logits ``[B, V]``.

    ``ends_context``: a :class:`TieredCache` compresses inside the last forward, each layer right after its attention,
    keeping what :func:`compress` would keep at a lower peak. ``phase`` names it to the progress reporter;
    ``feed_forward_rows``: :func:`feed_forward_in_pieces`'s (0 or None: the whole forward at once).
    """
    if feed_forward_rows is not None and (isinstance(feed_forward_rows, bool) or not isinstance(
            feed_forward_rows, numbers.Integral) or feed_forward_rows < 0):
        raise ValueError(f"feed_forward_rows must be a whole number of tokens >= 1 (0 or None: the whole forward at "
                         f"once), got {feed_forward_rows!r}")
    step = chunk_size or prefill_chunk(cache, ids.shape[1])
    chunks = -(-ids.shape[1] // step) if ids.shape[1] else 0
    logits = None
    pieces = feed_forward_rows if feed_forward_rows and step > feed_forward_rows else None
    # a TieredCache is told it is fed a prompt: a one-token chunk must not end the context (auto_compress)
    holding = cache.prefilling() if isinstance(cache, TieredCache) else contextlib.nullcontext()
    with _layer_ticks(model) as layers, feed_forward_in_pieces(model, pieces), holding:
        for k, start in enumerate(range(0, ids.shape[1], step)):
            _phase(f"{phase} chunk {k + 1}/{chunks}", layers or None, "layers")
            if ends_context and k == chunks - 1 and isinstance(cache, TieredCache):
                cache.context_end()  # each layer compresses right after its attention in this forward
            out = model(input_ids=ids[:, start : start + step].to(model.device), **cache_kwargs(model, cache),
                        use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1]
    return logits


def compress(cache: TieredCache) -> None:
    """The context ended: the cache's ``context_end`` event (every policy compresses here)."""
    _phase("compress")
    cache.compress()


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """The ids that end a generation: the model's generation config's and the tokenizer's EOS."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def check_max_new_tokens(value: Any) -> int:
    """``value`` when it is an int >= 1; a ValueError naming what is valid otherwise (floats, nan, strings, None,
    bools included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {value!r}")
    return int(value)


def max_positions(model: torch.nn.Module) -> int | None:
    """The model's ``max_position_embeddings`` (None when its config declares none)."""
    return config_max_positions(getattr(model, "config", None))


def config_max_positions(config: Any) -> int | None:
    """A model config's ``max_position_embeddings`` (its text model's, for a multimodal one; None: it declares none)."""
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_positions(model: torch.nn.Module, positions: int, what: str) -> None:
    """A ValueError when ``positions`` (what the forwards will run through, described by ``what``) exceed the
    model's ``max_position_embeddings``: positions past it were never trained, the results would be noise."""
    limit = max_positions(model)
    if limit is not None and positions > limit:
        raise ValueError(
            f"{what} need {positions} positions, more than the model's max_position_embeddings ({limit}): "
            f"positions past {limit} were never trained. Give at most {limit} positions (a shorter context, fewer "
            "new tokens)"
        )


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module,
    cache: Cache,
    logits: torch.Tensor,
    max_new_tokens: int,
    eos: set[int],
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy tokens from ``logits [1, V]`` on: up to ``max_new_tokens``, ending at an EOS (kept) or when
    ``stop(tokens)`` says so. The forward of the last token is not run (its logits would not be used)."""
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    tokens: list[int] = []
    _phase("decode", max_new_tokens, "tokens")
    for _ in range(max_new_tokens):
        token = int(logits.argmax(-1))
        tokens.append(token)
        _advance()
        if token in eos or len(tokens) == max_new_tokens or (stop is not None and stop(tokens)):
            break
        out = model(input_ids=torch.tensor([[token]], device=model.device), **cache_kwargs(model, cache), use_cache=True,
                    logits_to_keep=1)
        logits = out.logits[:, -1]
    return tokens


def check_teacher_forcing(mode: Any) -> str:
    if mode not in TEACHER_FORCING:
        raise ValueError(f"mode must be one of {TEACHER_FORCING} ('decode': one decode step per token, as generation "
                         f"reads the cache; 'one_forward': the whole text in one multi-token forward), got {mode!r}")
    return mode


@torch.no_grad()
def teacher_forced_nll(
    model: torch.nn.Module, cache: Cache, lead: torch.Tensor, target: torch.Tensor, last_logits: torch.Tensor,
    mode: str = "one_forward", *, phase: str = "teacher-forced",
) -> list[float]:
    """Per-token NLL (nats) of ``target [1, n]`` fed after ``lead [1, l]``, teacher-forced into ``cache`` (advanced:
    run it on a fork to keep the original).

    ``mode="one_forward"``: ``lead`` and ``target`` in one forward. ``mode="decode"``: ``lead`` in one forward, then
    each target token but the last as its own decode step -- the forwards greedy decoding runs, so a retriever reads
    the archive by its per-step rule. With an empty ``lead``, ``last_logits`` predict target token 0.
    """
    mode = check_teacher_forcing(mode)
    n = target.shape[1]
    if mode == "decode":
        logits = prefill(model, cache, lead, phase=f"{phase}: lead") if lead.shape[1] else last_logits
        steps = [logits.float()]
        ids = target.to(model.device)
        _phase(f"{phase}, one decode step per token", n - 1, "tokens")
        for i in range(n - 1):
            out = model(input_ids=ids[:, i : i + 1], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            steps.append(out.logits[:, -1].float())
            _advance()
        logits = torch.cat(steps, dim=0)  # [n, V]: row i predicts target token i
    else:
        _phase(f"{phase}, one forward")
        tail = torch.cat([lead, target], dim=1).to(model.device)
        if lead.shape[1]:
            logits = model(input_ids=tail, **cache_kwargs(model, cache), use_cache=True,
                           logits_to_keep=n + 1).logits[0, :n].float()
        else:
            out = model(input_ids=tail, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=n).logits
            logits = torch.cat([last_logits.float(), out[0, :-1].float()], dim=0)
    logp = torch.log_softmax(logits, dim=-1)
    return (-logp.gather(-1, target[0].to(logp.device)[:, None])[:, 0]).tolist()


@dataclass
class ContinuationResult:
    """A text teacher-forced right after a compressed context: per-token NLLs and the cross-entropy over the
    ``scored`` tokens (all of them by default)."""

    token_nll: list[float]
    scored: list[int]  # positions in the continuation whose NLL counts
    mode: str  # "decode" or "one_forward" (TEACHER_FORCING)
    stats: CacheStats

    @property
    def ce(self) -> float:
        """Mean NLL (nats/token) over the scored tokens."""
        return sum(self.token_nll[i] for i in self.scored) / len(self.scored)

    def scored_nll(self) -> list[float]:
        return [self.token_nll[i] for i in self.scored]


@dataclass
class DeltaCE:
    """ΔCE of one policy on one continuation: its cross-entropy minus ``full``'s, both measured the same way."""

    delta: float  # nats per scored token
    result: ContinuationResult  # the policy's
    reference: ContinuationResult  # full's (pass it back in as ``reference=`` to measure another policy)

    @property
    def token_deltas(self) -> list[float]:
        """Per scored token: the policy's NLL minus full's (a needle is intact where this is < 1 nat)."""
        return [a - b for a, b in zip(self.result.scored_nll(), self.reference.scored_nll(), strict=True)]


@torch.no_grad()
def continuation_nll(
    model: torch.nn.Module,
    context: TokenInput,
    continuation: TokenInput,
    policy: Policy | str | None = None,
    *,
    tokenizer: Any = None,
    mode: str = "decode",
    scored: Sequence[int] | None = None,
    chunk_size: int | None = None,
    progress: bool = False,
) -> ContinuationResult:
    """Prefill ``context`` under ``policy``, compress, then teacher-force ``continuation`` right after it
    (:func:`teacher_forced_nll`). ``scored``: the positions whose NLL the cross-entropy averages (default all)."""
    mode = check_teacher_forcing(mode)
    if isinstance(context, str) or isinstance(continuation, str):
        if tokenizer is None:
            raise ValueError("context/continuation given as text need a tokenizer; pass token ids to run without one")
    prefix = tokenizer(context, return_tensors="pt").input_ids if isinstance(context, str) else _as_ids(context)
    target = (tokenizer(continuation, add_special_tokens=False, return_tensors="pt").input_ids
              if isinstance(continuation, str) else _as_ids(continuation))
    check_ids(model, "context", prefix, allow_empty=False)
    check_ids(model, "continuation", target, allow_empty=False)
    check_positions(model, prefix.shape[1] + target.shape[1],
                    f"the context ({prefix.shape[1]} tokens) and the continuation ({target.shape[1]})")
    n = target.shape[1]
    scored = list(range(n)) if scored is None else [int(i) for i in scored]
    if not scored or any(i < 0 or i >= n for i in scored):
        raise ValueError(f"scored must name at least one position of the {n}-token continuation (0..{n - 1}), "
                         f"got {scored!r}")
    cache = TieredCache(model, policy, context_length=prefix.shape[1])
    try:
        with _own_progress(progress, "kvzoo continuation"):
            last_logits = prefill(model, cache, prefix.long(), chunk_size, ends_context=True)
            compress(cache)
            token_nll = teacher_forced_nll(model, cache, prefix[:, :0], target.long(), last_logits, mode)
        stats = cache.stats()
    finally:
        cache.close()
    return ContinuationResult(token_nll, scored, mode, stats)


def delta_ce(
    model: torch.nn.Module,
    context: TokenInput,
    continuation: TokenInput,
    policy: Policy | str,
    *,
    reference: ContinuationResult | None = None,
    **options: Any,
) -> DeltaCE:
    """ΔCE (nats per scored token) of ``policy`` on ``continuation`` after ``context``: its :func:`continuation_nll`
    minus ``full``'s, measured alike (``options``); ``reference``: full's result from an earlier call, reused."""
    result = continuation_nll(model, context, continuation, policy, **options)
    if reference is None:
        reference = continuation_nll(model, context, continuation, "full", **options)
    if reference.mode != result.mode or reference.scored != result.scored \
            or len(reference.token_nll) != len(result.token_nll):
        raise ValueError(f"the reference was measured another way ({reference.mode}, {len(reference.token_nll)} tokens, "
                         f"{len(reference.scored)} scored) than this policy ({result.mode}, {len(result.token_nll)} "
                         f"tokens, {len(result.scored)} scored): ΔCE compares the same tokens measured the same way")
    return DeltaCE(result.ce - reference.ce, result, reference)


def check_ids(model: torch.nn.Module, name: str, ids: torch.Tensor, *, allow_empty: bool = True) -> None:
    """ValueError for an empty ``ids`` (when not allowed) or ids outside the model's vocabulary."""
    if ids.shape[1] == 0:
        if allow_empty:
            return
        raise ValueError(f"the {name} is empty (0 tokens): there is nothing to prefill or compress; give at least one token")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None)
    low, high = int(ids.min()), int(ids.max())
    if vocab is not None and (low < 0 or high >= vocab):
        bad = low if low < 0 else high
        raise ValueError(f"the {name} holds token id {bad}, outside the model's vocabulary: valid ids are 0..{vocab - 1}")


def _prompt(model: torch.nn.Module, tokenizer: Any, context: TokenInput, question: TokenInput, question_position: str,
            chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked ``(prefix, rest)`` ids of :func:`generate` and :func:`score`: the prefix is prefilled and compressed,
    so with ``question_position="before"`` it holds the question too (and ``rest`` is empty)."""
    if question_position not in QUESTION_POSITIONS:
        raise ValueError(f"question_position must be one of {QUESTION_POSITIONS}, got {question_position!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None (one-shot prefill) or an int >= 1, got {chunk_size!r}")
    prefix, rest = build_prompt(tokenizer, context, question)
    check_ids(model, "context", prefix, allow_empty=False)
    check_ids(model, "question", rest)
    if question_position == "before":
        return torch.cat([prefix, rest], dim=1), rest[:, :0]
    return prefix, rest


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    context: TokenInput,
    question: TokenInput,
    policy: Policy | str | None = None,
    *,
    max_new_tokens: int = 32,
    question_position: str = "after",
    chunk_size: int | None = None,
    audit: bool = False,
    progress: bool = False,
) -> GenerationResult:
    """Prefill ``context``, compress it, then prefill ``question`` and decode greedily.

    ``policy``: a Policy, a registered name, or None (``full``). The result holds the answer, the new token ids,
    ``cache.stats()`` and the timings of each phase (``prefill_s``, ``compress_s``, ``question_s``, ``decode_s``).
    ``audit=True`` also scores every archived row exactly, to count bound violations (slow).
    """
    prefix, rest = _prompt(model, tokenizer, context, question, question_position, chunk_size)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    check_positions(model, prefix.shape[1] + rest.shape[1] + max_new_tokens - 1,
                    f"the prompt ({prefix.shape[1] + rest.shape[1]} tokens) and max_new_tokens={max_new_tokens}")
    cache = TieredCache(model, policy, context_length=prefix.shape[1], audit=audit)
    timings: dict[str, float] = {}
    with _own_progress(progress, "kvzoo generate"):
        t0 = time.perf_counter()
        logits = prefill(model, cache, prefix, chunk_size, ends_context=True)
        t1 = time.perf_counter()
        compress(cache)
        t2 = time.perf_counter()
        if rest.shape[1]:
            logits = prefill(model, cache, rest, chunk_size, phase="question")
        t3 = time.perf_counter()
        eos = eos_ids(model, tokenizer)
        new_tokens = greedy_decode(model, cache, logits, max_new_tokens, eos)
        t4 = time.perf_counter()
    timings.update(prefill_s=t1 - t0, compress_s=t2 - t1, question_s=t3 - t2, decode_s=t4 - t3)
    answer_ids = [t for t in new_tokens if t not in eos]
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True) if tokenizer is not None else ""
    return GenerationResult(
        answer=answer,
        token_ids=new_tokens,
        stats=cache.stats(),
        timings=timings,
        context_tokens=prefix.shape[1],
        question_tokens=rest.shape[1],
        cache=cache,
    )


@torch.no_grad()
def score(
    model: torch.nn.Module,
    tokenizer: Any,
    context: TokenInput,
    question: TokenInput,
    answer: TokenInput,
    policy: Policy | str | None = None,
    *,
    question_position: str = "after",
    chunk_size: int | None = None,
    audit: bool = False,
    mode: str = "one_forward",
    progress: bool = False,
) -> ScoreResult:
    """Teacher-forced NLL (nats) of ``answer`` given the compressed context and the question.

    ``mode`` is :func:`teacher_forced_nll`'s: with a retriever the two differ, as a multi-token forward reads the
    archive by the retriever's ``multi_token`` rule (default ``"dense"``: all of it), a decode step by its per-step rule.
    """
    check_teacher_forcing(mode)
    prefix, rest = _prompt(model, tokenizer, context, question, question_position, chunk_size)
    if isinstance(answer, str):
        if tokenizer is None:
            raise ValueError("an answer given as text needs a tokenizer")
        answer_ids = tokenizer(answer, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        answer_ids = _as_ids(answer)
    if answer_ids.shape[1] == 0:
        raise ValueError("answer is empty: nothing to score")
    check_ids(model, "answer", answer_ids)
    check_positions(model, prefix.shape[1] + rest.shape[1] + answer_ids.shape[1],
                    f"the prompt ({prefix.shape[1] + rest.shape[1]} tokens) and the answer ({answer_ids.shape[1]})")
    cache = TieredCache(model, policy, context_length=prefix.shape[1], audit=audit)
    with _own_progress(progress, "kvzoo score"):
        first_logits = prefill(model, cache, prefix, chunk_size, ends_context=True)
        compress(cache)
        token_nll = teacher_forced_nll(model, cache, rest, answer_ids, first_logits, mode)
    n_ans = answer_ids.shape[1]
    return ScoreResult(
        nll=float(sum(token_nll)),
        token_nll=token_nll,
        stats=cache.stats(),
        answer_tokens=n_ans,
        cache=cache,
    )
