"""SnapKV three ways on SmolLM2-135M, a needle context, the question after compression: kvzoo beside kvpress.

Arms (SnapKV keeping 1/4 of the context rows in each):

* ``kvpress``       -- kvpress's pipeline with its ``SnapKVPress(compression_ratio=0.75)``;
* ``kvzoo``         -- kvzoo's runtime (``kvzoo.pipeline.generate``'s steps: ``TieredCache``, prefill, compress, the
  question, greedy decoding) with ``snapkv`` at ratio 4 (paper defaults) and ``archive=False``: the evicted rows
  are dropped, as kvpress drops them (kvzoo's default keeps them bit-exact in its archive, which SnapKV without a
  retriever never reads);
* ``kvpress+kvzoo`` -- kvpress's pipeline with ``to_press(registry.get("snapkv", ratio=4))``.

Interleaved: every round runs each arm once, in a fresh process of its own, the arms' order rotated from round to
round, so a drift in the machine's load falls on every arm alike. Every arm reads the same token ids (the context and
the question as kvpress's pipeline tokenizes them, prepared once in a process of their own and handed to each arm;
the kvpress arms run the pipeline's ``forward`` on them, which is its ``__call__`` less the tokenization). A process
loads the model, makes one warm-up call (the whole context unless ``--warmup-tokens``: a 256-token warm-up left
the timed call paying first-touch costs unevenly between the arms), then times one whole call: the context's
prefill and compression, the question, greedy decoding (``--max-new-tokens``, ending early at EOS). Peak memory is
the process's ``ru_maxrss`` at its end (model, libraries and the call; the same accounting for every arm); tokens
generated are counted, and the call's CPU time (``time.process_time``, every thread; OpenMP's idle threads sleep:
``OMP_WAIT_POLICY=PASSIVE`` unless set), which other processes on the machine disturb less than the wall time. Per
round: each arm's wall time, CPU time and peak, and the ratios kvzoo / kvpress and kvpress+kvzoo / kvpress; then
their medians over the rounds. The load average (``os.getloadavg``) is recorded beside
every process: on a shared machine, read the ratios, not the seconds.

Runs only in kvpress's environment: ``.venv-kvpress/bin/python benchmarks/kvpress_side_by_side.py``
(``make test-kvpress`` builds it; ``--context-tokens 2000,8000 --rounds 3`` is the README's run).
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

ARMS = ("kvpress", "kvzoo", "kvpress+kvzoo")


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


def run_arm(arm: str, ids_path: str, max_new_tokens: int, warmup_tokens: int | None = None) -> dict:
    import torch
    from transformers import DynamicCache, pipeline

    from kvzoo import registry
    from kvzoo.framework.cache import TieredCache
    from kvzoo.models import load_smollm2
    from kvzoo.pipeline import compress, eos_ids, greedy_decode, prefill

    torch.manual_seed(0)
    model, tokenizer = load_smollm2(torch.float32)
    prepared = torch.load(ids_path)
    context_ids, question_ids = prepared["context_ids"], prepared["question_ids"]

    if arm == "kvzoo":
        def call(context: torch.Tensor, new_tokens: int) -> tuple[str, list[int], int]:
            cache = TieredCache(model, registry.get("snapkv", ratio=4, archive=False), context_length=context.shape[1])
            prefill(model, cache, context)
            compress(cache)
            kept = [layer.slots.shape[2] for layer in cache.tiered_layers]
            logits = prefill(model, cache, question_ids)
            tokens = greedy_decode(model, cache, logits, new_tokens, eos_ids(model, tokenizer))
            return tokenizer.decode(tokens, skip_special_tokens=True), kept, len(tokens)
    else:
        import kvpress

        from kvzoo.integrations.kvpress import to_press

        pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
        forwards = [0]  # the pipeline's lm_head forwards: the question's, then one per further token
        model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

        def call(context: torch.Tensor, new_tokens: int) -> tuple[str, list[int], int]:
            press = (kvpress.SnapKVPress(compression_ratio=0.75) if arm == "kvpress"
                     else to_press(registry.get("snapkv", ratio=4)))
            cache = DynamicCache()
            forwards[0] = 0
            out = pipe.forward({"context_ids": context, "questions_ids": [question_ids]}, press=press, cache=cache,
                               max_new_tokens=new_tokens)
            return out[0], [layer.keys.shape[2] for layer in cache.layers], forwards[0]

    with torch.no_grad():
        call(context_ids[:, :warmup_tokens], max_new_tokens)  # None: the whole context
        warm_peak = _peak_mib()
        t0, c0 = time.perf_counter(), time.process_time()
        answer, kept, generated = call(context_ids, max_new_tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "arm": arm, "context_tokens": context_ids.shape[1], "question_tokens": question_ids.shape[1],
        "kept_rows_per_layer": sorted(set(kept)), "layers": len(kept), "tokens_generated": generated,
        "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": _peak_mib(), "peak_rss_after_warmup_mib": warm_peak,
        "answer": answer.strip(), "needle_found": all(a in answer for a in prepared["answers"]),
        "threads": torch.get_num_threads(),
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
                 warmup_tokens: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ids_path = os.path.join(tmp, "ids.pt")
        _child("--prepare", ids_path, "--context-tokens", str(context_tokens))
        runs = []
        for r in range(rounds):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            for arm in order:
                load_before = os.getloadavg()
                row = json.loads(_child("--arm", arm, "--ids", ids_path, "--max-new-tokens", str(max_new_tokens),
                                        *(["--warmup-tokens", str(warmup_tokens)] if warmup_tokens else [])
                                        ).strip().splitlines()[-1])
                row.update(round=r, load_before=load_before, load_after=os.getloadavg())
                runs.append(row)
                print(f"  [{context_tokens} tokens, round {r + 1}/{rounds}] {arm}: {row['wall_s']:.2f} s, "
                      f"{row['peak_rss_mib']:.0f} MiB, {row['tokens_generated']} tokens, load "
                      f"{row['load_before'][0]:.2f}", file=sys.stderr, flush=True)
    ratios = []
    for r in range(rounds):
        by_arm = {row["arm"]: row for row in runs if row["round"] == r}
        base = by_arm.get("kvpress")
        if base is None:
            continue
        ratios.append({f"{arm}/kvpress": {"wall": by_arm[arm]["wall_s"] / base["wall_s"],
                                          "cpu": by_arm[arm]["cpu_s"] / base["cpu_s"],
                                          "peak": by_arm[arm]["peak_rss_mib"] / base["peak_rss_mib"]}
                       for arm in arms if arm != "kvpress" and arm in by_arm})
    medians = {key: {what: statistics.median(r[key][what] for r in ratios) for what in ("wall", "cpu", "peak")}
               for key in (ratios[0] if ratios else {})}
    return {"context_tokens": context_tokens, "rounds": rounds, "runs": runs, "ratios": ratios, "medians": medians}


def render(result: dict) -> list[str]:
    runs, arms = result["runs"], list(dict.fromkeys(row["arm"] for row in result["runs"]))
    first = runs[0]
    lines = [f"SmolLM2-135M fp32, {first['context_tokens']} context tokens + {first['question_tokens']} question "
             f"tokens, kept rows per layer {first['kept_rows_per_layer']}, {first['threads']} threads",
             "", "| round | " + " | ".join(f"{a}: wall s / CPU s / peak MiB / tokens" for a in arms) + " | "
             + " | ".join(f"{a}/kvpress: wall, CPU, peak" for a in arms if a != "kvpress") + " | load (1 min) |",
             "|---|" + "---|" * (2 * len(arms))]
    for r, ratio in enumerate(result["ratios"]):
        cells = [next(row for row in runs if row["round"] == r and row["arm"] == a) for a in arms]
        load = [row["load_before"][0] for row in runs if row["round"] == r]
        lines.append(f"| {r + 1} | " + " | ".join(
            f"{c['wall_s']:.1f} / {c['cpu_s']:.1f} / {c['peak_rss_mib']:.0f} / {c['tokens_generated']}" for c in cells)
            + " | " + " | ".join(f"{v['wall']:.2f}x, {v['cpu']:.2f}x, {v['peak']:.2f}x" for v in ratio.values())
                     + f" | {min(load):.1f}-{max(load):.1f} |")
    lines.append("| median | " + " | ".join(
        f"{statistics.median(row['wall_s'] for row in runs if row['arm'] == a):.1f} / "
        f"{statistics.median(row['cpu_s'] for row in runs if row['arm'] == a):.1f} / "
        f"{statistics.median(row['peak_rss_mib'] for row in runs if row['arm'] == a):.0f} / -" for a in arms) + " | "
        + " | ".join(f"**{v['wall']:.2f}x, {v['cpu']:.2f}x, {v['peak']:.2f}x**" for v in result["medians"].values())
        + " | |")
    found = {a: sorted({row["needle_found"] for row in runs if row["arm"] == a}) for a in arms}
    answers = {a: sorted({row["answer"][:40] for row in runs if row["arm"] == a}) for a in arms}
    lines += ["", f"needle found: {found}; answers: {answers}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--context-tokens", default="2000", help="comma-separated context lengths, e.g. 2000,8000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--warmup-tokens", type=int, default=None,
                        help="context tokens of each process's warm-up call (default: the whole context, as timed)")
    parser.add_argument("--json", help="write the runs, ratios and medians here too")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # a child process runs one arm
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)  # a child process writes the token ids
    args = parser.parse_args()
    if args.prepare:
        prepare(int(args.context_tokens), args.prepare)
        return
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.ids, args.max_new_tokens, args.warmup_tokens)))
        return
    arms = tuple(args.arms.split(","))
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "kvpress" not in arms:
        raise SystemExit(f"unknown arm(s) {unknown}; valid: {', '.join(ARMS)} (kvpress, the baseline, must be one)")
    print(f"uptime at start: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    results = []
    for n in (int(x) for x in args.context_tokens.split(",")):
        results.append(side_by_side(n, args.rounds, args.max_new_tokens, arms, args.warmup_tokens))
        print("\n".join(["", *render(results[-1])]), flush=True)
    print(f"\nuptime at end: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
