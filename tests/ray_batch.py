"""The test suite's runs of Flower's Simulation Runtime (Ray): ``python tests/ray_batch.py OUT [batched] [attached]``.

tests/conftest.py starts this script in a process of its own as soon as collection ends
(if a selected test uses ``ray_runs`` or ``ray_cluster_run``), so that Ray's start-ups
overlap the rest of the suite. Two parts, one after the other (those named; both if none):

1. Three runs share one local Ray start (``simulate_many``); each is asserted on by the test
   named next to its config. This process is the ServerApp's: it may not load or build a
   Paillier private key while Ray runs (the sites, in Ray's worker processes, do). Writes
   ``OUT/ray_runs.json``: the three summaries, the run configs, the run folder and the
   private-key attempts (must be []).
2. A run attached to a Ray cluster this process did not start in-process: ``ray start
   --head --block`` in a process group of its own with its own ``--temp-dir`` (stopped by
   group afterwards; ``ray stop`` would stop every Ray on the host). Writes
   ``OUT/ray_cluster.json`` for tests/test_ray_cluster.py: the summary, the run folder,
   where each site's ClientApp ran, the cluster's address and group, this process's pid,
   whether Ray was still initialised here afterwards and whether the cluster still
   answered. ``OUT/ray_cluster.pgid`` names the cluster's group while it is up, so that the
   suite can stop it if this process is killed."""

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
from dataclasses import replace
from pathlib import Path

RAY_TOPK = dict(  # tests/test_simulation.py::test_same_seed_gives_a_bit_identical_model_on_cpu_alone_or_batched
    num_server_rounds=2, num_sites=3, dirichlet_alpha=0.3, samples_per_site=60, local_epochs=5, batch_size=8,
    learning_rate=0.01, model_width=16, device="cpu", seed=0, compression="topk", topk_ratio=0.05,
)
RAY_ENCRYPTED = dict(  # tests/test_secure.py::test_simulation_end_to_end_without_the_server_loading_the_private_key
    num_server_rounds=2, num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8, learning_rate=0.01,
    model_width=8, device="cpu", strategy="dwa", encryption="paillier",
)
RAY_ATTACHED = dict(  # tests/test_ray_cluster.py: two sites, two rounds, a few seconds of training
    num_server_rounds=2, num_sites=2, samples_per_site=40, local_epochs=1, batch_size=8,
    learning_rate=0.01, model_width=8, device="cpu", seed=0,
)
START_SECONDS = 90.0


def batched_runs(out: Path) -> None:
    from fedind.paillier import keys as paillier_keys
    from fedind.config import RunConfig
    from fedind.simulation import simulate_many

    run_dir, keys = out / "runs", out / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    key = paillier_keys.generate_keypair(512)
    paillier_keys.save_keypair(key, keys / "paillier.key", keys / "paillier.pub")
    topk = RunConfig(**RAY_TOPK, run_dir=str(run_dir))
    configs = {
        "first": replace(topk, run_name="first"),
        "second": replace(topk, run_name="second"),
        "encrypted": RunConfig(
            **RAY_ENCRYPTED, paillier_public_key=str(keys / "paillier.pub"),
            paillier_private_key=str(keys / "paillier.key"), run_dir=str(run_dir), run_name="encrypted",
        ),
    }
    loads: list[str] = []

    def forbidden(*args, **kwargs):
        loads.append(repr(args))
        raise AssertionError("the server process touched a Paillier private key")

    paillier_keys.load_private_key = forbidden
    paillier_keys.PrivateKey.__init__ = forbidden
    summaries = simulate_many(list(configs.values()), runtime="ray")
    result = {
        **dict(zip(configs, summaries)),
        "configs": {name: config.to_flower() for name, config in configs.items()},
        "run_dir": str(run_dir),
        "private_key_loads": loads,
    }
    _write_json(out / "ray_runs.json", result)


def _write_json(path: Path, value) -> None:
    """Whole or not at all: the suite reads the file as soon as it exists."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WhereMod:
    """A client mod that notes where the site's ClientApp ran: its process, that process's
    group and the Ray cluster (GCS address) it is connected to, a file per process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, msg, context, call_next):
        import ray

        where = {"pid": os.getpid(), "pgid": os.getpgid(0), "gcs": ray.get_runtime_context().gcs_address}
        (self.folder / f"{os.getpid()}.json").write_text(json.dumps(where))
        return call_next(msg, context)


def attached_run(out: Path) -> None:
    """Part 2: a one-node cluster (2 CPUs, no dashboard) and a run attached to it."""
    import ray

    from fedind.config import RunConfig
    from fedind.simulation import ray_endpoint, simulate
    from fedind.site.app import site_app

    if ray.is_initialized():
        ray.shutdown()  # part 1's local Ray
    temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths live under it
    port = free_port()
    log = Path(temp_dir) / "ray-start.log"
    command = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
        "--num-cpus=2", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]
    with open(log, "wb") as sink:
        head = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    (out / "ray_cluster.pgid").write_text(str(head.pid))
    try:
        started = Path(temp_dir) / "ray_current_cluster"  # ray start writes it once the node is up
        deadline = time.monotonic() + START_SECONDS
        while not started.exists():
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`ray start --head` did not come up (exit {head.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        address = f"127.0.0.1:{port}"
        where = out / "where"
        where.mkdir()
        config = RunConfig(**RAY_ATTACHED, run_dir=str(out / "attached-runs"), run_name="attached")
        summary = simulate(config, client_app=site_app(outer_mods=(WhereMod(where),)), ray_address=address)
        try:
            socket.create_connection(ray_endpoint(address), timeout=5).close()
            answers = True
        except OSError:
            answers = False
        result = {
            "summary": summary, "folder": str(out / "attached-runs" / "attached"),
            "address": address,
            "cluster_group": os.getpgid(head.pid), "this_pid": os.getpid(),
            "where": [json.loads(f.read_text()) for f in sorted(where.iterdir())],
            "ray_initialized_after": ray.is_initialized(), "cluster_answers_after": answers,
        }
        _write_json(out / "ray_cluster.json", result)
    finally:
        _stop_group(head)
        (out / "ray_cluster.pgid").unlink(missing_ok=True)
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


if __name__ == "__main__":
    out, parts = Path(sys.argv[1]), set(sys.argv[2:]) or {"batched", "attached"}
    if "batched" in parts:
        batched_runs(out)
    if "attached" in parts:
        attached_run(out)
