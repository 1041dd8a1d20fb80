"""fedind predict: a real tiny run's model on its global test set gives the run's accuracy
exactly; models whose digest or shape does not fit are refused, naming the file."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fedind.cli import main as cli_main
from fedind.config import RunConfig
from fedind.data.format import load_split
from fedind.models import FaultCNN
from fedind.edge.predict import ModelFileError, load_model, read_windows
from fedind.server.results import save_model
from fedind.simulation import simulate
from fedind.training import evaluate


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A 2-round loopback run on a generated data root: (data root, run folder, summary)."""
    tmp = tmp_path_factory.mktemp("predict")
    root = tmp / "plant"
    assert cli_main(["data", "generate", "--out", str(root), "--sites", "2", "--alpha", "0.5", "--seed", "1",
                     "--samples-per-site", "60"]) == 0
    config = RunConfig(num_server_rounds=2, num_sites=2, samples_per_site=60, local_epochs=3, batch_size=8,
                       learning_rate=0.02, model_width=8, device="cpu", seed=1, data_root=str(root),
                       run_dir=str(tmp / "runs"), run_name="tiny", checkpoint_interval=1)
    summary = simulate(config, runtime="loopback")
    return root, tmp / "runs" / "tiny", summary


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_predict_reproduces_the_runs_final_accuracy_exactly(tiny_run, tmp_path, capsys):
    root, folder, summary = tiny_run
    out = tmp_path / "p.json"
    code, stdout, _ = run_cli(["predict", "--model", str(folder), str(root / "test.npz"), "--format", "json",
                               "--out", str(out)], capsys)
    assert code == 0
    result = json.loads(out.read_text())
    assert result["accuracy"] == summary["final_accuracy"]  # exactly, not approximately
    test_set = load_split(root / "test.npz")
    model = FaultCNN.from_state_dict(load_model(folder).model.state_dict())
    reference = evaluate(model, test_set, torch.device("cpu"))
    assert result["accuracy"] == reference.accuracy
    assert np.array_equal(np.array(result["confusion"]), reference.confusion)
    assert result["model"]["sha256"] == summary["model_sha256"] and result["model"]["round"] == 2
    assert len(result["predictions"]) == len(test_set.y)
    first = result["predictions"][0]
    assert first["class_name"] == json.loads((root / "meta.json").read_text())["class_names"][first["class"]]
    assert 0 < first["confidence"] <= 1
    assert f"accuracy {summary['final_accuracy']:.6f}" in stdout and "<- predicted" in stdout


def test_the_last_checkpoint_predicts_as_the_run_model(tiny_run, capsys):
    root, folder, _ = tiny_run
    code, from_run, _ = run_cli(["predict", "--model", str(folder / "model.safetensors"), str(root / "test.npz")], capsys)
    assert code == 0
    code, from_checkpoint, err = run_cli(["predict", "--model", str(folder / "checkpoints" / "round-000002"),
                                          str(root / "test.npz")], capsys)
    assert code == 0 and "round 2" in err
    rows = list(csv.DictReader(io.StringIO(from_checkpoint)))
    assert list(rows[0]) == ["index", "class", "class_name", "confidence", "label"]
    assert from_checkpoint == from_run


def test_raw_windows_without_labels(tiny_run, tmp_path, capsys):
    root, folder, _ = tiny_run
    x = load_split(root / "test.npz").x[:5]
    np.save(tmp_path / "w.npy", x)
    code, out, err = run_cli(["predict", "--model", str(folder), str(tmp_path / "w.npy")], capsys)
    assert code == 0 and "accuracy" not in err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 5 and "label" not in rows[0]


def copy_run(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    return copy


def test_refuses_a_modified_model_file(tiny_run, tmp_path, capsys):
    root, folder, _ = tiny_run
    copy = copy_run(folder, tmp_path)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-3] ^= 0x01  # one bit of the last weight
    (copy / "model.safetensors").write_bytes(bytes(data))
    code, out, err = run_cli(["predict", "--model", str(copy), str(root / "test.npz")], capsys)
    assert code == 2 and out == ""
    assert "model.safetensors: SHA-256" in err and "model.safetensors.sha256" in err


def test_refuses_a_model_the_summary_does_not_name(tiny_run, tmp_path, capsys):
    root, folder, _ = tiny_run
    copy = copy_run(folder, tmp_path)
    state = {k: v.numpy() for k, v in FaultCNN(in_channels=1, num_classes=10, width=8).state_dict().items()}
    save_model(copy / "model.safetensors", state, {"format": "fedind.FaultCNN"})  # a consistent sidecar
    code, _, err = run_cli(["predict", "--model", str(copy), str(root / "test.npz")], capsys)
    assert code == 2 and "summary.json's model_sha256" in err
    code, _, err = run_cli(["predict", "--model", str(folder), "--sha256", "ab" * 32, str(root / "test.npz")], capsys)
    assert code == 2 and "the expected digest" in err


def test_refuses_a_model_whose_shape_does_not_fit(tiny_run, tmp_path, capsys):
    root, folder, _ = tiny_run
    state = {k: v.numpy() for k, v in FaultCNN(in_channels=1, num_classes=10, width=8).state_dict().items()}
    torn = dict(state, **{"head.bias": np.zeros(7, np.float32)})  # 10 rows, 7 biases
    save_model(tmp_path / "torn.safetensors", torn, {})
    with pytest.raises(ModelFileError, match=r"torn\.safetensors: the arrays do not form a FaultCNN"):
        load_model(tmp_path / "torn.safetensors")
    save_model(tmp_path / "other.safetensors", {"w": np.zeros(3, np.float32)}, {})
    with pytest.raises(ModelFileError, match="not a FaultCNN model"):
        load_model(tmp_path / "other.safetensors")
    two_channel = tmp_path / "x2.npy"
    np.save(two_channel, np.zeros((2, 2, 1024), np.float32))
    code, _, err = run_cli(["predict", "--model", str(folder), str(two_channel)], capsys)
    assert code == 2 and "reads 1-channel windows" in err and "x2.npy has 2 channel(s)" in err
    small_head = {k: v.numpy() for k, v in FaultCNN(in_channels=1, num_classes=4, width=8).state_dict().items()}
    save_model(tmp_path / "small.safetensors", small_head, {"round": "3"})
    code, _, err = run_cli(["predict", "--model", str(tmp_path / "small.safetensors"), str(root / "test.npz")], capsys)
    assert code == 2 and "the model has 4 classes" in err


def test_a_round_in_the_file_metadata_is_reported(tmp_path):
    state = {k: v.numpy() for k, v in FaultCNN(in_channels=2, num_classes=9, width=8).state_dict().items()}
    save_model(tmp_path / "m.safetensors", state, {"format": "fedind.FaultCNN", "round": "7"})
    loaded = load_model(tmp_path / "m.safetensors")
    assert (loaded.round, loaded.num_classes, loaded.in_channels) == (7, 9, 2)
    with pytest.raises(Exception, match="file not found"):
        read_windows(tmp_path / "missing.npz")
