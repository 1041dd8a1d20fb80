"""A site's long-lived worker: the site agent imported once, answering the messages that the
per-message relay (:mod:`fedind.site.relay`) hands it over the site's socket.

Flower 1.42 starts a process per message; importing torch and the agent there costs about
1.4 s every round. A worker pays that once per site and then calls the same ClientApp, with
all its mods, exactly as ``flwr-clientapp`` would (:func:`run_app`): the Message and the
Context arrive as protobuf, the reply and the Context (its ``state`` as the app left it) go
back. It

* answers one message at a time (another relay waits in the socket's backlog);
* serves only relays of its own code version (:func:`fedind.site.channel.source_version`,
  computed when it starts): another version is answered "stale" and the worker exits, so
  that the relay starts one of the new code;
* exits after ``--idle`` seconds without a message, when its owner (the process that starts
  the ``flwr-clientapp`` processes, i.e. the SuperNode's) is gone, or when its socket was
  removed or replaced;
* sends an exception of the app back as its type's module, name and text: the relay raises
  one that Flower turns into the same error reply as in-process;
* sends the log records the app emits during a message back, for the relay to log where
  the SuperNode shows them (its own lines go to ``worker.log``).

The relay starts it (``python -m fedind.site.worker --folder STATE_DIR/worker --idle S --owner PID``);
by hand only to debug.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import time
import traceback
from logging import INFO
from pathlib import Path

from flwr.app import Context, Message
from flwr.common.logger import log
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.task_identity import TaskIdentity

from . import channel

POLL = 1.0  # seconds between looks at the idle time, the owner and the socket while waiting
REQUEST_TIMEOUT = 60.0  # a relay that connected but sends no complete request is dropped


def run_app(message: Message, context: Context) -> Message:
    """The site agent on one message, as ``flwr-clientapp`` calls it (its mods included)."""
    from .app import app

    return app(message, context)


class _Capture(logging.Handler):
    """Keeps [level, text] of every record the ``flwr`` logger passes during a message."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[list] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append([record.levelno, record.getMessage()])


def describe(error: BaseException) -> dict:
    """What the relay needs to raise an exception Flower reports the same way."""
    builtin = next(c for c in type(error).__mro__ if c.__module__ == "builtins")
    return {
        "module": type(error).__module__,
        "qualname": type(error).__qualname__,
        "builtin": builtin.__name__,
        "text": str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }


def handle(head: dict, message_bytes: bytes, context_bytes: bytes) -> tuple[dict, bytes, bytes]:
    """One request: (reply header, reply Message bytes or b"", Context bytes)."""
    task = head.get("task")
    if task:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = task
    message = message_from_proto(ProtoMessage.FromString(message_bytes))
    context = context_from_proto(ProtoContext.FromString(context_bytes))
    # A fresh process read the site's data folder anew each message; so does the worker.
    from ..data.sources import site_from_dir

    site_from_dir.cache_clear()
    capture, logger = _Capture(), logging.getLogger("flwr")
    logger.addHandler(capture)
    try:
        reply = message_to_proto(run_app(message, context)).SerializeToString()
        out = {"status": "ok"}
    except Exception as error:  # noqa: BLE001 - it goes back to the relay, which re-raises it
        reply, out = b"", {"status": "error", "error": describe(error)}
    finally:
        logger.removeHandler(capture)
    out["logs"] = capture.records
    return out, reply, context_to_proto(context).SerializeToString()


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _still_ours(path: Path, inode: int) -> bool:
    try:
        return path.stat().st_ino == inode
    except FileNotFoundError:
        return False


def _listen(path: Path) -> socket.socket:
    """A listening socket at ``path`` (mode 0600). A socket file there is a dead worker's:
    the relay starts a worker only under ``spawn.lock`` after connecting failed."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    umask = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(umask)
    path.chmod(0o600)
    server.listen(8)
    server.settimeout(POLL)
    return server


def serve(folder: Path, version: str, idle: float, owner: int | None = None) -> None:
    """Answer requests at ``folder``'s socket until idle, orphaned, displaced or stale."""
    path = channel.socket_path(folder)
    server = _listen(path)
    inode = path.stat().st_ino
    (folder / channel.PID).write_text(f"{os.getpid()}\n")
    log(INFO, "site worker %d serving %s (code %s, idle exit after %.0f s)", os.getpid(), path, version[:12], idle)
    last, why = time.monotonic(), ""
    try:
        while not why:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                if time.monotonic() - last > idle:
                    why = f"idle for {idle:.0f} s"
                elif not _alive(owner):
                    why = f"owner {owner} is gone"
                elif not _still_ours(path, inode):
                    why = f"{path} was removed or replaced"
                continue
            with conn:
                why, named = _serve_one(conn, version, path, inode)
            owner = named or owner
            last = time.monotonic()
    finally:
        server.close()
        if _still_ours(path, inode):
            path.unlink(missing_ok=True)
        pid = folder / channel.PID
        if pid.exists() and pid.read_text().strip() == str(os.getpid()):
            pid.unlink(missing_ok=True)
        log(INFO, "site worker %d exits: %s", os.getpid(), why or "stopped")


def _serve_one(conn: socket.socket, version: str, path: Path, inode: int) -> tuple[str, int | None]:
    """One request on ``conn``: (a reason to exit or "", the owner the relay named or None)."""
    conn.settimeout(REQUEST_TIMEOUT)
    try:
        head, message_bytes, context_bytes = channel.receive(conn, 3)
        head = channel.header(head)
    except (OSError, channel.ChannelError) as err:
        log(INFO, "site worker: dropped a request: %s", err)
        return "", None
    conn.settimeout(None)
    if head.get("version") != version:
        if _still_ours(path, inode):  # first, so that the relay can start a new worker at once
            path.unlink(missing_ok=True)
        _send(conn, {"status": "stale", "version": version}, b"", b"")
        return f"a relay of other code ({str(head.get('version'))[:12]}) asked", None
    started = time.monotonic()
    out, reply, context = handle(head, message_bytes, context_bytes)
    _send(conn, out, reply, context)
    log(INFO, "site worker: %s message answered (%s) in %.2f s", head.get("message-type", "?"), out["status"],
        time.monotonic() - started)
    owner = head.get("owner")
    return "", owner if isinstance(owner, int) and not isinstance(owner, bool) and owner > 0 else None


def _send(conn: socket.socket, out: dict, reply: bytes, context: bytes) -> None:
    try:
        channel.send(conn, json.dumps(out).encode(), reply, context)
    except OSError as err:  # the relay went away; it handles the message itself
        log(INFO, "site worker: reply not delivered: %s", err)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedind.site.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, required=True, help="the site's state-dir/worker folder")
    parser.add_argument("--idle", type=float, default=channel.DEFAULT_IDLE, help="exit after this many seconds without a message")
    parser.add_argument("--owner", type=int, help="exit when this process is gone")
    args = parser.parse_args(argv)
    if not args.folder.is_absolute() or not args.folder.is_dir():
        parser.error(f"--folder {args.folder} must be an existing absolute path")
    if not args.idle > 0:
        parser.error("--idle must be positive")
    version = channel.source_version()  # of the files about to be imported
    from . import app  # noqa: F401 - torch and the site agent, once for the worker's life

    serve(args.folder, version, args.idle, args.owner)


if __name__ == "__main__":
    main()
