"""Prometheus metrics of a run, and the code version every run records (audit trail).

With ``metrics-port`` > 0 the ServerApp serves ``http://<metrics-address>:<metrics-port>/metrics``
for the life of the run (the ServerApp process), updated once per round from
``evaluate_round`` in fedind/server/app.py:

========================================  =========  ===========================================
metric                                    type       meaning
========================================  =========  ===========================================
``fedind_run_info``                       info       run, strategy, fedind version, code version
``fedind_rounds_planned``                 gauge      ``num-server-rounds``
``fedind_sites_expected``                 gauge      sites the server waits for
``fedind_rounds_completed_total``         counter    rounds aggregated and evaluated
``fedind_round``                          gauge      last completed round
``fedind_global_accuracy``                gauge      global test accuracy after the last round
``fedind_global_loss``                    gauge      global test loss after the last round
``fedind_round_sites``                    gauge      sites whose update was aggregated, last round
``fedind_round_failed_sites``             gauge      sites that failed / timed out, last round
``fedind_site_updates_total``             counter    aggregated site updates, whole run
``fedind_site_failures_total``            counter    failed site replies, whole run
``fedind_uplink_bytes_total``             counter    serialized bytes site -> server
``fedind_downlink_bytes_total``           counter    serialized bytes server -> site
``fedind_round_duration_seconds``         histogram  wall time per round
``fedind_run_finished``                   gauge      1 once the run has written its results
``process_*``                             -          memory / CPU of the ServerApp process
========================================  =========  ===========================================

One registry per run (no module-level state), so in-process simulations can run one after
another on the same port.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, start_http_server

from ..config import ConfigError, RunConfig
from .results import RoundRow

ROUND_SECONDS_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


def code_version() -> dict[str, str | None]:
    """What code ran: fedind's package version, ``git describe`` of the checkout it was
    imported from (None outside a git checkout, e.g. an installed Flower App Bundle) and the
    SHA-256 over fedind's source files (always available, identifies the code exactly)."""
    package = Path(__file__).resolve().parents[1]  # fedind/ (this file is fedind/server/monitoring.py)
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        fedind_version = version("fedind")
    except PackageNotFoundError:
        fedind_version = "not installed"
    return {"fedind": fedind_version, "git": _git_describe(package.parent), "source_sha256": digest.hexdigest()}


def _git_describe(repo: Path) -> str | None:
    git = shutil.which("git")
    if git is None or not (repo / ".git").exists():
        return None
    try:
        done = subprocess.run(
            [git, "-C", str(repo), "describe", "--always", "--dirty", "--tags"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


class RunMonitor:
    """The metrics of one run. ``RunMonitor.start`` returns an inactive monitor (every
    method a no-op) when ``metrics-port`` is 0."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry
        self._server = None
        self._thread = None
        if registry is None:
            return
        self.info = Info("fedind_run", "the run: name, strategy, fedind and code version", registry=registry)
        self.rounds_planned = Gauge("fedind_rounds_planned", "num-server-rounds of the run", registry=registry)
        self.sites_expected = Gauge("fedind_sites_expected", "sites the server waits for", registry=registry)
        self.rounds = Counter("fedind_rounds_completed", "rounds aggregated and evaluated", registry=registry)
        self.round = Gauge("fedind_round", "last completed round", registry=registry)
        self.accuracy = Gauge("fedind_global_accuracy", "global test accuracy after the last round", registry=registry)
        self.loss = Gauge("fedind_global_loss", "global test loss after the last round", registry=registry)
        self.sites = Gauge("fedind_round_sites", "sites aggregated in the last round", registry=registry)
        self.failed = Gauge("fedind_round_failed_sites", "sites that failed in the last round", registry=registry)
        self.updates = Counter("fedind_site_updates", "aggregated site updates", registry=registry)
        self.failures = Counter("fedind_site_failures", "failed, rejected or timed-out site replies", registry=registry)
        self.uplink = Counter("fedind_uplink_bytes", "serialized bytes site -> server", registry=registry)
        self.downlink = Counter("fedind_downlink_bytes", "serialized bytes server -> site", registry=registry)
        self.duration = Histogram(
            "fedind_round_duration_seconds", "wall time per round", buckets=ROUND_SECONDS_BUCKETS, registry=registry
        )
        self.finished = Gauge("fedind_run_finished", "1 once the run has written its results", registry=registry)
        ProcessCollector(registry=registry)

    @classmethod
    def start(cls, config: RunConfig, run_name: str, num_sites: int) -> "RunMonitor":
        if config.metrics_port == 0:
            return cls(None)
        monitor = cls(CollectorRegistry())
        versions = code_version()
        monitor.info.info(
            {
                "run": run_name,
                "strategy": config.strategy,
                "fedind_version": versions["fedind"],
                "git": versions["git"] or "",
                "source_sha256": versions["source_sha256"],
            }
        )
        monitor.rounds_planned.set(config.num_server_rounds)
        monitor.sites_expected.set(num_sites)
        try:
            monitor._server, monitor._thread = start_http_server(
                config.metrics_port, addr=config.metrics_address, registry=monitor.registry
            )
        except OSError as err:
            raise ConfigError(
                f"metrics-port {config.metrics_port} on {config.metrics_address!r} cannot be served: {err}"
            ) from err
        return monitor

    @property
    def active(self) -> bool:
        return self.registry is not None

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None

    def record_round(self, row: RoundRow) -> None:
        if not self.active:
            return
        self.rounds.inc()
        self.round.set(row.round)
        self.accuracy.set(row.accuracy)
        self.loss.set(row.loss)
        self.sites.set(row.sites)
        self.failed.set(row.failures)
        self.updates.inc(row.sites)
        self.failures.inc(row.failures)
        self.uplink.inc(row.uplink_bytes)
        self.downlink.inc(row.downlink_bytes)
        self.duration.observe(row.seconds)

    def finish(self) -> None:
        if self.active:
            self.finished.set(1)

    def close(self) -> None:
        """Stop serving (the port is free again)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
