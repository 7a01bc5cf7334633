"""Where the exact top archived rows rank under the sketch bound, at digit steps and other steps (issue 25).

    PYTHONPATH=. .venv/bin/python benchmarks/vestige_recall.py --ratio 8 --depths 0.1 0.5 0.9 --seeds 0 1 \
        [--retriever 'vestige(rank_by=bound)'] [--out recall.json]

SmolLM2-135M (real weights), kvzoo's niah_single task on the noise haystack, question after compression. Per trial:
greedy answer (score), then the reference answer teacher-forced one decode step per token on a fork, with every
decode-step scan of the sketch index observed (``SketchIndex.choose`` wrapped, nothing changed): per layer, query
head and step, the exact scores of every archived row, the bound and the bound's estimate (the sketch's in-span
part ``scale <V^T q, z>``, the bound without its Cauchy-Schwarz term). Reported: recall@j (j = 16) of the exact
top-j archived rows by the bound's ranking and by the estimate's, the rank of the exact best archived row under
each, the rows whose bound beats s*, the share of the archive's exact softmax mass each top-j captures, and the
rows the retriever actually fetched -- split by steps that predict a digit of the answer and the others.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from kvzoo import pipeline, registry
from kvzoo.bench.runner import encode_prompt
from kvzoo.bench.tasks import TaskSpec, make_task
from kvzoo.framework.cache import TieredCache
from kvzoo.framework.retrieval import build_retriever
from kvzoo.kernels.index_scan import exact_scores, int8_page_bounds, int8_page_entries
from kvzoo.models import load_smollm2
from kvzoo.policies import vestige as vestige_module

J = 16
PAGED = ((16, 2), (16, 4), (16, 8), (32, 2), (32, 4))  # (page_rows, fine_pages) of the paged variants
REUSE = ((4, 64), (8, 64), (8, 128))  # (full scan every N steps, candidates kept per head) of the reuse variants


class Probe:
    def __init__(self) -> None:
        self.on = False
        self.calls = 0
        self.layers = 0
        self.step_kind = "other"
        self.bases: dict[int, torch.Tensor] = {}
        self.steps: dict[int, int] = {}  # decode steps observed per layer (this trial)
        self.kept: dict[tuple, torch.Tensor] = {}  # the reuse variants' candidates per (layer, every, C)
        self.acc: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def observe(self, index, query, best, scaling) -> None:
        layer = self.calls % self.layers
        self.calls += 1
        n = index.rows.n
        keys = index._probe_keys[:, :, :n]
        exact = exact_scores(query, keys, scaling)[0, :, 0]  # [H, n]
        bound, est = (x[0, :, 0, :n] for x in index._bounds_and_estimates(query, scaling))  # the index's own
        s_star = best[0, :, 0]  # [H]
        j = min(J, n)
        variants = {"bound": bound, "est": est}
        G = keys.shape[1]
        hpg = exact.shape[0] // G
        k32 = keys[0].float()  # [G, n, D]
        q32 = query[0, :, 0].float().view(G, hpg, -1)
        if layer not in self.bases:  # PCA of the layer's archived keys (what a higher-rank sketch would span)
            self.bases[layer] = torch.linalg.eigh(k32.transpose(-1, -2) @ k32)[1].flip(-1)
        V = self.bases[layer]
        for r in (16, 32, 48):
            Vr = V[..., :r]
            variants[f"pca{r}"] = (scaling * (q32 @ Vr) @ (k32 @ Vr).transpose(-1, -2)).reshape(exact.shape)
        for bits in (4, 8):  # per-row absmax quantized keys
            levels = 2 ** (bits - 1) - 1
            scale = k32.abs().amax(-1, keepdim=True) / levels
            kq = (k32 / scale).round() * scale
            variants[f"int{bits}"] = (scaling * q32 @ kq.transpose(-1, -2)).reshape(exact.shape)
        for size, pages in PAGED:  # index="paged": the top pages by their int8 summary's bound, then int8 rows
            p = -(-n // size)
            pad = p * size - n
            lo = torch.cat([k32, k32.new_full((G, pad, k32.shape[-1]), float("inf"))], 1).view(G, p, size, -1).amin(2)
            hi = torch.cat([k32, k32.new_full((G, pad, k32.shape[-1]), float("-inf"))], 1).view(G, p, size, -1).amax(2)
            codes, scale = int8_page_entries(lo[None], hi[None])
            page_bound = int8_page_bounds(q32[None], codes, scale, scaling)[0].reshape(exact.shape[0], p)
            top_pages = page_bound.topk(min(pages, p), -1).indices  # [H, pages]
            rows = (top_pages[..., None] * size + torch.arange(size)).flatten(-2).clamp(max=n - 1)
            candidate = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, rows, True)
            variants[f"paged{size}x{pages}"] = variants["int8"].masked_fill(~candidate, float("-inf"))
        H = exact.shape[0]

        def rerank(stage1: torch.Tensor, k: int) -> torch.Tensor:  # int8 estimate over stage 1's top k rows
            top = stage1.topk(min(k, n), -1).indices
            keep = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, top, True)
            return variants["int8"].masked_fill(~keep, float("-inf"))

        mu = k32.mean(1, keepdim=True)  # [G, 1, D]
        centred = k32 - mu
        sign_est = (q32 @ mu.transpose(-1, -2)) + (q32 @ torch.sign(centred).transpose(-1, -2)) \
            * centred.abs().mean(-1)[:, None, :]
        sign_est = (scaling * sign_est).reshape(H, n)
        V8 = V[..., :8]
        pca8 = (scaling * (q32 @ V8) @ (k32 @ V8).transpose(-1, -2)).reshape(H, n)
        if ("km", layer) not in self.bases:  # k-means of the archived keys, n / 16 clusters (cosine, 8 rounds)
            C = max(1, n // 16)
            unit = torch.nn.functional.normalize(k32, dim=-1)
            cent = unit[:, torch.randperm(n, generator=torch.Generator().manual_seed(0))[:C]]
            for _ in range(8):
                assign = (unit @ cent.transpose(-1, -2)).argmax(-1)  # [G, n]
                cent = torch.zeros_like(cent).scatter_add_(1, assign[..., None].expand(-1, -1, unit.shape[-1]), unit)
                cent = torch.nn.functional.normalize(cent, dim=-1)
            mean = torch.zeros(G, C, k32.shape[-1]).scatter_add_(1, assign[..., None].expand(-1, -1, k32.shape[-1]),
                                                                    k32)
            size = torch.zeros(G, C).scatter_add_(1, assign, torch.ones(G, n)).clamp(min=1)
            mean = mean / size[..., None]
            radius = torch.zeros(G, C).scatter_reduce_(1, assign, (k32 - mean.gather(
                1, assign[..., None].expand(-1, -1, k32.shape[-1]))).norm(dim=-1), "amax")
            self.bases[("km", layer)] = (assign, mean, radius)
        assign, mean, radius = self.bases[("km", layer)]
        cl_est = scaling * (q32 @ mean.transpose(-1, -2))  # [G, hpg, C]
        cl_bound = cl_est + scaling * q32.norm(dim=-1, keepdim=True) * radius[:, None]
        for name, cl in (("kmE", cl_est), ("kmB", cl_bound)):
            per_row = cl.gather(-1, assign[:, None].expand(-1, hpg, -1)).reshape(H, n)  # each row: its cluster's
            for k in (64, 128):
                variants[f"{name}{k}"] = rerank(per_row + 1e-6 * variants["int8"], k)  # whole clusters first
        # candidate reuse: the int8 top-C of the layer's last full scan (every `every`-th step), re-scored each step
        step = self.steps[layer] = self.steps.get(layer, -1) + 1
        for every, C in REUSE:
            slot = (layer, every, C)
            if step % every == 0 or slot not in self.kept or self.kept[slot].shape[-1] > n:
                self.kept[slot] = variants["int8"].topk(min(C, n), -1).indices
            keep = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, self.kept[slot].clamp(max=n - 1), True)
            variants[f"reuse{every}_{C}"] = variants["int8"].masked_fill(~keep, float("-inf"))
        for k in (64, 128):
            variants[f"s1_{k}"] = rerank(sign_est, k)
            variants[f"p8_{k}"] = rerank(pca8, k)
        true_top = exact.topk(j, -1).indices
        a = self.acc[(self.step_kind, layer)]
        w = torch.softmax(exact, -1)  # the archive's own softmax
        for name, score in variants.items():
            top = score.topk(j, -1).indices
            hit = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, top, True)
            a[f"recall_{name}"] += float(hit.gather(-1, true_top).float().mean(-1).sum())
            a[f"mass_{name}"] += float((w * hit).sum(-1).sum())
            order = score.argsort(-1, descending=True)
            pos = (order == exact.argmax(-1, keepdim=True)).float().argmax(-1)  # rank of the exact best row
            a[f"rank1_{name}"] += float(pos.sum())
            a[f"rank1_{name}_le16"] += float((pos < j).float().sum())
        a["bound_gt_sstar"] += float((bound > s_star[:, None]).float().sum(-1).sum())
        a["exact_gt_sstar"] += float((exact > s_star[:, None]).float().sum(-1).sum())
        a["exact_gt_sstar_m4"] += float((exact > s_star[:, None] - 4).float().sum(-1).sum())
        a["archive_mass_vs_best"] += float(torch.exp(exact - s_star[:, None]).sum(-1).sum())
        a["violations"] += float((bound < exact).sum())
        a["heads"] += exact.shape[0]
        a["rows"] += n * exact.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ratio", type=float, default=8)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--policy", default="vestige")
    parser.add_argument("--retriever", default="{}", help="the vestige retriever's options as JSON, e.g. "
                        '\'{"rank_by": "bound"}\' (today\'s rule before issue 25)')
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tok = load_smollm2(torch.float32)
    probe = Probe()
    probe.layers = model.config.num_hidden_layers

    def observed(original):  # a decode step's choose, observed once (PagedKeyIndex's certified mode calls its base)
        def choose(self, query, best, scaling, archive):
            if probe.on and query.shape[2] == 1 and not getattr(self, "_in_choose", False):
                self._probe_keys = archive.keys
                probe.observe(self, query, best, scaling)
            self._in_choose = True
            try:
                return original(self, query, best, scaling, archive)
            finally:
                self._in_choose = False
        return choose

    for cls in (vestige_module.SketchIndex, vestige_module.PagedKeyIndex):
        cls.choose = observed(cls.choose)
    args.retriever_config = build_retriever("vestige", **json.loads(args.retriever)).config()
    print("retriever:", args.retriever_config, flush=True)
    trials = []
    for depth in args.depths:
        for seed in args.seeds:
            task = make_task(TaskSpec("niah_single", args.context_tokens, depth, seed, "noise"), tok,
                             continuation_tokens=0)
            ids = encode_prompt(tok, task)
            policy = registry.get(args.policy, ratio=args.ratio,
                                  retriever=build_retriever("vestige", **json.loads(args.retriever)))
            cache = TieredCache(model, policy, context_length=ids.prefix.shape[1])
            pipeline.prefill(model, cache, ids.prefix)
            pipeline.compress(cache)
            targets = ids.answer[0].tolist()
            digit = [tok.decode([t]).strip().isdigit() for t in targets]
            probe.bases, probe.steps, probe.kept = {}, {}, {}
            with cache.fork() as fork:  # the reference answer, one decode step per token, observed
                probe.on = True
                logits = pipeline.prefill(model, fork, ids.question)
                steps = [logits.float()]
                before = fork.stats().totals.get("rows_fetched", 0)  # the question's forward reads the archive densely
                for i in range(len(targets) - 1):
                    probe.step_kind = "digit" if digit[i + 1] else "other"
                    out = model(input_ids=ids.answer[:, i : i + 1], **pipeline.cache_kwargs(model, fork),
                                use_cache=True, logits_to_keep=1)
                    steps.append(out.logits[:, -1].float())
                probe.on = False
                fetched = fork.stats().totals
            logp = torch.log_softmax(torch.cat(steps), -1)
            nll = (-logp.gather(-1, ids.answer[0][:, None])[:, 0]).tolist()
            logits = pipeline.prefill(model, cache, ids.question)
            new = pipeline.greedy_decode(model, cache, logits, task.max_new_tokens, pipeline.eos_ids(model, tok))
            answer = tok.decode(new, skip_special_tokens=True)
            last = [layer.last_step for layer in cache.stats().layers if layer.last_step.get("queries") == 1]
            index_share = (sum(x["index_bytes_scanned"] for x in last) / sum(x["kv_bytes_read"] for x in last)
                           if last else None)
            ok = all(a in answer for a in task.answers)
            trials.append({"depth": depth, "seed": seed, "answers": task.answers, "prediction": answer, "ok": ok,
                           "nll": nll, "tokens": [tok.decode([t]) for t in targets],
                           "decode_rows_fetched_per_kv_head_layer_step": (fetched.get("rows_fetched", 0) - before) / (
                               max(1, len(targets) - 1) * probe.layers * model.config.num_key_value_heads),
                           "archived_rows_per_kv_head": cache.stats().layers[0].archived_rows,
                           "last_step_index_share": index_share,
                           "last_step_kv_bytes": sum(x["kv_bytes_read"] for x in last)})
            print(f"depth {depth} seed {seed}: {'ok ' if ok else 'MISS'} {answer!r} want {task.answers} "
                  f"worst-token nll {max(nll):.2f}; last decode step: index {index_share or 0:.0%} of its KV bytes",
                  flush=True)
            cache.close()
            report(probe, trials, args)


def report(probe: Probe, trials: list, args) -> None:
    """Print the summary so far and write it (called after every trial: a partial run still reports)."""
    summary = {}
    for kind in ("digit", "other"):
        per_layer = {}
        total: dict[str, float] = defaultdict(float)
        for (k, layer), a in sorted(probe.acc.items()):
            if k != kind:
                continue
            heads = a["heads"]
            per_layer[layer] = {key: a[key] / heads for key in a if key not in ("heads", "rows", "violations")}
            per_layer[layer]["violations"] = a["violations"]
            for key, v in a.items():
                total[key] += v
        if not total:
            continue
        heads = total["heads"]
        summary[kind] = {"all_layers": {k: (v if k in ("heads", "rows", "violations") else v / heads)
                                        for k, v in total.items()}, "per_layer": per_layer}
        s = summary[kind]["all_layers"]
        print(f"\n{kind} steps ({int(heads)} head-steps): recall@{J} bound {s['recall_bound']:.3f} est "
              f"{s['recall_est']:.3f}; exact best row in top-{J}: bound {s['rank1_bound_le16']:.3f} est "
              f"{s['rank1_est_le16']:.3f} (mean rank {s['rank1_bound']:.0f} / {s['rank1_est']:.0f}); archive mass "
              f"in top-{J}: bound {s['mass_bound']:.3f} est {s['mass_est']:.3f}; rows bound>s* "
              f"{s['bound_gt_sstar']:.0f}, exact>s* {s['exact_gt_sstar']:.1f}, exact>s*-4 "
              f"{s['exact_gt_sstar_m4']:.1f}; violations {int(s['violations'])}")
        print("  recall@16 / exact-best in top-16 / mass in top-16 by estimator: " + ", ".join(
            f"{name} {s['recall_' + name]:.3f}/{s['rank1_' + name + '_le16']:.3f}/{s['mass_' + name]:.3f}"
            for name in ("bound", "est", "pca16", "pca32", "pca48", "int4", "int8",
                         *(f"paged{size}x{pages}" for size, pages in PAGED),
                         "s1_64", "s1_128", "p8_64", "p8_128", "kmE64", "kmE128", "kmB64", "kmB128",
                         *(f"reuse{every}_{C}" for every, C in REUSE))))
        print("layer: recall bound/est  best-in-top16 bound/est  mass bound/est")
        for layer, v in per_layer.items():
            print(f"  {layer:2d}: {v['recall_bound']:.2f}/{v['recall_est']:.2f}  {v['rank1_bound_le16']:.2f}/"
                  f"{v['rank1_est_le16']:.2f}  {v['mass_bound']:.2f}/{v['mass_est']:.2f}")
    print(f"\nscore {sum(t['ok'] for t in trials)}/{len(trials)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "trials": trials, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
