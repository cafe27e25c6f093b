"""A stage's files, local or fsspec URLs (s3://, gs://, memory://): where they are, whether they
exist, removing them, and writing them atomically.

Outputs are written to a temporary file in the same directory and renamed, so a reader never
sees a half-written file and a killed stage leaves the old output (or none). What a file holds,
and the stats that describe it, are other modules' (jsonl.py, stats.py).
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import socket
import uuid
from typing import IO, Iterator


def local_path(path: str) -> str | None:
    """The absolute local path of `path` (a path or a file:// URL), or None for a remote fsspec URL."""
    if "://" not in path:
        return os.path.abspath(path)
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, p = fsspec.core.url_to_fs(path)
    return p if isinstance(fs, LocalFileSystem) else None


def abspath(path: str) -> str:
    """os.path.abspath for a local path; a URL as it is (what the stats record)."""
    return path if "://" in path else os.path.abspath(path)


def temp_sibling(path: str, kind: str = "tmp") -> str:
    """A temporary name beside local `path` for this process: `PATH.tmp-HOST-PID`.

    A stage killed mid-write (SIGKILL, an OOM, a lost node) cannot remove its temporary, which may be a whole
    tokenized corpus. The name says which process made it, so this call first removes the leftovers of processes
    on this host that no longer run; a live writer's and another host's are never touched.
    """
    prefix = f"{path}.{kind}-{socket.gethostname()}-"
    for leftover in glob.glob(glob.escape(prefix) + "*"):
        pid = re.match(r"(\d+)(?:\.[^/]*)?$", leftover[len(prefix):])
        if pid and not _process_runs(int(pid.group(1))):
            _remove(leftover)
    return f"{prefix}{os.getpid()}"


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def atomic_dir(out_dir: str) -> Iterator[str]:
    """Yield a temporary sibling directory that replaces local directory `out_dir` only if the block completes
    (the old one is moved aside first and removed after, so a killed write leaves it whole)."""
    out_dir = os.path.abspath(os.fspath(out_dir).rstrip("/"))
    tmp_dir, old_dir = temp_sibling(out_dir), temp_sibling(out_dir, "old")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        yield tmp_dir
        if os.path.isdir(out_dir):
            os.replace(out_dir, old_dir)
        os.replace(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        shutil.rmtree(old_dir, ignore_errors=True)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file next to `path`; on success fsync and rename it over `path`.

    Readers never see a half-written output, and a killed stage leaves the old output (or
    none) plus a `.tmp` file that the next run ignores. On an exception the temp file is removed.
    `path` may be an fsspec URL (s3://, gs://, memory://): the temporary file is moved over it.

    Example:
        >>> with atomic_write("out.jsonl") as f: f.write(dumps({"text": "hi"}))
    """
    local = local_path(path)
    if local is None:
        with _atomic_write_url(path, mode, encoding) as f:
            yield f
        return
    directory = os.path.dirname(local)
    os.makedirs(directory, exist_ok=True)
    # Created like open() creates a file (mode 0666 less the umask), unlike mkstemp's 0600; O_EXCL and a
    # random name keep mkstemp's safety. The umask is applied by the kernel: nothing reads or sets it.
    tmp = os.path.join(directory, f".{os.path.basename(local)}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        kwargs = {"encoding": encoding} if "b" not in mode else {}
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, local)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _atomic_write_url(url: str, mode: str, encoding: str | None) -> Iterator[IO]:
    """atomic_write for a remote URL: write `.NAME.RANDOM.tmp` beside it, then move it into place
    (on object stores an upload only appears once complete, so the move is the commit)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    directory, name = path.rsplit("/", 1) if "/" in path else ("", path)
    tmp = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp" if directory else f".{name}.{uuid.uuid4().hex}.tmp"
    if directory:
        fs.makedirs(directory, exist_ok=True)
    try:
        with fs.open(tmp, mode, **({"encoding": encoding} if "b" not in mode else {})) as f:
            yield f
        fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(tmp)
        raise


def exists(path: str) -> bool:
    """os.path.exists for a path or an fsspec URL."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


def remove_tree(path: str) -> None:
    """shutil.rmtree(path, ignore_errors=True) for a path or an fsspec URL."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(p, recursive=True)
