"""A site's per-message cost: torch's SGD without torch._dynamo, the conditioned-window
cache (fedind.site.cache), and a train message that imports only what it needs."""

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedind import wire
from fedind.site import app as agent
from fedind.config import RunConfig
from fedind.data.format import SiteArrays, write_split
from fedind.models import FaultCNN, initial_state
from fedind.site.cache import CACHE_DIR, cache_key, cached_conditioning, conditioning_params
from fedind.training import MomentumSGD, condition_windows

pytestmark = pytest.mark.usefixtures("flower_task_identity")

WIDTH, WINDOW = 8, 256
REPO = Path(__file__).resolve().parents[1]


def test_momentum_sgd_is_torch_sgd_bit_for_bit():
    torch.manual_seed(0)
    ours, theirs = FaultCNN(width=WIDTH), FaultCNN(width=WIDTH)
    theirs.load_state_dict(ours.state_dict())
    a = MomentumSGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    b = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    x, y = torch.randn(6, 1, WINDOW), torch.randint(0, 10, (6,))
    for _ in range(4):
        for model, optimizer in ((ours, a), (theirs, b)):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    for (name, p), q in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kwargs", [{"lr": -1.0}, {"lr": 0.1, "momentum": float("nan")}, {"lr": 0.1, "weight_decay": -1}])
def test_momentum_sgd_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError, match="Invalid"):
        MomentumSGD([torch.zeros(1, requires_grad=True)], **kwargs)


def test_a_train_message_imports_neither_dynamo_nor_the_crypto_stack_and_openmp_threads_sleep(tmp_path):
    site = write_site(tmp_path / "line-00", seed=1)
    script = (
        "import sys, json; from flwr.supercore.task_identity import TaskIdentity;"
        "TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1;"
        "from tests.test_site_cache import train_once;"
        f"train_once({str(site)!r}, None);"
        "import os; print(os.environ.get('OMP_WAIT_POLICY'));"
        "crypto = ('phe', 'fedind.paillier.site', 'fedind.paillier.keys', 'fedind.paillier.packing', 'fedind.server.encrypted');"
        "print(json.dumps(sorted(m for m in ('torch._dynamo', 'sympy', *crypto) if m in sys.modules)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    *_, policy, imported = done.stdout.strip().splitlines()
    assert json.loads(imported) == []
    assert policy == "PASSIVE"  # OpenMP threads sleep while they wait: ten agents share two cores


# --------------------------------------------------------------------------- the cache


def write_site(folder, seed: int, n: int = 24):
    rng = np.random.default_rng(seed)
    t = np.arange(WINDOW, dtype=np.float32)
    y = np.arange(n) % 10
    x = (np.sin(t * (1 + y[:, None]) / 20)[:, None, :] + 0.3 * rng.standard_normal((n, 1, WINDOW))).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    write_split(folder / "train.npz", SiteArrays(x, y.astype(np.int64)))
    return folder


def train_once(site: str, state_dir) -> str:
    """The site agent's train handler on one round; the SHA-256 of the trained weights."""
    config = RunConfig(local_epochs=2, batch_size=8, model_width=WIDTH)
    arrays = {k: torch.from_numpy(v) for k, v in initial_state(0, 1, 10, WIDTH).items()}
    content = RecordDict({
        wire.ARRAYS: ArrayRecord(arrays),
        wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(config.to_flower()), wire.SERVER_ROUND: 1}),
    })
    node = {"data-dir": site} | ({"state-dir": str(state_dir)} if state_dir else {})
    context = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})
    agent.site_from_dir.cache_clear()  # a fresh process each message: nothing in memory
    reply = agent.train(Message(content, message_type=MessageType.TRAIN, dst_node_id=7), context)
    digest = hashlib.sha256()
    for name, array in reply.content[wire.ARRAYS].items():
        digest.update(name.encode() + array.numpy().tobytes())
    return digest.hexdigest()


def cache_files(state_dir):
    return sorted((state_dir / CACHE_DIR).glob("*.safetensors"))


def test_a_cached_round_trains_the_same_model_as_an_uncached_one(tmp_path):
    site, state = str(write_site(tmp_path / "line-00", seed=1)), tmp_path / "state"
    plain = train_once(site, None)
    assert cache_files(state) == []
    assert train_once(site, state) == plain  # computes and writes the cache
    assert len(cache_files(state)) == 1
    written = cache_files(state)[0].stat().st_mtime_ns
    assert train_once(site, state) == plain  # reads it
    assert cache_files(state)[0].stat().st_mtime_ns == written


def test_a_corrupt_cache_is_not_used_but_rebuilt_with_a_warning(tmp_path, caplog, monkeypatch):
    site, state = str(write_site(tmp_path / "line-00", seed=1)), tmp_path / "state"
    plain = train_once(site, state)
    path = cache_files(state)[0]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one bit pattern in the tensor, the header intact
    path.write_bytes(bytes(data))
    monkeypatch.setattr(logging.getLogger("flwr"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert train_once(site, state) == plain
    assert any("content does not match its SHA-256" in r.getMessage() and path.name in r.getMessage() for r in caplog.records)
    assert cache_files(state) == [path] and path.read_bytes() != bytes(data)
    path.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert train_once(site, state) == plain
    assert any("unreadable" in r.getMessage() for r in caplog.records)


def test_new_data_get_a_new_cache_entry_and_the_old_one_goes(tmp_path):
    folder, state = write_site(tmp_path / "line-00", seed=1), tmp_path / "state"
    train_once(str(folder), state)
    first = cache_files(state)
    write_site(folder, seed=2)  # the plant replaced the line's windows
    assert train_once(str(folder), state) == train_once(str(folder), None)
    assert len(cache_files(state)) == 1 and cache_files(state) != first


def test_the_key_changes_with_the_windows_and_the_conditioning_parameters():
    model, x = FaultCNN(width=WIDTH), np.zeros((2, 1, WINDOW), np.float32)
    params = conditioning_params(model, torch.device("cpu"))
    key = cache_key(x, params)
    assert cache_key(x.copy(), dict(params)) == key
    assert cache_key(x + 1, params) != key
    assert cache_key(x.reshape(2, 2, WINDOW // 2), params) != key
    assert cache_key(x, params | {"device": "cuda"}) != key
    assert cache_key(x, params | {"torch": "0.0"}) != key
    assert cache_key(x, params | {"front_end": "edited"}) != key


def test_cached_windows_are_those_of_the_front_end(tmp_path):
    model = FaultCNN(width=WIDTH)
    x = np.random.default_rng(0).standard_normal((5, 1, WINDOW)).astype(np.float32)
    expected = condition_windows(model, torch.from_numpy(x))
    assert torch.equal(cached_conditioning(tmp_path, model, x, torch.device("cpu")), expected)
    assert torch.equal(cached_conditioning(tmp_path, model, x, torch.device("cpu")), expected)
    assert cached_conditioning(tmp_path, model, x[:0], torch.device("cpu")) is None
