"""Diagnosis at the line: a small local HTTP service that answers from the newest global
model that reached the site, and swaps to each new one between requests.

::

    POST /diagnose   body: JSON {"windows": [N][C][L] or [C][L]} or an .npy float32 array
                     -> {"model": {"round", "sha256"}, "predictions": [{"class", "class_name", "confidence"}]}
    GET  /model      the model in service (round, sha256, path, classes, loaded_at)
    GET  /metrics    Prometheus text: model round and digest, requests, windows, latency, swaps
    GET  /healthz    200 once a model is in service, else 503

A swap is one reference assignment: a :class:`ModelWatcher` thread polls a folder, loads
the newest model file fully and verifies it (its ``.sha256`` or checkpoint manifest, the
FaultCNN shapes: :func:`fedind.edge.predict.load_model`), and only then replaces
``ModelSlot.current``. A request reads that reference once, so it is answered by one whole
model, old or new, and never waits on a load. Writers publish with
:func:`fedind.edge.publish.publish_model` (temporary file, then ``os.replace``; the digest file
last), as the site agent does with ``serve-dir`` in its node config: a file whose digest
file is missing or does not match is not served, and tried again when either changes. A
model with a grown head (more classes) is just another model.
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from fastapi.concurrency import run_in_threadpool

from ..store import MANIFEST
from ..data.format import DataFormatError
from .predict import (
    LoadedModel,
    MissingDigestError,
    ModelFileError,
    check_window_array,
    class_name,
    classify,
    load_model,
)
from ..files import digest_path
from .publish import model_file_name, publish_model  # noqa: F401 - the writers' side, re-exported

log = logging.getLogger("fedind.serve")

DEFAULT_PORT = 8470
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MAX_WINDOWS = 4096  # per request: a bound on one request's memory and time


# --------------------------------------------------------------------------- the model in service


@dataclass(frozen=True)
class Served:
    """One model in service and when it went in."""

    loaded: LoadedModel
    loaded_at: float


class ModelSlot:
    """The reference to the model in service. Readers read ``current`` once per request;
    :meth:`swap` replaces it whole (one assignment, atomic in Python)."""

    def __init__(self) -> None:
        self.current: Served | None = None
        self._lock = threading.Lock()  # writers only: one swap at a time

    def swap(self, loaded: LoadedModel) -> Served:
        served = Served(loaded, time.time())
        with self._lock:
            self.current = served
        return served


class ServeMetrics:
    """The service's Prometheus metrics, in a registry of its own (no module-level state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.round = Gauge("fedind_serve_model_round", "server round of the model in service (-1: unknown)", registry=r)
        self.model = Info("fedind_serve_model", "the model in service: sha256, path, classes", registry=r)
        self.loaded_at = Gauge("fedind_serve_model_loaded_timestamp_seconds", "when the model went into service", registry=r)
        self.swaps = Counter("fedind_serve_model_swaps_total", "models put into service", registry=r)
        self.rejected = Counter("fedind_serve_model_rejected_total", "model files that failed verification", registry=r)
        self.requests = Counter("fedind_serve_requests_total", "diagnosis requests", ["outcome"], registry=r)
        self.windows = Counter("fedind_serve_windows_total", "windows diagnosed", registry=r)
        self.latency = Histogram("fedind_serve_request_seconds", "time to answer a diagnosis request",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.round.set(-1)

    def model_in_service(self, served: Served) -> None:
        loaded = served.loaded
        self.round.set(-1 if loaded.round is None else loaded.round)
        self.model.info({"sha256": loaded.sha256, "path": str(loaded.path), "classes": str(loaded.num_classes)})
        self.loaded_at.set(served.loaded_at)
        self.swaps.inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


# --------------------------------------------------------------------------- watching a folder


def candidates(folder: Path) -> list[Path]:
    """Model files in ``folder``, newest first: ``*.safetensors`` files and checkpoint
    folders (``round-*/`` with a manifest, also under ``checkpoints/``); hidden names (a
    writer's temporary files) are not candidates."""
    found: list[tuple[int, str, Path]] = []
    for base in (folder, folder / "checkpoints"):
        if not base.is_dir():
            continue
        for entry in base.iterdir():
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_file() and entry.suffix == ".safetensors":
                    found.append((entry.stat().st_mtime_ns, entry.name, entry))
                elif entry.is_dir() and re.fullmatch(r"round-\d+", entry.name) and (entry / MANIFEST).is_file():
                    found.append(((entry / MANIFEST).stat().st_mtime_ns, entry.name, entry))
            except FileNotFoundError:  # replaced or pruned while listed
                continue
    return [path for _, _, path in sorted(found, reverse=True)]


def signature(path: Path) -> tuple:
    """What identifies one version of a model file and of what vouches for it."""
    parts = [path / MANIFEST] if path.is_dir() else [path, digest_path(path)]
    stamps = []
    for part in parts:
        try:
            stat = part.stat()
            stamps.append((stat.st_mtime_ns, stat.st_size, stat.st_ino))
        except FileNotFoundError:
            stamps.append(None)
    return (str(path), tuple(stamps))


class ModelWatcher:
    """Polls ``folder`` every ``interval`` seconds and puts the newest model that verifies
    into ``slot``. A file that fails verification is logged, counted and not tried again
    until it (or its digest file) changes."""

    def __init__(self, folder: Path, slot: ModelSlot, metrics: ServeMetrics, interval: float = 0.5) -> None:
        if not interval > 0:
            raise ValueError(f"Invalid poll interval: {interval!r} (seconds > 0)")
        self.folder = Path(folder)
        self.slot = slot
        self.metrics = metrics
        self.interval = interval
        self._seen: dict[str, tuple] = {}  # path -> signature last loaded or rejected
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> Served | None:
        """One look at the folder: the model newly put into service, or None."""
        for path in candidates(self.folder):
            stamp = signature(path)
            if self._seen.get(str(path)) == stamp:
                return None  # the newest is the one in service, or one already refused
            try:
                loaded = load_model(path, require_digest=True)
            except MissingDigestError:
                return None  # its .sha256 is on its way: look again next poll
            except (ModelFileError, DataFormatError, OSError) as err:
                self._seen[str(path)] = stamp
                self.metrics.rejected.inc()
                log.warning("model not served: %s", err)
                continue  # an older file may still be newer than the one in service
            self._seen[str(path)] = stamp
            current = self.slot.current
            if current is not None and current.loaded.sha256 == loaded.sha256:
                return None
            served = self.slot.swap(loaded)
            self.metrics.model_in_service(served)
            log.info("serving %s (round %s, sha256 %s)", loaded.path, loaded.round, loaded.sha256[:16])
            return served
        return None

    def start(self) -> "ModelWatcher":
        self.poll()
        self._thread = threading.Thread(target=self._run, name="fedind-model-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the service must outlive any fault of one poll
                log.exception("model watcher: poll failed")


# --------------------------------------------------------------------------- requests


class BadRequest(ValueError):
    """A diagnosis request the service cannot read (HTTP 422)."""


def windows_from_body(body: bytes, content_type: str) -> np.ndarray:
    """float32 [N, C, L] from a JSON ``{"windows": ...}`` or an .npy body; [C, L] is one window."""
    if "json" in content_type:
        import json

        try:
            document = json.loads(body)
            x = np.asarray(document["windows"], dtype=np.float32)
        except (ValueError, TypeError, KeyError) as err:
            raise BadRequest(f"expected JSON {{\"windows\": [N][C][L]}} of numbers ({err})") from err
    else:
        try:
            x = np.load(io.BytesIO(body), allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise BadRequest(f"expected an .npy float32 array body ({err})") from err
        if not isinstance(x, np.ndarray):
            raise BadRequest("expected one .npy array, got an .npz archive")
    if x.ndim == 2:
        x = x[None]
    try:
        check_window_array(x, "request")
    except DataFormatError as err:
        raise BadRequest(str(err)) from err
    if len(x) > MAX_WINDOWS:
        raise BadRequest(f"request: {len(x)} windows, at most {MAX_WINDOWS} per request")
    return x


def diagnose(served: Served, x: np.ndarray, class_names: tuple[str, ...]) -> dict:
    """The answer of one request, from one model."""
    loaded = served.loaded
    if x.shape[1] != loaded.in_channels:
        raise BadRequest(f"request: {x.shape[1]}-channel windows, the model reads {loaded.in_channels}")
    predictions = classify(loaded.model, x)
    return {
        "model": {"round": loaded.round, "sha256": loaded.sha256},
        "predictions": [
            {"class": c, "class_name": class_name(class_names, c), "confidence": round(p, 6)}
            for c, p in zip(predictions.classes.tolist(), predictions.confidence.tolist())
        ],
    }


def build_app(slot: ModelSlot, metrics: ServeMetrics, class_names: tuple[str, ...] = ()):
    """The FastAPI application over ``slot``."""
    app = FastAPI(title="fedind line service")

    @app.post("/diagnose")
    async def _diagnose(request: Request):
        started = time.perf_counter()
        served = slot.current  # read once: this request's model, whatever swaps meanwhile
        if served is None:
            metrics.requests.labels("unavailable").inc()
            return JSONResponse({"error": "no model has reached the site yet"}, status_code=503)
        body = await request.body()
        try:
            x = windows_from_body(body, request.headers.get("content-type", ""))
            answer = await run_in_threadpool(diagnose, served, x, class_names)
        except BadRequest as err:
            metrics.requests.labels("bad_request").inc()
            return JSONResponse({"error": str(err), "model": _model_json(served)}, status_code=422)
        metrics.requests.labels("ok").inc()
        metrics.windows.inc(len(x))
        metrics.latency.observe(time.perf_counter() - started)
        return answer

    @app.get("/model")
    def _model():
        served = slot.current
        if served is None:
            return JSONResponse({"error": "no model has reached the site yet"}, status_code=503)
        return _model_json(served) | {"path": str(served.loaded.path), "classes": served.loaded.num_classes,
                                      "loaded_at": served.loaded_at}

    @app.get("/healthz")
    def _health():
        served = slot.current
        return JSONResponse({"ok": served is not None}, status_code=200 if served is not None else 503)

    @app.get("/metrics")
    def _metrics():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app


def _model_json(served: Served) -> dict:
    return {"round": served.loaded.round, "sha256": served.loaded.sha256}


# --------------------------------------------------------------------------- running it


class LineService:
    """The service: a slot, its metrics, a watcher (with ``watch``) and the HTTP app."""

    def __init__(self, model: Path | None = None, watch: Path | None = None, interval: float = 0.5,
                 class_names: tuple[str, ...] = ()) -> None:
        if (model is None) == (watch is None):
            raise ValueError("give either a model file or a folder to watch")
        self.slot = ModelSlot()
        self.metrics = ServeMetrics()
        self.watcher = ModelWatcher(watch, self.slot, self.metrics, interval) if watch is not None else None
        if model is not None:
            self.metrics.model_in_service(self.slot.swap(load_model(model)))
        self.app = build_app(self.slot, self.metrics, class_names)

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> tuple[int, Callable[[], None]]:
        """Serve in a background thread; return the bound port and a function that stops it."""
        import uvicorn

        if self.watcher is not None:
            self.watcher.start()
        server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                                  access_log=False, ws="none"))
        thread = threading.Thread(target=server.run, name="fedind-serve", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the service did not start on {host}:{port}")
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]

        def stop() -> None:
            server.should_exit = True
            thread.join()
            if self.watcher is not None:
                self.watcher.stop()

        return bound, stop

    def run(self, host: str, port: int) -> None:
        """Serve in this thread until interrupted."""
        import uvicorn

        if self.watcher is not None:
            self.watcher.start()
        try:
            uvicorn.run(self.app, host=host, port=port, log_level="info", ws="none")
        finally:
            if self.watcher is not None:
                self.watcher.stop()


def add_commands(commands) -> None:
    """Add ``serve`` to the ``fedind`` subcommands (argparse subparsers)."""
    serve = commands.add_parser(
        "serve", help="answer diagnosis requests over HTTP from the newest model that reached the site",
        description="A local HTTP service: POST /diagnose, GET /model, /metrics (Prometheus), /healthz. "
        "With --watch DIR it serves the newest verified model file in DIR (*.safetensors with its .sha256, "
        "or a checkpoint folder round-<r>/) and swaps to each new one between requests.",
    )
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, metavar="PATH", help="serve this model (file, run or checkpoint folder)")
    source.add_argument("--watch", type=Path, metavar="DIR", help="serve the newest model that arrives in DIR")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="default %(default)s")
    serve.add_argument("--poll", type=float, default=0.5, metavar="S", help="seconds between looks at DIR (default %(default)s)")
    serve.add_argument("--data-root", type=Path, metavar="DIR", default=None,
                       help="a data folder whose meta.json names the classes (default: class-<k>)")
    serve.set_defaults(run=_serve)


def _serve(args) -> int:
    from .predict import class_names_near

    if args.watch is not None and not args.watch.is_dir():
        raise ValueError(f"--watch {args.watch}: not a folder")
    names = class_names_near(args.data_root / "meta.json", levels=1) if args.data_root is not None else ()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    LineService(model=args.model, watch=args.watch, interval=args.poll, class_names=names).run(args.host, args.port)
    return 0
