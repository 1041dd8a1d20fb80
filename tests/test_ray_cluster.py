"""A simulation attached to a Ray cluster it did not start (``simulate(ray_address=...)``).

The run itself is part 2 of the suite's Ray batch (tests/ray_batch.py, ``ray_cluster_run``):
it starts a one-node cluster with ``ray start --head --block`` in a process group of its own
and its own ``--temp-dir``, runs a simulation attached to it, and stops that group, and
nothing else, afterwards (``ray stop`` would stop every Ray on the host). It runs in the
background while the rest of the suite does: a Ray start, a run and a stop are about a
minute of waiting on 2 cores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fedind.config import RunConfig
from fedind.simulation import ray_endpoint, simulate
from ray_batch import RAY_ATTACHED as TINY  # two sites, two rounds
from ray_batch import free_port

pytestmark = pytest.mark.ray_cluster


def test_a_simulation_runs_on_a_ray_cluster_it_did_not_start(ray_cluster_run):
    run = ray_cluster_run
    folder = Path(run["folder"])
    summary = run["summary"]
    assert json.loads((folder / "summary.json").read_text()) == summary
    rounds = (folder / "rounds.csv").read_text().splitlines()
    assert len(rounds) == 1 + TINY["num_server_rounds"]
    assert sorted(summary["per_site"]) == ["line-00", "line-01"]
    # The sites ran in the cluster's own processes (its group, its GCS port), not in the
    # process that ran the simulation nor in a Ray it started; that process left the
    # cluster, which was still up.
    seen = run["where"]
    assert seen
    assert {w["pgid"] for w in seen} == {run["cluster_group"]}
    assert {ray_endpoint(w["gcs"])[1] for w in seen} == {ray_endpoint(run["address"])[1]}
    assert run["this_pid"] not in {w["pid"] for w in seen}
    assert run["ray_initialized_after"] is False
    assert run["cluster_answers_after"] is True


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
