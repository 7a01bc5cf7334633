"""Train the reference twins (NoPE and RoPE arms of kvzoo's tiny Kimi-style MLA model).

    python benchmarks/refmodels/train.py --arm nope --seed 0      # one arm per process, 1 thread
    python benchmarks/refmodels/train.py --arm rope --seed 0
    python benchmarks/refmodels/train.py --throughput             # tokens/s first

Work state (resumable: rerun the same command) goes to ``--work-dir/<arm>-s<seed>/``; a model
that reaches >= 90 % held-out recall at T = 512 is shipped to
``kvzoo/refmodel/checkpoints/ref-<arm>-s<seed>/`` (config.json, model.safetensors,
training_record.json). A model that does not pass is left in the work dir and not shipped.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvzoo.refmodel import CHECKPOINT_DIR  # noqa: E402
from kvzoo.refmodel.train import TrainConfig, default_work_dir, throughput, train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", choices=("nope", "rope"), default="nope")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=str(default_work_dir()), help="training state (default: per-user cache)")
    p.add_argument("--max-steps", type=int, default=8000)
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--no-ship", action="store_true", help="do not copy a passing model into the package")
    p.add_argument("--throughput", action="store_true", help="only measure training tokens/s and exit")
    args = p.parse_args(argv)
    if args.throughput:
        import torch

        torch.set_num_threads(args.threads)
        for arm in ("nope", "rope"):
            for T, tps in throughput(arm).items():
                print(f"{arm}: T={T}: {tps:,.0f} training tokens/s ({args.threads} thread(s), bf16 autocast)")
        return 0
    cfg = TrainConfig(arm=args.arm, seed=args.seed, work_dir=args.work_dir, max_steps=args.max_steps,
                      tokens_per_step=args.tokens_per_step, threads=args.threads, device=args.device)
    record = train(cfg)
    final = pathlib.Path(cfg.work_dir) / f"{cfg.arm}-s{cfg.seed}" / "final"
    if record["passed"] and not args.no_ship:
        target = CHECKPOINT_DIR / f"ref-{cfg.arm}-s{cfg.seed}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(final, target)
        print(f"shipped {target}")
    elif not record["passed"]:
        print(f"NOT shipped: held-out accuracy {record['final']['acc']:.3f} < 0.90 (model left in {final})")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
