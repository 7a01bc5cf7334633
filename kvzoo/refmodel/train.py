"""Training of the reference twins (the measured recipe, docs/environment.md); CLI in ``benchmarks/refmodels/train.py``.

One arm per process; the same seed gives both arms the same initial weights and data, each batch is generated from
``(seed, step, stage)`` and the state saved to ``work_dir/state.pt``, so a run resumes. The curriculum
(:data:`kvzoo.refmodel.data.CURRICULUM`) advances at ``advance_at`` held-out accuracy and stops at ``stop_at``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvzoo.refmodel import data as D
from kvzoo.refmodel.modeling import KvzooMLAConfig, KvzooMLAForCausalLM


@dataclass
class TrainConfig:
    arm: str = "nope"  # "nope" (branch never rotated, Kimi) or "rope" (branch rotated, DeepSeek)
    seed: int = 0
    work_dir: str = field(default_factory=lambda: str(default_work_dir()))
    out_dir: str | None = None  # where the finished model goes (save_pretrained); None = work_dir/final
    tokens_per_step: int = 2048
    max_steps: int = 8000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_count: int = 200
    advance_at: float = 0.95
    stop_at: float = 0.97
    save_every: int = 100
    n_queries: int | None = None  # per training sequence; None: min(16, T // 8)
    curriculum: tuple[tuple[int, int], ...] = D.CURRICULUM
    threads: int = 1
    device: str | None = None  # None: CUDA when present, else CPU
    bf16: bool = True
    final_count: int = 500
    other_tasks_count: int = 100  # zero-shot accuracy on the shared-vocabulary and text-needle sets (0: skip)
    model: dict[str, Any] = field(default_factory=dict)  # KvzooMLAConfig overrides
    progress: bool = True


def build_model(cfg: TrainConfig) -> KvzooMLAForCausalLM:
    if cfg.arm not in ("nope", "rope"):
        raise ValueError(f"arm must be 'nope' or 'rope', got {cfg.arm!r}")
    config = KvzooMLAConfig(rope_branch=cfg.arm == "rope", vocab_size=D.VOCAB_SIZE, **cfg.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return KvzooMLAForCausalLM(config)


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(cfg: TrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)


@torch.no_grad()
def predict(model: KvzooMLAForCausalLM, examples: list[D.Example], batch_size: int = 50, bf16: bool = False) -> list[int]:
    """Greedy answer token of each example from a plain full forward (all examples the same length)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    answers: list[int] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        ids = torch.tensor([e.context + e.question for e in chunk], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, logits_to_keep=1).logits[:, -1]
        answers += logits.argmax(-1).tolist()
    model.train(was_training)
    return answers


def accuracy(model: KvzooMLAForCausalLM, examples: list[D.Example], bf16: bool = False) -> float:
    answers = predict(model, examples, bf16=bf16)
    return sum(a == e.answer for a, e in zip(answers, examples, strict=True)) / len(examples)


def default_work_dir() -> pathlib.Path:
    """Per-user: ``$KVZOO_CACHE_DIR/train`` or ``~/.cache/kvzoo/train`` (not a world-writable /tmp folder)."""
    root = os.environ.get("KVZOO_CACHE_DIR") or pathlib.Path.home() / ".cache" / "kvzoo"
    return pathlib.Path(root) / "train"


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) one arm; returns the training record (also written as JSON)."""
    from tqdm import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    work = pathlib.Path(cfg.work_dir) / f"{cfg.arm}-s{cfg.seed}"
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state_file = work / "state.pt"
    step, stage, tokens, curve, train_s = 0, 0, 0, [], 0.0
    if state_file.is_file():
        # weights_only: a state file is tensors and plain numbers; nothing in it may run code on load
        state = torch.load(state_file, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, stage, tokens, curve, train_s = state["step"], state["stage"], state["tokens"], state["curve"], state["train_s"]
        print(f"resumed {work} at step {step} (stage {stage}, {tokens} tokens)", flush=True)

    def save() -> None:
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "stage": stage,
                 "tokens": tokens, "curve": curve, "train_s": train_s, "config": asdict(cfg)}
        torch.save(state, work / "state.tmp")
        (work / "state.tmp").replace(state_file)

    heldout_sets: dict[int, list[D.Example]] = {}

    def stage_acc(s: int) -> float:
        if s not in heldout_sets:
            T, n = cfg.curriculum[s]
            heldout_sets[s] = D.heldout_recall(T, n, cfg.eval_count)
        return accuracy(model, heldout_sets[s], bf16=cfg.bf16)

    done = bool(curve) and curve[-1]["stage"] == len(cfg.curriculum) - 1 and curve[-1]["acc"] >= cfg.stop_at
    final_record = work / "final" / "training_record.json"
    if (done or step >= cfg.max_steps) and final_record.is_file():
        return json.loads(final_record.read_text())  # finished before: nothing to do
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not cfg.progress, desc=f"{cfg.arm}-s{cfg.seed}")
    losses: list[float] = []
    t_start = time.perf_counter()
    while step < cfg.max_steps and not done:
        T, n = cfg.curriculum[stage]
        batch = max(1, cfg.tokens_per_step // T)
        ids, labels = D.training_batch(cfg.seed, step, T, n, batch, cfg.n_queries)
        ids, labels = ids.to(device), labels.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        with _autocast(cfg, device):
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += ids.numel()
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(T=T, pairs=n, loss=f"{loss.item():.3f}")
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            train_s += time.perf_counter() - t_start
            t_start = time.perf_counter()
            acc = stage_acc(stage)
            curve.append({"step": step, "tokens": tokens, "stage": stage, "T": T, "pairs": n, "acc": acc,
                          "loss": sum(losses) / len(losses), "train_s": round(train_s, 1)})
            losses = []
            tqdm.write(f"[{cfg.arm}-s{cfg.seed}] step {step} T={T} pairs={n} loss={curve[-1]['loss']:.3f} "
                       f"held-out acc={acc:.3f} ({train_s:.0f}s)")
            last = stage == len(cfg.curriculum) - 1
            if last and acc >= cfg.stop_at:
                done = True
            elif not last and acc >= cfg.advance_at:
                stage += 1
            t_start = time.perf_counter()
        if step % cfg.save_every == 0 or done:
            save()
    bar.close()
    train_s += time.perf_counter() - t_start
    save()
    return finish(cfg, model, step, tokens, curve, train_s)


def finish(cfg: TrainConfig, model: KvzooMLAForCausalLM, step: int, tokens: int, curve: list, train_s: float) -> dict:
    """Final held-out accuracy at the trained length (fp32), 5 recorded examples, save model + record."""
    model = model.float().cpu().eval()
    T, n = cfg.curriculum[-1]
    final = D.heldout_recall(T, n, cfg.final_count)
    final_acc = accuracy(model, final)
    extra = {}
    for task in ("shared", "needle_text") if cfg.other_tasks_count else ():
        sets = D.heldout(task, T, n if task == "shared" else 4, count=cfg.other_tasks_count)
        extra[task] = accuracy(model, sets)
    examples = D.heldout_recall(T, n, 5, seed=777)
    answers = predict(model, examples)
    record = {
        "arm": cfg.arm, "seed": cfg.seed, "steps": step, "tokens": tokens, "train_s": round(train_s, 1),
        "final": {"T": T, "pairs": n, "count": cfg.final_count, "acc": final_acc},
        "zero_shot_other_tasks_acc": extra,
        "passed": final_acc >= 0.9, "curve": curve,
        "examples": [{**e.as_dict(), "model_answer": a} for e, a in zip(examples, answers, strict=True)],
        "train_config": {k: v for k, v in asdict(cfg).items() if k not in ("progress",)},
    }
    out = pathlib.Path(cfg.out_dir) if cfg.out_dir else pathlib.Path(cfg.work_dir) / f"{cfg.arm}-s{cfg.seed}" / "final"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "training_record.json").write_text(json.dumps(record, indent=1))
    print(f"[{cfg.arm}-s{cfg.seed}] final held-out acc at T={T}, {n} pairs: {final_acc:.3f} "
          f"({'PASS' if record['passed'] else 'FAIL'}); saved to {out}", flush=True)
    return record


def throughput(arm: str = "nope", lengths: tuple[int, ...] = (64, 512), steps: int = 3, tokens_per_step: int = 8192,
               bf16: bool = True) -> dict[int, float]:
    """Training tokens/s per length (forward + backward + AdamW), measured after one warm-up step."""
    cfg = TrainConfig(arm=arm, tokens_per_step=tokens_per_step, bf16=bf16)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = {}
    for T in lengths:
        batch = max(1, tokens_per_step // T)
        for i in range(steps + 1):
            if i == 1:
                t0 = time.perf_counter()
            ids, labels = D.training_batch(0, i, T, 16 if T >= 256 else 4, batch)
            with _autocast(cfg, device):
                loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        result[T] = steps * batch * T / (time.perf_counter() - t0)
    return result
