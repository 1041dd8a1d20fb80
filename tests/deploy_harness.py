"""A plant on one machine: a SuperLink and SuperNodes as real processes, started with the
scripts in ``deploy/`` exactly as README's "Deployment" section does. Used by
tests/test_deployment_e2e.py and simulations/deployment_load.py (needs a source checkout:
the scripts are not part of the wheel; Linux: process trees are read from /proc).

Every process is started in its own session (process group) and everything started is
stopped by :meth:`LocalPlant.close` — each group, and each descendant that left its group
(the SuperLink's SuperExec and ServerApp run in their own sessions) — also after a failure.
Each component gets its own ``FLWR_HOME`` under the plant's folder; ``~/.flwr`` is not used.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode, flwr, fedind of this environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def memory_bytes(pids: Sequence[int], kind: str = "Pss") -> int:
    """Memory of these processes (those still alive) from /proc/<pid>/smaps_rollup: ``Pss``
    (shared pages split between the processes sharing them, so sums are honest) or ``Rss``."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith(f"{kind}:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class LocalPlant:
    """Files and processes of one plant under ``root``."""

    root: Path
    port: int = field(default_factory=free_port)
    procs: list[Proc] = field(default_factory=list)
    connection: str = "plant"
    closed: bool = False  # once closed (another thread may close it), the plant starts nothing more
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.certs, self.keys, self.logs = self.root / "certs", self.root / "keys", self.root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.cli_home = self.root / "flwr-cli"  # FLWR_HOME of the operator's `flwr` commands
        self.cli_home.mkdir(exist_ok=True)

    # ----------------------------------------------------------------- environment

    def env(self, flwr_home: Path | None = None, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        env["FLWR_HOME"] = str(flwr_home or self.cli_home)
        env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"  # nothing is downloaded
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def run(self, args: Sequence[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        """A short command (fedind, flwr, deploy/*.sh) that must succeed."""
        done = subprocess.run(
            [str(a) for a in args], cwd=REPO, env=self.env(), capture_output=True, text=True, timeout=timeout, **kwargs
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def start(self, name: str, args: Sequence[str], flwr_home: Path | None = None) -> Proc:
        log = self.logs / f"{name}.log"
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the plant in {self.root} is closed: {name} not started")
            out = open(log, "ab")  # noqa: SIM115 - the child writes it; closed with the process
            try:
                popen = subprocess.Popen(
                    [str(a) for a in args], cwd=REPO, env=self.env(flwr_home), stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            finally:
                out.close()
            proc = Proc(name, popen, log)
            self.procs.append(proc)
        return proc

    # ----------------------------------------------------------------- set-up, as in README

    def make_keys(self, site_ids: Sequence[str], hosts: Sequence[str] = ()) -> None:
        self.run([BIN / "fedind", "deploy", "certs", "--out", self.certs, *[a for h in hosts for a in ("--host", h)]])
        self.run([BIN / "fedind", "deploy", "site-keys", "--out", self.keys, *site_ids])

    def start_superlink(self, database: Path | None = None, timeout: float = 60) -> Proc:
        args = [DEPLOY / "superlink.sh", self.certs, self.port] + ([database] if database else [])
        proc = self.start("superlink", args)
        self.wait_for(lambda: "Uvicorn running on https://" in proc.text(), timeout, "the SuperLink to listen", proc)
        return proc

    def connect_cli(self) -> None:
        self.run([DEPLOY / "flwr-connection.sh", self.connection, f"127.0.0.1:{self.port}", self.certs / "ca.crt"])

    def register(self) -> str:
        return self.run([DEPLOY / "register.sh", self.connection, self.keys], timeout=300).stdout

    def set_up(self, site_ids: Sequence[str], seed: int, samples_per_site: int = 40) -> Path:
        """README, Deployment, steps 1-3: site data (returned), certificates and keys, a
        SuperLink with TLS, SuperNode auth and SQLite state, the operator's connection, the
        sites' keys registered."""
        data = self.root / "data"
        self.run([BIN / "fedind", "data", "generate", "--out", data, "--sites", len(site_ids),
                  "--samples-per-site", samples_per_site, "--window", "256", "--seed", seed])
        self.make_keys(site_ids)
        self.start_superlink(database=self.root / "superlink.db")
        self.connect_cli()
        self.register()
        return data

    def site_home(self, site: str) -> Path:
        home = self.root / "sites" / site / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        return home

    def state_dir(self, site: str) -> Path:
        return self.root / "sites" / site / "state"

    def start_supernode(
        self, site: str, data_dir: Path, key: Path | None = None, ca: Path | None = None, name: str | None = None,
        paillier_key: Path | None = None, serve_dir: Path | None = None,
    ) -> Proc:
        args = [
            DEPLOY / "supernode.sh",
            "--superlink", f"127.0.0.1:{self.port}",
            "--ca", ca or self.certs / "ca.crt",
            "--key", key or self.keys / site,
            "--data-dir", data_dir,
            "--state-dir", self.state_dir(site),
            "--port", free_port(),
        ] + (["--paillier-key", paillier_key] if paillier_key else []) + (["--serve-dir", serve_dir] if serve_dir else [])
        return self.start(name or f"supernode-{site}", args, flwr_home=self.site_home(site))

    def online_nodes(self) -> int:
        out = self.run([BIN / "flwr", "supernode", "list", self.connection, "--format", "json"]).stdout
        nodes = json.loads(out[out.index("{"):]).get("nodes", [])
        return sum(1 for n in nodes if n.get("status") == "online")

    def wait_online(self, nodes: Sequence[Proc], timeout: float = 90) -> None:
        """Wait until the SuperLink counts ``len(nodes)`` SuperNodes online. First, cheaply,
        until each of ``nodes`` has logged its SuperNode ID (Flower logs it once the
        SuperLink accepted the node); only then ask the SuperLink (``flwr supernode list``
        starts a Python process each time: ~1 s of CPU)."""
        deadline = time.monotonic() + timeout
        for node in nodes:
            self.wait_for(lambda: "SuperNode ID:" in node.text(), max(0.0, deadline - time.monotonic()),
                          f"{node.name} to connect", node, every=0.2)
        self.wait_for(lambda: self.online_nodes() == len(nodes), max(0.0, deadline - time.monotonic()),
                      f"{len(nodes)} SuperNodes online")

    def wait_for(self, condition, timeout: float, what: str, proc: Proc | None = None, every: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}:\n{proc.text()[-3000:]}")
            if time.monotonic() > deadline:
                tail = proc.text()[-3000:] if proc is not None else ""
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
            time.sleep(every)

    # ----------------------------------------------------------------- measuring

    def server_pids(self) -> list[int]:
        """The SuperLink and everything below it (SuperExec, flwr-serverapp)."""
        link = next((p for p in self.procs if p.name == "superlink" and p.alive()), None)
        return [] if link is None else [link.popen.pid, *descendants(link.popen.pid)]

    # ----------------------------------------------------------------- stopping

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        """Stop one process, its process group and every descendant, gracefully first."""
        pids = [proc.popen.pid, *descendants(proc.popen.pid)] if proc.alive() else []
        groups = {proc.popen.pid}  # its own session: catches children it left behind when it died
        for pid in pids:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout
        for pid in pids:  # also descendants in other sessions, e.g. SuperExec
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and not _zombie(pid):
                time.sleep(0.1)
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(timeout=10)

    def close(self) -> None:
        """Stop everything this plant started, SuperNodes first, then the SuperLink; start
        nothing more."""
        with self._lock:
            self.closed = True
        for proc in sorted(reversed(self.procs), key=lambda p: p.name == "superlink"):
            self.stop(proc, timeout=10)

    def __enter__(self) -> "LocalPlant":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
