"""Smoke run of ``benchmarks/probe.py vestige-recovery`` on the reference twins (one seed, two ratios, two examples)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_recovery_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import probe

    out = tmp_path / "rows.jsonl"
    assert probe.main(["vestige-recovery", "--seeds", "0", "--ratios", "8", "128", "--count", "2",
                       "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    fields = {"model", "arm", "seed", "ratio", "budget", "tier", "examples", "accuracy", "fetched_rows_per_step",
              "archived_rows", "fetched_share", "commit", "date"}
    assert all(fields <= set(r) for r in rows)
    assert len(rows) == 2 * (1 + 2 * len(probe.RECOVERY_TIERS))
    for arm in probe.RECOVERY_ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        assert {r["model"] for r in mine} == {f"ref-{arm}-s0"}
        assert [r for r in mine if r["tier"] == probe.FULL and r["ratio"] is None]
        assert {(r["tier"], r["ratio"]) for r in mine if r["ratio"]} == {(t, k) for t in probe.RECOVERY_TIERS
                                                                          for k in (8, 128)}
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and r["examples"] == 2
        if r["tier"] in (probe.FULL, "eviction alone"):
            assert r["fetched_rows_per_step"] == 0 and r["archived_rows"] == 0 and r["fetched_share"] is None
        else:  # the tiers archive what eviction drops: 510 - 510 // ratio rows per layer
            assert r["archived_rows"] == 510 - 510 // r["ratio"] and 0 <= r["fetched_share"] <= 1
    assert "| nope | eviction alone | 128x |" in capsys.readouterr().out
    sys.modules.pop("benchmarks.probe", None)
