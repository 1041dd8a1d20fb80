"""Server checkpoints: atomic verified store, strategy state, and resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedind.server.checkpoint import CheckpointStore, CorruptCheckpointError, join_arrays, read_checkpoint, split_arrays
from fedind.config import ConfigError, RunConfig
from fedind.server.screening import UpdateScreen
from fedind.server.app import resume_point, run_folder
from fedind.server.strategies import FedAdam, FedAvg, FedAvgM, build_strategy, load_strategy_state, strategy_state

MODEL = {"conv.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "head.bias": np.ones(5, dtype=np.float32)}


def _state(marker: int = 0) -> dict:
    return {
        "run_config": RunConfig().to_flower(),
        "strategy": {"momentum_vector": [np.full((3, 4), marker, np.float32), np.zeros(5, np.float32)]},
        "rng": {"python": [3, tuple(range(5)), None], "torch": np.arange(8, dtype=np.uint8)},
        "rows": [{"round": 1, "accuracy": 0.5}],
        "nothing": None,
    }


def _save_rounds(store: CheckpointStore, rounds) -> None:
    for r in rounds:
        store.save(r, {k: v + r for k, v in MODEL.items()}, _state(r))


# ---------------------------------------------------------------------- encoding


def test_split_and_join_round_trip_nested_arrays():
    tree = {"a": [np.eye(2), {"b": np.int64(3), "c": (1, "x", None)}], "d": np.zeros(0, np.float32)}
    plain, arrays = split_arrays(tree)
    json.dumps(plain, allow_nan=False)  # JSON-ready
    back = join_arrays(json.loads(json.dumps(plain)), arrays)
    np.testing.assert_array_equal(back["a"][0], np.eye(2))
    assert back["a"][1]["b"] == 3 and back["a"][1]["c"] == [1, "x", None]
    assert back["d"].dtype == np.float32 and back["d"].shape == (0,)


@pytest.mark.parametrize("bad", [{1: "int key"}, {"x": object()}, {"$array": "a0"}])
def test_split_refuses_what_it_cannot_restore(bad):
    with pytest.raises((TypeError, ValueError)):
        split_arrays(bad)


# ---------------------------------------------------------------------- store


def test_save_and_load_latest_round_trip(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", keep=3)
    _save_rounds(store, [1, 2])
    checkpoint = store.load_latest()
    assert checkpoint.round == 2
    for name, value in MODEL.items():
        np.testing.assert_array_equal(checkpoint.arrays[name], value + 2)
    np.testing.assert_array_equal(checkpoint.state["strategy"]["momentum_vector"][0], np.full((3, 4), 2))
    assert checkpoint.state["rng"]["python"] == [3, [0, 1, 2, 3, 4], None]
    assert checkpoint.state["rng"]["torch"].dtype == np.uint8
    assert checkpoint.state["rows"] == [{"round": 1, "accuracy": 0.5}] and checkpoint.state["nothing"] is None


def test_keeps_only_the_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    _save_rounds(store, [1, 2, 3, 4])
    assert store.rounds() == [3, 4]


def _corrupt_truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _corrupt_flip_byte(path: Path) -> None:
    data = bytearray((path / "state.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "state.safetensors").write_bytes(bytes(data))


def _corrupt_tamper_json(path: Path) -> None:
    (path / "state.json").write_text((path / "state.json").read_text().replace('"round": 1', '"round": 9'))


def _corrupt_manifest(path: Path) -> None:
    (path / "manifest.json").write_text("{ torn")


def _corrupt_missing_file(path: Path) -> None:
    (path / "state.json").unlink()


@pytest.mark.parametrize(
    "corrupt", [_corrupt_truncate, _corrupt_flip_byte, _corrupt_tamper_json, _corrupt_manifest, _corrupt_missing_file]
)
def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_previous_one_loaded(tmp_path, corrupt, caplog):
    store = CheckpointStore(tmp_path, keep=3)
    _save_rounds(store, [1, 2, 3])
    corrupt(store.path(3))
    with pytest.raises(CorruptCheckpointError):
        read_checkpoint(store.path(3), 3)
    checkpoint = store.load_latest()
    assert checkpoint.round == 2
    np.testing.assert_array_equal(checkpoint.arrays["head.bias"], MODEL["head.bias"] + 2)
    assert store.rounds() == [1, 2]  # never considered again
    assert [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name][0].startswith("round-000003.corrupt-")


def test_a_non_finite_model_is_never_loaded(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, {"w": np.array([1.0, np.nan], np.float32)}, {})
    assert store.load_latest() is None


def test_no_valid_checkpoint_gives_none(tmp_path):
    assert CheckpointStore(tmp_path / "absent").load_latest() is None
    store = CheckpointStore(tmp_path)
    _save_rounds(store, [1])
    _corrupt_manifest(store.path(1))
    assert store.load_latest() is None


def test_a_crashed_save_leaves_the_previous_checkpoints_and_is_cleaned_up(tmp_path):
    store = CheckpointStore(tmp_path)
    _save_rounds(store, [1])
    torn = tmp_path / ".round-000002.4242.tmp"  # what a crash between files leaves behind
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"partial")
    assert store.load_latest().round == 1
    _save_rounds(store, [2])
    assert not torn.exists() and store.rounds() == [1, 2]


def test_resaving_a_round_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path)
    _save_rounds(store, [1])
    store.save(1, {"w": np.zeros(2, np.float32)}, {})
    assert set(store.load(1).arrays) == {"w"}


# ---------------------------------------------------------------------- strategy state


def _through_store(tmp_path, state: dict) -> dict:
    store = CheckpointStore(tmp_path)
    store.save(1, MODEL, {"strategy": state})
    return store.load_latest().state["strategy"]


def test_fedavgm_momentum_survives_a_checkpoint(tmp_path):
    strategy = FedAvgM(server_momentum=0.9)
    strategy.load_state_dict({"momentum_vector": [np.full(3, 0.5, np.float32), np.arange(4, dtype=np.float32)]})
    fresh = FedAvgM(server_momentum=0.9)
    load_strategy_state(fresh, _through_store(tmp_path, strategy_state(strategy)))
    for a, b in zip(fresh.momentum_vector, strategy.momentum_vector):
        np.testing.assert_array_equal(a, b)


def test_fedadam_moments_survive_a_checkpoint(tmp_path):
    strategy = FedAdam()
    strategy.load_state_dict({"m_t": {"w": np.ones(3, np.float32)}, "v_t": {"w": np.full(3, 2.0, np.float32)}})
    fresh = FedAdam()
    load_strategy_state(fresh, _through_store(tmp_path, strategy_state(strategy)))
    np.testing.assert_array_equal(fresh.m_t["w"], strategy.m_t["w"])
    np.testing.assert_array_equal(fresh.v_t["w"], strategy.v_t["w"])


def test_dwa_state_survives_a_checkpoint(tmp_path):
    config = RunConfig(strategy="dwa", num_sites=3)
    strategy = build_strategy(config, 3, num_classes=4)
    strategy.global_histogram.update("line-00", np.array([5, 0, 1, 0]))
    fresh = build_strategy(config, 3, num_classes=4)
    load_strategy_state(fresh, _through_store(tmp_path, strategy_state(strategy)))
    np.testing.assert_array_equal(fresh.global_histogram.counts(), [5, 0, 1, 0])


def test_the_screens_alignment_record_survives_a_checkpoint(tmp_path):
    screen = UpdateScreen(alignment_threshold=-0.4)
    screen.alignment.add("line-03", -0.7)
    screen.flagged.add("line-03")
    store = CheckpointStore(tmp_path)
    store.save(1, MODEL, {"screen": screen.state_dict()})
    fresh = UpdateScreen(alignment_threshold=-0.4)
    fresh.load_state_dict(store.load_latest().state["screen"])
    assert fresh.flagged == {"line-03"}
    assert fresh.alignment.add("line-03", 0.1) == screen.alignment.add("line-03", 0.1)


def test_state_of_another_strategy_is_refused():
    with pytest.raises(ValueError, match="momentum_vector"):
        load_strategy_state(FedAvg(), {"momentum_vector": None})


# ---------------------------------------------------------------------- resume rules


def test_resume_refuses_a_different_run_config(tmp_path):
    config = RunConfig(run_dir=str(tmp_path), run_name="r", resume=True)
    store = CheckpointStore(run_folder(config) / "checkpoints")
    store.save(2, MODEL, {"run_config": RunConfig(seed=7, local_epochs=3).to_flower()})
    with pytest.raises(ConfigError, match="local-epochs: 3 -> 2.*seed: 7 -> 0"):
        resume_point(store, config)
    store.save(3, MODEL, {"run_config": RunConfig(num_server_rounds=20, round_timeout=5.0).to_flower()})
    assert resume_point(store, config).round == 3  # a longer run or another timeout is the same run


def test_resume_without_a_name_picks_the_run_with_the_newest_checkpoint(tmp_path):
    for name in ("older", "newer"):
        CheckpointStore(tmp_path / name / "checkpoints").save(1, MODEL, {})
        time.sleep(0.02)
    (tmp_path / "no-checkpoints").mkdir()
    assert run_folder(RunConfig(run_dir=str(tmp_path), resume=True)).name == "newer"


# ---------------------------------------------------------------------- SIGKILL and resume

_CHILD = textwrap.dedent(
    """
    import logging, sys, time
    from fedind.config import RunConfig
    from fedind.simulation import simulate

    class Saved(logging.Handler):  # one line on stdout per checkpoint saved: the parent waits on it
        def emit(self, record):
            if record.getMessage().startswith("checkpoint of round "):
                saved = int(record.getMessage().split()[3])
                print(saved, flush=True)
                if saved >= 3:  # hold the run here until the kill, however late it comes on a loaded machine
                    time.sleep(600)

    logging.getLogger("flwr").addHandler(Saved())
    simulate(RunConfig(**{k: v for k, v in __import__("json").loads(sys.argv[1]).items()}), runtime="loopback")
    """
)


def test_sigkilled_server_resumes_and_finishes_bit_identical(tmp_path):
    """A run killed after its round-3 checkpoint (SIGKILL of the whole simulation process
    group; the child holds there, so the kill lands at the same point however loaded the
    machine is), whose newest checkpoint is then truncated, resumes from the one before and
    ends with exactly the model of an uninterrupted run: on CPU the whole run is
    deterministic given the seed.
    The runs use the loopback runtime (fedind.loopback: server and sites in one process;
    that process is the one killed); tests/test_server_resume_e2e.py kills a deployed
    ServerApp under a real SuperLink."""
    from fedind.simulation import simulate

    # served_ema: the published model is the average of the global models, so it too must resume exactly
    base = dict(num_server_rounds=5, num_sites=3, samples_per_site=40, local_epochs=1, served_ema=0.5,
                run_dir=str(tmp_path))
    killed = {**base, "run_name": "killed"}
    checkpoints = tmp_path / "killed" / "checkpoints"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(killed)],
        start_new_session=True,  # its own process group: the kill takes everything it started
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    saved: list[int] = []

    def kill_after_round_3() -> None:
        """Wait (no polling) for the child's line saying the checkpoint of round 3 is
        saved, then SIGKILL its process group (also when it ended early)."""
        try:
            for line in child.stdout:
                saved.append(int(line))
                if saved[-1] >= 3:
                    break
        finally:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    watcher = threading.Thread(target=kill_after_round_3, daemon=True)
    watcher.start()
    try:
        # Meanwhile, here: the same run without interruption.
        clean = simulate(RunConfig(run_name="clean", **base), runtime="loopback")
        watcher.join(timeout=240)
    finally:
        if watcher.is_alive():
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        watcher.join(timeout=10)
        child.stdout.close()
    assert saved and saved[-1] >= 3, f"no checkpoint of round 3 in time (saved: {saved})"
    assert (checkpoints / "round-000003").is_dir()
    assert not (tmp_path / "killed" / "summary.json").exists()
    newest = max(CheckpointStore(checkpoints).rounds())
    assert newest == 3
    _corrupt_truncate(checkpoints / f"round-{newest:06d}")  # and the newest checkpoint is torn

    resumed = simulate(RunConfig(resume=True, **killed), runtime="loopback")
    assert resumed["rounds"] == 5
    rows = (tmp_path / "killed" / "rounds.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == [1, 2, 3, 4, 5]
    assert resumed["model_sha256"] == clean["model_sha256"]
    assert resumed["final_accuracy"] == clean["final_accuracy"]
    assert any(".corrupt-" in p.name for p in checkpoints.iterdir())
