"""The results file: one JSON line per trial, append-only, locked while a grid writes it. Reading never writes (a line
that is not a row is reported and left), appending writes whole lines only, and an unusable ``--out`` or
``--plot-dir`` is refused before anything runs.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import json
import math
import os
import platform
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None

RESULTS_DIR = Path("results")

STATUSES = ("ok", "skipped", "error")
# what every kvzoo row has (trial_row), and what an ok row adds that readers index (ΔNLL's reference, the tables)
ROW_FIELDS: dict[str, type] = {"key": str, "status": str, "model": str, "policy": str, "task": str,
                               "question_position": str}
OK_ROW_NUMBERS = ("answer_nll", "score")
# numbers a row may hold (None: not measured) that the tables and plots compute with: NaN or inf there is no result
# (the plots group points by value, and NaN equals nothing)
PLOTTED_NUMBERS = ("ratio", "kv_bytes_per_token")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def row_problem(row: Any) -> str | None:
    """Why the JSON value ``row`` is not a kvzoo results row (None: it is one): the fields every row has, of their types,
    an ``ok`` row's ``answer_nll`` and ``score`` (a finite one), and finite :data:`PLOTTED_NUMBERS` where given."""
    why = _row_fault(row)
    return None if why is None else f"JSON, but not a kvzoo results row ({why})"


def _row_fault(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not an object"
    if "key" not in row:
        return "no 'key'"
    missing = [name for name in ROW_FIELDS if name not in row]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    wrong = [name for name, kind in ROW_FIELDS.items() if not isinstance(row[name], kind)]
    if wrong:
        return f"{', '.join(f'{n!r} is {type(row[n]).__name__}' for n in wrong)}, not a string"
    if row["status"] not in STATUSES:
        return f"status {row['status']!r} is not one of {', '.join(STATUSES)}"
    for name in PLOTTED_NUMBERS:
        if row.get(name) is not None and not _is_finite(row[name]):
            return f"{name!r} is {row[name]!r}, not a finite number or null"
    if row["status"] != "ok":
        return None
    bad = [name for name in OK_ROW_NUMBERS if not _is_number(row.get(name))]
    if bad:
        return f"an ok row without a number for {', '.join(map(repr, bad))}"
    # a score is a share of the answers found; answer_nll may be NaN or inf (a model's own overflow is a result)
    return None if _is_finite(row["score"]) else f"an ok row whose 'score' is {row['score']!r}, not a finite number"


@dataclass
class ResultsFile:
    """What a results file holds: kvzoo's rows, and the lines that are not (reported, never removed)."""

    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (line number, why it was skipped)
    nonempty_lines: int = 0

    @property
    def is_kvzoo(self) -> bool:
        """True for a missing or empty file, or one holding at least one kvzoo row."""
        return self.nonempty_lines == 0 or bool(self.rows)

    def problems(self) -> list[str]:
        return [f"{self.path}:{line}: {why} (skipped; the line stays in the file)" for line, why in self.bad_lines]


class ResultsFileError(ValueError):
    """A results file (or output folder) kvzoo will not use; the message says why and what to do. Nothing was
    written to it."""


class NotKvzooResults(ResultsFileError):
    """An output file exists and holds something other than kvzoo results: it is not overwritten."""


class ResultsFileLocked(ResultsFileError):
    """Another process (a second ``kvzoo leaderboard``) is writing the results file."""


class ResultsWriteError(ResultsFileError):
    """A row could not be appended to the results file (a full disk, a quota, an I/O error): nothing of it was left
    in the file; the message names the file and the cause."""


def _not_a_regular_file(path: Path) -> str | None:
    """Why ``path`` (which exists) cannot be read as a results file: a directory, FIFO, socket or device."""
    if path.is_file():
        return None
    if path.is_dir():
        return "is a directory"
    return "is not a regular file (a FIFO, socket or device: reading it could block or never end)"


def read_results_file(path: str | Path) -> ResultsFile:
    """Parse a JSONL results file line by line; reading never writes. A line that is not a kvzoo row is reported with its
    number and skipped; a path that is not a regular file is refused (:class:`ResultsFileError`) unread."""
    path = Path(path)
    found = ResultsFile(path)
    if not path.exists():
        return found
    problem = _not_a_regular_file(path)
    if problem is not None:
        raise ResultsFileError(f"{path} {problem}: it is not a results file")
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        found.nonempty_lines += 1
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            found.bad_lines.append((number, f"not UTF-8 ({err.reason} at byte {err.start})"))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            found.bad_lines.append((number, f"not JSON ({err.msg})"))
            continue
        why = row_problem(row)
        if why is None:
            found.rows.append(row)
        else:
            found.bad_lines.append((number, why))
    return found


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The kvzoo rows of a JSONL results file (none if it does not exist); see :func:`read_results_file`."""
    return read_results_file(path).rows


def latest_rows(rows: Sequence[dict[str, Any]],
                stale: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, dict[str, Any]]:
    """One row per trial key, in the order keys first appear: a trial's latest ``ok`` row wins over any other (a finished
    trial stays finished), else its latest row. An ok row for which ``stale(row)`` is true (it ran another
    configuration than its name builds now) is passed over as if it were not in the file."""
    latest: dict[str, dict[str, Any]] = {}
    for row in rows:
        if stale is not None and row["status"] == "ok" and stale(row):
            continue
        kept = latest.get(row["key"])
        if kept is None or row["status"] == "ok" or kept["status"] != "ok":
            latest[row["key"]] = row
    return latest


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append one row as a JSON line and flush it to disk, all or nothing: a write that fails (a full disk) is cut back
    to the file's old length and raises :class:`ResultsWriteError`; after a cut-short last line the row starts anew."""
    path = Path(path)
    lead = b""
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            lead = b"" if fh.read(1) == b"\n" else b"\n"
    line = lead + (json.dumps(row, default=_json_default) + "\n").encode("utf-8")
    with _interrupts_deferred():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as err:
            raise ResultsWriteError(_write_failure(path, err, 0)) from err
        try:
            start = os.fstat(fd).st_size
            try:
                left = memoryview(line)
                while left:  # os.write may take part of the line (a disk filling up takes what fits)
                    left = left[os.write(fd, left):]
                os.fsync(fd)
            except OSError as err:
                try:
                    os.ftruncate(fd, start)
                    cut = ""
                except OSError as cut_err:  # could not cut back: say where the partial line is
                    cut = (f"; the partial line could not be removed ({cut_err.strerror or cut_err}): everything after "
                           f"byte {start} is it, and reading skips it")
                raise ResultsWriteError(_write_failure(path, err, start) + cut) from err
        finally:
            os.close(fd)


def _write_failure(path: Path, err: OSError, kept: int) -> str:
    cause = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}.get(err.errno, "")
    name = errno.errorcode.get(err.errno, type(err).__name__) if err.errno else type(err).__name__
    return (f"could not append a row to {path} ({name}: {err.strerror or err}{'; ' + cause if cause else ''}): the "
            f"row was not written and the file was left as it was ({kept} bytes, the earlier rows intact). "
            f"{'Free some space' if cause else 'Fix the cause'} (or give another --out) and rerun the same command: "
            "it resumes with the trials that have no row")


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives while a row is written until the line is whole, then raise it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _cannot_create_in(directory: Path) -> str | None:
    """Why no file can be created in the existing ``directory`` (None: one can), tried with an unnamed temporary file:
    permission bits do not tell for root or a read-only mount."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def check_output_dir(path: str | Path, option: str = "--plot-dir") -> Path:
    """``path`` as a folder kvzoo may write files into (made later if missing); a :class:`ResultsFileError` naming
    ``option`` when it is not a folder or no file can be created in it (or where it would be made)."""
    path = Path(path)
    base = _existing_ancestor(path)
    if not base.is_dir():
        where = "is" if base == path.absolute() else f"would be made under {base}, which is"
        raise ResultsFileError(f"{option} {path} {where} not a folder: give a folder (or a path where one can be made)")
    problem = _cannot_create_in(base)
    if problem is not None:
        where = "" if base == path.absolute() else f" (it would be made in {base})"
        raise ResultsFileError(f"{option} {path}: no file can be written there{where} ({problem}); give a writable "
                               "folder")
    return path


def check_results_path(path: str | Path, option: str = "--out") -> Path:
    """``path`` as a results file kvzoo can append to (a regular file, or a path where one can be made); else a
    :class:`ResultsFileError` naming ``option``. Nothing is written, nothing is read."""
    path = Path(path)
    if path.exists():
        problem = _not_a_regular_file(path)
        if problem is not None:
            hint = f": give a file path such as {path / 'results.jsonl'}" if path.is_dir() else \
                ": give the path of a regular file (a .jsonl that exists, or one that does not exist yet)"
            raise ResultsFileError(f"{option} {path} {problem}{hint}")
        try:  # opening for appending writes nothing (and keeps the file's times)
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        except OSError as err:
            raise ResultsFileError(f"{option} {path} is not writable ({type(err).__name__}: {err.strerror or err}); "
                                   "nothing was run. Give a results file you can write, or another --out") from None
        return path
    base = _existing_ancestor(path.parent)
    if not base.is_dir():
        raise ResultsFileError(f"{option} {path} cannot be created: {base} is not a folder")
    problem = _cannot_create_in(base)
    if problem is not None:
        raise ResultsFileError(f"{option} {path} cannot be created: nothing can be written in {base} ({problem}); "
                               "nothing was run. Give a path in a writable folder")
    return path


def check_results_target(path: str | Path, *, force: bool = False, fresh: bool = False) -> ResultsFile:
    """The results file a grid will append to, refused (:class:`ResultsFileError`) when kvzoo may not use it.

    A non-empty file holding no kvzoo row is refused (:class:`NotKvzooResults`) unless ``force``; ``fresh`` (delete
    and start over) is refused for any file holding anything but kvzoo rows, ``force`` or not.
    """
    path = check_results_path(path)
    found = read_results_file(path)
    if not found.is_kvzoo:
        lines = f"{found.nonempty_lines} line(s), none a kvzoo row"
        if fresh:
            raise NotKvzooResults(
                f"{found.path} is not a kvzoo results file ({lines}): --fresh would delete it, and kvzoo never "
                f"deletes or truncates a file that is not its own{', whatever --force says (--force only lets it append)' if force else ''}. "
                "Nothing was changed. Choose another --out, or leave out --fresh"
                + ("" if force else " (and pass --force to append kvzoo rows to it)")
            )
        if not force:
            raise NotKvzooResults(
                f"{found.path} exists and is not a kvzoo results file ({lines}): nothing was written to it. Choose "
                "another --out, or pass --force to append kvzoo rows to it"
            )
    elif fresh and found.bad_lines:
        shown = ", ".join(str(line) for line, _ in found.bad_lines[:10]) + (", ..." if len(found.bad_lines) > 10 else "")
        raise NotKvzooResults(
            f"--fresh would delete {found.path}, which holds {len(found.bad_lines)} line(s) that are not kvzoo rows "
            f"(line {shown}; the first: {found.bad_lines[0][1]}): nothing was deleted. Move those lines out of the "
            "file, or choose another --out; without --fresh kvzoo appends to the file and keeps them"
        )
    return found


def _lock_holder(path: Path) -> str:
    """Who holds the ``flock`` on ``path``: ``pid N`` from ``/proc/locks`` (Linux), else a plain phrase."""
    try:
        inode = os.stat(path).st_ino
        table = Path("/proc/locks").read_text()
    except OSError:
        return "pid unknown"
    for line in table.splitlines():
        fields = line.split()[1:]  # "1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF"
        if fields and fields[0] == "->":  # a process waiting for the lock, not holding it
            continue
        if len(fields) >= 5 and fields[0] == "FLOCK" and fields[4].rsplit(":", 1)[-1] == str(inode):
            return f"pid {fields[3]}"
    return "pid unknown"


@contextlib.contextmanager
def results_lock(path: str | Path) -> Iterator[int]:
    """Hold an advisory lock (``flock``) on the results file while a grid appends to it; yields its descriptor. A second
    driver gets :class:`ResultsFileLocked` naming this one's pid; a file this call created and left empty is removed."""
    path = Path(path)
    existed = path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ResultsFileLocked(
                    f"{path} is being written by another kvzoo leaderboard ({_lock_holder(path)}): two drivers on one "
                    "results file would run and write the same trials twice. Nothing was run; wait for it to finish "
                    "(then rerun to resume), or choose another --out"
                ) from None
        yield fd
    finally:
        if not existed and os.fstat(fd).st_size == 0:
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    os.unlink(path)
        os.close(fd)  # releases the lock


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return repr(obj)


def versions() -> dict[str, str]:
    """Versions of what produced the numbers: kvzoo, torch, transformers, Python, platform."""
    import transformers

    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "kvzoo": dist("kvzoo"),
        "kvpress": dist("kvpress"),  # kvpress: policies run its presses
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
    }
