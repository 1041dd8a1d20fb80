"""Publishing global models for the line's service (``fedind serve --watch DIR``).

A writer puts each model into the watched folder with :func:`publish_model`: the
safetensors file atomically (temporary file, ``os.replace``), then its ``.sha256``, so the
service never reads a half-written model (:mod:`fedind.edge.serve`). The site agent does it for
every global model that reaches it when its node config names a folder (``serve-dir``):
:func:`publish_received`, called from :mod:`fedind.site.app`.

Kept apart from :mod:`fedind.edge.serve` (FastAPI, Prometheus) so that a site agent, which
Flower starts once per message, imports nothing more than safetensors to publish.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path

import numpy as np

from flwr.common.logger import log

from ..files import read_digest, write_verified

SERVE_DIR_KEY = "serve-dir"  # node config: the folder the line's service watches
KEEP = 3  # published models kept in the folder (the newest); older ones are removed
FORMAT = "fedind.FaultCNN"
_NAME = re.compile(r"model-round-(\d{6,})\.safetensors")


def model_file_name(server_round: int) -> str:
    return f"model-round-{server_round:06d}.safetensors"


def model_bytes(arrays: Mapping[str, np.ndarray], server_round: int) -> bytes:
    """The safetensors file of the global model of ``server_round`` (its round in the
    metadata), the same bytes for the same arrays and round: safetensors writes metadata
    keys in a random (hash map) order, so they are put in sorted order here."""
    from safetensors.numpy import save

    data = save(
        {k: np.ascontiguousarray(v) for k, v in arrays.items()},
        metadata={"format": FORMAT, "round": str(int(server_round))},
    )
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    canonical = json.dumps(header, separators=(",", ":")).encode()
    if len(canonical) > size:  # cannot happen (same keys, same values); keep safetensors' own
        return data
    return data[:8] + canonical.ljust(size, b" ") + data[8 + size :]


def publish_model(folder: Path, arrays: Mapping[str, np.ndarray], server_round: int) -> Path:
    """Write the global model of ``server_round`` into ``folder`` for a watching service:
    the file atomically (temporary file, ``os.replace``), then its ``.sha256``."""
    path, _ = _publish(Path(folder), model_bytes(arrays, server_round), server_round)
    return path


def _publish(folder: Path, data: bytes, server_round: int) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / model_file_name(server_round)
    return path, write_verified(path, data)


def publish_if_new(folder: Path, arrays: Mapping[str, np.ndarray], server_round: int, keep: int = KEEP) -> Path | None:
    """Publish the model of ``server_round`` unless the very same file is already there
    (same name, same size, its ``.sha256`` the digest of these bytes: one hash of ~0.2 MB
    and two small reads). Then remove published models beyond the newest ``keep`` rounds.
    Returns the path written, or None when it was already published."""
    folder = Path(folder)
    data = model_bytes(arrays, server_round)
    path = folder / model_file_name(server_round)
    try:
        same_size = path.stat().st_size == len(data)
    except OSError:
        same_size = False
    if same_size and read_digest(path) == hashlib.sha256(data).hexdigest():
        return None
    path, _ = _publish(folder, data, server_round)
    prune(folder, keep)
    return path


def prune(folder: Path, keep: int = KEEP) -> list[Path]:
    """Remove the published models (``model-round-<r>.safetensors`` and digest files)
    beyond the newest ``keep`` rounds; the digest file goes first, so a watcher that lists
    the model meanwhile waits for a digest instead of reading a vanishing file."""
    rounds = sorted(
        (int(match.group(1)), entry)
        for entry in folder.iterdir()
        if (match := _NAME.fullmatch(entry.name))
    )
    removed = []
    for _, path in rounds[: max(0, len(rounds) - keep)]:
        for part in (path.with_name(path.name + ".sha256"), path):
            try:
                part.unlink()
            except FileNotFoundError:
                pass
        removed.append(path)
    return removed


def publish_received(folder: str | Path, arrays: Mapping[str, np.ndarray], server_round: int) -> Path | None:
    """:func:`publish_if_new`, logging a failure as a warning instead of raising: the
    line's service keeps its current model, and the training message is not failed."""
    try:
        path = publish_if_new(Path(folder).expanduser(), arrays, server_round)
    except Exception as err:  # noqa: BLE001 - a full disk or a bad folder must not fail training
        log(WARNING, "global model of round %d not published to %s: %s", server_round, folder, err)
        return None
    if path is not None:
        log(INFO, "global model of round %d published to %s", server_round, path)
    return path
