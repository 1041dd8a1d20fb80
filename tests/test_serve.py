"""fedind serve: a real HTTP service (uvicorn, loopback) answers from one whole model while
new models are published, swaps between requests, refuses unverified files, and reports
the model's round and digest in every answer and in /metrics."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from fedind.models import FaultCNN
from fedind.edge.predict import classify
from fedind.edge.serve import LineService, model_file_name, publish_model

WINDOWS = np.random.default_rng(0).standard_normal((3, 1, 512)).astype(np.float32)


def make_model(seed: int, num_classes: int = 10) -> tuple[dict[str, np.ndarray], FaultCNN]:
    torch.manual_seed(seed)
    model = FaultCNN(in_channels=1, num_classes=num_classes, width=8).eval()
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}, model


def post(port: int, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return response.read().decode()


def diagnose(port: int) -> tuple[int, dict]:
    return post(port, "/diagnose", json.dumps({"windows": WINDOWS.tolist()}).encode())


@pytest.fixture
def service(tmp_path):
    folder = tmp_path / "models"
    arrays, model = make_model(1)
    first = publish_model(folder, arrays, 1)
    line = LineService(watch=folder, interval=0.05)
    port, stop = line.start_in_thread()
    yield folder, port, line, {first: model}
    stop()


def test_requests_in_a_loop_while_three_models_are_written(service):
    folder, port, line, _ = service
    expected: dict[str, list[int]] = {}  # sha256 -> the classes that model gives WINDOWS
    written = [(1, *make_model(1)), (2, *make_model(2)), (3, *make_model(3)), (4, *make_model(4, num_classes=11))]
    for server_round, arrays, model in written[:1]:
        expected[line.slot.current.loaded.sha256] = classify(model, WINDOWS).classes.tolist()
    answers: list[tuple[int, dict]] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set():
            answers.append(diagnose(port))

    clients = [threading.Thread(target=client) for _ in range(3)]
    for thread in clients:
        thread.start()
    for server_round, arrays, model in written[1:]:  # three new models, the last with a grown head
        time.sleep(0.3)
        path = publish_model(folder, arrays, server_round)
        digest = (path.with_name(path.name + ".sha256")).read_text().split()[0]
        expected[digest] = classify(model, WINDOWS).classes.tolist()
    deadline = time.monotonic() + 10
    while line.slot.current.loaded.round != 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # some requests on the last model
    done.set()
    for thread in clients:
        thread.join()
    assert answers and all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:3]
    seen = {}
    for _, answer in answers:
        digest = answer["model"]["sha256"]
        assert digest in expected  # a written model, and no other
        # One whole model: the classes are exactly those the model of that digest gives.
        assert [p["class"] for p in answer["predictions"]] == expected[digest]
        seen[digest] = answer["model"]["round"]
    assert sorted(seen.values())[0] == 1 and sorted(seen.values())[-1] == 4
    metrics = get(port, "/metrics")
    assert "fedind_serve_model_round 4.0" in metrics
    assert f'fedind_serve_requests_total{{outcome="ok"}} {float(len(answers))}' in metrics
    assert "fedind_serve_model_swaps_total 4.0" in metrics
    assert "fedind_serve_request_seconds_count" in metrics
    model_info = json.loads(get(port, "/model"))
    assert model_info["round"] == 4 and model_info["classes"] == 11


def test_an_unverified_file_is_not_served(service):
    folder, port, line, _ = service
    before = line.slot.current.loaded.sha256
    arrays, _ = make_model(5)
    path = publish_model(folder, arrays, 5)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    torn = folder / model_file_name(6)
    torn.write_bytes(bytes(data))  # not published: a copy of round 5 with a flipped byte and round 5's digest
    torn.with_name(torn.name + ".sha256").write_text(path.with_name(path.name + ".sha256").read_text())
    deadline = time.monotonic() + 10
    while "fedind_serve_model_rejected_total 1.0" not in get(port, "/metrics") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "fedind_serve_model_rejected_total 1.0" in get(port, "/metrics")
    status, answer = diagnose(port)
    assert status == 200 and answer["model"]["round"] == 5  # the newest file that verifies
    assert answer["model"]["sha256"] != before
    no_digest = folder / model_file_name(7)
    no_digest.write_bytes(path.read_bytes())  # its .sha256 has not arrived: not yet
    time.sleep(0.3)
    assert diagnose(port)[1]["model"]["round"] == 5


def test_bad_requests_are_answered_with_the_model_and_the_fault(service):
    _, port, _, _ = service
    status, answer = post(port, "/diagnose", json.dumps({"windows": np.zeros((1, 2, 64)).tolist()}).encode())
    assert status == 422 and "2-channel windows, the model reads 1" in answer["error"]
    assert answer["model"]["round"] == 1
    status, answer = post(port, "/diagnose", b"not an array", "application/octet-stream")
    assert status == 422 and ".npy" in answer["error"]
    import io

    buffer = io.BytesIO()
    np.save(buffer, WINDOWS[0])  # one window [C, L]
    status, answer = post(port, "/diagnose", buffer.getvalue(), "application/octet-stream")
    assert status == 200 and len(answer["predictions"]) == 1
    assert 'fedind_serve_requests_total{outcome="bad_request"} 2.0' in get(port, "/metrics")


def test_a_service_without_a_model_says_so(tmp_path):
    line = LineService(watch=tmp_path, interval=0.05)
    port, stop = line.start_in_thread()
    try:
        assert diagnose(port)[0] == 503
        arrays, _ = make_model(1)
        publish_model(Path(tmp_path), arrays, 1)
        deadline = time.monotonic() + 10
        while line.slot.current is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert diagnose(port)[0] == 200
    finally:
        stop()
