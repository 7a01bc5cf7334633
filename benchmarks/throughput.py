"""Decode throughput under a KV memory budget: the largest batch each arm fits, and its aggregate tokens/s (CPU).

    .venv/bin/python benchmarks/throughput.py --context 8192 --budget-gib 2 --json docs/results/throughput.jsonl
    .venv/bin/python benchmarks/throughput.py --context 32768 --budget-gib 2 --group 1 --json docs/results/throughput.jsonl
    .venv/bin/python benchmarks/throughput.py --scaling --context 8192 --json docs/results/throughput.jsonl
    .venv/bin/python benchmarks/throughput.py --toy           # tiny random Llama, seconds: the mechanics only

What compression is worth to a server: more sequences in the same memory, so more tokens per second. Every arm starts
from the same rows, built as ``decode_step.py`` builds them: one dense prefill of the context's first ``context -
tail`` tokens is copied into each arm's cache (:meth:`TieredCache.transplant`; ``transformers``: the same rows in a
``DynamicCache`` on a copy of the model kvzoo never attached to), the last ``tail`` tokens run for real under the arm's
policy, and the policy compresses (``cache.compress()``). The dense rows are stored with room for the decode steps to
come (64 rows more than the run takes), so ``full``'s storage never grows by a quarter mid-run; that room is
``full``'s (and the archive's) to hold, and counted. Then, at batch 1, two decode steps, and the bytes the arm
keeps for its one sequence are counted: every tensor the cache holds (:func:`held_bytes`: the attended tier, the
archive a retriever fetches from, its index, spare capacity, positions, flags and kept queries), storage by storage,
not what its live rows would need. The arm's batch is the budget (``--budget-gib``) over those bytes, at most
``--max-batch``; the cache is repeated to that batch (``cache.batch_repeat_interleave``), and after the timed steps the
bytes it holds are counted again and checked against the budget (``bytes_at_batch``, ``within_budget``).

Then the arms decode one step each in turn, ``--rounds`` rounds (after two warm-up steps): the 1-thread CPU time of
a step (``time.thread_time``: load on a shared machine does not enter it), and in a second pass, when ``--threads``
asks, the 2-thread wall time. An arm's aggregate decode rate is its batch over its step time; the figure is its ratio
to ``full``'s in the same interleaving. Holding every arm at its budget at once takes (arms x budget) of memory:
``--group N`` measures the other arms N at a time, each group beside a ``full`` of its own (rebuilt from the same
rows), ratios within the group.

Every sequence of a batch is the same prefilled sequence repeated, each fed its own random token per step: the cost
of a step does not depend on the tokens (a retriever's fetched rows do, a little), and one shared prefill serves
every batch. A ragged batch (sequences of other lengths, left-padded) decodes each sequence as it decodes alone:
``tests/test_throughput.py`` holds that for every policy on a tiny model, with the exceptions it names.

``--scaling``: for each arm (default ``full``, ``snapkv@8``, ``vestige@8``), a step at batch 1 and at batch 8 of the
same rows, interleaved; the figure is the per-sequence cost, (batch-8 step time / 8) over batch 1's (goal, issue 47:
<= 0.5 at 8k). ``--group 1`` holds one arm's two caches at a time.

Arms are ``decode_step.py``'s: ``transformers`` or a registered policy with ``@RATIO`` (``full``: none).
OpenMP's idle threads spin by default; this script sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
import weakref  # noqa: E402
from typing import Any  # noqa: E402

import decode_step  # noqa: E402  (before torch: it sets OMP_WAIT_POLICY)
import torch  # noqa: E402

from kvzoo import TieredCache  # noqa: E402
from kvzoo.framework.attention import detach  # noqa: E402
from kvzoo.framework.memory import release_freed  # noqa: E402

ARMS = "full,transformers,snapkv@32,streaming_llm@32,vestige@32,quest@32,snapkv@8,streaming_llm@8"
SCALING_ARMS = "full,snapkv@8,vestige@8"
TOY = {"model": "tiny-llama", "context": 384, "tail": 16, "budget_gib": 2 / 1024, "rounds": 2, "threads": "1",
       "arms": "full,transformers,snapkv@8,streaming_llm@8,vestige@8,quest@8"}
WARMUP = 2  # decode steps before anything is counted or timed (at batch 1, and again at the arm's batch)
MiB = 2**20


# --- what an arm keeps ---------------------------------------------------------------------------------------


def _storages(obj: Any) -> dict[int, tuple[int, str]]:
    """Every tensor storage reachable from ``obj`` through attributes, dicts and sequences -- not through a module (the
    model's weights) or a weak reference --: ``data_ptr -> (bytes, the first path that reached it)``."""
    found: dict[int, tuple[int, str]] = {}
    seen: set[int] = set()
    todo: list[tuple[Any, str]] = [(obj, "")]
    while todo:
        item, path = todo.pop()
        if id(item) in seen or item is None or isinstance(item, (str, bytes, int, float, bool, type, weakref.ref,
                                                                 types.ModuleType, types.FunctionType,
                                                                 types.MethodType, torch.nn.Module)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in found:
                found[storage.data_ptr()] = (storage.nbytes(), path)
            continue
        if isinstance(item, dict):
            todo += [(v, f"{path}[{k!r}]") for k, v in item.items()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo += [(v, f"{path}[{i}]") for i, v in enumerate(item)]
        else:
            fields = getattr(item, "__dict__", None)
            if fields is not None:
                todo += [(v, f"{path}.{k}") for k, v in fields.items() if k != "adapter"]  # the adapter: the model's
            for name in getattr(type(item), "__slots__", ()):
                if hasattr(item, name):
                    todo.append((getattr(item, name), f"{path}.{name}"))
    return found


def held_bytes(cache: Any) -> dict[str, int]:
    """Bytes ``cache`` holds, by what they hold: ``tier`` (the attended rows' keys and values), ``archive`` (evicted rows
    kept bit-exact for a retriever, in the same memory), ``index`` (the retriever's entries over them), ``other``
    (spare capacity, slots, validity flags, position lists, kept queries, counters) and ``total`` (every storage the
    cache reaches, each once). A ``DynamicCache``: its keys and values, all ``tier``."""
    storages = _storages(cache)
    total = sum(size for size, _ in storages.values())
    if not isinstance(cache, TieredCache):
        return {"total": total, "tier": total, "archive": 0, "index": 0, "other": 0}
    totals = cache.stats().totals
    index = sum(size for size, _ in _storages([layer.store.archive.index for layer in cache.tiered_layers]).values())
    tier, archive = int(totals["resident_bytes"]), int(totals["archived_bytes"])
    return {"total": total, "tier": tier, "archive": archive, "index": index, "other": total - tier - archive - index}


def holds_text(held: dict[str, int], batch: int = 1) -> str:
    """``held``'s parts per sequence, in MiB, for the table ("tier 11.2, other 3.1")."""
    names = {"tier": "tier", "archive": "archive (CPU, bit-exact)", "index": "index", "other": "other"}
    parts = [f"{label} {held[key] / batch / MiB:.1f}" for key, label in names.items() if held[key] / batch >= 0.05 * MiB]
    return ", ".join(parts) + " MiB"


def fit_batch(per_sequence: int, budget: int, max_batch: int) -> int:
    """The most sequences of ``per_sequence`` bytes that ``budget`` bytes hold, at most ``max_batch`` (0: not one)."""
    return min(max_batch, budget // per_sequence) if per_sequence > 0 else max_batch


# --- building the arms -----------------------------------------------------------------------------------------


class Setup:
    """The model, its kvzoo-free copy (``transformers``), the context's ids and the shared dense prefill of its head."""

    def __init__(self, model_name: str, context: int, tail: int, room: int, max_batch: int, steps: int,
                 prefill_threads: int | None = None) -> None:
        from kvzoo.models import load_model

        self.model, _ = load_model(model_name)
        self.model_name, self.context, self.tail = model_name, context, tail
        vocab = self.model.config.vocab_size
        low, high = min(100, vocab // 4), min(40000, vocab)
        self.ids = torch.randint(low, high, (1, context), generator=torch.Generator().manual_seed(0))
        # each sequence of a batch its own token per step: [max_batch, steps]
        self.decode_ids = torch.randint(low, high, (max_batch, steps), generator=torch.Generator().manual_seed(1))
        self.head = context - tail
        self.plain = None
        threads = torch.get_num_threads()
        torch.set_num_threads(prefill_threads or threads)
        t = time.perf_counter()
        with torch.no_grad():
            # room for the decode steps to come: a full cache's storage then never grows by a quarter mid-run. No
            # record_window: an arm keeps the queries its own policy keeps (its tail records them), no more
            self.shared = TieredCache(self.model, "full", context_length=context + room)
            for start in range(0, self.head, 1024):
                self.model(input_ids=self.ids[:, start : min(self.head, start + 1024)], cache=self.shared,
                           use_cache=True, logits_to_keep=1)
        self.prefill_s = time.perf_counter() - t
        torch.set_num_threads(threads)
        self.position = 0  # the next decode_ids column

    def build(self, arm: str) -> tuple[Any, Any]:
        """``(model, cache)`` of ``arm`` at batch 1: the shared rows, the tail under the arm's policy, compressed, then
        :data:`WARMUP` decode steps."""
        policy, _ = decode_step.parse_arm(arm)
        with torch.no_grad():
            if policy is None:
                if self.plain is None:
                    self.plain = copy.deepcopy(self.model)
                    detach(self.plain)
                model, cache = self.plain, decode_step.dynamic_cache(self.shared, self.plain)
            else:
                model, cache = self.model, decode_step.transplant(self.shared, policy, context=self.context,
                                                                  capacity=None)
            model(input_ids=self.ids[:, self.head :], cache=cache, use_cache=True, logits_to_keep=1)
            if hasattr(cache, "compress"):
                cache.compress()
            for i in range(WARMUP):
                model(input_ids=self.decode_ids[:1, i : i + 1], cache=cache, use_cache=True)
        return model, cache

    def tokens(self, batch: int) -> torch.Tensor:
        """The next step's token per sequence, ``[batch, 1]`` (every arm's first sequences get the same ones)."""
        column = WARMUP + self.position % (self.decode_ids.shape[1] - WARMUP)
        return self.decode_ids[:batch, column : column + 1]


def repeat(cache: Any, batch: int) -> Any:
    """``cache`` repeated to ``batch`` sequences, in place (every sequence the same rows)."""
    if batch > 1:
        cache.batch_repeat_interleave(batch)
    return cache


def copy_of(cache: Any) -> Any:
    return cache.fork() if isinstance(cache, TieredCache) else copy.deepcopy(cache)


def interleave(setup: Setup, runs: dict[str, tuple[Any, Any, int]], rounds: int, threads: list[int]
               ) -> dict[str, dict[str, float]]:
    """Each run ``name -> (model, cache, batch)`` decodes one step in turn, :data:`WARMUP` untimed rounds then
    ``rounds`` timed ones, per thread count: the median step seconds (``cpu_s_1t``: 1-thread CPU time;
    ``wall_s_Nt``: wall time at N threads)."""
    out: dict[str, dict[str, float]] = {name: {} for name in runs}
    with torch.no_grad():
        for n in threads:
            torch.set_num_threads(n)
            clock = time.thread_time if n == 1 else time.perf_counter
            times: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(WARMUP + rounds):
                for name, (model, cache, batch) in runs.items():
                    token = setup.tokens(batch)
                    t = clock()
                    model(input_ids=token, cache=cache, use_cache=True)
                    spent = clock() - t
                    if r >= WARMUP:
                        times[name].append(spent)
                setup.position += 1
            for name in runs:
                out[name]["cpu_s_1t" if n == 1 else f"wall_s_{n}t"] = statistics.median(times[name])
    return out


# --- the two measurements --------------------------------------------------------------------------------------


def budget_rows(setup: Setup, arms: list[str], budget: int, max_batch: int, rounds: int, threads: list[int],
                group: int, log=print) -> list[dict[str, Any]]:
    """One row per arm: its bytes per sequence, the batch the budget holds, its step time and tokens/s at that batch,
    and the ratio to ``full``'s tokens/s measured in the same interleaving (module docstring)."""
    others = [a for a in arms if a != "full"]
    groups = [others[i : i + group] for i in range(0, len(others), group)] if group else [others]
    groups = [(["full"] if "full" in arms else []) + g for g in groups] or [["full"]]
    rows: dict[str, dict[str, Any]] = {}
    for members in groups:
        runs, held1 = {}, {}
        for arm in members:
            model, cache = setup.build(arm)
            held1[arm] = held_bytes(cache)
            batch = fit_batch(held1[arm]["total"], budget, max_batch)
            log(f"# {arm}: {held1[arm]['total'] / MiB:.1f} MiB per sequence ({holds_text(held1[arm])}); batch {batch}")
            if batch:
                runs[arm] = (model, repeat(cache, batch), batch)
        times = interleave(setup, runs, rounds, threads) if runs else {}
        full_rate = {k: runs["full"][2] / v for k, v in times["full"].items()} if "full" in times else {}
        for arm in members:
            if arm in rows and arm == "full":
                continue  # the first group's full is the row; later groups' only their ratios' reference
            held = held1[arm]
            row: dict[str, Any] = {
                "arm": arm, "context": setup.context, "budget_gib": budget / 2**30, "max_batch": max_batch,
                "per_sequence_bytes": held["total"], "per_sequence_mib": held["total"] / MiB,
                "holds": {k: v / MiB for k, v in held.items() if k != "total"}, "holds_text": holds_text(held),
                "batch": 0, "batch_capped": False, "group": members,
            }
            if arm in runs:
                model, cache, batch = runs[arm]
                at_batch = held_bytes(cache)["total"]
                row.update(batch=batch, batch_capped=batch == max_batch and budget // held["total"] > max_batch,
                           bytes_at_batch=at_batch, gib_at_batch=at_batch / 2**30, within_budget=at_batch <= budget)
                for key, seconds in times[arm].items():
                    row[f"step_{key}"] = seconds
                    rate = batch / seconds
                    row[f"tokens_per_s_{key[-2:]}"] = rate
                    if key in full_rate:
                        row[f"ratio_to_full_{key[-2:]}"] = rate / full_rate[key]
                        row[f"full_tokens_per_s_{key[-2:]}"] = full_rate[key]
            else:
                row["note"] = f"one sequence ({held['total'] / MiB:.0f} MiB) exceeds the budget"
            rows[arm] = row
            log(f"# {arm}: batch {row['batch']}, " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                                                  if k.startswith(("step_", "tokens_", "ratio_"))))
        runs = model = cache = None  # the group's caches go before the next group's are built
        setup.plain = None  # the DynamicCache arm's copy of the model, made again when a group needs it
        gc.collect()
        release_freed()  # the C heap's free pages back to the system before the next group's caches
    return [rows[a] for a in arms if a in rows]


def scaling_rows(setup: Setup, arms: list[str], batch: int, rounds: int, threads: list[int], group: int,
                 log=print) -> list[dict[str, Any]]:
    """Per arm, a step at batch 1 and at ``batch`` of the same rows, interleaved: two rows, the second with the
    per-sequence cost ``(step at batch / batch) / step at 1``."""
    groups = [arms[i : i + group] for i in range(0, len(arms), group)] if group else [arms]
    rows = []
    for members in groups:
        runs, held = {}, {}
        for arm in members:
            model, cache = setup.build(arm)
            held[arm] = held_bytes(cache)
            runs[(arm, 1)] = (model, cache, 1)
            runs[(arm, batch)] = (model, repeat(copy_of(cache), batch), batch)
        times = interleave(setup, runs, rounds, threads)
        for arm in members:
            for b in (1, batch):
                row: dict[str, Any] = {"arm": arm, "context": setup.context, "batch": b,
                                       "per_sequence_bytes": held[arm]["total"],
                                       "per_sequence_mib": held[arm]["total"] / MiB,
                                       "holds": {k: v / MiB for k, v in held[arm].items() if k != "total"},
                                       "holds_text": holds_text(held[arm]), "group": members}
                for key, seconds in times[(arm, b)].items():
                    row[f"step_{key}"] = seconds
                    row[f"tokens_per_s_{key[-2:]}"] = b / seconds
                    row[f"per_sequence_cost_vs_batch1_{key[-2:]}"] = seconds / b / times[(arm, 1)][key]
                rows.append(row)
                log(f"# {arm} batch {b}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                                       if k.startswith(("step_", "per_sequence_cost"))))
        runs = model = cache = None
        setup.plain = None
        gc.collect()
        release_freed()
    return rows


# --- output ------------------------------------------------------------------------------------------------------


def provenance(setup: Setup, load_start: float | None, started: float) -> dict[str, Any]:
    from kvzoo.bench.results import versions

    return {"model": setup.model_name, "tail": setup.tail, "prefill_s": setup.prefill_s,
            "versions": versions(), "finished_at": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "load_start": load_start, "load_end": _load(), "run_s": time.perf_counter() - started,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def markdown(rows: list[dict[str, Any]], scaling: bool) -> str:
    keys = sorted({k for r in rows for k in r if k.startswith("step_")})
    if scaling:
        head = ["arm", "batch", "MiB per sequence"] + [f"{k[5:]} ms" for k in keys] + \
               [f"per-sequence cost vs batch 1 ({k[-2:]})" for k in keys]
        lines = [f"| {r['arm']} | {r['batch']} | {r['per_sequence_mib']:.1f} | "
                 + " | ".join(f"{1e3 * r[k]:.0f}" for k in keys) + " | "
                 + " | ".join(f"{r['per_sequence_cost_vs_batch1_' + k[-2:]]:.2f}" for k in keys) + " |" for r in rows]
    else:
        head = ["arm", "MiB per sequence", "holds", "batch", "GiB at batch"] + \
               [h for k in keys for h in (f"{k[5:]} ms", f"tokens/s ({k[-2:]})", "x full")]

        def cells(r: dict[str, Any]) -> str:
            out = [r["arm"], f"{r['per_sequence_mib']:.1f}", r["holds_text"],
                   f"{r['batch']}{' (cap)' if r['batch_capped'] else ''}", f"{r.get('gib_at_batch', 0):.2f}"]
            for k in keys:
                rate = r.get(f"tokens_per_s_{k[-2:]}")
                ratio = r.get(f"ratio_to_full_{k[-2:]}")
                out += [f"{1e3 * r[k]:.0f}" if k in r else "-", f"{rate:.1f}" if rate else "-",
                        f"{ratio:.2f}" if ratio else "-"]
            return "| " + " | ".join(out) + " |"

        lines = [cells(r) for r in rows]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (real weights, offline) or tiny-llama")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--budget-gib", type=float, default=2.0, help="KV memory budget of each arm, GiB (default 2)")
    p.add_argument("--max-batch", type=int, default=128, help="the largest batch tried (a row says when it caps one)")
    p.add_argument("--arms", default=None, help=f"comma-separated (default {ARMS}; --scaling: {SCALING_ARMS})")
    p.add_argument("--rounds", type=int, default=5, help="timed interleaved rounds per pass")
    p.add_argument("--tail", type=int, default=64, help="context tokens each arm runs for real after the shared rows")
    p.add_argument("--threads", default="1", help="passes: 1 = thread CPU time, >1 = wall time (e.g. 1,2)")
    p.add_argument("--prefill-threads", type=int, default=None, help="threads of the shared prefill (default: torch's)")
    p.add_argument("--group", type=int, default=0, help="arms held at once besides full (0: all; module docstring)")
    p.add_argument("--scaling", action="store_true", help="batch 1 against --scaling-batch per arm instead")
    p.add_argument("--scaling-batch", type=int, default=8)
    p.add_argument("--toy", action="store_true", help="a tiny random Llama at toy sizes (seconds)")
    p.add_argument("--json", help="append the rows here (JSON lines)")
    args = p.parse_args(argv)
    if args.toy:
        for key, value in TOY.items():
            if key != "arms" or args.arms is None:
                setattr(args, key, value)
    arms = (args.arms or (SCALING_ARMS if args.scaling else ARMS)).split(",")
    threads = [int(x) for x in args.threads.split(",")]
    started, load_start = time.perf_counter(), _load()
    torch.manual_seed(0)
    print(f"# {decode_step.OMP_NOTE}; torch {torch.__version__}; {platform.processor() or platform.machine()}; "
          f"torch threads {torch.get_num_threads()}")
    steps = WARMUP * 2 + (args.rounds + WARMUP) * len(threads) + 8
    setup = Setup(args.model, args.context, args.tail, room=steps + 64,
                  max_batch=max(args.max_batch, args.scaling_batch), steps=steps, prefill_threads=args.prefill_threads)
    print(f"# shared prefill of {setup.head} tokens: {setup.prefill_s:.0f} s")
    budget = int(args.budget_gib * 2**30)
    if args.scaling:
        rows = scaling_rows(setup, arms, args.scaling_batch, args.rounds, threads, args.group)
    else:
        rows = budget_rows(setup, arms, budget, args.max_batch, args.rounds, threads, args.group)
    setup.shared.close()
    print(f"\n{args.context} tokens, " + (f"batch 1 and {args.scaling_batch}" if args.scaling else
                                          f"KV budget {args.budget_gib:g} GiB per arm, at most {args.max_batch}")
          + f"; {args.rounds} interleaved rounds, median step\n")
    print(markdown(rows, args.scaling))
    extra = provenance(setup, load_start, started)
    mode = "scaling" if args.scaling else "budget"
    rows = [{**r, "mode": mode, "rounds": args.rounds, **extra} for r in rows]
    if args.json:
        decode_step.append_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
