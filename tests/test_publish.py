"""The site agent publishes the global models it receives (node config ``serve-dir``) for
the line's ``fedind serve --watch``: a real two-phase run on the loopback runtime, its
models read back with the service's own loader and compared with the server's."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedind.server.checkpoint import CheckpointStore
from flwr.app import Context, RecordDict

from fedind.site.app import SERVED_ROUND, line_average
from fedind.site.app import app as site_app
from fedind.config import RunConfig
from fedind.loopback import LoopbackGrid, task_identity
from fedind.edge.publish import model_bytes, model_file_name, publish_if_new, publish_received
from fedind.edge.serve import ModelSlot, ModelWatcher, ServeMetrics
from fedind.server.app import run_server

# tests/test_continual.py's short two-phase run: the head grows from 9 to 10 classes at round 3.
SHORT = dict(
    num_server_rounds=3, num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8, learning_rate=0.01,
    model_width=8, device="cpu", seed=0, phases=2, phase_rounds=2, replay_samples=64, replay_share=0.2,
    replay_ratio=0.5,
)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def published_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("publish")
    blocked = tmp / "not-a-folder"
    blocked.write_text("a file where the line's folder should be")
    serve_dirs = [tmp / "line-00" / "models", tmp / "line-01" / "models", blocked / "models"]
    config = RunConfig(**SHORT, run_dir=str(tmp / "runs"), run_name="cl")
    grid = LoopbackGrid(site_app, 3, node_configs=[{"serve-dir": str(d)} for d in serve_dirs])
    with task_identity(grid.run.run_id):
        summary = run_server(grid, config)
    return summary, tmp / "runs" / "cl", serve_dirs


def test_each_site_publishes_every_global_model_it_receives(published_run):
    summary, run, serve_dirs = published_run
    final = load_file(run / "model.safetensors")
    checkpoints = CheckpointStore(run / "checkpoints")
    for folder in serve_dirs[:2]:
        names = sorted(p.name for p in folder.iterdir())
        assert names == [name for r in (1, 2, 3) for name in (model_file_name(r), model_file_name(r) + ".sha256")]
        assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left
        for server_round in (1, 2, 3):
            path = folder / model_file_name(server_round)
            sent = checkpoints.load(server_round).arrays  # the global model after that round
            assert path.read_bytes() == model_bytes(sent, server_round)
        # the newest is the final model, its head grown by the new class at round 3
        assert path.read_bytes() == model_bytes(final, 3)


def test_the_line_service_serves_the_newest_with_the_digest_of_the_global_model(published_run):
    summary, run, serve_dirs = published_run
    final = load_file(run / "model.safetensors")
    slot, metrics = ModelSlot(), ServeMetrics()
    served = ModelWatcher(serve_dirs[0], slot, metrics).poll()  # the service's loader: digest file, shapes
    assert served is not None and slot.current is served
    assert served.loaded.round == 3
    assert served.loaded.sha256 == digest(model_bytes(final, 3))  # the global model the server sent
    assert served.loaded.num_classes == summary["continual"]["classes"] == 10
    for name, value in served.loaded.model.state_dict().items():
        assert np.array_equal(value.numpy(), final[name])
    older = ModelWatcher(serve_dirs[0], ModelSlot(), ServeMetrics())
    (serve_dirs[0] / (model_file_name(3) + ".sha256")).unlink()  # round 3 not vouched for: round 2 is served
    (serve_dirs[0] / model_file_name(3)).unlink()
    assert older.poll().loaded.num_classes == 9  # before the head grew


def test_a_folder_that_cannot_be_written_does_not_fail_training(published_run):
    summary, run, serve_dirs = published_run
    assert not serve_dirs[2].exists()
    assert sorted(summary["per_site"]) == ["line-00", "line-01", "line-02"]
    assert summary["totals"]["failures"] == 0  # every site trained every round


@pytest.fixture(scope="module")
def averaged_run(tmp_path_factory):
    """The same run with ``served-ema``: the server scores an average of the global models."""
    tmp = tmp_path_factory.mktemp("publish-ema")
    serve_dirs = [tmp / f"line-0{i}" / "models" for i in range(3)]
    config = RunConfig(**SHORT, served_ema=0.5, run_dir=str(tmp / "runs"), run_name="ema")
    grid = LoopbackGrid(site_app, 3, node_configs=[{"serve-dir": str(d)} for d in serve_dirs])
    with task_identity(grid.run.run_id):
        run_server(grid, config)
    return tmp / "runs" / "ema", serve_dirs


def test_with_served_ema_each_line_publishes_the_average_the_server_scores(averaged_run):
    run, serve_dirs = averaged_run
    checkpoints = CheckpointStore(run / "checkpoints")
    served = {r: checkpoints.load(r).state["served"]["average"] for r in (1, 2, 3)}
    global_2 = checkpoints.load(2).arrays
    assert any(not np.array_equal(served[2][name], global_2[name]) for name in global_2)  # an average, not round 2's model
    final = load_file(run / "model.safetensors")
    for folder in serve_dirs:
        for server_round in (1, 2):  # folded by the line from the global models it received
            assert (folder / model_file_name(server_round)).read_bytes() == model_bytes(served[server_round], server_round)
        # the final evaluate message carries the server's served model; published as sent
        assert (folder / model_file_name(3)).read_bytes() == model_bytes(final, 3)


def test_the_line_average_folds_each_round_once_and_weighs_missed_rounds():
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    model = {"w": np.full(2, 4.0, dtype=np.float32), "n": np.array(3, dtype=np.int64)}
    first = line_average(context, model, 1, 0.5)
    assert np.array_equal(first["w"], model["w"])  # the average starts at the first model it gets
    assert line_average(context, {"w": np.zeros(2, np.float32), "n": model["n"]}, 1, 0.5) is None  # round 1 again
    later = line_average(context, {"w": np.zeros(2, np.float32), "n": np.array(5, dtype=np.int64)}, 3, 0.5)
    assert np.allclose(later["w"], 1.0) and later["n"] == 5  # round 2 missed: the old average keeps 0.5 ** 2
    grown = line_average(context, {"w": np.ones(3, np.float32), "n": model["n"]}, 4, 0.5)
    assert np.array_equal(grown["w"], np.ones(3, np.float32))  # a grown head restarts the average
    assert int(context.state[SERVED_ROUND]["round"]) == 4


def test_a_model_already_published_is_not_written_again(tmp_path):
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    path = publish_if_new(tmp_path, arrays, 4)
    assert path == tmp_path / model_file_name(4)
    stamp = path.stat().st_mtime_ns, path.stat().st_ino
    assert publish_if_new(tmp_path, arrays, 4) is None
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == stamp
    changed = {"w": arrays["w"] + 1}
    assert publish_if_new(tmp_path, changed, 4) == path  # same round, other weights: rewritten
    assert path.read_bytes() == model_bytes(changed, 4)
    path.write_bytes(path.read_bytes()[:-4])  # torn: written again
    assert publish_if_new(tmp_path, changed, 4) == path and path.read_bytes() == model_bytes(changed, 4)


def test_only_the_newest_rounds_are_kept(tmp_path):
    arrays = {"w": np.zeros(3, dtype=np.float32)}
    for server_round in range(1, 6):
        publish_if_new(tmp_path, arrays, server_round, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        model_file_name(4), model_file_name(4) + ".sha256", model_file_name(5), model_file_name(5) + ".sha256"
    ]


def test_a_failed_write_is_a_warning(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert publish_received(blocked / "models", {"w": np.zeros(1, dtype=np.float32)}, 1) is None
    assert "not published" in caplog.text
