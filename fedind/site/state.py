"""Persistent site state: a client mod that keeps a ClientApp's ``context.state`` on disk.

Flower keeps ``context.state`` (a RecordDict) for the life of a SuperNode only; a site agent
that restarts (power cut, update, systemd restart) would lose its error-feedback residuals
and anything else an inner mod or handler keeps there. With ``state-dir`` in the node config
(``flower-supernode --node-config "... state-dir='/var/lib/fedind/line-00'"``) this mod

* restores every record of the run's saved state when ``context.state`` arrives empty
  (the first message after a restart; a new run starts fresh, its folder does not exist);
* saves all of ``context.state`` after every reply.

It must be the **outermost** mod (``ClientApp(mods=[state_mod, ...])``) so that what inner
mods wrote after their ``call_next`` is saved too.

On-disk layout, one folder per run (``state-dir/run-<run-id>/``)::

    manifest.json           {"format": "fedind.site-state", "version": 1, "generation": g,
                             "files": {name: sha256}, "records": [...], "history": [...], ...}
    state-<g>.safetensors   every Array of every ArrayRecord (tensor names in "records")
    state-<g>.json          ConfigRecords and MetricRecords, values tagged with their type

A save writes generation g+1's data files (temp file, fsync, rename), then the manifest the
same way, fsyncs the folder and removes generation g: a crash at any point leaves a
manifest whose files exist and match. A manifest or file that fails to parse or whose
SHA-256 differs is reported (WARNING), moved aside as ``run-<id>.corrupt-<time>`` and not
loaded; the site continues with fresh state. No pickle: safetensors and JSON only. The
files, manifest and quarantine are those of the verified store, :mod:`fedind.store`.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from safetensors import SafetensorError

from .. import store, wire
from ..store import MANIFEST, CorruptStoreError

NODE_CONFIG_KEY = "state-dir"
FORMAT, VERSION = "fedind.site-state", 1
MAX_HISTORY = 1000  # manifest keeps the last entries of (message type, round, time)


class CorruptStateError(CorruptStoreError):
    """Saved state that must not be loaded; the message says which file and why."""


# --------------------------------------------------------------------------- encoding

_SCALARS = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bytes"}


def _tag(value: Any) -> list:
    """[type tag, JSON value]; lists are tagged by their element type."""
    if isinstance(value, list):
        kinds = {_SCALARS[type(v)] for v in value}
        if len(kinds) > 1:
            raise TypeError(f"mixed list {kinds}")
        kind = kinds.pop() if kinds else "float"
        return [f"list[{kind}]", [_encode_scalar(kind, v) for v in value]]
    kind = _SCALARS[type(value)]
    return [kind, _encode_scalar(kind, value)]


def _encode_scalar(kind: str, value: Any) -> Any:
    if kind == "bytes":
        return base64.b64encode(value).decode("ascii")
    if kind == "float" and not np.isfinite(value):
        return repr(float(value))  # 'nan', 'inf', '-inf': strict JSON has no literal for them
    return value


def _decode_scalar(kind: str, value: Any) -> Any:
    if kind == "bytes":
        return base64.b64decode(value, validate=True)
    if kind == "float":
        return float(value)
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"expected an int, got {value!r}")
    expected = {"bool": bool, "str": str, "int": int}[kind]
    if not isinstance(value, expected):
        raise TypeError(f"expected {kind}, got {value!r}")
    return value


def _untag(tagged: Any) -> Any:
    kind, value = tagged
    if kind.startswith("list[") and kind.endswith("]"):
        return [_decode_scalar(kind[5:-1], v) for v in value]
    return _decode_scalar(kind, value)


def encode_state(state: RecordDict) -> tuple[bytes, bytes, list[dict]]:
    """(safetensors bytes, JSON bytes, record index) for a RecordDict."""
    tensors: dict[str, np.ndarray] = {}
    plain: dict[str, dict] = {}
    index: list[dict] = []
    for name, record in state.items():
        if isinstance(record, ArrayRecord):
            keys = []
            for key, array in record.items():
                tensor = f"t{len(tensors)}"
                tensors[tensor] = np.require(array.numpy(), requirements="C")  # keeps 0-d arrays 0-d
                keys.append([key, tensor])
            index.append({"name": name, "kind": "array", "keys": keys})
        elif isinstance(record, (ConfigRecord, MetricRecord)):
            kind = "config" if isinstance(record, ConfigRecord) else "metric"
            plain[name] = {key: _tag(value) for key, value in record.items()}
            index.append({"name": name, "kind": kind})
        else:
            raise TypeError(f"context.state[{name!r}] is a {type(record).__name__}, which cannot be saved")
    array_bytes = store.arrays_to_bytes(tensors, FORMAT) if tensors else b""
    return array_bytes, json.dumps(plain, allow_nan=False).encode(), index


def decode_state(array_bytes: bytes, json_bytes: bytes, index: list[dict]) -> RecordDict:
    tensors = store.arrays_from_bytes(array_bytes, "saved arrays", CorruptStateError) if array_bytes else {}
    plain = json.loads(json_bytes)
    state = RecordDict()
    for entry in index:
        name, kind = entry["name"], entry["kind"]
        if kind == "array":
            state[name] = ArrayRecord({key: Array(tensors[tensor]) for key, tensor in entry["keys"]})
        elif kind in ("config", "metric"):
            values = {key: _untag(tagged) for key, tagged in plain[name].items()}
            state[name] = ConfigRecord(values) if kind == "config" else MetricRecord(values)
        else:
            raise CorruptStateError(f"unknown record kind {kind!r}")
    return state


# --------------------------------------------------------------------------- save / load


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, None when there is none; CorruptStateError when unreadable."""
    return store.read_manifest(folder, FORMAT, VERSION, CorruptStateError, missing_ok=True)


def load_state(folder: Path) -> tuple[RecordDict, dict] | None:
    """(state, manifest) saved in ``folder``; None if nothing was saved there.

    Raises CorruptStateError when the manifest or a data file does not match."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    try:
        data = store.read_files(folder, manifest["files"], CorruptStateError)
        generation = int(manifest["generation"])
        state = decode_state(
            data.get(f"state-{generation:06d}.safetensors", b""), data[f"state-{generation:06d}.json"], manifest["records"]
        )
    except CorruptStateError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, OSError, SafetensorError) as err:
        raise CorruptStateError(f"{folder}: cannot decode saved state ({type(err).__name__}: {err})") from err
    return state, manifest


def save_state(folder: Path, state: RecordDict, entry: dict, restored: bool = False) -> dict:
    """Atomically replace the state saved in ``folder`` by ``state``; return the manifest.

    ``entry`` (e.g. message type and server round) is appended to the manifest's history;
    ``restored`` counts this process's restore in ``restores``."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        previous = read_manifest(folder)
    except CorruptStateError:
        previous = None
    generation = int(previous["generation"]) + 1 if previous else 1
    array_bytes, json_bytes, index = encode_state(state)
    files = {f"state-{generation:06d}.json": json_bytes}
    if array_bytes:
        files[f"state-{generation:06d}.safetensors"] = array_bytes
    history = (previous or {}).get("history", []) + [{**entry, "generation": generation, "time": time.time()}]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "generation": generation,
        "files": {name: store.sha256(content) for name, content in files.items()},
        "records": index,
        "restores": int((previous or {}).get("restores", 0)) + int(restored),
        "history": history[-MAX_HISTORY:],
    }
    store.write(folder, files, manifest)  # the data files, then the manifest
    for old in folder.iterdir():  # earlier generations and temp files of crashed saves
        if old.name != MANIFEST and old.name not in files and (old.name.startswith("state-") or old.name.startswith(".")):
            old.unlink(missing_ok=True)
    return manifest


# --------------------------------------------------------------------------- the mod


def run_folder(context: Context) -> Path | None:
    """``state-dir/run-<run-id>`` for this node, or None without ``state-dir``."""
    if NODE_CONFIG_KEY not in context.node_config:
        return None
    root = Path(str(context.node_config[NODE_CONFIG_KEY])).expanduser()
    if not root.is_absolute():
        raise ValueError(f"node config {NODE_CONFIG_KEY} = {str(root)!r} must be an absolute path")
    return root / f"run-{context.run_id}"


def _restore(folder: Path, context: Context) -> bool:
    try:
        loaded = load_state(folder)
    except CorruptStateError as err:
        moved = store.quarantine(folder)
        log(WARNING, "site state not loaded, starting fresh: %s (moved to %s)", err, moved)
        return False
    if loaded is None:
        return False
    state, manifest = loaded
    for name, record in state.items():
        context.state[name] = record
    last = manifest["history"][-1] if manifest.get("history") else {}
    log(
        INFO,
        "restored site state from %s: %d records, generation %d (saved after %s round %s)",
        folder, len(state), manifest["generation"], last.get("message-type"), last.get("server-round"),
    )
    return True


def state_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower client mod: restore ``context.state`` from ``state-dir`` when it arrives empty,
    save it after the reply. A no-op without ``state-dir`` in the node config."""
    folder = run_folder(context)
    if folder is None:
        return call_next(msg, context)
    restored = _restore(folder, context) if not len(context.state) else False
    reply = call_next(msg, context)
    config = msg.content.config_records.get(wire.CONFIG)
    server_round = config.get(wire.SERVER_ROUND) if config is not None else None
    entry = {
        "message-type": msg.metadata.message_type,
        "server-round": int(server_round) if server_round is not None else None,
        "reply-error": reply.has_error(),
    }
    try:
        save_state(folder, context.state, entry, restored=restored)
    except (OSError, TypeError, ValueError) as err:
        # The reply is still valid; the site keeps running on its in-memory state.
        log(ERROR, "could not save site state to %s: %s", folder, err)
    return reply


# --------------------------------------------------------------------------- one run's state

RUN_RECORD = "fedind-run"  # context.state: which fedind run the rest of the state belongs to


def run_identity(msg: Message) -> str | None:
    """``run-dir/run-name`` of the run config ``msg`` carries (None if it carries none)."""
    config = msg.content.config_records.get(wire.CONFIG) if msg.has_content() else None
    if config is None or wire.RUN_CONFIG not in config:
        return None
    try:
        values = json.loads(str(config[wire.RUN_CONFIG]))
    except ValueError:
        return None  # the handler rejects the message with the parse error
    return f"{values.get('run-dir', '')}/{values.get('run-name', '')}" if isinstance(values, dict) else None


def run_scope_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower client mod: ``context.state`` belongs to one fedind run. Flower keeps a context
    per Flower run; :func:`fedind.simulation.simulate_many` runs several fedind runs in one
    Flower run, so a message of another fedind run (run-dir and run-name of its run config)
    starts from empty state: no residual or replay buffer carries over into the next run.
    Goes inside :func:`state_mod`, which restores the state (and this record) first."""
    identity = run_identity(msg)
    if identity is not None:
        record = context.state.get(RUN_RECORD)
        if record is not None and record.get("run") != identity:
            for name in list(context.state.keys()):
                del context.state[name]
        # (State without the record, saved before this mod existed, is kept and stamped.)
        context.state[RUN_RECORD] = ConfigRecord({"run": identity})
    return call_next(msg, context)
