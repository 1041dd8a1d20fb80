"""One verified store: a folder of files vouched for by a ``manifest.json`` that lists each
file's SHA-256. Server checkpoints (:mod:`fedind.server.checkpoint`) and a site's saved
state (:mod:`fedind.site.state`) are two layouts of it, each with its own manifest format.

Writing (:func:`write`): every file by temp file, fsync and rename, the manifest last, then
the folder is fsynced, so a crash leaves a manifest whose files exist and match. Reading:
the manifest must parse and name the expected format and version (:func:`read_manifest`),
and every file it lists must exist and match its SHA-256, and its size where the manifest
gives one (:func:`read_files`); anything else raises the caller's error class, naming the
file and the fault. A folder that does not verify is moved aside (:func:`quarantine`),
never loaded. Arrays are safetensors, everything else JSON: no pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError

from .files import atomic_write, fsync_dir

MANIFEST = "manifest.json"


class CorruptStoreError(ValueError):
    """Stored files that must not be loaded; the message names the file and the fault."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(folder: Path, files: Mapping[str, bytes], manifest: Mapping) -> None:
    """Write ``files`` into ``folder`` crash-safe, then ``manifest`` as JSON, then fsync the folder."""
    for name, data in files.items():
        atomic_write(folder / name, data)
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(folder)


def read_manifest(
    folder: Path, fmt: str, version: int, error: type[CorruptStoreError] = CorruptStoreError, missing_ok: bool = False
) -> dict | None:
    """The manifest of ``folder`` (format ``fmt``, version ``version``); None when there is
    none and ``missing_ok``; ``error`` when it is missing, unreadable or of another format."""
    path = folder / MANIFEST
    if missing_ok and not path.exists():
        return None
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise error(f"{path}: unreadable manifest ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != fmt or manifest.get("version") != version:
        raise error(f"{path}: not a {fmt} v{version} manifest")
    return manifest


def read_files(
    folder: Path, listed: Mapping, error: type[CorruptStoreError] = CorruptStoreError, sized: bool = False
) -> dict[str, bytes]:
    """The bytes of every file ``listed`` in the manifest, each verified: ``{name: sha256}``,
    or with ``sized`` ``{name: {"sha256": ..., "bytes": ...}}``; ``error`` on any mismatch."""
    data: dict[str, bytes] = {}
    for name, entry in listed.items():
        if not isinstance(name, str) or Path(name).name != name:
            raise error(f"{folder / MANIFEST}: file name {name!r} outside the folder")
        file = folder / name
        try:
            content = file.read_bytes()
        except OSError as err:
            raise error(f"{file}: missing or unreadable ({err.strerror})") from err
        if sized:
            if not isinstance(entry, Mapping) or len(content) != entry.get("bytes"):
                said = entry.get("bytes") if isinstance(entry, Mapping) else entry
                raise error(f"{file}: {len(content)} bytes, the manifest says {said!r} (truncated?)")
            entry = entry.get("sha256")
        if sha256(content) != entry:
            raise error(f"{file}: SHA-256 does not match the manifest (modified or torn)")
        data[name] = content
    return data


def quarantine(path: Path) -> Path:
    """Move a folder that does not verify aside as ``<name>.corrupt-<time>-<pid>``: kept for
    inspection, never loaded."""
    target = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.replace(path, target)
    return target


def arrays_to_bytes(arrays: Mapping[str, np.ndarray], fmt: str) -> bytes:
    """safetensors bytes of ``arrays`` (C order), with ``{"format": fmt}`` as metadata."""
    from safetensors.numpy import save

    return save({k: np.require(v, requirements="C") for k, v in arrays.items()}, metadata={"format": fmt})


def arrays_from_bytes(data: bytes, where, error: type[CorruptStoreError] = CorruptStoreError) -> dict[str, np.ndarray]:
    """The arrays of safetensors ``data`` read from ``where``; ``error`` when they do not decode."""
    from safetensors.numpy import load

    try:
        return load(data)
    except (SafetensorError, ValueError, OSError) as err:
        raise error(f"{where}: not readable safetensors ({err})") from err
