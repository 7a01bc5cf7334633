"""Smoke runs of the benchmark scripts at their toy sizes (the figures themselves are the scripts' job)."""

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_decode_step_ops_counts_every_policy_against_transformers(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("decode_step", None)
    import decode_step

    from kvzoo.models import tiny_llama

    rows = decode_step.count_ops({"tiny Llama": tiny_llama},
                                 {k: decode_step.OPS_POLICIES[k] for k in ("full", "streaming_llm")})
    caches = [r["cache"] for r in rows]
    assert caches[:2] == ["transformers DynamicCache", "transformers StaticCache"]
    assert {"kvzoo full", "kvzoo streaming_llm"} <= set(caches)
    assert all(r["syncs"] == 0 for r in rows)
    assert "| tiny Llama | kvzoo full | yes |" in decode_step.ops_markdown(rows)


def test_soak_toy_run_reports_every_policy_and_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("soak", None)
    import soak

    out = tmp_path / "soak.json"
    assert soak.main(["--steps", "40", "--context", "30", "--window", "10", "--models", "tiny-llama", "--check",
                      "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == set(soak.POLICIES) and all(r["step"] == 40 and r["ms_per_step"] > 0 for r in rows.values())
    assert rows["streaming_llm"]["attended_rows"] <= 256 and rows["streaming_llm"]["archived_rows"] == 0  # 70 < budget
    assert "| tiny-llama | vestige+sketch | 40 |" in capsys.readouterr().out
    # the growth criterion: a streaming_llm slower at 10,000 steps than 1.3x its 1,000-step figure fails the soak
    fake = [{"model": "m", "policy": "streaming_llm", "step": 1_000, "ms_per_step": 1.0},
            {"model": "m", "policy": "streaming_llm", "step": 10_000, "ms_per_step": 1.4}]
    assert soak.check(fake, 100.0, 100.0) == ["m: streaming_llm ms/step at 10,000 steps is 1.40x its ms/step at 1,000 "
                                              "(limit 1.3x)"]
    assert soak.check(fake[:1], 100.0, 200.0)[0].startswith("RSS grew 100 MiB")
