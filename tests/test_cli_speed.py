"""The front door loads nothing it does not need: ``import kvzoo``, ``kvzoo --help``, ``--version`` and ``list``.

Each check runs in a fresh interpreter and reads ``sys.modules`` afterwards: torch and transformers are what make a
command take seconds (``python -X importtime`` shows it), so a command that does not need them must not import them.
``kvzoo list`` needs torch (the policies are torch classes), never transformers.
"""

from __future__ import annotations

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


def test_list_imports_torch_for_the_policies_but_not_transformers():
    loaded = _loaded_after("from kvzoo.cli import main\nassert main(['list']) == 0")
    assert "torch" in loaded
    assert "transformers" not in loaded and "matplotlib" not in loaded


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
