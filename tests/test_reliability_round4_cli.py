"""Issue 44's user-facing items: a NaN score in a results file (7), a broken entry-point plugin (8), a hub model
offline (9), a policy spec given to ``kvzoo run`` (10), ``KVZOO_KERNELS=triton`` on CPU (12), Ctrl-C, and the rule
behind them: the CLI prints one line and exits non-zero for every error a user can cause (a traceback with --debug)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from kvzoo import registry
from kvzoo.bench import results
from kvzoo.cli import _as_flags, main

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("clean_registry")  # tests/conftest.py


def _cli(args: list[str]) -> int:
    """Run the CLI; argparse's refusals become the exit code they would have been."""
    try:
        return main(args)
    except SystemExit as stop:
        return stop.code


def _error_lines(err: str) -> list[str]:
    """stderr without the OpenMP and allocator notes every model-running command prints first."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith(("kvzoo: OMP_", "kvzoo: MALLOC_"))
            and "OpenMP" not in line]


# --- item 7: an ok row whose score is NaN ----------------------------------------------------------------------


def _row(policy: str, ratio: float | None, score: float, kv_bytes: float) -> dict:
    return {"key": f"tiny-llama|niah_single|{policy}|{ratio}|after", "status": "ok", "error": None,
            "model": "tiny-llama", "task": "niah_single", "policy": policy, "ratio": ratio,
            "question_position": "after", "answer_nll": 1.5, "score": score, "intact": True,
            "kv_bytes_per_token": kv_bytes}


@pytest.mark.parametrize("field,value", [("score", math.nan), ("score", math.inf),
                                         ("kv_bytes_per_token", math.nan), ("ratio", math.nan)])
def test_an_ok_row_with_a_number_that_is_not_finite_is_not_a_results_row(field: str, value: float):
    row = _row("snapkv", 4.0, 0.31, 2.0**20)
    assert results.row_problem(row) is None
    row[field] = value
    problem = results.row_problem(row)
    assert problem is not None and repr(field) in problem and "finite" in problem


def test_plot_draws_a_file_holding_an_ok_row_whose_score_is_nan(tmp_path: Path, capsys: pytest.CaptureFixture):
    """The row is reported as a line that is not a results row (as the leaderboard's resume reads it: it runs that
    trial again), and the plots are drawn from the rest; before, the frontier raised ``KeyError: (0.31, nan)``."""
    rows = [_row("full", None, 1.0, 4 * 2.0**20), _row("snapkv", 4.0, 0.31, 2.0**20),
            {**_row("snapkv", 8.0, math.nan, 0.31 * 2.0**20)}]
    path = tmp_path / "nan.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # json writes NaN as NaN, and reads it back
    assert main(["plot", str(path), "--out-dir", str(tmp_path / "plots")]) == 0
    captured = capsys.readouterr()
    assert f"{path}:3: JSON, but not a kvzoo results row (an ok row whose 'score' is nan, not a finite number)" \
        in captured.err
    assert (tmp_path / "plots" / "nan-frontier.png").is_file()
    assert "nan-frontier.png" in captured.out


# --- item 8: a broken entry-point plugin --------------------------------------------------------------------------

BROKEN_IMPORT = "import kvzoo_no_such_dependency  # noqa: F401\n"
CLAIMS_FULL = ("from dataclasses import dataclass\nfrom typing import ClassVar\n\n"
               "from kvzoo.framework.policy import Policy\nfrom kvzoo.hookspecs import hookimpl\n\n\n"
               "@dataclass\nclass Impostor(Policy):\n    name: ClassVar[str] = 'full'\n\n"
               "    def priority(self, rows, keep):\n        raise NotImplementedError\n\n\n"
               "@hookimpl\ndef kvzoo_policies():\n    return [Impostor]\n")
BROKEN_HOOK = ("from kvzoo.hookspecs import hookimpl\n\n\n@hookimpl\ndef kvzoo_policies():\n"
               "    raise RuntimeError('the plugin cannot list its policies')\n")


def _install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
                    name: str, source: str) -> str:
    """A distribution ``kvzoo-<name> 0.1.0`` on sys.path whose ``kvzoo`` entry point ``name`` is a module holding
    ``source``; the registry re-read. Returns the module's name."""
    module = f"kvzoo_{name}_plugin"
    (tmp_path / f"{module}.py").write_text(source)
    dist_info = tmp_path / f"kvzoo_{name}-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvzoo-{name.replace('_', '-')}\n"
                                        "Version: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[kvzoo]\n{name} = {module}\n")
    request.addfinalizer(lambda: sys.modules.pop(module, None))
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


@pytest.mark.parametrize("source,why", [
    (BROKEN_IMPORT, "importing kvzoo_broken_rows_plugin raised ModuleNotFoundError: No module named "
                    "'kvzoo_no_such_dependency'"),
    (BROKEN_HOOK, "kvzoo_policies() raised RuntimeError: the plugin cannot list its policies"),
    (CLAIMS_FULL, "kvzoo_policies: policy name 'full' is claimed twice: by built-in plugin 'kvzoo.builtins'"),
])
def test_a_broken_entry_point_plugin_is_named_and_left_out_and_the_rest_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, tiny, source: str, why: str):
    from kvzoo import TieredCache

    _install_plugin(tmp_path, monkeypatch, request, "broken_rows", source)
    with pytest.warns(registry.PluginWarning) as caught:
        registry.reload()
    (warning,) = [str(w.message) for w in caught]
    assert "plugin 'broken_rows' (entry point of kvzoo-broken-rows 0.1.0)" in warning and why in warning
    assert "left out" in warning
    assert "full" in registry.available() and registry.get("snapkv", ratio=4).name == "snapkv"
    assert type(registry.get("full")).__module__ == "kvzoo.policies.full"
    assert list(registry.broken_plugins()) == ["broken_rows"]
    assert TieredCache(tiny, "full") is not None
    with pytest.raises(registry.UnknownPolicyError) as refused:
        registry.get("broken_rows")
    message = str(refused.value)
    assert message.startswith("policy 'broken_rows' is not available: ") and why in message
    assert "plugin 'broken_rows' (entry point of kvzoo-broken-rows 0.1.0)" in message
    with pytest.raises(registry.UnknownPolicyError, match="a plugin left out .*plugin 'broken_rows'"):
        registry.get("snapkvv")  # another unknown name: the left-out plugin is mentioned, as its policy might be it


def test_kvzoo_list_and_run_with_a_broken_plugin_name_it_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture):
    _install_plugin(tmp_path, monkeypatch, request, "broken_rows", BROKEN_IMPORT)
    registry.reset()
    assert main(["list"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("full ")
    (line,) = captured.err.splitlines()
    assert line.startswith("kvzoo: warning: plugin 'broken_rows' (entry point of kvzoo-broken-rows 0.1.0)")
    assert "ModuleNotFoundError" in line
    registry.reset()
    assert main(["run", "--policy", "broken_rows", "--model", "no-such-model"]) == 2
    err = _error_lines(capsys.readouterr().err)
    assert err[-1].startswith("kvzoo run: policy 'broken_rows' is not available: plugin 'broken_rows'")
    assert "Traceback" not in "".join(err)


def test_register_plugin_still_refuses_a_bad_plugin():
    """A plugin given to register_plugin() fails there (its author is calling): only installed ones are left out."""
    import types

    @registry.hookimpl
    def kvzoo_policies():
        raise RuntimeError("broken")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(registry.RegistryError, match="kvzoo_policies\\(\\) raised RuntimeError: broken"):
            registry.register_plugin(types.SimpleNamespace(kvzoo_policies=kvzoo_policies), name="bad")
    assert "full" in registry.available()


# --- item 9: a hub model offline ------------------------------------------------------------------------------------


def test_run_with_a_hub_model_offline_ends_in_one_line():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "kvzoo.cli", "run", "--model", "org/name", "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = _error_lines(done.stderr)
    assert line.startswith("kvzoo run: could not load 'org/name' from the hub (")
    assert "download it where a network is, then pass the local directory" in line


def test_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    import kvzoo.models

    def offline(name, dtype=None):
        raise OSError(f"could not load {name!r} from the hub (no network\nat all)")

    monkeypatch.setattr(kvzoo.models, "load_model", offline)
    assert main(["run", "--model", "org/name"]) == 1
    assert _error_lines(capsys.readouterr().err) == ["kvzoo run: could not load 'org/name' from the hub (no network "
                                                     "at all)"]
    for argv in (["--debug", "run", "--model", "org/name"], ["run", "--model", "org/name", "--debug"]):
        with pytest.raises(OSError, match="no network"):
            main(argv)


# --- item 10: a policy spec given to kvzoo run ------------------------------------------------------------------------


def test_the_flag_rewording_never_touches_quoted_user_input():
    message = "unknown policy 'snapkv(window=4)'; did you mean \"snapkv(window=4, it's)\"? window=4 is too small"
    assert _as_flags(message, ["window"]) == ("unknown policy 'snapkv(window=4)'; did you mean \"snapkv(window=4, "
                                              "it's)\"? --param window=4 is too small")
    assert _as_flags("the policy's ratio=4 is 'ratio=4'", ["window"]) == "the policy's --ratio 4 is 'ratio=4'"


def test_run_takes_a_policy_spec(capsys: pytest.CaptureFixture):
    code = main(["run", "--model", "tiny-llama", "--policy", "snapkv(window=4)", "--ratio", "4", "--context-tokens",
                 "300", "--max-new-tokens", "2", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "window=4" in captured.out.splitlines()[0]
    assert _cli(["run", "--model", "tiny-llama", "--policy", "snapkv(window=4)", "--param", "window=8"]) == 2
    assert "policy spec 'snapkv(window=4)' sets window, given again as --param window=8: give each once" \
        in capsys.readouterr().err


def test_a_refused_policy_spec_is_quoted_as_given(capsys: pytest.CaptureFixture):
    # a model that exists: a misspelt one is refused first, before torch (issue 48); the policy is refused before the
    # model loads
    assert _cli(["run", "--model", "tiny-llama", "--policy", "snapkv(window=0)", "--ratio", "4"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy" not in err
    assert "snapkv: window must be" in err


# --- item 12: KVZOO_KERNELS=triton on CPU ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["run", "--model", "no-such-model"],
                                     ["leaderboard", "--preset", "tiny", "--model", "no-such-model", "--no-progress"]])
def test_triton_kernels_on_cpu_without_the_interpreter_are_refused_at_start_up(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, command: list[str]):
    monkeypatch.setenv("KVZOO_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _cli(command) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.startswith(f"kvzoo {command[0]}: KVZOO_KERNELS=triton runs the Triton kernels")
    assert "TRITON_INTERPRET=1" in line and "KVZOO_KERNELS=torch" in line
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # with the interpreter, start-up lets it by: the model is refused
    assert _cli(command) == 2
    assert "no-such-model" in capsys.readouterr().err


# --- Ctrl-C ---------------------------------------------------------------------------------------------------------


def test_ctrl_c_ends_in_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture):
    from kvzoo.bench import runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_grid", interrupted)
    out = tmp_path / "r.jsonl"
    assert main(["leaderboard", "--preset", "tiny", "--policies", "full", "--out", str(out), "--no-plots",
                 "--no-progress"]) == 130
    err = _error_lines(capsys.readouterr().err)
    assert err[-1] == (f"kvzoo leaderboard: interrupted; 0 of 2 trials are kept in {out} (whole rows only): the "
                       "same command resumes where it stopped")
    assert "Traceback" not in "".join(err)
    with pytest.raises(KeyboardInterrupt):
        main(["--debug", "leaderboard", "--preset", "tiny", "--policies", "full", "--out", str(out), "--no-plots",
              "--no-progress"])


# --- issue 48: quiet acceptances ---------------------------------------------------------------------------------
def test_ratio_one_warns_that_it_compresses_nothing():
    with pytest.warns(UserWarning, match=r"ratio=1\) keeps every row: it compresses nothing"):
        registry.get("snapkv", ratio=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.get("snapkv", ratio=2)  # no warning above 1


def test_a_policy_handed_to_kvpress_as_a_press_names_to_press():
    """kvpress's pipeline enters ``press(model)``: a kvzoo policy there says what to pass instead."""
    policy = registry.get("snapkv", ratio=4)
    with pytest.raises(TypeError, match=r"not a kvpress press: pass kvzoo\.integrations\.kvpress\.to_press"):
        with policy(object()):
            pass
