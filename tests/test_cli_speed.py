"""The front door loads nothing it does not need: ``import kvzoo``, ``kvzoo --help``, ``--version``, ``list``, and a
refused policy, model or option (issue 48).

Each check runs in a fresh interpreter and reads ``sys.modules`` afterwards: torch and transformers are what make a
command take seconds (``python -X importtime`` shows it), so a command that does not need them must not import them.
``kvzoo list`` reads what it prints of the built-in policies from kvzoo/listing.json (held equal to the classes here);
with a plugin it asks the registry, which imports the policies (torch).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvzoo

HEAVY = ("torch", "transformers", "triton", "matplotlib", "ray")


def _run(code: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def _loaded_after(statement: str) -> set[str]:
    code = (f"import sys\n{statement}\n"
            f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))")
    return set(_run(code).stdout.split("\n")[-2].split())


def test_import_kvzoo_loads_nothing_heavy_and_names_resolve_on_use():
    assert _loaded_after("import kvzoo") == set()
    code = ("import sys, kvzoo\n"
            "assert kvzoo.registry.get('vestige', ratio=4).name == 'vestige'\n"
            "assert 'transformers' not in sys.modules  # the registry and policies need torch alone\n"
            "assert callable(kvzoo.pipeline.generate) and kvzoo.TieredCache.__name__ == 'TieredCache'\n"
            "assert kvzoo.bench.Grid and kvzoo.bench.TaskSpec and kvzoo.load_smollm2\n"
            "print('ok')")
    assert _run(code).stdout.strip() == "ok"


def test_unknown_attribute_names_what_kvzoo_has():
    with pytest.raises(AttributeError, match="has no attribute 'registri'.*registry"):
        kvzoo.registri  # noqa: B018


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"], ["plot", "--help"]])
def test_help_and_version_import_neither_torch_nor_transformers(argv: list[str]):
    statement = ("from kvzoo.cli import main\n"
                 f"try:\n    main({argv!r})\nexcept SystemExit as exit_:\n    assert exit_.code == 0, exit_.code")
    assert _loaded_after(statement) == set()


@pytest.mark.parametrize("argv", [["list"], ["list", "--verbose"]])
def test_list_imports_neither_torch_nor_transformers(argv: list[str]):
    assert _loaded_after(f"from kvzoo.cli import main\nassert main({argv!r}) == 0") == set()


def test_the_listing_file_says_what_the_policy_classes_say(clean_registry: None):
    """kvzoo/listing.json is what `kvzoo list` prints without importing the policies: it must equal what the registry
    reads from the classes now (after changing a policy's summary, paper, parameters or default retriever, rewrite it:
    ``python -c "from kvzoo import cli; cli.write_listing()"``)."""
    from kvzoo import cli

    assert json.loads(cli.LISTING.read_text(encoding="utf-8")) == cli.listing_entries(), (
        "kvzoo/listing.json is stale: python -c \"from kvzoo import cli; cli.write_listing()\"")


def test_list_prints_the_same_from_the_file_and_from_the_registry(clean_registry: None, capsys: pytest.CaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch):
    from kvzoo import cli

    printed = {}
    for builtins_only in (True, False):
        monkeypatch.setattr(cli, "_builtins_only", lambda value=builtins_only: value)
        for argv in (["list"], ["list", "--verbose"]):
            assert cli.main(argv) == 0
            printed[builtins_only, len(argv)] = capsys.readouterr().out
    assert printed[True, 1] == printed[False, 1] and printed[True, 2] == printed[False, 2]
    assert "retriever: vestige (index 'auto'" in printed[True, 1] and "from: built-in plugin" in printed[True, 2]


def test_list_with_a_registered_plugin_asks_the_registry(clean_registry: None, capsys: pytest.CaptureFixture):
    from kvzoo import registry
    from kvzoo.cli import main
    from tests import plugin_example

    registry.register_plugin(plugin_example)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "keep_first" in out and "keep the first rows (test plugin)" in out


def test_the_parsers_executors_are_the_registrys(clean_registry: None):
    from kvzoo import cli, registry

    assert cli._builtins_only()
    classes = cli.executor_classes()
    assert classes == {name: registry.executor_class(name) for name in registry.executors()}
    assert list(classes)[0] == "local"


@pytest.mark.parametrize("argv,said", [
    (["leaderboard", "--policies", "typo"], "unknown policies 'typo'; registered policies: full, streaming_llm"),
    (["run", "--model", "smollm2-135"], "unknown model 'smollm2-135': valid names are smollm2-135m, gemma3-270m"),
    (["leaderboard", "--model", "smollm2-135"], "unknown model 'smollm2-135': valid names are smollm2-135m"),
    (["leaderboard", "--policies", "snapkv", "--model", "smollm2-135"], "unknown model 'smollm2-135'"),
    # a policy's parameter values are checked by its class (torch): a misspelt model is refused first
    (["run", "--policy", "snapkv(window=-1)", "--ratio", "4", "--model", "smollm2-135"], "unknown model 'smollm2-135'"),
    (["run", "--seed", "3"], "--seed applies to --task only"),
    (["run", "--param", "ratio=4", "--ratio", "8"], "ratio is given twice"),
    (["leaderboard", "--out", ""], "--out '' is empty"),
])
def test_a_misspelt_policy_model_or_option_is_refused_before_importing_torch(argv: list[str], said: str):
    """Issue 48: `kvzoo leaderboard --policies typo` took 3.1 s (its parser built the executors' options through the
    registry, which imported every policy) and a misspelt --model was refused after torch and transformers."""
    statement = ("import contextlib, io\nfrom kvzoo.cli import main\nerr = io.StringIO()\n"
                 f"with contextlib.redirect_stderr(err):\n    code = main({argv!r})\n"
                 f"assert code == 2 and {said!r} in err.getvalue(), (code, err.getvalue())")
    assert _loaded_after(statement) == set()


@pytest.mark.parametrize("argv,said", [
    (["run", "--policy", "snapkvv"], "unknown policy 'snapkvv'; did you mean 'snapkv'?"),
    (["run", "--policy", "snapkvv(window=4)"], "unknown policy 'snapkvv'"),
])
def test_a_misspelt_policy_is_refused_before_importing_torch(argv: list[str], said: str):
    """A typo is refused at once (issue 48: it took 8 s, torch and transformers imported before the name was read)."""
    statement = ("import contextlib, io\nfrom kvzoo.cli import main\nerr = io.StringIO()\n"
                 f"with contextlib.redirect_stderr(err):\n    code = main({argv!r})\n"
                 f"assert code != 0 and {said!r} in err.getvalue(), (code, err.getvalue())")
    assert _loaded_after(statement) == set()


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture):
    from kvzoo.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvzoo {kvzoo.__version__}"


def test_the_parser_offers_the_pipelines_question_positions_and_the_planners_names():
    from kvzoo import cli, pipeline
    from kvzoo.bench import planner

    assert cli.QUESTION_POSITIONS == pipeline.QUESTION_POSITIONS
    parser = cli.build_parser()
    args = parser.parse_args(["leaderboard", "--preset", "demo", "--dtype", "bfloat16", "--positions", "before"])
    assert (args.preset, args.dtype, args.positions) == ("demo", "bfloat16", ["before"])
    assert set(planner.PRESETS) == {"demo", "leaderboard", "leaderboard-hour", "long", "tiny"}
    assert set(planner.DTYPES) == {"float32", "bfloat16", "float16"}
