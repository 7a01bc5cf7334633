"""The software ``make gpu-check`` needs on the GPU machine: carried wheels and a preflight that refuses the rest.

    python benchmarks/gpu_bundle.py download            # here (network to PyPI): the wheels into .gpu-wheels/
    python benchmarks/gpu_bundle.py install --target /tmp/kvzoo-site   # there: unpack them (no network)
    python benchmarks/gpu_bundle.py preflight           # anywhere: refuse what kvzoo does not support

The GPU machine's image (Python 3.12, torch 2.11, triton 3.6.0) has transformers 5.17, whose DeepseekV2 forward takes
``past_key_values=`` and silently drops ``cache=`` into ``**kwargs``: the cache stays empty and every figure is wrong
without an error. Nothing installs from the network there, so :data:`BUNDLE` -- transformers >= 5.18 and what its
import checks -- travels as cp312 manylinux wheels in a git-ignored folder (``carry`` it), unpacked with ``pip install
--no-index --no-deps --target`` into a scratch folder put on ``PYTHONPATH``. :func:`preflight` then checks what the
interpreter will import: kvzoo's own transformers range (``pyproject.toml``), every requirement of the installed
transformers (huggingface-hub >= 1.31 for 5.24, checked at its import), torch and triton in kvzoo's ranges, and --
by running it -- that a DeepseekV2 forward fills a cache handed as ``cache=``. It names each version it refuses and
the fix. Imports the standard library only (and ``packaging``, which pip and transformers both need), so it runs
before torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".gpu-wheels"  # git-ignored (.gitignore); name it in the device tool's `carry`
# The device tool carries at most 64 MiB of working tree; the tracked checkout is ~14 MiB.
WHEELS_LIMIT_MIB = 40

# What travels: transformers >= 5.18 and what its import checks (its Requires-Dist) that the image may hold at another
# version (one session saw huggingface-hub 1.33 there, another needed a newer one than it had). The versions are the
# GPU bundle's lock (locks/gpu-bundle.txt, resolved for cp312 manylinux by `make lock`), never typed here; the
# wheels are small (~18 MiB together), so they travel whatever the image holds and the preflight checks the result.
# huggingface-hub stays on 1.x (locks/gpu-bundle.in): 2.x needs httpx2, which the image lacks.
BUNDLE_NAMES = ("transformers", "huggingface-hub", "tokenizers", "safetensors", "regex")
BUNDLE_LOCK = ROOT / "locks" / "gpu-bundle.txt"


def _load_lock_tool():
    spec = importlib.util.spec_from_file_location("kvzoo_locks", ROOT / "locks" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


locks = _load_lock_tool()
BUNDLE = {name: locks.pins(BUNDLE_LOCK)[name] for name in BUNDLE_NAMES}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
SITE = "/tmp/kvzoo-site"  # where `install` unpacks them on the GPU machine
TRITON_REQUIREMENT = "triton>=3.6"  # pyproject.toml's `triton` extra: the kernels compile with 3.6 (the image's)


def fix_text() -> str:
    """What to do about a refused version (the same words in the preflight's refusal and the README)."""
    pins = ", ".join(f"{k}=={v}" for k, v in BUNDLE.items())
    return (f"on a machine with network run `make gpu-bundle` (wheels of {pins} into {WHEELS.name}/), carry "
            f"{WHEELS.name} to the GPU machine and run there `python3 benchmarks/gpu_check.py --wheels {WHEELS.name} "
            f"...` (it unpacks them with pip install --no-index --no-deps --target {SITE} and puts that folder on "
            "PYTHONPATH)")


# --- here: download -------------------------------------------------------------------------------------------
def download(dest: Path = WHEELS, limit_mib: float = WHEELS_LIMIT_MIB, python: str = sys.executable) -> list[Path]:
    """The :data:`BUNDLE` wheels for CPython 3.12 on x86-64 manylinux into ``dest`` (other versions of the same
    packages removed: two versions of one package stop ``pip install``). A ValueError when they exceed ``limit_mib``."""
    dest.mkdir(parents=True, exist_ok=True)
    requirements = dest / "bundle-requirements.txt"  # the BUNDLE entries of the lock, hashes included
    requirements.write_text(locks.pick(BUNDLE_LOCK, list(BUNDLE)))
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes", "--python-version",
           "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
           "-r", str(requirements)]
    subprocess.run(cmd, check=True)
    requirements.unlink()
    wanted = {_normal(name): version for name, version in BUNDLE.items()}
    kept = []
    for wheel in sorted(dest.glob("*.whl")):
        name, version = _wheel_name(wheel)
        if wanted.get(name) == version:
            kept.append(wheel)
        else:
            wheel.unlink()  # a stale version (or a package no longer in the bundle)
    missing = set(wanted) - {_wheel_name(w)[0] for w in kept}
    if missing:
        raise ValueError(f"pip left no wheel for {sorted(missing)} in {dest}")
    total = sum(w.stat().st_size for w in kept) / 2**20
    if total > limit_mib:
        raise ValueError(f"the wheels in {dest} take {total:.1f} MiB, over the {limit_mib} MiB they may (the device "
                         f"tool carries at most 64 MiB of working tree): drop one the GPU image already has")
    return kept


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_name(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return _normal(name), version


# --- there: install ---------------------------------------------------------------------------------------------
def install(wheels: Path, target: str = SITE, python: str = sys.executable) -> None:
    """Unpack ``wheels/*.whl`` into ``target`` with no network and no dependency resolution (the GPU machine's
    packages are the rest); ``target`` then goes first on ``PYTHONPATH``."""
    found = sorted(Path(wheels).glob("*.whl"))
    if not found:
        raise FileNotFoundError(f"no wheels in {wheels}: {fix_text()}")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--upgrade", "--target", target, *map(str, found)], check=True)


# --- anywhere: the preflight ------------------------------------------------------------------------------------
def installed(name: str, pretend: dict[str, str] | None = None) -> str | None:
    """The version of ``name`` the interpreter would import (``pretend`` overrides, for the tests), None if absent."""
    if pretend and _normal(name) in pretend:
        return pretend[_normal(name)]
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def kvzoo_requirement(name: str = "transformers") -> str:
    """kvzoo's requirement on ``name`` as ``pyproject.toml`` states it (e.g. ``transformers>=5.18,<5.40``)."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(rf'^\s*"({re.escape(name)}[^";]*)"', text, re.MULTILINE)
    if found is None:
        raise ValueError(f"pyproject.toml names no requirement on {name}")
    return found.group(1).replace(" ", "")


def check_requirement(requirement: str, pretend: dict[str, str] | None = None, why: str = "") -> str | None:
    """None when the installed version satisfies ``requirement`` (a PEP 508 string); else what is wrong."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return None
    have = installed(req.name, pretend)
    if have is None:
        return f"{req.name} is not installed; {why}needs {req.name}{req.specifier}"
    try:
        ok = req.specifier.contains(Version(have), prereleases=True)
    except InvalidVersion:
        ok = False
    return None if ok else f"{req.name} {have} is installed; {why}needs {req.name}{req.specifier}"


def transformers_requirements(version: str | None) -> list[str] | None:
    """transformers ``version``'s own requirements (no extras): what its import checks, huggingface-hub among them.

    The bundle's version is read from its committed copy (``locks/gpu-bundle.transformers-requires.txt``, written by
    ``make lock`` from the wheel), any other from the installed transformers when that is the version asked about;
    None when neither knows it (a pretended version that is not installed)."""
    bundled, requires = locks.bundle_requires()
    if version == bundled:
        return requires
    try:
        if metadata.version("transformers") != version:
            return None
        reqs = metadata.requires("transformers") or []
    except metadata.PackageNotFoundError:
        return None
    return [r for r in reqs if "extra ==" not in r and "extra==" not in r]


def probe_cache_kwarg() -> str | None:
    """Run a tiny DeepseekV2 with ``cache=DynamicCache``: None when the cache holds the prompt afterwards, else what
    happened (transformers 5.17 drops ``cache=`` into ``**kwargs`` and the cache stays empty)."""
    try:
        import torch
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DynamicCache

        config = DeepseekV2Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
                                  n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
        torch.manual_seed(0)
        model = DeepseekV2ForCausalLM(config).eval()
        cache = DynamicCache(config=config)
        with torch.no_grad():
            model(input_ids=torch.arange(1, 6)[None], cache=cache, use_cache=True)
        held = cache.get_seq_length()
    except Exception as err:  # an import that fails (a hub version check) is the finding itself
        return f"a DeepseekV2 forward with cache= failed: {type(err).__name__}: {str(err)[:300]}"
    if held != 5:
        return (f"a DeepseekV2 forward with cache= left the cache holding {held} tokens, not the prompt's 5: this "
                f"transformers ignores cache= (5.17 drops it into **kwargs)")
    return None


def preflight(pretend: dict[str, str] | None = None, probe: bool = True) -> dict:
    """What ``make gpu-check`` runs before timing anything: ``{"ok", "problems", "versions", "fix"}``.

    ``pretend``: package -> version, read instead of the installed one (the toy run's test of a refusal)."""
    pretend = {_normal(k): v for k, v in (pretend or {}).items()}
    names = ("python", "torch", "triton", *BUNDLE)
    versions = {n: installed(n, pretend) for n in names if n != "python"}
    versions = {"python": pretend.get("python", sys.version.split()[0]), **versions}
    problems = []
    for requirement in (kvzoo_requirement("transformers"), kvzoo_requirement("torch"), TRITON_REQUIREMENT):
        problem = check_requirement(requirement, pretend, "kvzoo (pyproject.toml) ")
        if problem:
            problems.append(problem)
    requires = transformers_requirements(versions["transformers"]) if versions["transformers"] else []
    unchecked = []
    if requires is None:
        unchecked.append(f"the requirements of transformers {versions['transformers']} (neither installed nor the "
                         f"bundle's {BUNDLE['transformers']})")
    for requirement in requires or []:
        problem = check_requirement(requirement, pretend, f"transformers {versions['transformers']} ")
        if problem:
            problems.append(problem)
    if not problems and probe and not pretend:
        problem = probe_cache_kwarg()
        if problem:
            problems.append(problem)
    return {"ok": not problems, "problems": problems, "versions": versions, "fix": fix_text() if problems else None,
            "probed": probe and not pretend and not problems, "unchecked": unchecked}


def _pretend(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, version = item.partition("=")
        if not sep or not name or not version:
            raise SystemExit(f"--pretend takes NAME=VERSION, got {item!r}")
        out[name] = version
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="the BUNDLE wheels for cp312 manylinux (needs network to PyPI)")
    d.add_argument("--dest", type=Path, default=WHEELS)
    d.add_argument("--limit-mib", type=float, default=WHEELS_LIMIT_MIB)
    i = sub.add_parser("install", help="unpack carried wheels into a scratch folder (no network)")
    i.add_argument("--wheels", type=Path, default=WHEELS)
    i.add_argument("--target", default=SITE)
    p = sub.add_parser("preflight", help="refuse a transformers / huggingface-hub kvzoo does not support")
    p.add_argument("--pretend", action="append", default=[], metavar="NAME=VERSION",
                   help="read VERSION for NAME instead of the installed one (tests the refusal)")
    p.add_argument("--no-probe", action="store_true", help="skip running a tiny DeepseekV2 with cache=")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if args.command == "download":
        kept = download(args.dest, args.limit_mib)
        for wheel in kept:
            print(f"{wheel.stat().st_size / 2**20:6.1f} MiB  {wheel.name}")
        print(f"{sum(w.stat().st_size for w in kept) / 2**20:6.1f} MiB in {args.dest} (limit {args.limit_mib} MiB)")
        return 0
    if args.command == "install":
        install(args.wheels, args.target)
        print(f"unpacked {args.wheels}/*.whl into {args.target}: put it first on PYTHONPATH")
        return 0
    result = preflight(_pretend(args.pretend), probe=not args.no_probe)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 2


if __name__ == "__main__":
    raise SystemExit(main())
