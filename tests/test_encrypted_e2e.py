"""An encrypted run over the network: the recipe's sparse uplink and compressed downlink
under ``encryption = 'paillier'``, on a real SuperLink (TLS + SuperNode auth) with three
SuperNodes started by deploy/supernode.sh with ``--paillier-key``, as docs/encryption.md
tells a plant to. The server's run config names the public key only. About 40 seconds, in
a thread from the end of collection, on the lane's plant (``scenario``, conftest.py).
"""

import json
import shutil

import pytest

from deploy_harness import BIN

pytestmark = [
    pytest.mark.deployment,
    pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None, reason="Flower CLIs not installed"),
]

SITES = ["line-00", "line-01", "line-02"]


def encrypted_scenario(scenario) -> None:
    """Checked by :func:`test_an_encrypted_run_completes_on_a_deployed_plant`. The lane's
    SuperNodes are stopped and started again with the federation's Paillier key."""
    with scenario.step("encrypted"):
        plant = scenario.lane_plant(SITES, seed=1)  # closed when the lane ends
        data = plant.root / "data"
        keys = scenario.root / "paillier"
        plant.run([BIN / "fedind", "keys", "paillier", "--out", keys, "--bits", "1024"])
        nodes = scenario.lane.setdefault("supernodes", {})
        for site in SITES:
            if site in nodes and nodes[site].alive():
                plant.stop(nodes[site])
            nodes[site] = plant.start_supernode(site, data / "sites" / site, name=f"supernode-{site}-paillier",
                                                paillier_key=keys / "paillier.key")
        plant.wait_online(list(nodes.values()))

        folder = scenario.root / "runs" / "enc"
        run_config = (
            f"data-root='{data}' run-dir='{scenario.root / 'runs'}' run-name='enc' num-server-rounds=2 local-epochs=1 "
            f"model-width=8 round-timeout=120.0 encryption='paillier' paillier-public-key='{keys / 'paillier.pub'}' "
            f"phases=1 phase-rounds=0 replay-samples=0 ewc-lambda=0.0 head-calibration=false"
        )
        run = plant.start("flwr-run-enc", [BIN / "flwr", "run", ".", plant.connection, "--stream", "--run-config", run_config])
        assert run.popen.wait(timeout=300) == 0, run.text()[-4000:]
        log = run.text()
        assert "fedind run 'enc' finished: 2 rounds, 3 sites" in log
        assert "Paillier-encrypted aggregation" in log

        summary = json.loads((folder / "summary.json").read_text())
        assert summary["config"]["encryption"] == "paillier" and summary["config"]["downlink"] == "topk"
        assert summary["config"]["compression"] == "topk"  # sparse encrypted rounds
        assert summary["totals"]["failures"] == 0 and sorted(summary["per_site"]) == SITES
        assert "paillier-private-key" not in summary["config"] or not summary["config"]["paillier-private-key"]


@pytest.mark.scenario(run=encrypted_scenario, lane="tls-plant")  # runs in a thread from the end of collection (conftest.py)
def test_an_encrypted_run_completes_on_a_deployed_plant(scenario):
    scenario.result("encrypted")
