"""File I/O shared by the tools: whole-file writes that never leave a half-written file, appends, and readers whose
errors name the file and what was expected instead of a library traceback."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path


class DataFileError(ValueError):
    """A file that cannot be used; the message names it, says what is wrong and what was expected."""


def vllm_missing(what: str) -> str | None:
    """One line where vLLM is not installed (``what`` needs it), to stop on before any output is written; None
    where it is (or was imported)."""
    loaded = sys.modules.get("vllm", False)  # None: an import of it failed before
    if loaded is None or (loaded is False and importlib.util.find_spec("vllm") is None):
        return f"{what} needs vLLM, which is not installed: `pip install -e '.[gpu]'` on a GPU machine"
    return None


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a whole file through a temporary file in the same folder and ``os.replace``: readers see the old file
    or the new one, never a part. Permissions follow the umask, like a plain ``open(path, "w")``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp creates 0600
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def output_problem(path: Path, kind: str, option: str = "--out") -> str | None:
    """Why ``path`` cannot be written as a ``kind`` (``"folder"`` or ``"file"``): something of the other kind is in
    the way, or the folder it would be written in (the nearest existing one) is read-only or immutable. One line
    naming the option and the fix, or None."""
    path = Path(path)
    if kind == "folder" and path.exists() and not path.is_dir():
        return f"{option} {path}: a file is in the way; name a folder"
    if kind == "file" and path.is_dir():
        return f"{option} {path}: a folder is in the way; name a file"
    start = path if kind == "folder" else path.parent
    nearest = next((p for p in (start, *start.parents) if p.exists()), None)
    if nearest is not None and not nearest.is_dir():
        return f"{option} {path}: {nearest} is a file, so nothing can be made under it; name another place"
    if nearest is not None and not os.access(nearest, os.W_OK | os.X_OK):  # access(2) sees chattr +i even as root
        return f"{option} {path}: {nearest} cannot be written (read-only, immutable or not yours); name another place"
    return None


def new_folder_problem(path: Path, option: str = "--out") -> str | None:
    """Why ``path`` cannot be a run's new folder: :func:`output_problem`'s reasons, or it exists and is not empty (a
    run's records are never mixed with another's). One line naming the option, or None."""
    if problem := output_problem(path, "folder", option):
        return problem
    if Path(path).is_dir() and any(Path(path).iterdir()):
        return f"{option} {path}: exists and is not empty; name a new folder"
    return None


_HELD: dict[Path, int] = {}
"""Folders this process holds (:func:`hold_folder`) and their open descriptors."""


def hold_folder(folder: Path, option: str = "--out") -> str | None:
    """Make ``folder`` and hold it for the rest of this process with an exclusive ``flock`` on the folder itself, which
    the kernel drops when the process ends, however it ends (``kill -9`` too): no lock is ever left stuck, and nothing
    is written into the folder. One line naming the option when another process holds it (or it cannot be made),
    else None."""
    folder = Path(folder).absolute()
    if folder in _HELD:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        return f"{option} {folder}: cannot make the folder ({error.strerror})"
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return f"{option} {folder}: another run is writing into it now; wait for it to end or name another folder"
    _HELD[folder] = descriptor
    return None


def number_problems(
    args, positive: Iterable[str] = (), non_negative: Iterable[str] = (), fractions: Iterable[str] = ()
) -> list[str]:
    """The options of ``args`` (an ``argparse`` namespace) out of range, one line each: ``positive`` ones must be
    greater than 0 (whole numbers: at least 1), ``non_negative`` ones 0 or more, ``fractions`` in (0, 1]; NaN is
    none of these. An option left at None (not given, no default) is not checked; a list is checked value by value."""
    rules = [(positive, lambda x: x > 0, "a positive number"), (non_negative, lambda x: x >= 0, "0 or more")]
    rules.append((fractions, lambda x: 0 < x <= 1, "a fraction in (0, 1]"))
    found = []
    for names, fits, wanted in rules:
        for name in names:
            value = getattr(args, name)
            values = value if isinstance(value, list) else [value]
            if any(v is not None and not fits(v) for v in values):
                shown = " ".join(map(str, values))
                found.append(f"--{name.replace('_', '-')} {shown}: must be {wanted}")
    return found


def model_folder_problems(folder: Path, label: str | None = None) -> list[str]:
    """Why ``folder`` is not a loadable Hugging Face model folder, one line each: no ``config.json`` (the line starts
    with ``label``, default ``--model FOLDER``), or a ``*.safetensors`` file whose header is unreadable or whose
    tensors run past its end (a truncated copy; the line names the file). Reads each file's header only."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return [f"{label or f'--model {folder}'}: no config.json in it; pass a Hugging Face model folder"]
    found = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with path.open("rb") as file:
                length = int.from_bytes(file.read(8), "little")
                header = json.loads(file.read(length))
            end = 8 + length + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
            found.append(f"{path}: not a readable safetensors file ({first_line(error)}); copy it again")
            continue
        if path.stat().st_size < end:
            found.append(f"{path}: truncated ({path.stat().st_size:,} of {end:,} bytes); copy it again")
    return found


def follow_umask(folder: Path) -> None:
    """Give ``folder`` and the files in it the permissions a plain ``open(path, "w")`` or ``mkdir`` would: safetensors
    writes model weights 0600 and ``tempfile.mkdtemp`` makes 0700 folders, unlike every other output."""
    folder = Path(folder)
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.iterdir():
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def append_atomic(path: Path, lines: Sequence[str]) -> None:
    """Append ``lines`` with one ``O_APPEND`` write, then fsync. A write cut off by a kill leaves one partial last
    line, which readers of such logs skip (see ``stapo.tools.evaluate.load_samples``)."""
    data = "".join(lines).encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view) :]
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def parquet_columns(path: Path, expected: str) -> list[str]:
    """The column names of a parquet file; :class:`DataFileError` naming the file if it is missing or unreadable.
    ``expected`` says what the file should be (e.g. "a verl parquet written by `python -m stapo.tools.data`")."""
    import pyarrow.parquet as pq

    path = Path(path)
    if path.is_dir():
        raise DataFileError(f"{path}: a folder, not a file; expected {expected}")
    if not path.is_file():
        raise DataFileError(f"{path}: no such file; expected {expected}")
    try:
        return pq.read_schema(path).names
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataFileError(f"{path}: not a readable parquet file ({first_line(error)}); expected {expected}") from None


def read_parquet(path: Path, expected: str, columns: Iterable[str] | None = None) -> list[dict]:
    """The rows of a parquet file as dicts; :class:`DataFileError` naming the file if it cannot be read or lacks
    one of ``columns``."""
    import pyarrow.parquet as pq

    columns = list(columns) if columns is not None else None
    names = parquet_columns(path, expected)
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise DataFileError(f"{path}: missing column(s) {', '.join(missing)}; expected {expected}")
    try:
        return pq.read_table(path, columns=columns).to_pylist()
    except Exception as error:  # noqa: BLE001
        raise DataFileError(f"{path}: not a readable parquet file ({first_line(error)}); expected {expected}") from None


def read_jsonl(path: Path, expected: str) -> list[dict]:
    """The objects of a JSON-lines file; :class:`DataFileError` naming the file and line if one is not JSON."""
    path = Path(path)
    records = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    records.append(json.loads(line))
    except FileNotFoundError:
        raise DataFileError(f"{path}: no such file; expected {expected}") from None
    except IsADirectoryError:
        raise DataFileError(f"{path}: a folder, not a file; expected {expected}") from None
    except UnicodeDecodeError:
        raise DataFileError(f"{path}: not a text file; expected {expected}") from None
    except json.JSONDecodeError as error:
        raise DataFileError(f"{path}: line {number} is not JSON ({error.msg}); expected {expected}") from None
    return records


def first_line(error: Exception) -> str:
    """The first line of what ``error`` says (its type when it says nothing)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def set_aside(path: Path, segment: bool = True) -> Path | None:
    """Rename a non-empty ``path`` so that whatever opens it for writing next cannot erase it: to the first free
    ``<stem>.<k><suffix>`` (k = 1, 2, ...), an earlier segment of the same log that :func:`segments` reads, or with
    ``segment=False`` to ``<stem>.previous-<k><suffix>``, which it does not. Returns the new name (None when there was
    nothing to keep)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return None
    k, label = 1, "" if segment else "previous-"
    while (target := path.with_name(f"{path.stem}.{label}{k}{path.suffix}")).exists():
        k += 1
    os.replace(path, target)
    return target


def segments(path: Path) -> list[Path]:
    """``path`` after the earlier segments :func:`set_aside` made of it, oldest first; of ``NAME.jsonl.gz``, as
    evidence/ keeps a log, ``NAME.1.jsonl.gz`` and so on."""
    path = Path(path)
    gz = ".gz" if path.suffix == ".gz" else ""
    inner = Path(path.name.removesuffix(gz))
    earlier, k = [], 1
    while (part := path.with_name(f"{inner.stem}.{k}{inner.suffix}{gz}")).is_file():
        earlier.append(part)
        k += 1
    return earlier + ([path] if path.is_file() else [])
