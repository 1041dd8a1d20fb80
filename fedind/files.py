"""Crash-safe file writes: one place for the temp-file, fsync, rename dance, and for the
``<name>.sha256`` file that vouches for a written file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so a crash leaves the old file or the new one, never a torn
    one: a temporary file beside it, flushed and fsynced, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest_path(path: Path) -> Path:
    """The ``<name>.sha256`` file beside ``path`` (``sha256sum`` format)."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def write_verified(path: Path, data: bytes) -> str:
    """:func:`atomic_write` ``data``, then its ``.sha256`` (last, so a reader that finds the
    digest finds the whole file); return the SHA-256 hex digest."""
    digest = hashlib.sha256(data).hexdigest()
    atomic_write(path, data)
    atomic_write(digest_path(path), f"{digest}  {Path(path).name}\n".encode())
    return digest


def read_digest(path: Path) -> str | None:
    """The digest ``path``'s ``.sha256`` vouches for (lower case), or None: no digest file,
    an unreadable or an empty one."""
    try:
        text = digest_path(path).read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError):
        return None
    return text[0].lower() if text else None
