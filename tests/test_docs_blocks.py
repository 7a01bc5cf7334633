"""Every Python block of README.md and docs/*.md runs as written, each on its own (a block is self-contained).

A block's first line may carry one marker:

* ``# kvzoo: tiny`` -- ``load_smollm2()`` returns a tiny random Llama and a byte tokenizer for this block, so that a
  block written for the real SmolLM2-135M runs in CI in a second (what it prints is then noise; that it runs is
  the point);
* ``# kvzoo: needs kvpress`` -- runs only where kvpress is installed: ``make test-kvpress`` runs these blocks
  (``tests/kvpress/test_docs_blocks.py``); here they are skipped, and the skip says so;
* ``# kvzoo: skip: <why>`` -- never run by CI (a GPU, a cluster, a network); the reason shows in the summary.

Without a marker a block runs as it is (real weights if it loads them: one load per process, ``load_smollm2``
caches). A misspelt marker fails, so a block cannot drop out of CI by accident.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvzoo
import kvzoo.models
from kvzoo import registry

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"#\s*kvzoo:\s*(.*)")
KNOWN = ("tiny", "needs kvpress", "skip:")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the fence, 1-based
    source: str

    @property
    def marker(self) -> str | None:
        first = self.source.lstrip().splitlines()[0] if self.source.strip() else ""
        found = MARKER.fullmatch(first.strip())
        return found.group(1).strip() if found else None

    @property
    def name(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{where}:{self.line}"


def blocks(files: list[Path] = FILES) -> list[Block]:
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            found.append(Block(path, text.count("\n", 0, match.start()) + 1, match.group(1)))
    return found


ALL = blocks()


def _tiny_smollm2(dtype=None):
    """What a ``# kvzoo: tiny`` block gets from ``load_smollm2()``: a tiny random Llama and byte-level tokens."""
    from kvzoo.bench.tasks import ByteTokenizer

    model, _ = kvzoo.models.tiny_llama(seed=0)
    return model, ByteTokenizer()


def run_block(block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Execute ``block`` as a module of its own (in ``sys.modules``, as an imported file would be), in ``tmp_path``,
    honouring its marker; the registry is reset afterwards (a block may register a plugin)."""
    marker = block.marker
    if marker is not None and not marker.startswith(KNOWN):
        pytest.fail(f"{block.name}: unknown marker '# kvzoo: {marker}'; valid: # kvzoo: tiny, # kvzoo: needs kvpress, "
                    "# kvzoo: skip: <why>")
    if marker is not None and marker.startswith("skip:"):
        pytest.skip(f"{block.name} is not run in CI: {marker[5:].strip()}")
    if marker == "needs kvpress" and importlib.util.find_spec("kvpress") is None:
        pytest.skip(f"{block.name} needs kvpress: `make test-kvpress` runs it in kvpress's environment")
    if marker == "tiny":
        monkeypatch.setattr(kvzoo.models, "load_smollm2", _tiny_smollm2)
        monkeypatch.setattr(kvzoo, "load_smollm2", _tiny_smollm2, raising=False)
    monkeypatch.chdir(tmp_path)
    name = "docs_block_" + re.sub(r"\W", "_", block.name)
    module = types.ModuleType(name)
    module.__file__ = str(tmp_path / f"{name}.py")
    monkeypatch.setitem(sys.modules, name, module)
    try:
        exec(compile(block.source, block.name, "exec"), module.__dict__)
    finally:
        registry.reset()


def test_the_blocks_are_found_and_the_readme_quick_start_is_among_them():
    readme = [b for b in ALL if b.path.name == "README.md"]
    assert len(readme) >= 3
    assert all("load_smollm2()" in b.source for b in readme)  # the quick start, on the real model
    assert [b for b in ALL if b.marker == "needs kvpress"], "the kvpress example is a docs block"


@pytest.mark.parametrize("block", [b for b in ALL if b.marker != "needs kvpress"], ids=lambda b: b.name)
def test_block_runs_as_written(block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    run_block(block, monkeypatch, tmp_path)


@pytest.mark.parametrize("block", [b for b in ALL if b.marker == "needs kvpress"], ids=lambda b: b.name)
def test_kvpress_block_runs_where_kvpress_is(block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    run_block(block, monkeypatch, tmp_path)


def test_a_failing_block_fails_and_a_bad_marker_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nundefined_name\n```\n\n```python\n# kvzoo: tiyn\nprint(1)\n```\n")
    failing, misspelt = blocks([page])
    assert (failing.line, failing.marker, misspelt.marker) == (3, None, "tiyn")
    with pytest.raises(NameError):
        run_block(failing, monkeypatch, tmp_path)
    with pytest.raises(pytest.fail.Exception, match="unknown marker"):
        run_block(misspelt, monkeypatch, tmp_path)


README_BLOCKS = [b for b in ALL if b.path.name == "README.md" and b.marker in (None, "tiny")]
CLAIM = re.compile(r"answer NLL: (\S+) nats under snapkv 8x, (\S+) under full: the needle is (intact|lost) "
                   r"\(ΔNLL (\S+) nats\)")


@pytest.mark.smollm2
def test_the_readme_blocks_print_what_they_measured_on_smollm2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture):
    """The README's blocks on the real SmolLM2-135M (the tiny stand-in of the test above prints noise): every claim
    they print holds for the figures they print beside it."""
    assert len(README_BLOCKS) >= 3
    printed = {}
    for block in README_BLOCKS:
        source = block.source.replace("# kvzoo: tiny", "", 1)  # on the real weights
        run_block(Block(block.path, block.line, source), monkeypatch, tmp_path)
        printed[block.line] = capsys.readouterr().out
    out = "\n".join(printed.values())
    print(out)
    claims = CLAIM.findall(out)
    assert len(claims) == 1, out
    nll, full, verdict, delta = claims[0]
    assert abs(float(nll) - float(full) - float(delta)) < 0.011
    assert verdict == ("intact" if float(delta) < 1 else "lost")
    kept = dict(re.findall(r"(\w+): .* -- kept (\d+ of \d+) rows per layer and KV group", out))
    (streaming, seen), (vestige, _) = (map(int, kept[name].split(" of ")) for name in ("streaming_llm", "vestige"))
    assert streaming <= -(-seen // 8) + 1  # evicts to 1/8
    assert streaming <= vestige < seen  # 1/8 and the archived rows it fetched back
    (resident,) = re.findall(r"(\d+) rows resident in layer 0 \((within|over) the budget of 256", out)
    assert resident[1] == ("within" if int(resident[0]) <= 256 else "over") == "within"
