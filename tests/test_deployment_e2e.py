"""End to end over the network on 127.0.0.1: a SuperLink with TLS and SuperNode
authentication, three SuperNodes with their own data folders, a real ``flwr run``.

Processes are started with the deploy/ scripts exactly as README's "Deployment" section
does (tests/deploy_harness.py) and stopped — process groups and stray descendants — when the
scenario ends, also when it fails. Every process gets its own FLWR_HOME under the
scenario's temporary folder; ~/.flwr is not touched. Deselect with ``-m "not deployment"``.
About 1.5 minutes on 2 cores, in a thread from the end of collection while the other tests
run: :func:`plant_scenario` runs the three checks below on one plant, one after the other,
and each test waits for its check (``scenario``, conftest.py).
"""

import json
import shutil
import signal
import threading
import urllib.request

import pytest

from deploy_harness import BIN, free_port
from safetensors.numpy import load_file

from fedind.edge.publish import model_bytes, model_file_name
from fedind.server.checkpoint import CheckpointStore
from fedind.site.state import load_state

pytestmark = [
    pytest.mark.deployment,
    pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None, reason="Flower CLIs not installed"),
]

SITES = ["line-00", "line-01", "line-02"]


def plant_scenario(scenario) -> None:
    """One plant (README, Deployment, steps 1-3: data, keys, SuperLink, registration), then
    each check in turn, as the tests of a module-scoped plant ran. The plant is the lane's:
    tests/test_server_resume_e2e.py runs on it next, with the SuperNodes left running."""
    plant = scenario.lane_plant(SITES, seed=1)
    for check in (an_unregistered_supernode_is_refused, a_supernode_that_does_not_trust_the_plant_ca_is_refused):
        with scenario.step(check.__name__):
            check(plant)
    with scenario.step("a_run_completes_and_a_restarted_site_resumes_with_its_saved_state"):
        a_run_completes_and_a_restarted_site_resumes_with_its_saved_state(plant, scenario.lane)


@pytest.mark.scenario(run=plant_scenario, lane="tls-plant")
def test_an_unregistered_supernode_is_refused(scenario):
    scenario.result("an_unregistered_supernode_is_refused")


@pytest.mark.scenario(run=plant_scenario, lane="tls-plant")
def test_a_supernode_that_does_not_trust_the_plant_ca_is_refused(scenario):
    scenario.result("a_supernode_that_does_not_trust_the_plant_ca_is_refused")


@pytest.mark.scenario(run=plant_scenario, lane="tls-plant")
def test_a_run_completes_and_a_restarted_site_resumes_with_its_saved_state(scenario):
    scenario.result("a_run_completes_and_a_restarted_site_resumes_with_its_saved_state")


def an_unregistered_supernode_is_refused(plant):
    plant.run([BIN / "fedind", "deploy", "site-keys", "--out", plant.root / "rogue", "intruder"])
    rogue = plant.start_supernode(
        "intruder", plant.root / "data" / "sites" / "line-00", key=plant.root / "rogue" / "intruder"
    )
    assert rogue.popen.wait(timeout=60) != 0
    assert "Failed to initialize the connection to the SuperLink" in rogue.text()
    assert plant.online_nodes() == 0


def a_supernode_that_does_not_trust_the_plant_ca_is_refused(plant):
    other = plant.root / "other-ca"
    plant.run([BIN / "fedind", "deploy", "certs", "--out", other])
    # A registered key, but the server certificate does not verify against this CA.
    stranger = plant.start(
        "supernode-wrong-ca",
        [BIN / "flower-supernode", "--superlink", f"127.0.0.1:{plant.port}", "--root-certificates", other / "ca.crt",
         "--auth-supernode-private-key", plant.keys / "line-02", "--port", free_port(), "--max-retries", "1",
         "--max-wait-time", "5"],
        flwr_home=plant.site_home("stranger"),
    )
    assert stranger.popen.wait(timeout=60) != 0
    assert "CERTIFICATE_VERIFY_FAILED" in stranger.text()
    assert plant.online_nodes() == 0


def scrape_while(alive, port: int, seen: dict) -> None:
    """Keep the last successful scrape of the server's /metrics while ``alive()``."""
    while alive():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            seen.update(
                {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("fedind_")}
            )
        except OSError:
            pass
        threading.Event().wait(0.5)


def a_run_completes_and_a_restarted_site_resumes_with_its_saved_state(plant, lane: dict | None = None):
    data = plant.root / "data"
    serve_dirs = {site: plant.root / "sites" / site / "models" for site in SITES}
    nodes = {site: plant.start_supernode(site, data / "sites" / site, serve_dir=serve_dirs[site]) for site in SITES}
    plant.wait_online(list(nodes.values()))  # 3 SuperNodes online

    metrics_port = free_port()
    run_config = (
        f"data-root='{data}' run-dir='{plant.root / 'runs'}' run-name='e2e' num-server-rounds=3 local-epochs=1 "
        f"model-width=8 compression='topk' topk-ratio=0.1 round-timeout=120.0 metrics-port={metrics_port} phases=1 phase-rounds=0 replay-samples=0 ewc-lambda=0 head-calibration=false "
        f"served-ema=0.5 checkpoint-interval=1 downlink='none'"  # dense downlink: the lines hold the global models
    )
    run = plant.start("flwr-run", [BIN / "flwr", "run", ".", plant.connection, "--stream", "--run-config", run_config])
    seen: dict[str, float] = {}
    scraper = threading.Thread(target=scrape_while, args=(run.alive, metrics_port, seen), daemon=True)
    scraper.start()

    # Restart line-00 between rounds: once it has sent its round-1 update, stop the agent
    # (SIGTERM, as systemd does) and start it again. The server waits for all three sites
    # before it samples a round; if round 2 was already on its way to line-00, that round
    # counts line-00 as failed and the final evaluation still reaches the restarted agent.
    plant.wait_for(lambda: "Sent successfully" in nodes["line-00"].text(), 150, "line-00's round-1 reply", run)
    before = load_state(next(plant.state_dir("line-00").glob("run-*")))
    plant.stop(nodes["line-00"], signal.SIGTERM)
    restarted = plant.start_supernode("line-00", data / "sites" / "line-00", name="supernode-line-00-restarted",
                                      serve_dir=serve_dirs["line-00"])
    if lane is not None:  # the SuperNodes the next scenario of the lane may use
        lane["supernodes"] = {**nodes, "line-00": restarted}

    assert run.popen.wait(timeout=240) == 0, run.text()[-4000:]
    scraper.join(timeout=5)
    log = run.text()
    assert "fedind run 'e2e' finished: 3 rounds, 3 sites" in log

    # Results and audit trail.
    folder = plant.root / "runs" / "e2e"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["sites"] == 3
    assert len(summary["model_sha256"]) == 64 and (folder / "model.safetensors").exists()
    assert summary["config"]["compression"] == "topk" and summary["config"]["metrics-port"] == metrics_port
    assert len(summary["code_version"]["source_sha256"]) == 64 and summary["code_version"]["fedind"]
    assert sorted(summary["per_site"]) == SITES  # the restarted agent answered the final evaluation

    # The restarted agent restored the state it had saved before the restart.
    assert before is not None
    _, manifest_before = before
    assert [h["server-round"] for h in manifest_before["history"] if h["message-type"] == "train"] == [1]
    state, manifest = load_state(next(plant.state_dir("line-00").glob("run-*")))
    assert manifest["restores"] == 1
    assert manifest["generation"] > manifest_before["generation"]
    trains = [h for h in manifest["history"] if h["message-type"] == "train" and not h["reply-error"]]
    assert trains[0]["server-round"] == 1
    # error-feedback steps continue across the restart: one per train reply, before and after
    assert int(state["topk-state"]["step"]) == len(trains)
    assert manifest["history"][-1]["message-type"] == "evaluate"
    assert "restored site state" in restarted.text()
    for site in SITES[1:]:  # the others never restarted
        assert load_state(next(plant.state_dir(site).glob("run-*")))[1]["restores"] == 0

    # Each line's service got the model the server scores: the agents (a process per
    # message) folded the global models into the same average in their saved state
    # (byte for byte with the dense downlink; the sparse one's lines average their mirrors).
    # A line that missed round 2 (line-00 while it restarted; on a loaded machine another
    # whose SuperNode missed a heartbeat, "Node Unavailable") folds round 1's model late and
    # may differ: the lines compared are those whose round-1 file is the server's round-1
    # average, i.e. that were sent round 2; at least one always is.
    store = CheckpointStore(folder / "checkpoints")
    served_1, served_2 = (store.load(r).state["served"]["average"] for r in (1, 2))
    in_round_2 = [site for site in SITES if (serve_dirs[site] / model_file_name(1)).exists()
                  and (serve_dirs[site] / model_file_name(1)).read_bytes() == model_bytes(served_1, 1)]
    assert in_round_2, "no line holds the server's round-1 average"
    for site in in_round_2:
        assert (serve_dirs[site] / model_file_name(2)).read_bytes() == model_bytes(served_2, 2)
    for site in SITES[1:]:  # round 3 reached every line: the final model, as sent
        assert (serve_dirs[site] / model_file_name(3)).read_bytes() == model_bytes(load_file(folder / "model.safetensors"), 3)

    # Prometheus saw the run while it was going.
    assert seen.get("fedind_rounds_completed_total", 0) >= 1
    assert seen["fedind_sites_expected"] == 3 and seen["fedind_uplink_bytes_total"] > 0
