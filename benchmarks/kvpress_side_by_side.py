"""A kvzoo policy beside kvpress's press and transformers' own prefill, on SmolLM2-135M, a needle context, the
question after compression.

Arms (``--policy`` at ``--ratio``, 8 by default: each compressing arm keeps 1/8 of the context rows):

* ``kvpress``       -- kvpress's pipeline with its press for the policy (``PRESSES``: ``SnapKVPress``; for
  ``chunkkv`` its ``ChunkKVPress`` around ``SnapKVPress``, chunks of 10; for ``vestige``, which has no kvpress
  counterpart, ``SnapKVPress`` of the same size), ``compression_ratio = 1 - 1/ratio``;
* ``kvzoo``         -- kvzoo's runtime (``kvzoo.pipeline.generate``'s steps: ``TieredCache``, the default prefill,
  which compresses each layer right after its attention in the context's last forward, as kvpress's hooks do; the
  question; greedy decoding) with the policy's defaults (an eviction-only policy drops what it evicts, as kvpress
  does; ``vestige`` keeps its bit-exact archive, which its retriever reads);
* ``kvpress+kvzoo`` -- kvpress's pipeline with ``to_press(registry.get(policy, ratio=ratio))`` (not for ``vestige``);
* ``transformers``  -- transformers' own prefill of the same context into a ``DynamicCache`` (nothing compressed),
  then the same question and decoding: the yardstick for the prefill's wall (``kvzoo/transformers prefill``).

Every arm records its whole call and, apart, its prefill (the context's forward(s) and compression: kvzoo's
``prefill``, transformers' forward, kvpress's first forward of the base model, its press hooks inside).

Interleaved: every round runs each arm once, in a fresh process of its own, the arms' order rotated from round to
round, so a drift in the machine's load falls on every arm alike. Every arm reads the same token ids (the context and
the question as kvpress's pipeline tokenizes them, prepared once in a process of their own and handed to each arm;
the kvpress arms run the pipeline's ``forward`` on them, which is its ``__call__`` less the tokenization). A process
loads the model, makes one warm-up call (the whole context unless ``--warmup-tokens``: a 256-token warm-up left
the timed call paying first-touch costs unevenly between the arms), then times one whole call: the context's
prefill and compression, the question, greedy decoding (``--max-new-tokens``, ending early at EOS). Peak memory is
the timed call's peak RSS (``peak_rss_mib``: everything resident -- model, libraries and the call; the process's peak
is reset right before the call by ``kvzoo.allocator.mark_model``, so the load's and the warm-up's peaks are not
counted), the same peak over the loaded model (``peak_rss_over_model_mib``: less the RSS right before the call, after
the load and the warm-up: the weights and libraries left out, kvpress's imports -- ``datasets``, ``pandas``, ~90 MiB
-- among them), the same for the prefill alone (``prefill_peak_rss_over_model_mib``: the peak when the prefill
ended, compression included), and what the call added over the process's peak after the warm-up
(``call_peak``, as earlier rows recorded it); tokens generated are counted, and the call's CPU time
(``time.process_time``, every thread; OpenMP's idle threads sleep: ``OMP_WAIT_POLICY=PASSIVE`` unless set), which
other processes on the machine disturb less than the wall time. glibc's mmap threshold is fixed at 4 MiB in every arm
alike (``kvzoo.allocator.prefer_mmap_threshold``, as the ``kvzoo`` command does; ``KVZOO_MMAP_THRESHOLD=0``: glibc's
dynamic one), recorded as ``mmap_threshold``. Per round: each arm's wall time, CPU time and peak, and the ratios
kvzoo / kvpress and kvpress+kvzoo / kvpress; then their medians over the rounds. The load average
(``os.getloadavg``) is recorded beside every process: on a shared machine, read the ratios, not the seconds.

Runs only in kvpress's environment: ``.venv-kvpress/bin/python benchmarks/kvpress_side_by_side.py``
(``make venv-kvpress`` builds it; with another kvpress environment, put this checkout first on ``PYTHONPATH``).
Issue 32's runs: ``--context-tokens 2000,8000,16000`` (snapkv), then
``--policy chunkkv --context-tokens 8000`` and ``--policy vestige --context-tokens 8000``, each ``--rounds 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from kvzoo.allocator import mark_model, mmap_threshold, peak_over_model, peak_rss_mib, prefer_mmap_threshold

MALLOC_NOTE = prefer_mmap_threshold()  # every arm alike: exported to the processes this one starts

ARMS = ("kvpress", "kvzoo", "kvpress+kvzoo", "transformers")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def prepare(context_tokens: int, path: str) -> None:
    """The token ids every arm reads: kvpress's pipeline's tokenization of a needle task (``niah_single``)."""
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    import torch
    from transformers import pipeline

    from kvzoo.bench.tasks import make_task
    from kvzoo.models import load_smollm2

    model, tokenizer = load_smollm2(torch.float32)
    task = make_task("niah_single", tokenizer, context_tokens=context_tokens, depth=0.5)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    ids = pipe.preprocess(task.context, questions=[task.question], answer_prefix="", max_context_length=10**9)
    torch.save({"context_ids": ids["context_ids"], "question_ids": ids["questions_ids"][0],
                "answers": list(task.answers)}, path)


PRESSES = {  # the policy -> kvpress's press it is measured against
    "snapkv": "SnapKVPress",
    "chunkkv": "ChunkKVPress(SnapKVPress, chunk_length=10)",
    "vestige": "SnapKVPress",  # kvpress has no query-independent press that keeps an archive: its SnapKV, same size
}


def _press(policy: str, ratio: float):
    import kvpress

    snap = kvpress.SnapKVPress(compression_ratio=1 - 1 / ratio)
    return kvpress.ChunkKVPress(press=snap, chunk_length=CHUNK) if policy == "chunkkv" else snap


def _timed_first_forward(module, record: dict) -> None:
    """Time ``module``'s first forward after ``record`` is cleared (kvpress's pipeline: the context's prefill, its
    press hooks compressing each layer inside it)."""
    import time

    def pre(*_):
        if "t0" not in record:
            record["t0"] = (time.perf_counter(), time.process_time())

    def post(*_):
        if "prefill_s" not in record:
            t0, c0 = record["t0"]
            record["prefill_s"], record["prefill_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
            record["prefill_peak_rss_mib"] = peak_rss_mib()

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


CHUNK = 10  # ChunkKV's chunk length (the paper's c), in both arms


def run_arm(arm: str, ids_path: str, max_new_tokens: int, warmup_tokens: int | None, policy: str,
            ratio: float) -> dict:
    import torch
    from transformers import DynamicCache, pipeline

    from kvzoo import registry
    from kvzoo.framework.cache import TieredCache
    from kvzoo.models import load_smollm2
    from kvzoo.pipeline import cache_kwargs, eos_ids, greedy_decode, prefill

    torch.manual_seed(0)
    model, tokenizer = load_smollm2(torch.float32)
    prepared = torch.load(ids_path)
    context_ids, question_ids = prepared["context_ids"], prepared["question_ids"]
    if policy == "chunkkv":
        # kvpress's ChunkKVPress keeps a partial last chunk in some layers and not in others, so the layers' lengths
        # differ and the question's forward fails on the attention mask (kvpress 0.5.5): every arm gets a context
        # of whole chunks (the warm-up too)
        context_ids = context_ids[:, : context_ids.shape[1] // CHUNK * CHUNK]
        warmup_tokens = warmup_tokens and max(CHUNK, warmup_tokens // CHUNK * CHUNK)
    record: dict = {}

    def clock(fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        record["prefill_s"], record["prefill_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        record["prefill_peak_rss_mib"] = peak_rss_mib()
        return out

    if arm in ("kvzoo", "transformers"):
        def call(context: torch.Tensor, new_tokens: int) -> tuple[str, list[int], int]:
            if arm == "kvzoo":  # kvzoo.pipeline.generate's steps: the default prefill (compressing inside it)
                cache = TieredCache(model, registry.get(policy, ratio=ratio), context_length=context.shape[1])
                clock(lambda: prefill(model, cache, context, ends_context=True))
                kept = [layer.store.n for layer in cache.tiered_layers]
            else:  # transformers' own prefill of the same tokens into its DynamicCache, nothing compressed
                cache = DynamicCache()
                clock(lambda: model(input_ids=context, **cache_kwargs(model, cache), use_cache=True,
                                    logits_to_keep=1))
                kept = [layer.keys.shape[2] for layer in cache.layers]
            logits = prefill(model, cache, question_ids, phase="question")
            tokens = greedy_decode(model, cache, logits, new_tokens, eos_ids(model, tokenizer))
            return tokenizer.decode(tokens, skip_special_tokens=True), kept, len(tokens)
    else:
        import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)

        from kvzoo.integrations.kvpress import to_press

        pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
        forwards = [0]  # the pipeline's lm_head forwards: the question's, then one per further token
        model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        _timed_first_forward(model.model, record)

        def call(context: torch.Tensor, new_tokens: int) -> tuple[str, list[int], int]:
            press = _press(policy, ratio) if arm == "kvpress" else to_press(registry.get(policy, ratio=ratio))
            cache = DynamicCache()
            forwards[0] = 0
            out = pipe.forward({"context_ids": context, "questions_ids": [question_ids]}, press=press, cache=cache,
                               max_new_tokens=new_tokens)
            return out[0], [layer.keys.shape[2] for layer in cache.layers], forwards[0]

    with torch.no_grad():
        call(context_ids[:, :warmup_tokens], max_new_tokens)  # None: the whole context
        warm_peak = _peak_mib()
        model_rss = mark_model()  # the peak counts from here: the load's and the warm-up's are not the call's
        record.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        answer, kept, generated = call(context_ids, max_new_tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "arm": arm, "policy": policy, "ratio": ratio, "context_tokens": context_ids.shape[1],
        "question_tokens": question_ids.shape[1], "kept_rows_per_layer": sorted(set(kept)), "layers": len(kept),
        "tokens_generated": generated, "wall_s": wall, "cpu_s": cpu, "prefill_s": record.get("prefill_s"),
        "prefill_cpu_s": record.get("prefill_cpu_s"), **peak_over_model(model_rss),
        "prefill_peak_rss_over_model_mib": record["prefill_peak_rss_mib"] - model_rss,
        "peak_rss_after_warmup_mib": warm_peak, "answer": answer.strip(),
        "needle_found": all(a in answer for a in prepared["answers"]), "threads": torch.get_num_threads(),
        "mmap_threshold": mmap_threshold(),
    }


def _child(*args: str) -> str:
    # idle OpenMP threads sleep (unless the caller set a policy): on a shared machine spinning threads fight the other
    # processes for the cores, and their spinning would count as CPU time
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def side_by_side(context_tokens: int, rounds: int, max_new_tokens: int, arms: tuple[str, ...],
                 warmup_tokens: int | None = None, policy: str = "snapkv", ratio: float = 8) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ids_path = os.path.join(tmp, "ids.pt")
        _child("--prepare", ids_path, "--context-tokens", str(context_tokens))
        runs = []
        for r in range(rounds):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            for arm in order:
                load_before = os.getloadavg()
                row = json.loads(_child("--arm", arm, "--ids", ids_path, "--max-new-tokens", str(max_new_tokens),
                                        "--policy", policy, "--ratio", str(ratio),
                                        *(["--warmup-tokens", str(warmup_tokens)] if warmup_tokens else [])
                                        ).strip().splitlines()[-1])
                row.update(round=r, load_before=load_before, load_after=os.getloadavg())
                runs.append(row)
                print(f"  [{policy} {ratio:g}x, {context_tokens} tokens, round {r + 1}/{rounds}] {arm}: "
                      f"{row['wall_s']:.2f} s (prefill {row['prefill_s'] or float('nan'):.2f} s), "
                      f"{row['peak_rss_mib']:.0f} MiB, {row['tokens_generated']} tokens, load "
                      f"{row['load_before'][0]:.2f}", file=sys.stderr, flush=True)
    ratios = []
    for r in range(rounds):
        by_arm = {row["arm"]: row for row in runs if row["round"] == r}
        base = by_arm.get("kvpress")
        if base is None:
            continue
        ratio_row = {f"{arm}/kvpress": {"wall": by_arm[arm]["wall_s"] / base["wall_s"],
                                        "cpu": by_arm[arm]["cpu_s"] / base["cpu_s"],
                                        "peak": by_arm[arm]["peak_rss_mib"] / base["peak_rss_mib"],
                                        "call_peak": _call_peak(by_arm[arm]) / max(_call_peak(base), 1.0),
                                        "over_model": by_arm[arm]["peak_rss_over_model_mib"]
                                        / max(base["peak_rss_over_model_mib"], 1.0),
                                        "prefill_over_model": by_arm[arm]["prefill_peak_rss_over_model_mib"]
                                        / max(base["prefill_peak_rss_over_model_mib"], 1.0)}
                     for arm in arms if arm not in ("kvpress", "transformers") and arm in by_arm}
        if "kvzoo" in by_arm and "transformers" in by_arm:  # the prefill (and compression) beside transformers'
            kz, tf = by_arm["kvzoo"], by_arm["transformers"]
            ratio_row["kvzoo/transformers prefill"] = {"wall": kz["prefill_s"] / tf["prefill_s"],
                                                       "cpu": kz["prefill_cpu_s"] / tf["prefill_cpu_s"],
                                                       "peak": kz["peak_rss_mib"] / tf["peak_rss_mib"],
                                                       "over_model": kz["peak_rss_over_model_mib"]
                                                       / max(tf["peak_rss_over_model_mib"], 1.0)}
        ratios.append(ratio_row)
    medians = {key: {what: statistics.median(r[key][what] for r in ratios) for what in ratios[0][key]}
               for key in (ratios[0] if ratios else {})}
    by_arm_median = {field: {arm: statistics.median(row[field] for row in runs if row["arm"] == arm) for arm in arms}
                     for field in ("peak_rss_mib", "peak_rss_over_model_mib", "prefill_peak_rss_over_model_mib")}
    return {"policy": policy, "ratio": ratio, "press": PRESSES[policy], "context_tokens": context_tokens,
            "rounds": rounds, "runs": runs, "ratios": ratios, "medians": medians, **by_arm_median,
            "mmap_threshold": runs[0]["mmap_threshold"]}


def _code() -> str:
    """The commit measured (``+`` when kvzoo's or the benchmarks' tracked files differed from it at the start)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=os.path.dirname(__file__)).stdout

    return git("rev-parse", "--short", "HEAD").strip() + ("+" if git("status", "--porcelain", "-uno", "--", "../kvzoo", ".").strip() else "")


def _call_peak(row: dict) -> float:
    """What the timed call added to the process's peak (MiB over the peak after the model's load and warm-up: the
    libraries and weights, alike in every arm but for kvpress's own imports, ~90 MiB, are left out)."""
    return max(row["peak_rss_mib"] - row["peak_rss_after_warmup_mib"], 0.0)


def _call(ratio: dict) -> str:
    parts = ([f"own {ratio['call_peak']:.2f}x"] if "call_peak" in ratio else []) + (
        [f"over the model {ratio['over_model']:.2f}x"] if "over_model" in ratio else [])
    return f" ({', '.join(parts)})" if parts else ""


def _prefill(row: dict) -> str:
    return "-" if row.get("prefill_s") is None else f"{row['prefill_s']:.1f}"


def render(result: dict) -> list[str]:
    runs, arms = result["runs"], list(dict.fromkeys(row["arm"] for row in result["runs"]))
    first, keys = runs[0], list(result["medians"])
    kept = {a: next(row["kept_rows_per_layer"] for row in runs if row["arm"] == a) for a in arms}
    lines = [f"{result['policy']} {result['ratio']:g}x (kvpress: {result['press']}), SmolLM2-135M fp32, "
             f"{first['context_tokens']} context tokens + {first['question_tokens']} question tokens, "
             f"{first['threads']} threads; kept rows per layer {kept}",
             "", "| round | " + " | ".join(f"{a}: wall s / prefill s / CPU s / peak MiB (over the model) / tokens"
                                          for a in arms)
             + " | " + " | ".join(f"{k}: wall, CPU, peak (the call's own, over the model)" for k in keys)
             + " | load (1 min) |",
             "|---|" + "---|" * (len(arms) + len(keys) + 1)]
    for r, ratio in enumerate(result["ratios"]):
        cells = [next(row for row in runs if row["round"] == r and row["arm"] == a) for a in arms]
        load = [row["load_before"][0] for row in runs if row["round"] == r]
        lines.append(f"| {r + 1} | " + " | ".join(
            f"{c['wall_s']:.1f} / {_prefill(c)} / {c['cpu_s']:.1f} / {c['peak_rss_mib']:.0f} "
            f"({c['peak_rss_over_model_mib']:.0f}) / {c['tokens_generated']}" for c in cells)
            + " | " + " | ".join(f"{v['wall']:.2f}x, {v['cpu']:.2f}x, {v['peak']:.2f}x{_call(v)}" for v in ratio.values())
            + f" | {min(load):.1f}-{max(load):.1f} |")

    def median(a: str, field: str) -> float:
        values = [row[field] for row in runs if row["arm"] == a and row.get(field) is not None]
        return statistics.median(values) if values else float("nan")

    lines.append("| median | " + " | ".join(
        f"{median(a, 'wall_s'):.1f} / {median(a, 'prefill_s'):.1f} / {median(a, 'cpu_s'):.1f} / "
        f"{median(a, 'peak_rss_mib'):.0f} ({median(a, 'peak_rss_over_model_mib'):.0f}) / -" for a in arms) + " | "
        + " | ".join(f"**{v['wall']:.2f}x, {v['cpu']:.2f}x, {v['peak']:.2f}x{_call(v)}**" for v in result["medians"].values())
        + " | |")
    found = {a: sorted({row["needle_found"] for row in runs if row["arm"] == a}) for a in arms}
    answers = {a: sorted({row["answer"][:40] for row in runs if row["arm"] == a}) for a in arms}
    lines += ["", f"needle found: {found}; answers: {answers}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=None,
                        help=f"comma-separated, from {', '.join(ARMS)} (default: all; vestige: kvpress, kvzoo, "
                             "transformers -- kvpress has no vestige press)")
    parser.add_argument("--policy", default="snapkv", choices=sorted(PRESSES))
    parser.add_argument("--ratio", type=float, default=8.0, help="compression ratio (8: keep 1/8 of the context)")
    parser.add_argument("--context-tokens", default="2000", help="comma-separated context lengths, e.g. 2000,8000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--warmup-tokens", type=int, default=None,
                        help="context tokens of each process's warm-up call (default: the whole context, as timed)")
    parser.add_argument("--json", help="write the runs, ratios and medians here too (one JSON line per length)")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # a child process runs one arm
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)  # a child process writes the token ids
    args = parser.parse_args()
    if args.ratio <= 1:
        raise SystemExit(f"--ratio must be > 1 (got {args.ratio})")
    if args.prepare:
        prepare(int(args.context_tokens), args.prepare)
        return
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.ids, args.max_new_tokens, args.warmup_tokens, args.policy,
                                 args.ratio)))
        return
    default = ("kvpress", "kvzoo", "transformers") if args.policy == "vestige" else ARMS
    arms = tuple(args.arms.split(",")) if args.arms else default
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "kvpress" not in arms:
        raise SystemExit(f"unknown arm(s) {unknown}; valid: {', '.join(ARMS)} (kvpress, the baseline, must be one)")
    print(f"uptime at start: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"allocator: {MALLOC_NOTE}")
    code, results = _code(), []
    for n in (int(x) for x in args.context_tokens.split(",")):
        results.append({**side_by_side(n, args.rounds, args.max_new_tokens, arms, args.warmup_tokens, args.policy,
                                       args.ratio), "code": code})
        print("\n".join(["", *render(results[-1])]), flush=True)
        if args.json:  # appended as each length finishes: a long run's earlier lengths are not lost
            with open(args.json, "a") as f:
                f.write(json.dumps(results[-1]) + "\n")
    print(f"\nuptime at end: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
