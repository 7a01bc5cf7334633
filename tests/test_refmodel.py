"""kvzoo's reference twins (kvzoo.refmodel): runtime equivalence, the arms' one difference, shipped checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvzoo import pipeline
from kvzoo.framework.cache import TieredCache
from kvzoo.models import load_model
from kvzoo.refmodel import CHECKPOINT_DIR, KvzooMLAConfig, KvzooMLAForCausalLM
from kvzoo.refmodel import data as D
from kvzoo.refmodel.train import TrainConfig, train

ARMS = {"nope": False, "rope": True}
SHIPPED = sorted(p.name for p in CHECKPOINT_DIR.glob("ref-*") if (p / "config.json").is_file())


def _model(rope_branch: bool, seed: int = 0) -> KvzooMLAForCausalLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return KvzooMLAForCausalLM(KvzooMLAConfig(rope_branch=rope_branch)).eval()


def test_arms_share_initial_weights() -> None:
    nope, rope = _model(False), _model(True)
    for (name, a), (_, b) in zip(nope.state_dict().items(), rope.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arm", ARMS)
def test_tiered_full_matches_dynamic_cache(arm: str) -> None:
    """TieredCache(full) through kvzoo's MLA adapter == the model's own forward: prefill, chunk, decode."""
    model = _model(ARMS[arm])
    ids = torch.randint(4, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        outs = {}
        for kind in ("dynamic", "tiered"):
            cache = DynamicCache(config=model.config) if kind == "dynamic" else TieredCache(model, "full")
            pieces = [model(input_ids=ids[:, :30], cache=cache, use_cache=True).logits,
                      model(input_ids=ids[:, 30:40], cache=cache, use_cache=True).logits]  # chunked prefill
            pieces += [model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(40, 48)]
            outs[kind] = torch.cat(pieces, dim=1)
    assert (outs["dynamic"] - reference).abs().max() < 1e-4
    assert (outs["tiered"] - reference).abs().max() < 1e-4


@pytest.mark.parametrize("arm", ARMS)
def test_branch_rotated_only_in_rope_arm(arm: str) -> None:
    """The same token with the same (empty) history cached at positions 0 and 7: its branch differs iff RoPE."""
    model = _model(ARMS[arm])
    branches = []
    with torch.no_grad():
        for pos in (0, 7):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([[42]]), position_ids=torch.tensor([[pos]]), cache=cache, use_cache=True)
            branches.append(cache.layers[0].values[0, 0, 0])  # k_rot, [qk_rope_head_dim]
    assert branches[0].shape[-1] == model.config.qk_rope_head_dim
    if ARMS[arm]:
        assert (branches[0] - branches[1]).abs().max() > 1e-3
    else:
        torch.testing.assert_close(branches[0], branches[1], rtol=1e-6, atol=1e-6)  # two forwards: equal to rounding


def test_reference_checkpoints_are_shipped() -> None:
    assert "ref-nope-s0" in SHIPPED and "ref-rope-s0" in SHIPPED, f"shipped: {SHIPPED}"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_checkpoint_reproduces_recorded_answers(name: str) -> None:
    path = CHECKPOINT_DIR / name
    record = json.loads((path / "training_record.json").read_text())
    assert record["passed"] and record["final"]["acc"] >= 0.9
    assert (path / "model.safetensors").stat().st_size < 25 * 2**20
    short = name.removesuffix("-s0")
    model, tokenizer = load_model(short)
    assert tokenizer is None and model.config.rope_branch == (record["arm"] == "rope")
    assert isinstance(AutoModelForCausalLM.from_pretrained(path), KvzooMLAForCausalLM)
    for ex in record["examples"]:
        out = pipeline.generate(model, None, ex["context"], ex["question"], "full", max_new_tokens=1)
        assert out.token_ids[0] == ex["model_answer"]
    assert sum(ex["model_answer"] == ex["answer"] for ex in record["examples"]) >= 4


def test_heldout_sets_are_fixed_and_well_formed() -> None:
    a, b = D.heldout_recall(128, 8, 5), D.heldout_recall(128, 8, 5)
    assert [x.as_dict() for x in a] == [x.as_dict() for x in b]
    for ex in a + D.heldout("shared", 128, 8, 5) + D.heldout("needle_text", 128, 4, 5):
        assert len(ex.context) + len(ex.question) == 128
        assert ex.question[0] == D.QUERY and ex.context[0] == D.BOS
        key_at = ex.context.index(ex.question[1])  # the key occurs once in the context, its value next
        assert ex.context.count(ex.question[1]) == 1 and ex.context[key_at + 1] == ex.answer


def test_smoke_training_loss_decreases(tmp_path) -> None:
    cfg = TrainConfig(arm="rope", work_dir=str(tmp_path), tokens_per_step=1024, max_steps=60, warmup=10,
                      eval_every=20, eval_count=20, final_count=20, other_tasks_count=0, curriculum=((32, 2),),
                      threads=1, progress=False)
    record = train(cfg)
    losses = [point["loss"] for point in record["curve"]]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5
    assert (tmp_path / "rope-s0" / "final" / "model.safetensors").is_file()
    # resumable: a rerun finds the finished state and does not train further
    assert train(cfg)["steps"] == 60
