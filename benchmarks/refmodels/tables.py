"""VestigeKV's tables measured on kvzoo's reference twins (NoPE arm vs RoPE arm), question after compression.

    python benchmarks/refmodels/tables.py                       # all shipped seeds, 100 examples per cell
    python benchmarks/refmodels/tables.py --count 20 --seeds 0  # quick look

Three tables, printed as markdown and written to ``benchmarks/refmodels/RESULTS.md``:

1. dual arm (VestigeKV Tab. 5 analog): answer accuracy on held-out 16-pair recall at T = 512 through
   ``kvzoo.pipeline.generate`` (context prefilled and compressed, then the question ``[QUERY, k]``,
   one greedy token) at 8x and 32x; with several seeds: mean ± half the range ((max - min) / 2);
2. selector signal (Tab. 1 analog): per layer, the rows the full model's question queries read
   most (argmax over keys per head, union over heads and the two question tokens), and the share
   of them inside the top 1/8 and 1/32 of the context rows ranked by each signal;
3. retrieval tier: vestige + certified retriever with ``audit=True``: rows fetched per retrieval
   step and bound violations.

Deviations from the policies' defaults, forced by the 510-token context and the 2-layer model:
snapkv/chunkkv ``window = min(32, budget)`` (at 32x the budget is 15 rows); quest
``dense_layers = 0`` (its default 2 would leave both layers of this model dense). The answer is
the question forward's own next token, and the question is a 2-token forward: under the default
``multi_token="dense"`` rule a retriever would read the whole archive there and equal ``full`` by
construction, so the retriever rows use ``multi_token="union"`` (each question token's own
choice, the same rule as a decode step).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvzoo import pipeline, registry  # noqa: E402
from kvzoo.framework.retrieval import build_retriever  # noqa: E402
from kvzoo.models import load_model  # noqa: E402
from kvzoo.policies.vestige import branch_sigma  # noqa: E402
from kvzoo.refmodel import CHECKPOINT_DIR  # noqa: E402
from kvzoo.refmodel import data as D  # noqa: E402
from kvzoo.refmodel.modeling import rotate_branch  # noqa: E402

RATIOS = (8, 32)
POLICIES = ("full", "vestige", "vestige+certified", "snapkv", "h2o", "streaming_llm", "chunkkv", "quest",
            "quest(rule=kernel)")
TABLE_SEED = 2026  # held-out examples for the tables: a stream no training run saw
KAPPA = 8


def make_policy(name: str, ratio: int, context_len: int) -> Any:
    budget = context_len // ratio
    if name == "full":
        return registry.get("full")
    if name == "vestige":
        return registry.get("vestige", ratio=ratio, retriever=None)
    if name == "vestige+certified":
        return registry.get("vestige", ratio=ratio, retriever=build_retriever("vestige", certified=True, tau=8.0,
                                                                              multi_token="union"))
    if name in ("snapkv", "chunkkv"):
        return registry.get(name, ratio=ratio, window=min(32, budget))
    if name.startswith("quest"):  # the page index scanned by the 2-token question too (its reference rule is dense)
        rule = registry.parse_spec(name)[1].get("rule", "eval")
        return registry.get("quest", ratio=ratio, dense_layers=0, rule=rule,
                            retriever=build_retriever("quest", multi_token="union", rule=rule))
    return registry.get(name, ratio=ratio)


def shipped_seeds(arm: str) -> list[int]:
    return sorted(int(p.name.rsplit("-s", 1)[1]) for p in CHECKPOINT_DIR.glob(f"ref-{arm}-s*") if (p / "config.json").is_file())


def accuracy(model: Any, examples: list[D.Example], policy_name: str, ratio: int) -> float:
    hits = 0
    for e in examples:
        policy = make_policy(policy_name, ratio, len(e.context))
        out = pipeline.generate(model, None, e.context, e.question, policy, max_new_tokens=1)
        hits += out.token_ids[0] == e.answer
    return hits / len(examples)


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {(max(values) - min(values)) / 2:.3f}"


def arm_seed_accuracies(arm: str, seed: int, examples: list[D.Example],
                        policies: tuple[str, ...] = POLICIES) -> dict[tuple[str, int], float]:
    """Accuracy of every (policy, ratio) cell for one trained model (one worker process's job)."""
    torch.set_num_threads(1)
    model = load_model(f"ref-{arm}-s{seed}")[0]
    return {(name, ratio): accuracy(model, examples, name, ratio)
            for name in policies for ratio in ((1,) if name == "full" else RATIOS)}


def dual_arm_table(examples: list[D.Example], seeds: dict[str, list[int]], workers: int,
                   policies: tuple[str, ...] = POLICIES) -> str:
    jobs = [(arm, s) for arm in ("nope", "rope") for s in seeds[arm]]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        results = dict(zip(jobs, pool.map(arm_seed_accuracies, *zip(*jobs), [examples] * len(jobs),
                                          [policies] * len(jobs)), strict=True))
    lines = ["| policy | ratio | NoPE arm | RoPE arm |", "|---|---|---|---|"]
    for name in policies:
        for ratio in (1,) if name == "full" else RATIOS:
            cells = [fmt([results[(arm, s)][(name, ratio)] for s in seeds[arm]]) for arm in ("nope", "rope")]
            lines.append(f"| {name} | {'full' if ratio == 1 else f'{ratio}x'} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


@torch.no_grad()
def rows_and_reads(model: Any, example: D.Example) -> list[tuple[torch.Tensor, torch.Tensor, set[int]]]:
    """Per layer: latent ``c [n, kv_lora_rank]``, cached branch ``r [n, rope]`` of the context rows, and
    the context rows the question's queries read most (argmax per head, union over heads and queries)."""
    ids = torch.tensor([example.context + example.question])
    n_ctx = len(example.context)
    captured: dict[int, dict[str, torch.Tensor]] = {}
    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn

        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            captured[module.layer_idx] = {"hidden": hidden, "pe": kwargs["position_embeddings"]}

        hooks.append(attn.register_forward_hook(hook, with_kwargs=True))
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for layer in model.model.layers:
        m = layer.self_attn
        hidden, pe = captured[m.layer_idx]["hidden"], captured[m.layer_idx]["pe"]
        B, T = hidden.shape[:2]
        q = m.q_proj(hidden).view(B, T, m.num_heads, m.qk_head_dim).transpose(1, 2)
        q_nope, q_r = torch.split(q, [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, r = torch.split(m.kv_a_proj_with_mqa(hidden), [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = m.kv_a_layernorm(c).view(B, 1, T, m.kv_lora_rank)
        q_r, r = rotate_branch(m, q_r, r.view(B, 1, T, m.qk_rope_head_dim), pe)
        kv = m.kv_b_proj(c).view(B, T, m.num_heads, -1).transpose(1, 2)
        k_nope = kv[..., : m.qk_nope_head_dim]
        scores = (q_nope @ k_nope.transpose(-1, -2) + q_r @ r.transpose(-1, -2)) * m.scaling  # [1, H, T, T]
        question_scores = scores[0, :, n_ctx:, :]  # [H, 2, T]: the question tokens' queries
        question_scores = question_scores.masked_fill(
            torch.arange(T)[None, None, :] > torch.arange(n_ctx, T)[None, :, None], float("-inf"))
        reads = question_scores[..., :n_ctx].argmax(-1)  # over context rows only
        out.append((c[0, 0, :n_ctx], r[0, 0, :n_ctx], set(reads.flatten().tolist())))
    return out


def selector_table(examples: list[D.Example], seeds: dict[str, list[int]]) -> str:
    signals = ("σ on branch", "σ on full row", "σ on content", "raw branch norm", "random")
    lines = ["| arm | signal | " + " | ".join(f"L{i} keep 1/{k}" for i in (0, 1) for k in RATIOS) + " | mean 1/8 | mean 1/32 |",
             "|---|---|" + "---|" * (2 * len(RATIOS) + 2)]
    for arm in ("nope", "rope"):
        hits: dict[tuple[str, int, int], list[float]] = {}
        for s in seeds[arm]:
            model = load_model(f"ref-{arm}-s{s}")[0]
            gen = torch.Generator().manual_seed(s)
            for e in examples:
                for li, (c, r, reads) in enumerate(rows_and_reads(model, e)):
                    n = c.shape[0]
                    scores = {
                        "σ on branch": branch_sigma(r, KAPPA),
                        "σ on full row": branch_sigma(torch.cat([c, r], -1), KAPPA),
                        "σ on content": branch_sigma(c, KAPPA),
                        "raw branch norm": r.float().norm(dim=-1),
                        "random": torch.rand(n, generator=gen),
                    }
                    for sig, sc in scores.items():
                        for k in RATIOS:
                            top = set(sc.topk(max(1, n // k)).indices.tolist())
                            hits.setdefault((sig, li, k), []).append(len(reads & top) / len(reads))
        for sig in signals:
            cells = [statistics.mean(hits[(sig, li, k)]) for li in (0, 1) for k in RATIOS]
            means = [statistics.mean(hits[(sig, 0, k)] + hits[(sig, 1, k)]) for k in RATIOS]
            lines.append(f"| {arm} | {sig} | " + " | ".join(f"{x:.3f}" for x in cells + means) + " |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def retrieval_table(examples: list[D.Example], seeds: dict[str, list[int]]) -> str:
    lines = ["| arm | ratio | accuracy | rows fetched / step | retrieval steps | bound violations | audited scores |",
             "|---|---|---|---|---|---|---|"]
    for arm in ("nope", "rope"):
        for ratio in RATIOS:
            tot = {"fetched_rows": 0, "retrieval_steps": 0, "bound_violations": 0, "audited_scores": 0}
            hits = 0
            for s in seeds[arm]:
                model = load_model(f"ref-{arm}-s{s}")[0]
                for e in examples:
                    policy = make_policy("vestige+certified", ratio, len(e.context))
                    out = pipeline.generate(model, None, e.context, e.question, policy, max_new_tokens=1, audit=True)
                    hits += out.token_ids[0] == e.answer
                    t = out.stats.totals
                    for k in tot:
                        tot[k] += t.get(k, 0)
            runs = len(examples) * len(seeds[arm])
            per_step = tot["fetched_rows"] / max(1, tot["retrieval_steps"])
            lines.append(f"| {arm} | {ratio}x | {hits / runs:.3f} | {per_step:.1f} | {tot['retrieval_steps']} | "
                         f"{tot['bound_violations']} | {tot['audited_scores']} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=100, help="held-out examples per dual-arm cell")
    p.add_argument("--signal-count", type=int, default=50, help="examples for the selector-signal table")
    p.add_argument("--retrieval-count", type=int, default=20, help="examples for the retrieval-tier table")
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="training seeds (default: all shipped)")
    p.add_argument("--workers", type=int, default=2, help="processes for the dual-arm table (one thread each)")
    p.add_argument("--out", default=str(pathlib.Path(__file__).with_name("RESULTS.md")))
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="rows of the dual-arm table (default: all)")
    p.add_argument("--dual-arm-only", action="store_true",
                   help="print the dual-arm table only (of --policies); RESULTS.md is left as it is")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seeds = {arm: args.seeds if args.seeds is not None else shipped_seeds(arm) for arm in ("nope", "rope")}
    missing = [arm for arm in seeds if not seeds[arm]]
    if missing:
        print(f"no shipped checkpoint for arm(s) {missing} in {CHECKPOINT_DIR}: train them first "
              "(benchmarks/refmodels/train.py)")
        return 1
    T, n_pairs = D.CURRICULUM[-1]
    examples = D.heldout_recall(T, n_pairs, max(args.count, args.signal_count, args.retrieval_count), seed=TABLE_SEED)
    t0 = time.perf_counter()
    print(f"## Dual arm: held-out recall, T = {T}, {n_pairs} pairs, {args.count} examples, seeds {seeds}\n")
    dual = dual_arm_table(examples[: args.count], seeds, args.workers, tuple(args.policies))
    print(dual, flush=True)
    if args.dual_arm_only:
        print(f"\n({time.perf_counter() - t0:.0f}s; RESULTS.md not written: --dual-arm-only)")
        return 0
    print(f"\n## Selector signal: recall of the rows read most, {args.signal_count} examples, kappa = {KAPPA}\n")
    signal = selector_table(examples[: args.signal_count], seeds)
    print(f"\n## Retrieval tier: vestige + certified retriever (tau 8), audit, {args.retrieval_count} examples\n")
    retrieval = retrieval_table(examples[: args.retrieval_count], seeds)
    elapsed = time.perf_counter() - t0
    command = "python benchmarks/refmodels/tables.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        f"# VestigeKV tables on kvzoo's reference twins\n\nProduced by `{command.strip()}` "
        f"({elapsed / 60:.1f} min, {args.workers} worker process(es) of one CPU thread); seeds {seeds}.\n"
        "snapkv/chunkkv window = min(32, budget); quest dense_layers = 0 (see the script's docstring).\n\n"
        f"## Dual arm (Tab. 5 analog): accuracy, T = {T}, {n_pairs} pairs, {args.count} held-out examples\n\n{dual}\n\n"
        f"## Selector signal (Tab. 1 analog): recall of the rows the question reads most, {args.signal_count} "
        f"examples, κ = {KAPPA}\n\n{signal}\n\n"
        f"## Retrieval tier: vestige + certified retriever (τ = 8), audit=True, {args.retrieval_count} examples "
        f"per seed\n\n{retrieval}\n\n"
        "Columns: selector recall = share of the rows the question reads most (argmax over context rows per "
        "head, union over heads and both question tokens) that lie in the top 1/8 or 1/32 of the 510 "
        "context rows by the signal (L0/L1 = layer; mean over both). Retrieval: one retrieval step per "
        "layer per example (the question forward; the answer is one token); rows fetched / step out of "
        f"{T - 2 - (T - 2) // 8} archived rows per layer at 8x and {T - 2 - (T - 2) // 32} at 32x; audited "
        "scores = archived rows scored exactly by the audit.\n"
    )
    pathlib.Path(args.out).write_text(text)
    print(f"\nwritten to {args.out} ({elapsed:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
