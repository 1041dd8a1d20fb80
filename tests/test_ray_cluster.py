"""A simulation attached to a Ray cluster it did not start (``simulate(ray_address=...)``).

The fixture starts a one-node cluster on this host with ``ray start --head --block`` in a
process group of its own and its own ``--temp-dir`` (so that no other ``ray.init()`` on the
host finds it: the suite's Ray batch starts its own Ray meanwhile), and stops that group,
and nothing else, afterwards: ``ray stop`` would stop every Ray on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from flwr.app import Context, Message

from fedind.config import RunConfig
from fedind.simulation import ray_endpoint, simulate
from fedind.site.app import site_app

pytestmark = pytest.mark.ray_cluster

TINY = dict(  # two sites, two rounds: a few seconds of training on 2 cores
    num_server_rounds=2, num_sites=2, samples_per_site=40, local_epochs=1, batch_size=8,
    learning_rate=0.01, model_width=8, device="cpu", seed=0,
)
START_SECONDS = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """``(address, pgid)`` of a running one-node Ray cluster (2 CPUs, no dashboard)."""
    temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths live under it
    port = free_port()
    log = Path(temp_dir) / "ray-start.log"
    command = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
        "--num-cpus=2", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]
    with open(log, "wb") as out:
        head = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = Path(temp_dir) / "ray_current_cluster"  # ray start writes it once the node is up
        deadline = time.monotonic() + START_SECONDS
        while not started.exists():
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`ray start --head` did not come up (exit {head.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", os.getpgid(head.pid)
    finally:
        _stop_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_group(head: subprocess.Popen) -> None:
    """SIGTERM to the cluster's process group (``ray start --block`` stops its processes),
    then SIGKILL to whatever of the group is left."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            return
        try:
            head.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(1)  # the group's other processes exit after the leader


class WhereMod:
    """A client mod that notes where the site's ClientApp ran: its process, that process's
    group and the Ray cluster (GCS address) it is connected to, a file per process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, msg: Message, context: Context, call_next) -> Message:
        import ray

        where = {"pid": os.getpid(), "pgid": os.getpgid(0), "gcs": ray.get_runtime_context().gcs_address}
        (self.folder / f"{os.getpid()}.json").write_text(json.dumps(where))
        return call_next(msg, context)


def test_a_simulation_runs_on_a_ray_cluster_it_did_not_start(ray_head, tmp_path):
    import ray

    address, cluster_group = ray_head
    where = tmp_path / "where"
    where.mkdir()
    config = RunConfig(**TINY, run_dir=str(tmp_path / "runs"), run_name="attached")
    summary = simulate(config, client_app=site_app(outer_mods=(WhereMod(where),)), ray_address=address)

    folder = tmp_path / "runs" / "attached"
    assert json.loads((folder / "summary.json").read_text()) == summary
    rounds = (folder / "rounds.csv").read_text().splitlines()
    assert len(rounds) == 1 + TINY["num_server_rounds"]
    assert sorted(summary["per_site"]) == ["line-00", "line-01"]
    # The sites ran in the cluster's own processes (its group, its GCS port), not in this
    # process nor in a Ray it started; this process left the cluster, which is still up.
    seen = [json.loads(f.read_text()) for f in where.iterdir()]
    assert seen
    assert {w["pgid"] for w in seen} == {cluster_group}
    assert {ray_endpoint(w["gcs"])[1] for w in seen} == {ray_endpoint(address)[1]}
    assert os.getpid() not in {w["pid"] for w in seen}
    assert not ray.is_initialized()
    socket.create_connection(ray_endpoint(address), timeout=5).close()


def test_an_unreachable_cluster_fails_fast_naming_its_address(tmp_path):
    config = RunConfig(**TINY, run_dir=str(tmp_path / "runs"), run_name="nowhere")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no Ray cluster answers at {address}"):
        simulate(config, ray_address=address)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("address", ["auto", "ray://127.0.0.1:10001", "127.0.0.1", ":6379", "host:port"])
def test_a_cluster_address_is_host_and_port(address):
    with pytest.raises(ValueError, match="host:port"):
        ray_endpoint(address)


def test_the_loopback_runtime_refuses_a_cluster_address(tmp_path):
    config = RunConfig(**TINY, run_dir=str(tmp_path / "runs"), run_name="loop")
    with pytest.raises(ValueError, match="needs runtime='ray'"):
        simulate(config, runtime="loopback", ray_address="127.0.0.1:6379")
