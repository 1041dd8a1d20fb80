"""The site agent's per-message process, kept thin: the Flower ClientApp ``client.app:app``.

Flower 1.42 starts a ``flwr-clientapp`` process per message. Deployed (``state-dir`` in the
node config, no ``partition-id``, ``site-worker`` not false: :func:`fedind.site.channel.uses_worker`),
this app hands the Message and the Context to the site's long-lived worker
(:mod:`fedind.site.worker`, which imported torch and :mod:`fedind.site.app` once) over a Unix
socket in ``state-dir/worker/`` and returns the worker's reply, with ``context.state`` replaced
by the worker's (Flower keeps it between messages; the round trip is protobuf, exact). Its own
imports are flwr's and this package's channel: no torch, no numpy.

* No worker answers: it starts one (detached, output in ``worker.log``) and waits for it.
* The worker runs other code (fedind's source, the interpreter, flwr or torch changed): that
  worker exits and a new one starts.
* The worker cannot be reached or dies with the message: the message is handled here, in
  this process, as without a worker (``fedind.site.app`` imported then), and the reason is logged.
  A message is never lost.
* The app raised in the worker: the same exception type name and text are raised here, so
  Flower's error reply is the one the in-process agent gives.

In simulation the app is called in-process (:func:`local_app`, imported once per process):
Ray's actors keep their imports, and the results are the same bit for bit.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.task_identity import TaskIdentity
from google.protobuf.message import DecodeError

from . import channel

READY_TIMEOUT = 180.0  # seconds for a new worker to listen: torch's import, on a loaded machine


def local_app() -> ClientApp:
    """The site agent itself (:data:`fedind.site.app.app`), imported on first use."""
    from .app import app as agent

    return agent


def forward(msg: Message, context: Context) -> Message:
    """The ClientApp handler: the worker's reply when one is used, else the agent's here."""
    if not channel.uses_worker(context.node_config):
        return local_app()(msg, context)
    try:
        return relay(msg, context)
    except (channel.Unavailable, OSError) as why:  # OSError: the folder, the lock, starting the worker
        log(WARNING, "site worker not used, the message is handled in this process: %s", why)
        return local_app()(msg, context)


def relay(msg: Message, context: Context) -> Message:
    """``msg`` answered by the site's worker; Unavailable when that cannot be done."""
    folder = channel.worker_folder(context.node_config)
    path = channel.socket_path(folder)
    head = {"version": channel.source_version(), "owner": os.getppid(), "task": _task(),
            "message-type": msg.metadata.message_type}
    request = (json.dumps(head).encode(), message_to_proto(msg).SerializeToString(),
               context_to_proto(context).SerializeToString())
    for _ in range(2):  # the second time after a worker of other code stepped down
        sock = connect(folder, path, context.node_config)
        try:
            channel.send(sock, *request)
            frames = channel.receive(sock, 3)
        except OSError as err:
            raise channel.Unavailable(f"the worker went away with the message ({err})") from err
        finally:
            sock.close()
        answer = channel.header(frames[0])
        if answer.get("status") != "stale":
            return _accept(answer, frames[1], frames[2], context)
        log(INFO, "site worker of other code (%s) stepped down; starting one of this code", str(answer.get("version"))[:12])
    raise channel.Unavailable("a freshly started worker reports other code too")


def _accept(answer: dict, reply: bytes, state: bytes, context: Context) -> Message:
    """The worker's answer applied: its log records logged, ``context.state`` replaced, the
    reply returned or the app's exception raised."""
    status = answer.get("status")
    if status not in ("ok", "error"):
        raise channel.ChannelError(f"unknown status {status!r}")
    try:
        new_state = context_from_proto(ProtoContext.FromString(state)).state
        message = message_from_proto(ProtoMessage.FromString(reply)) if status == "ok" else None
    except DecodeError as err:
        raise channel.ChannelError(f"the worker's reply does not parse: {err}") from err
    for level, text in answer.get("logs", []):
        log(int(level), "%s", text)
    for name in list(context.state.keys()):
        del context.state[name]
    for name, record in new_state.items():
        context.state[name] = record
    if message is None:
        info = answer.get("error") or {}
        log(ERROR, "site worker: the app raised; its traceback there:\n%s", info.get("traceback", ""))
        raise rebuilt(info)
    return message


class WorkerError(Exception):
    """An exception of the app in the worker, raised again here. Its class carries the
    original's module and name and derives from its nearest built-in class: Flower's
    error reason (``str(type(ex))`` and ``str(ex)``) and its exit code are the same."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def rebuilt(info: dict) -> WorkerError:
    """A WorkerError named as ``info`` (from :func:`fedind.site.worker.describe`) says."""
    qualname = str(info.get("qualname", "Exception"))
    names = {"__module__": str(info.get("module", "builtins")), "__qualname__": qualname}
    base = getattr(builtins, str(info.get("builtin", "")), Exception)
    text = str(info.get("text", ""))
    if isinstance(base, type) and issubclass(base, Exception) and base is not Exception:
        try:
            return type(qualname.rsplit(".", 1)[-1], (WorkerError, base), names)(text)
        except TypeError:  # a built-in whose constructor wants more (UnicodeDecodeError...)
            pass
    return type(qualname.rsplit(".", 1)[-1], (WorkerError,), names)(text)


def _task() -> list[int] | None:
    """The task identity flwr-clientapp set in this process (the worker stamps it too)."""
    try:
        return [TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id]
    except RuntimeError:
        return None


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def connect(folder: Path, path: Path, node_config) -> socket.socket:
    """A connection to the site's worker, started first if none answers."""
    try:
        return _connect(path)
    except OSError:
        pass
    lock = os.open(folder / channel.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one relay starts the worker; the others wait here
        try:
            return _connect(path)
        except OSError:
            pass
        process = start_worker(folder, channel.idle_seconds(node_config))
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                return _connect(path)
            except OSError:
                pass
            if process.poll() is not None:
                raise channel.Unavailable(
                    f"the new worker exited ({process.returncode}) before it listened; see {folder / channel.LOG}"
                )
            if time.monotonic() > deadline:
                raise channel.Unavailable(f"the new worker did not listen within {READY_TIMEOUT:.0f} s")
            time.sleep(0.05)
    finally:
        os.close(lock)


def start_worker(folder: Path, idle: float) -> subprocess.Popen:
    """A detached worker for ``folder`` (its own session; output appended to ``worker.log``),
    importing the same ``fedind`` as this process."""
    logfile = folder / channel.LOG
    if logfile.exists() and logfile.stat().st_size > channel.LOG_LIMIT:
        logfile.replace(folder / f"{channel.LOG}.1")
    root = str(channel.package_root())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    out = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(
            # -P: the working folder (the state folder) is not put on sys.path
            [sys.executable, "-P", "-m", "fedind.site.worker", "--folder", str(folder), "--idle", repr(idle),
             "--owner", str(os.getppid())],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder, env=env,
        )
    finally:
        os.close(out)


app = ClientApp()
"""The per-message ClientApp: the same handlers as :data:`fedind.site.app.app`, each forwarding."""
app.train()(forward)
app.evaluate()(forward)
app.query("phase_end")(forward)
app.query("calibrate")(forward)
app.query()(forward)
