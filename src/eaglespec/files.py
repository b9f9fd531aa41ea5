"""Safe file handling shared by the commands: bounded reads, atomic writes with the usual
permissions, and removal of temporary files that a killed process left behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: stale temporaries are recognised by age alone
    fcntl = None

TMP_SUFFIX = ".tmp"
STALE_AFTER_S = 60.0  # a live writer locks its temp file at once; the grace period covers that instant
UNLOCKED_STALE_AFTER_S = 24 * 3600.0  # without fcntl: only files a day old are surely abandoned
STALE_DIR_AFTER_S = 3600.0


def _read_umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it
    os.umask(mask)
    return mask


# Read once at import, while the process is still single-threaded.
_UMASK = _read_umask()
FILE_MODE, DIR_MODE = 0o666 & ~_UMASK, 0o777 & ~_UMASK  # what open() and mkdir() would give


def read_text_limited(path: str | Path, limit: int) -> str:
    """A UTF-8 text file of at most `limit` bytes. Reads at most limit + 1 bytes, so a device
    (/dev/zero) or a huge file is refused instead of filling memory. Raises OSError,
    UnicodeDecodeError or ValueError (too large)."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than the limit of {limit:,} bytes")
    return data.decode("utf-8")


@contextmanager
def atomic_path(path: Path) -> Iterator[str]:
    """Yield a temp file name next to `path`; on success it replaces `path` (readers never see half
    a file), on failure it is removed. The temp file is locked while it is written, so that
    `remove_stale_temps` can tell it from one a killed process left, and it ends with the mode a
    plain open() would give (mkstemp's 0600 would differ from its neighbours)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=TMP_SUFFIX)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        os.close(fd)  # releases the lock
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(Path(path)) as tmp:
        Path(tmp).write_text(text)


def pin_settings(path: Path, info: dict, refusal: str, error: type[ValueError] = ValueError,
                 counts: tuple[str, ...] = ()) -> None:
    """Record `info` in `path` (JSON) on first use; afterwards refuse other settings with
    `refusal` followed by the keys that differ (an output made one way must not be extended
    another way). Keys in `counts` may change (a dataset that grew): they are updated, not refused."""
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(info) if old.get(k) != info.get(k) and k not in counts)
        if diff:
            raise error(f"{refusal} ({', '.join(diff)})")
        if old == info:
            return
    atomic_write_text(path, json.dumps(info, indent=2))


def remove_stale_temps(directory: Path, now: float | None = None) -> list[Path]:
    """Remove temp files (*.tmp) that their writer abandoned: not locked by a live process (a lock
    dies with its process, even under SIGKILL) and older than a short grace period; temp
    directories by age. Safe while other processes write into the same directory. Returns what
    was removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        candidates = [p for p in directory.iterdir() if p.name.endswith(TMP_SUFFIX)]
    except OSError:
        return removed
    for p in candidates:
        try:
            age = now - p.stat().st_mtime
            if p.is_dir():  # a temp directory (tokenizer cache) is written in a second: an hour is ample
                if age >= STALE_DIR_AFTER_S:
                    shutil.rmtree(p)
                    removed.append(p)
                continue
            if age < (STALE_AFTER_S if fcntl is not None else UNLOCKED_STALE_AFTER_S):
                continue
            with open(p, "rb") as f:
                if fcntl is not None:
                    try:
                        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        continue  # a live writer holds it
                p.unlink()
            removed.append(p)
        except OSError:
            continue  # gone already, or not ours to remove
    return removed
