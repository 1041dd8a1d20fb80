"""The per-message relay and the long-lived site worker (fedind.site.relay, fedind.site.worker):
real worker processes on a real Unix socket, compared with the site agent called in-process."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto

from fedind import wire
from fedind.config import RunConfig
from fedind.data.format import SiteArrays, write_split
from fedind.models import initial_state
from fedind.site import channel, relay, state
from fedind.site.app import app as agent

pytestmark = pytest.mark.usefixtures("flower_task_identity")

REPO = Path(__file__).resolve().parents[1]
WIDTH, WINDOW = 8, 256
VOLATILE = {wire.TRAIN_SECONDS, wire.COMPRESS_SECONDS, wire.ENCRYPT_SECONDS, wire.PEAK_RSS_MB}  # measured


@pytest.fixture
def plant():
    """A short folder (a socket path holds 107 bytes) with one site's data; the workers
    started under it are killed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="fedind-worker-"))
    site = root / "line-00"
    rng = np.random.default_rng(1)
    y = np.arange(24) % 10
    t = np.arange(WINDOW, dtype=np.float32)
    x = (np.sin(t * (1 + y[:, None]) / 20)[:, None, :] + 0.3 * rng.standard_normal((24, 1, WINDOW))).astype(np.float32)
    site.mkdir()
    write_split(site / "train.npz", SiteArrays(x, y.astype(np.int64)))
    yield root
    for pid in worker_pids(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(root, ignore_errors=True)


def worker_pids(root: Path) -> list[int]:
    return [int(p.read_text()) for p in root.glob(f"*/{channel.FOLDER}/{channel.PID}") if p.read_text().strip()]


def node(root: Path, name: str, **extra) -> dict:
    return {"data-dir": str(root / "line-00"), "state-dir": str(root / name), channel.IDLE_KEY: 60} | extra


def message(server_round: int, run_config: dict | None = None) -> Message:
    config = RunConfig(local_epochs=1, batch_size=8, model_width=WIDTH, compression="topk", topk_ratio=0.1, run_name="w")
    arrays = {k: torch.from_numpy(v + 0.01 * server_round) for k, v in initial_state(0, 1, 10, WIDTH).items()}
    text = json.dumps(run_config if run_config is not None else config.to_flower())
    content = RecordDict({
        wire.ARRAYS: ArrayRecord(arrays),
        wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: text, wire.SERVER_ROUND: server_round}),
    })
    msg = Message(content, message_type=MessageType.TRAIN, dst_node_id=7)
    msg.metadata.__dict__["_message_id"] = msg.object_id  # what flwr-clientapp does on arrival
    return msg


def twin(msg: Message) -> Message:
    """An equal copy (same id and metadata) for the in-process agent: mods may touch the message."""
    return message_from_proto(message_to_proto(msg))


def context(node_config: dict) -> Context:
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def assert_same_records(a: RecordDict, b: RecordDict, skip=frozenset()) -> None:
    assert sorted(a.keys()) == sorted(b.keys())
    for name, record in a.items():
        other = b[name]
        assert type(record) is type(other) and sorted(record.keys()) == sorted(other.keys()), name
        for key, value in record.items():
            if key in skip:
                continue
            if isinstance(record, ArrayRecord):
                x, y = value.numpy(), other[key].numpy()
                assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), (name, key)
            else:
                assert type(value) is type(other[key]) and value == other[key], (name, key)


def assert_same_reply(a: Message, b: Message, msg: Message) -> None:
    assert a.metadata.reply_to_message_id == b.metadata.reply_to_message_id == msg.metadata.message_id != ""
    for field in ("run_id", "src_node_id", "dst_node_id", "group_id", "message_type", "src_task_id", "dst_task_id"):
        assert getattr(a.metadata, field) == getattr(b.metadata, field), field
    assert_same_records(a.content, b.content, skip=VOLATILE)


def test_the_relay_imports_no_torch_and_registers_what_the_site_agent_does():
    script = "import sys, client.app; print(sorted(m for m in ('torch', 'fedind.site.app', 'fedind.training') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert sorted(relay.app._registered_funcs) == sorted(agent._registered_funcs)
    assert channel.STATE_DIR_KEY == state.NODE_CONFIG_KEY


def test_only_a_deployed_node_with_a_state_dir_uses_a_worker():
    assert channel.uses_worker({"state-dir": "/s"})
    assert not channel.uses_worker({"state-dir": "/s", "partition-id": 0, "num-partitions": 2})  # simulation
    assert not channel.uses_worker({"data-dir": "/d"})
    assert not channel.uses_worker({"state-dir": "/s", "site-worker": False})
    with pytest.raises(ValueError, match="site-worker"):
        channel.uses_worker({"state-dir": "/s", "site-worker": "no"})
    with pytest.raises(ValueError, match="site-worker-idle"):
        channel.idle_seconds({"site-worker-idle": 0})
    with pytest.raises(channel.Unavailable, match="longer than 107"):
        channel.socket_path(Path("/" + "x" * 120))


def test_a_worker_answers_as_the_in_process_agent_and_keeps_the_state_exact(plant):
    via, here = context(node(plant, "a")), context(node(plant, "b"))
    pids = []
    for server_round in (1, 2):
        msg = message(server_round)
        reply = relay.forward(msg, via)
        expected = agent(twin(msg), here)
        assert_same_reply(reply, expected, msg)
        assert len(via.state) and not any(k in VOLATILE for k in via.state)
        assert_same_records(via.state, here.state)
        pids.append(worker_pids(plant))
    assert len(pids[0]) == 1 and pids[0] == pids[1]  # one worker, reused
    folder = plant / "a" / channel.FOLDER
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / channel.SOCKET).stat().st_mode) == 0o600
    assert stat.S_ISSOCK((folder / channel.SOCKET).stat().st_mode)
    assert not (plant / "b" / channel.FOLDER).exists()  # in-process: no worker
    # The app's exception in the worker: the same type name and text as in-process.
    bad = RunConfig(model_width=WIDTH).to_flower() | {"local-epochs": -1}
    msg = message(3, bad)
    with pytest.raises(Exception) as there:
        relay.forward(twin(msg), via)
    with pytest.raises(Exception) as here_error:
        agent(msg, here)
    assert str(type(there.value)) == str(type(here_error.value)) and str(there.value) == str(here_error.value)
    assert isinstance(there.value, relay.WorkerError) and isinstance(there.value, ValueError)
    assert worker_pids(plant) == pids[0]  # the worker survived its app's exception


def test_a_killed_worker_loses_no_message_and_a_new_one_starts(plant, caplog):
    via, here = context(node(plant, "a")), context(node(plant, "b"))
    msg = message(1)
    relay.forward(twin(msg), via)
    agent(msg, here)
    (first,) = worker_pids(plant)
    # The worker dies with the message in hand: stopped, handed the message, then killed.
    os.kill(first, signal.SIGSTOP)
    answer, msg = {}, message(2)
    thread = threading.Thread(target=lambda: answer.update(reply=relay.forward(twin(msg), via)))
    thread.start()
    time.sleep(0.5)
    os.kill(first, signal.SIGKILL)
    thread.join(timeout=120)
    assert_same_reply(answer["reply"], agent(msg, here), msg)  # handled in-process
    assert_same_records(via.state, here.state)
    # The next message starts a new worker (the dead one's socket file is still there).
    assert (plant / "a" / channel.FOLDER / channel.SOCKET).exists()
    msg = message(3)
    assert_same_reply(relay.forward(twin(msg), via), agent(msg, here), msg)
    assert_same_records(via.state, here.state)
    (second,) = worker_pids(plant)
    assert second != first


def test_a_worker_of_other_code_is_not_used(plant):
    other = plant / "other-code"
    shutil.copytree(REPO / "fedind", other / "fedind", ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "fedind" / "site" / "app.py", "a") as f:
        f.write("\n# another version\n")
    folder = channel.worker_folder(node(plant, "a"))
    env = dict(os.environ, PYTHONPATH=str(other))
    old = subprocess.Popen([sys.executable, "-m", "fedind.site.worker", "--folder", str(folder), "--idle", "60"],
                           env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (folder / channel.PID).exists() and old.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert int((folder / channel.PID).read_text()) == old.pid
        via, here = context(node(plant, "a")), context(node(plant, "b"))
        msg = message(1)
        assert_same_reply(relay.forward(twin(msg), via), agent(msg, here), msg)
        assert_same_records(via.state, here.state)
        assert old.wait(timeout=30) == 0  # it stepped down instead of answering
        (new,) = worker_pids(plant)
        assert new != old.pid
    finally:
        if old.poll() is None:
            old.kill()


def test_in_simulation_the_relay_is_the_site_agent_bit_for_bit(tmp_path):
    """``client.app:app`` is the relay; in a simulation (``partition-id`` in the node config)
    it calls the agent in-process and trains the very same model, with no worker."""
    from dataclasses import replace

    from fedind.simulation import simulate

    config = RunConfig(num_server_rounds=2, num_sites=2, samples_per_site=30, local_epochs=1, batch_size=8,
                       model_width=WIDTH, phases=1, phase_rounds=0, replay_samples=0, ewc_lambda=0.0, head_calibration=False,
                       compression="topk", topk_ratio=0.1, run_dir=str(tmp_path))
    agent_run = simulate(replace(config, run_name="agent"), runtime="loopback")
    relay_run = simulate(replace(config, run_name="relay"), client_app=relay.app, runtime="loopback")
    assert relay_run["model_sha256"] == agent_run["model_sha256"]
    assert not list(tmp_path.rglob(channel.SOCKET))
