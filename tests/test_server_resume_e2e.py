"""A deployed server killed mid-run (SIGKILL of the flwr-serverapp process) resumes from its
checkpoint with a new ``flwr run ... resume=true``: real SuperLink (TLS + SuperNode auth)
and three SuperNodes on 127.0.0.1, started with the deploy/ scripts. About 2 minutes, in a
thread from the end of collection while the other tests run (``scenario``, conftest.py).
"""

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from deploy_harness import BIN, LocalPlant

pytestmark = [
    pytest.mark.deployment,
    pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None, reason="Flower CLIs not installed"),
]

SITES = ["line-00", "line-01", "line-02"]


def _serverapp_pids(plant: LocalPlant) -> list[int]:
    pids = []
    for pid in plant.server_pids():
        try:
            if b"flwr-serverapp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            pass
    return pids


def resume_scenario(scenario) -> None:
    """Checked by :func:`test_a_sigkilled_serverapp_resumes_from_its_checkpoint`. On the
    lane's plant (set up by tests/test_deployment_e2e.py's scenario when that runs first),
    with the SuperNodes it left running; those missing are started."""
    with scenario.step("resumed"):
        tmp_path = scenario.root
        plant = scenario.lane_plant(SITES, seed=1)  # closed when the lane ends
        data = plant.root / "data"
        nodes = scenario.lane.setdefault("supernodes", {})
        for site in SITES:
            if site not in nodes or not nodes[site].alive():
                nodes[site] = plant.start_supernode(site, data / "sites" / site, name=f"supernode-{site}-resume")
        plant.wait_online(list(nodes.values()))  # 3 SuperNodes online

        folder = tmp_path / "runs" / "plant-run"
        run_config = (
            f"data-root='{data}' run-dir='{tmp_path / 'runs'}' run-name='plant-run' num-server-rounds=3 "
            f"local-epochs=1 model-width=8 round-timeout=120.0 phases=1 phase-rounds=0 replay-samples=0 ewc-lambda=0 head-calibration=false"
        )
        first = plant.start("flwr-run-1", [BIN / "flwr", "run", ".", plant.connection, "--stream", "--run-config", run_config])
        plant.wait_for(lambda: (folder / "checkpoints" / "round-000001").is_dir(), 300, "the round-1 checkpoint", first)
        killed = _serverapp_pids(plant)
        assert killed, "no flwr-serverapp process found under the SuperLink"
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        plant.stop(first)  # the operator's `flwr run --stream` of the dead run
        assert not (folder / "summary.json").exists()
        saved_rounds = sorted(int(p.name[6:]) for p in (folder / "checkpoints").glob("round-??????"))
        assert 1 <= saved_rounds[-1] < 3

        second = plant.start(
            "flwr-run-2", [BIN / "flwr", "run", ".", plant.connection, "--stream", "--run-config", run_config + " resume=true"]
        )
        assert second.popen.wait(timeout=400) == 0, second.text()[-4000:]
        log = second.text()
        assert f"resuming run plant-run at round {saved_rounds[-1] + 1}" in log
        assert "fedind run 'plant-run' finished: 3 rounds, 3 sites" in log

        summary = json.loads((folder / "summary.json").read_text())
        assert summary["rounds"] == 3 and sorted(summary["per_site"]) == SITES
        rows = (folder / "rounds.csv").read_text().splitlines()[1:]
        assert [int(r.split(",")[0]) for r in rows] == [1, 2, 3]
        model = load_file(folder / "model.safetensors")
        assert all(np.all(np.isfinite(v)) for v in model.values())


@pytest.mark.scenario(run=resume_scenario, lane="tls-plant")  # runs in a thread from the end of collection (conftest.py)
def test_a_sigkilled_serverapp_resumes_from_its_checkpoint(scenario):
    scenario.result("resumed")
