"""Issue 31, "What a newcomer hits": each case gives a clear, early message or does the right thing.

1. no global test.npz: the run goes to the end, per-site scores only, and the summary says so;
2. a plain Flower ClientApp (quickstart-pytorch's shape) finishes a run with dwa and fedavgm;
   the server reads its metrics, sends the quickstart's train-config keys, says once which
   fedind features its replies switch off, and names the cause when no site trains;
3. a site without its own test.npz is scored on nothing, and the summary marks it;
4. a mistyped run-config key is named (server side, ``fedind check-config``, ``fedind run``),
   and a failed run ends with a one-line cause;
5. a run's results are never overwritten unasked (a rerun, a resume with nothing to resume);
6. a stray label without meta.json, a resume past num-server-rounds, ``--seed -1`` and too
   few windows per site each get a message naming what is wrong.

All runs use the in-process loopback grid, which calls the plain ClientApp with the same
Messages and Context as Flower's runtimes (Ray took ~45 s more here; fedind's own site agent
runs under Ray in tests/ray_batch.py and tests/test_ray_cluster.py, and over real SuperNodes
in the deployment tests).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedind import wire
from fedind.server import app as server_app
from fedind.server.checkpoint import CheckpointStore
from fedind.cli import main as cli_main
from fedind.config import ConfigError, RunConfig, recipe
from fedind.data.format import SiteArrays, write_split
from fedind.server.diagnostics import common_cause, short_reason, site_score
from fedind.cli.launch import run_failure
from fedind.models import FaultCNN
from fedind.server.app import claim_run_folder, existing_results, federation_shape, run_server, train_config
from fedind.simulation import simulate, simulate_many

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(num_sites=3, local_epochs=1, batch_size=8, learning_rate=0.02, model_width=8, device="cpu", seed=0)


def generate(out: Path) -> Path:
    """3 sites of ~40 windows of 256 samples, written by ``fedind data generate``."""
    argv = ["data", "generate", "--out", str(out), "--sites", "3", "--seed", "0", "--samples-per-site", "40",
            "--window", "256"]
    assert cli_main(argv) == 0
    return out


class Collect(logging.Handler):
    """The messages Flower's logger ("flwr") emits while attached."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def collecting(run):
    logger, handler = logging.getLogger("flwr"), Collect()
    logger.addHandler(handler)
    try:
        return run(), handler.lines
    finally:
        logger.removeHandler(handler)


# --------------------------------------------------------------------------- case 2: a quickstart client


def quickstart_app(root: Path, width: int = 8, reads: tuple[str, ...] = ()) -> ClientApp:
    """A ClientApp in the shape of Flower's quickstart-pytorch: it replies ``arrays`` and
    ``metrics`` (``num-examples``, ``train_loss``; ``eval_acc`` at evaluation), reads ``lr``
    and ``local-epochs`` (and ``reads``) from the train config, and sends no label
    histogram nor site id. Nothing of fedind on the site side but the model class."""
    app = ClientApp()

    def load(context: Context, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        sites = sorted(p.name for p in (root / "sites").iterdir())
        with np.load(root / "sites" / sites[int(context.node_config["partition-id"])] / f"{split}.npz") as f:
            return torch.from_numpy(f["x"]), torch.from_numpy(f["y"])

    def received_model(msg: Message) -> FaultCNN:
        state = msg.content["arrays"].to_torch_state_dict()
        model = FaultCNN(in_channels=1, num_classes=state["head.weight"].shape[0], width=width)
        model.load_state_dict(state)
        return model

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = received_model(msg)
        x, y = load(context, "train")
        for key in reads:
            msg.content["config"][key]
        optimizer = torch.optim.SGD(model.parameters(), lr=msg.content["config"]["lr"], momentum=0.9)
        model.train()
        total = 0.0
        for _ in range(int(msg.content["config"]["local-epochs"])):
            for i in range(0, len(y), 8):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8])
                loss.backward()
                optimizer.step()
                total += loss.item()
        metrics = MetricRecord({"train_loss": total, "num-examples": len(y)})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = received_model(msg).eval()
        x, y = load(context, "test")
        with torch.no_grad():
            out = model(x)
        metrics = MetricRecord({"eval_loss": torch.nn.functional.cross_entropy(out, y).item(),
                                "eval_acc": (out.argmax(1) == y).float().mean().item(), "num-examples": len(y)})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory):
    """3 rounds of fedind's server with dwa, then fedavgm, over three quickstart clients."""
    tmp = tmp_path_factory.mktemp("quickstart")
    root = generate(tmp / "data")
    configs = [RunConfig(**SMALL, strategy=strategy, num_server_rounds=3, data_root=str(root),
                         run_dir=str(tmp / "runs"), run_name=strategy) for strategy in ("dwa", "fedavgm")]
    # The default recipe (two phases: the phase-end query goes unanswered by a plain client;
    # top-k both ways: a plain client gets whole models and replies dense weights).
    configs.append(recipe(**SMALL, num_server_rounds=3, phase_rounds=2, data_root=str(root),
                          run_dir=str(tmp / "runs"), run_name="recipe"))
    summaries, lines = collecting(lambda: simulate_many(configs, client_app=quickstart_app(root), runtime="loopback"))
    return dict(zip(("dwa", "fedavgm", "recipe"), summaries)), lines, tmp / "runs", root


@pytest.mark.parametrize("strategy", ["dwa", "fedavgm", "recipe"])
def test_a_quickstart_client_finishes_a_run(quickstart_runs, strategy):
    summaries, _, runs, root = quickstart_runs
    summary = summaries[strategy]
    assert json.loads((runs / strategy / "summary.json").read_text()) == summary
    assert (runs / strategy / "model.safetensors").exists()
    # Under the recipe the only failures are the queries a plain client cannot answer: the
    # phase end and the head calibration (three sites each; the head then stays as trained).
    assert summary["rounds"] == 3 and summary["totals"]["failures"] == (6 if strategy == "recipe" else 0)
    assert summary["global_test"] and 0 <= summary["final_accuracy"] <= 1
    # The accuracy the sites report as eval_acc is read, on each site's own test split.
    test_sizes = sorted(int(np.load(p)["y"].size) for p in (root / "sites").glob("*/test.npz"))
    assert sorted(entry["num_examples"] for entry in summary["per_site"].values()) == test_sizes
    for entry in summary["per_site"].values():
        assert entry["reported_as"] == "eval_acc" and 0 <= entry["accuracy"] <= 1


def test_the_quickstart_clients_train_every_round_on_the_sent_lr(quickstart_runs):
    _, _, runs, _ = quickstart_runs
    for strategy in ("dwa", "fedavgm", "recipe"):
        rows = (runs / strategy / "rounds.csv").read_text().splitlines()[1:]
        assert [int(row.split(",")[5]) for row in rows] == [3, 3, 3]  # sites aggregated per round


def test_the_server_says_once_which_features_the_replies_switch_off(quickstart_runs):
    _, lines, _, _ = quickstart_runs
    told = [line for line in lines if line.startswith("fedind features off")]
    assert len(told) == 3  # once per run
    dwa, fedavgm, _ = told
    assert "no 'label-histogram' metric" in dwa and "the label-alignment screen is off" in dwa
    assert "dwa weights the round by example counts" in dwa and "example counts" not in fedavgm
    assert "no 'site' record" in fedavgm and "named by node id" in fedavgm


def test_the_train_config_carries_the_quickstart_keys():
    config = RunConfig(learning_rate=0.03, local_epochs=4)
    record = train_config(config, json.dumps(config.to_flower()))
    assert record["lr"] == 0.03 and record["local-epochs"] == 4
    assert RunConfig.from_json(record[wire.RUN_CONFIG]) == config


def test_when_no_site_trains_the_run_ends_naming_the_cause(tmp_path):
    root = generate(tmp_path / "data")
    config = RunConfig(**SMALL, num_server_rounds=2, data_root=str(root), run_dir=str(tmp_path / "runs"), run_name="x")
    app = quickstart_app(root, reads=("batch_size",))  # a key fedind does not send
    cause = "KeyError: 'batch_size' (3 of 3 failed replies)"
    logger, handler = logging.getLogger("flwr"), Collect()
    logger.addHandler(handler)
    try:
        with pytest.raises(RuntimeError) as failed:
            simulate(config, client_app=app, runtime="loopback")
    finally:
        logger.removeHandler(handler)
    assert str(failed.value) == f"no site update was aggregated in any round; cause: {cause}"
    assert f"round 1: no site update arrived; the global model is unchanged (cause: {cause})" in handler.lines


def test_the_cause_of_failing_sites_is_one_line():
    # The reasons as Flower formats them: str(type(ex)) + ":<'" + str(ex) + "'>", from a
    # SuperNode, and from a Ray worker whose message ends with the site's own exception.
    supernode = "<class 'KeyError'>:<''lr''>"
    ray = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
           "(pid=8230, ip=192.0.2.2)\nKeyError: 'lr''>")
    assert short_reason(supernode) == short_reason(ray) == "KeyError: 'lr'"
    failures = [f"node 1: {ray}", f"node 2: {supernode}", "node 3: no reply (timeout)"]
    assert common_cause(failures) == "KeyError: 'lr' (2 of 3 failed replies)"


# --------------------------------------------------------------------------- cases 1, 3, 5, 6: a plant run


@pytest.fixture(scope="module")
def plant_run(tmp_path_factory):
    """2 rounds of fedind's agent on a data-root without a global test.npz, whose line-01
    has no test.npz either (checkpoint every round)."""
    tmp = tmp_path_factory.mktemp("plant")
    root = generate(tmp / "data")
    (root / "test.npz").unlink()
    (root / "sites" / "line-01" / "test.npz").unlink()
    config = RunConfig(**SMALL, num_server_rounds=2, data_root=str(root), run_dir=str(tmp / "runs"), run_name="plant")
    summary, lines = collecting(lambda: simulate(config, runtime="loopback"))
    return summary, lines, config, tmp / "runs" / "plant", root


def test_without_a_global_test_set_the_run_finishes_with_per_site_scores(plant_run):
    summary, lines, _, folder, _ = plant_run
    assert json.loads((folder / "summary.json").read_text(), parse_constant=pytest.fail) == summary
    assert summary["rounds"] == 2 and summary["global_test"] is False
    assert summary["final_accuracy"] is summary["best_accuracy"] is summary["initial_accuracy"] is None
    rows = (folder / "rounds.csv").read_text().splitlines()[1:]
    assert [row.split(",")[1] for row in rows] == ["nan", "nan"]  # unscored rounds, as documented
    assert any("no global test set" in line for line in lines)
    # Every round's checkpoint was saved, and restores the unscored rounds as NaN.
    saved = CheckpointStore(folder / "checkpoints").load_latest()
    assert saved.round == 2 and all(math.isnan(row["accuracy"]) for row in saved.state["rows"])


def test_a_site_without_a_test_split_is_scored_on_nothing(plant_run):
    summary, lines, _, _, root = plant_run
    per_site = summary["per_site"]
    assert per_site["line-01"] == {"accuracy": None, "num_examples": 0, "note": "no test split at the site: not scored"}
    for site in ("line-00", "line-02"):
        with np.load(root / "sites" / site / "test.npz") as split:
            assert per_site[site]["num_examples"] == split["y"].size
        assert 0 <= per_site[site]["accuracy"] <= 1
    assert any("line-01: no test split" in line for line in lines)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "runs" / folder.name
    shutil.copytree(folder, copy)
    return copy


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_rerun_under_the_same_name_refuses_before_touching_its_results(plant_run, tmp_path):
    _, _, config, folder, _ = plant_run
    copy = copy_of(folder, tmp_path)
    before = snapshot(copy)
    rerun = RunConfig.from_flower({**config.to_flower(), "run-dir": str(tmp_path / "runs")})
    with pytest.raises(ConfigError, match=r"already holds a run \(summary.json, rounds.csv, model.safetensors, "
                                          r"checkpoints\).*resume = true.*overwrite = true"):
        run_server(None, rerun)  # refused before the server waits for a site
    assert snapshot(copy) == before


def test_overwrite_removes_the_earlier_results_first(plant_run, tmp_path):
    _, _, config, folder, _ = plant_run
    copy = copy_of(folder, tmp_path)
    (copy / "site.key").write_text("kept")  # not a result (simulate() puts Paillier keys here)
    claim_run_folder(copy, RunConfig.from_flower({**config.to_flower(), "overwrite": True}))
    assert existing_results(copy) == [] and not (copy / "progress.png").exists()
    assert (copy / "site.key").read_text() == "kept"


def test_resume_with_nothing_to_resume_stops_and_says_so(plant_run, tmp_path):
    _, _, config, folder, _ = plant_run
    copy = copy_of(folder, tmp_path)
    shutil.rmtree(copy / "checkpoints")
    before = snapshot(copy)
    resumed = RunConfig.from_flower({**config.to_flower(), "run-dir": str(tmp_path / "runs"), "resume": True})
    with pytest.raises(ConfigError, match="nothing to resume: no valid checkpoint.*overwrite = true"):
        run_server(None, resumed)
    assert snapshot(copy) == before


def test_resume_before_the_checkpoints_round_is_refused(plant_run, tmp_path):
    _, _, config, folder, _ = plant_run
    copy_of(folder, tmp_path)
    shorter = RunConfig.from_flower(
        {**config.to_flower(), "run-dir": str(tmp_path / "runs"), "resume": True, "num-server-rounds": 1}
    )
    with pytest.raises(ConfigError, match="after round 2, beyond num-server-rounds = 1"):
        run_server(None, shorter)


# --------------------------------------------------------------------------- case 4: a mistyped key


def test_the_server_names_a_mistyped_key_and_ends_with_a_one_line_cause(caplog):
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={**RunConfig().to_flower(), "num-server-round": 3})
    with caplog.at_level(logging.ERROR, logger="flwr"), pytest.raises(ConfigError):
        server_app.main(None, context)
    assert ("fedind: the run failed: ConfigError: Unknown run config key 'num-server-round' "
            "(did you mean 'num-server-rounds'?)") in caplog.messages


@pytest.mark.parametrize("command", ["check-config", "run"])
def test_the_cli_names_a_mistyped_key_before_flower_sees_it(command, capsys):
    assert cli_main([command, str(REPO), "--run-config", "num-server-round=3"]) == 2
    err = capsys.readouterr().err
    assert "Unknown run config key 'num-server-round' (did you mean 'num-server-rounds'?)" in err
    assert "Invalid run configuration" in err  # what flwr run alone would have said


def test_check_config_accepts_a_valid_run_config(capsys):
    assert cli_main(["check-config", str(REPO), "-c", "num-server-rounds=50 strategy='fedavgm'"]) == 0
    assert "run config OK: strategy fedavgm, 50 rounds" in capsys.readouterr().out


def test_a_failed_flwr_run_ends_with_its_cause():
    # flwr run --stream output of a failed ServerApp: fedind's ERROR line, then Flower's exit.
    failed = ["INFO :      round 1/3  accuracy nan",
              "\x1b[91mERROR \x1b[0m:     fedind: the run failed: ConfigError: run folder /r/x already holds a run",
              "\x1b[91mERROR \x1b[0m:     Exit Code: 700", "An unhandled exception occurred."]
    assert run_failure(failed, 0) == "ConfigError: run folder /r/x already holds a run"
    assert run_failure(failed[2:], 0) == "Flower exit code 700: An unhandled exception occurred."
    assert run_failure(["INFO :      fedind run 'x' finished"], 0) is None


# --------------------------------------------------------------------------- case 6: smaller ones


def test_a_stray_label_without_meta_json_is_named(tmp_path, caplog, capsys):
    rng = np.random.default_rng(0)
    for i, labels in enumerate(([0, 1, 2, 3] * 3, [0, 1, 2, 42] * 3)):
        y = np.asarray(labels, dtype=np.int64)
        write_split(tmp_path / "sites" / f"line-{i}" / "train.npz",
                    SiteArrays(rng.standard_normal((y.size, 1, 64)).astype(np.float32), y))
    config = RunConfig(data_root=str(tmp_path), num_sites=2)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert federation_shape(config)[1] == 43
    expected = "the model gets 43 classes from the largest label 42, but labels 4-41 occur in no split"
    assert any(expected in message for message in caplog.messages)
    assert cli_main(["data", "check", str(tmp_path)]) == 0
    assert expected in capsys.readouterr().out


def test_generate_names_the_option_of_a_bad_seed(tmp_path, capsys):
    assert cli_main(["data", "generate", "--out", str(tmp_path / "d"), "--seed", "-1"]) == 2
    assert "argument --seed: must be >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="seed = -1"):
        RunConfig(seed=-1)


def test_too_few_windows_per_site_is_said_so(tmp_path, capsys):
    argv = ["data", "generate", "--out", str(tmp_path / "d"), "--sites", "200", "--samples-per-site", "20"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "too few windows per site: 4000 windows (20 per site) could not be split among 200 sites" in err
    assert "raise samples-per-site or alpha, or use fewer sites" in err


def test_site_score_reads_what_a_site_sent():
    assert site_score({"num-examples": 5, "accuracy": 0.8}) == {"accuracy": 0.8, "num_examples": 5}
    assert site_score({"num-examples": 5, "val_accuracy": 0.6})["reported_as"] == "val_accuracy"
    assert site_score({"num-examples": 5, "eval_loss": 1.0})["note"] == "reported no accuracy metric (got eval_loss, num-examples)"
