"""The channel between a site's per-message relay and its long-lived worker.

Flower 1.42 starts one ``flwr-clientapp`` process per message; :mod:`fedind.site.relay` (that
process) hands the message to :mod:`fedind.site.worker` (one process per site, torch imported
once) over a Unix domain socket in the site's state dir. This module is what both sides share:
where the socket is, which node-config keys turn the worker on, the code version a worker must
match, and the framing. It imports neither torch nor numpy: the relay's cost is the point.

Layout, under ``state-dir/worker/`` (mode 0700)::

    worker.sock   the socket (mode 0600)
    worker.pid    the serving worker's process id
    worker.log    the workers' output (kept below LOG_LIMIT bytes, one older file)
    spawn.lock    relays starting a worker hold it, so that only one starts

Frames: an 8-byte big-endian length, then the bytes. A request is three frames (JSON header,
``Message`` protobuf, ``Context`` protobuf), a reply three too (JSON header, reply ``Message``
protobuf or empty, ``Context`` protobuf). Protobuf and JSON only, no pickle.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import struct
import sys
from pathlib import Path

import flwr

STATE_DIR_KEY = "state-dir"  # fedind.site.state.NODE_CONFIG_KEY (that module imports numpy)
ENABLE_KEY = "site-worker"  # node config: false keeps every message in the per-message process
IDLE_KEY = "site-worker-idle"  # node config: seconds a worker waits for a message before it exits
DEFAULT_IDLE = 600.0
PARTITION_KEY = "partition-id"  # simulation: Ray's actors keep their imports, no worker
FOLDER, SOCKET, PID, LOG, LOCK = "worker", "worker.sock", "worker.pid", "worker.log", "spawn.lock"
LOG_LIMIT = 10 * 2**20
MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path: 108 bytes with the terminating NUL
MAX_FRAME = 2**36  # a sanity bound on a length field, far above any model fedind sends
_LENGTH = struct.Struct(">Q")


class Unavailable(Exception):
    """The worker cannot take this message (none answers, it died, the path is too long...):
    the relay handles it in its own process and logs this text."""


class ChannelError(Unavailable):
    """The peer closed the socket or sent a frame that does not parse."""


def uses_worker(node_config) -> bool:
    """Whether messages of this node go to a worker: deployment with ``state-dir`` in the node
    config, not a simulation (``partition-id``), and ``site-worker`` not false."""
    if PARTITION_KEY in node_config or STATE_DIR_KEY not in node_config:
        return False
    enabled = node_config.get(ENABLE_KEY, True)
    if not isinstance(enabled, bool):
        raise ValueError(f"node config {ENABLE_KEY} = {enabled!r} must be true or false")
    return enabled


def idle_seconds(node_config) -> float:
    """``site-worker-idle`` of the node config (default 10 minutes); a positive number."""
    value = node_config.get(IDLE_KEY, DEFAULT_IDLE)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"node config {IDLE_KEY} = {value!r} must be a positive number of seconds")
    return float(value)


def worker_folder(node_config) -> Path:
    """``state-dir/worker``, created with mode 0700 (an existing one is set to 0700)."""
    root = Path(str(node_config[STATE_DIR_KEY])).expanduser()
    if not root.is_absolute():
        raise ValueError(f"node config {STATE_DIR_KEY} = {str(root)!r} must be an absolute path")
    folder = root / FOLDER
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    return folder


def socket_path(folder: Path) -> Path:
    """The socket in ``folder``; Unavailable when the path is too long for a Unix socket."""
    path = folder / SOCKET
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise Unavailable(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter {STATE_DIR_KEY}")
    return path


def package_root() -> Path:
    """The folder that holds this ``fedind`` package (what a worker must import from)."""
    return Path(__file__).resolve().parents[2]


def source_version() -> str:
    """SHA-256 over fedind's source files, the interpreter, flwr's and torch's versions: a
    worker serves only relays whose version equals the one it computed when it started.
    Torch's version is read from its ``version.py`` without importing torch."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{sys.executable}\0{sys.version}\0flwr {flwr.__version__}\0".encode())
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        version_file = Path(spec.origin).with_name("version.py")
        digest.update(version_file.read_bytes() if version_file.exists() else b"torch")
    return digest.hexdigest()


def send(sock: socket.socket, *frames: bytes) -> None:
    sock.sendall(b"".join(part for frame in frames for part in (_LENGTH.pack(len(frame)), frame)))


def _exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 2**20))
        if not chunk:
            raise ChannelError(f"the peer closed the socket with {left} of {count} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` frames from ``sock``; ChannelError when the peer goes or a length is absurd."""
    frames = []
    for _ in range(count):
        (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
        if length > MAX_FRAME:
            raise ChannelError(f"frame of {length} bytes announced; not a fedind site worker channel")
        frames.append(_exactly(sock, length))
    return frames


def header(frame: bytes) -> dict:
    """A JSON header frame; ChannelError when it is not a JSON object."""
    try:
        value = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ChannelError(f"header is not JSON: {err}") from err
    if not isinstance(value, dict):
        raise ChannelError(f"header is a {type(value).__name__}, not an object")
    return value
