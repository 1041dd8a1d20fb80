"""Crash-safe, verified checkpoints of the server: save every few rounds, resume from the
newest one that verifies.

One checkpoint is one folder ``checkpoints/round-<r>/``::

    model.safetensors   the global model's arrays
    state.safetensors   every array inside ``state`` (strategy buffers, RNG state)
    state.json          ``state`` with each array replaced by {"$array": name}
    manifest.json       {"format", "version", "round", "files": {name: {"sha256", "bytes"}}}

A save writes all four into a hidden temporary folder (each file fsynced, manifest last),
renames the folder into place and fsyncs the parent: a crash leaves the previous
checkpoints and, at worst, a temporary folder that is ignored and removed by the next save.
The newest ``keep`` checkpoints are kept.

Loading tries the newest first. A checkpoint whose manifest does not parse, whose files are
missing, truncated or differ from their SHA-256, or whose contents do not decode is
reported (WARNING), renamed ``round-<r>.corrupt-<time>`` (kept for inspection, never loaded)
and the next older one is tried. No pickle: safetensors and JSON only. The files, manifest
and quarantine are those of the verified store, :mod:`fedind.store`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.logger import log

from .. import store
from ..files import fsync_dir
from ..store import MANIFEST, CorruptStoreError

FORMAT, VERSION = "fedind.checkpoint", 1
_ARRAY_TAG = "$array"
_FLOAT_TAG = "$float"  # a non-finite float ("nan", "inf", "-inf"): state.json is strict JSON


class CorruptCheckpointError(CorruptStoreError):
    """A checkpoint that must not be loaded; the message names the file and the fault."""


@dataclass(frozen=True)
class Checkpoint:
    round: int  # the last finished round: a resumed run continues at round + 1
    arrays: dict[str, np.ndarray]  # the global model after that round
    state: dict[str, Any]  # everything else the server needs (JSON values and arrays)
    path: Path


# --------------------------------------------------------------------------- pure encoding


def split_arrays(tree: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """(JSON-ready tree, arrays): every ndarray in nested dicts/lists/tuples becomes
    ``{"$array": "a<i>"}``, every NaN or infinite float ``{"$float": "nan"}`` (a round
    without a global test set scores NaN); tuples become lists. Dict keys must be strings."""
    arrays: dict[str, np.ndarray] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, np.ndarray):
            name = f"a{len(arrays)}"
            arrays[name] = np.require(node, requirements="C")
            return {_ARRAY_TAG: name}
        if isinstance(node, Mapping):
            if not all(isinstance(k, str) for k in node):
                raise TypeError(f"checkpoint state keys must be strings, got {list(node)!r}")
            if _ARRAY_TAG in node or _FLOAT_TAG in node:
                raise ValueError(f"checkpoint state may not use the keys {_ARRAY_TAG!r}, {_FLOAT_TAG!r}")
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v) for v in node]
        if isinstance(node, np.generic):
            node = node.item()
        if isinstance(node, float) and not math.isfinite(node):
            return {_FLOAT_TAG: repr(node)}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"cannot checkpoint a {type(node).__name__}")

    return walk(tree), arrays


def join_arrays(tree: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """Inverse of :func:`split_arrays` (tuples come back as lists)."""
    if isinstance(tree, dict):
        if set(tree) == {_ARRAY_TAG}:
            name = tree[_ARRAY_TAG]
            if name not in arrays:
                raise CorruptCheckpointError(f"state refers to array {name!r}, which is not saved")
            return arrays[name]
        if set(tree) == {_FLOAT_TAG} and tree[_FLOAT_TAG] in ("nan", "inf", "-inf"):
            return float(tree[_FLOAT_TAG])
        return {k: join_arrays(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_arrays(v, arrays) for v in tree]
    return tree


def _safetensors(arrays: Mapping[str, np.ndarray]) -> bytes:
    return store.arrays_to_bytes(arrays, FORMAT)


def _load_safetensors(data: bytes, path: Path) -> dict[str, np.ndarray]:
    return store.arrays_from_bytes(data, path, CorruptCheckpointError)


# --------------------------------------------------------------------------- the store


class CheckpointStore:
    """The checkpoints of one run, in ``folder`` (usually ``<run folder>/checkpoints``)."""

    def __init__(self, folder: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.keep = keep

    def rounds(self) -> list[int]:
        """Rounds of the checkpoints present (not yet verified), oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for entry in self.folder.iterdir():
            name = entry.name
            if entry.is_dir() and name.startswith("round-") and name[6:].isdigit():
                found.append(int(name[6:]))
        return sorted(found)

    def path(self, server_round: int) -> Path:
        return self.folder / f"round-{server_round:06d}"

    def save(self, server_round: int, arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]) -> Path:
        """Write the checkpoint of ``server_round`` atomically; prune to the newest ``keep``."""
        tree, state_arrays = split_arrays(dict(state))
        files = {
            "model.safetensors": _safetensors(arrays),
            "state.safetensors": _safetensors(state_arrays),
            "state.json": json.dumps(tree, allow_nan=False).encode(),
        }
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "round": int(server_round),
            "created": time.time(),
            "files": {name: {"sha256": store.sha256(data), "bytes": len(data)} for name, data in files.items()},
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".round-{server_round:06d}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        store.write(tmp, files, manifest)  # the manifest last
        target = self.path(server_round)
        if target.exists():  # a resumed run that fell back re-saves a round: replace it whole
            old = self.folder / f".{target.name}.{os.getpid()}.old"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(self.folder)
        self._prune()
        return target

    def _prune(self) -> None:
        for server_round in self.rounds()[: -self.keep]:
            shutil.rmtree(self.path(server_round), ignore_errors=True)
        for entry in self.folder.iterdir():  # leftovers of saves that crashed
            if entry.name.startswith(".round-") and entry.name.endswith((".tmp", ".old")):
                shutil.rmtree(entry, ignore_errors=True)

    def load(self, server_round: int) -> Checkpoint:
        """The checkpoint of ``server_round``, verified; CorruptCheckpointError otherwise."""
        return read_checkpoint(self.path(server_round), server_round)

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; corrupt ones are reported and set aside.
        None when no checkpoint verifies (or none exists)."""
        for server_round in reversed(self.rounds()):
            try:
                return self.load(server_round)
            except CorruptCheckpointError as err:
                moved = self.quarantine(server_round)
                log(WARNING, "checkpoint of round %d not loaded: %s (moved to %s)", server_round, err, moved.name)
        return None

    def quarantine(self, server_round: int) -> Path:
        return store.quarantine(self.path(server_round))


def read_checkpoint(path: Path, expected_round: int | None = None) -> Checkpoint:
    """Read and verify one checkpoint folder (manifest, sizes, SHA-256, decoding, finite model)."""
    manifest_path = path / MANIFEST
    manifest = store.read_manifest(path, FORMAT, VERSION, CorruptCheckpointError)
    server_round = manifest.get("round")
    if not isinstance(server_round, int) or server_round < 0 or (expected_round is not None and server_round != expected_round):
        raise CorruptCheckpointError(f"{manifest_path}: round {server_round!r} does not match the folder")
    listed = manifest.get("files")
    if not isinstance(listed, dict) or set(listed) != {"model.safetensors", "state.safetensors", "state.json"}:
        raise CorruptCheckpointError(f"{manifest_path}: wrong file list {sorted(listed) if isinstance(listed, dict) else listed!r}")
    data = store.read_files(path, listed, CorruptCheckpointError, sized=True)
    arrays = _load_safetensors(data["model.safetensors"], path / "model.safetensors")
    if not arrays:
        raise CorruptCheckpointError(f"{path / 'model.safetensors'}: no arrays")
    for name, array in arrays.items():
        if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
            raise CorruptCheckpointError(f"{path / 'model.safetensors'}: {name} is not finite")
    try:
        tree = json.loads(data["state.json"])
    except ValueError as err:
        raise CorruptCheckpointError(f"{path / 'state.json'}: not JSON ({err})") from err
    state = join_arrays(tree, _load_safetensors(data["state.safetensors"], path / "state.safetensors"))
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path / 'state.json'}: expected an object")
    return Checkpoint(round=server_round, arrays=arrays, state=state, path=path)
