"""Shared pytest fixtures."""

import logging
import os

# One thread per process for torch's OpenMP and for BLAS, in this process and in every
# process the tests start (plants' ClientApps, the SIGKILL child, Ray workers inherit the
# environment). The suite's models are tiny: on a shared 2-core machine OpenMP's spinning
# worker threads burned ~5x the CPU of the work itself (tests/test_training.py,
# test_ewc.py and test_faults.py: 69 s of CPU with 2 threads, 13 s with 1). Set before
# torch is imported; a value already in the environment is kept.
for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import pytest  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402


@pytest.fixture
def flower_task_identity(monkeypatch):
    """Messages stamp run/node/task ids from TaskIdentity, which a Flower runtime sets."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


@pytest.fixture
def flwr_log(caplog, monkeypatch):
    """caplog on Flower's logger, directly: Flower's simulation turns its propagation off."""
    logger = logging.getLogger("flwr")
    monkeypatch.setattr(logger, "propagate", False)  # each record reaches caplog once
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="flwr")
    yield caplog
    logger.removeHandler(caplog.handler)


# --------------------------------------------------------------------------- the suite's Ray batch
#
# Most federation tests run on the loopback runtime (fedind.loopback: the sites called in
# this process, no start-up). Flower's Simulation Runtime (Ray, a worker process per site)
# runs for the tests that use ``ray_runs`` (a local Ray start) or ``ray_cluster_run`` (a
# cluster started with ``ray start --head``): tests/ray_batch.py, in a process of its own
# started as soon as collection ends, so that it runs while the other tests do; those
# tests run near the end.

_RAY_BATCH: dict = {}  # "process", "out", "log", "parts"
_RAY_PARTS = {  # fixture -> (tests/ray_batch.py's part that serves it, the file that part writes)
    "ray_runs": ("batched", "ray_runs.json"),
    "ray_cluster_run": ("attached", "ray_cluster.json"),
}


def _start_ray_batch(config, parts=tuple(_RAY_PARTS)) -> None:
    """Start tests/ray_batch.py for the parts that ``parts`` (fixture names) need."""
    import subprocess
    import sys
    from pathlib import Path

    if _RAY_BATCH:
        return
    out = config._tmp_path_factory.mktemp("ray")
    log = open(out / "ray_batch.log", "wb")  # noqa: SIM115 - the child writes it; closed below
    try:
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("ray_batch.py")), str(out), *(_RAY_PARTS[p][0] for p in parts)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # its group: Ray's processes too
        )
    finally:
        log.close()
    _RAY_BATCH.update(process=process, out=out, log=out / "ray_batch.log", parts=list(parts))


def _stop_ray_batch() -> None:
    """Let the batch finish its clean-up if its results are all written (at most 60 s),
    else kill its process group and the Ray cluster it started, if it was up (a group of
    its own: ``OUT/ray_cluster.pgid``)."""
    import os
    import signal
    import subprocess

    process = _RAY_BATCH.get("process")
    if process is not None and process.poll() is None and all(
        (_RAY_BATCH["out"] / _RAY_PARTS[name][1]).exists() for name in _RAY_BATCH["parts"]
    ):
        try:  # its results are written: it is stopping its cluster and removing its files
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    if process is not None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    cluster = _RAY_BATCH["out"] / "ray_cluster.pgid" if _RAY_BATCH else None
    if cluster is not None and cluster.exists():
        try:
            os.killpg(int(cluster.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _ray_batch_file(request, timeout: float = 900.0):
    """The file of the fixture ``request`` serves (:data:`_RAY_PARTS`), once tests/ray_batch.py
    has written it (each part writes its file when it is done); the batch's log in the
    error if it exits without it."""
    import time

    _start_ray_batch(request.config, (request.fixturename,))  # normally started at the end of collection
    name = _RAY_PARTS[request.fixturename][1]
    process, path = _RAY_BATCH["process"], _RAY_BATCH["out"] / name
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None and not path.exists():  # again: it may have written it, then exited
            tail = _RAY_BATCH["log"].read_text(errors="replace")[-6000:]
            raise RuntimeError(f"tests/ray_batch.py exited with {process.returncode} without {name}:\n{tail}")
        if time.monotonic() > deadline:
            _stop_ray_batch()
            raise TimeoutError(f"tests/ray_batch.py did not write {name} in {timeout:.0f} s")
        time.sleep(0.2)
    return path


@pytest.fixture(scope="session")
def ray_runs(request) -> dict:
    """What tests/ray_batch.py's first part wrote: summaries of three runs in one Ray
    simulation (``simulate_many``): ``first`` and ``second`` (RAY_TOPK, the same config
    twice), ``encrypted`` (RAY_ENCRYPTED with a Paillier key pair, the ServerApp's process
    barred from the private key); ``configs`` (the RunConfig of each), ``run_dir`` and
    ``private_key_loads`` (attempts in the ServerApp's process: must stay [])."""
    import json
    from pathlib import Path

    from fedind.config import RunConfig

    runs = json.loads(_ray_batch_file(request).read_text())
    runs["configs"] = {name: RunConfig.from_flower(values) for name, values in runs["configs"].items()}
    runs["run_dir"] = Path(runs["run_dir"])
    return runs


@pytest.fixture(scope="session")
def ray_cluster_run(request) -> dict:
    """What tests/ray_batch.py's second part wrote (``ray_cluster.json``): a run attached to
    a Ray cluster started with ``ray start --head``, and where its sites ran."""
    import json

    return json.loads(_ray_batch_file(request).read_text())


# --------------------------------------------------------------------------- scenarios that start early
#
# The deployment tests (real SuperLink, SuperNodes, ``flwr run`` processes over TLS) spend
# most of their minutes waiting: for Flower to count a killed node offline (60 s), for a
# round-timeout, for processes to start. Each such test checks a step of a *scenario*
# (``@pytest.mark.scenario(run=fn, lane=...)``), and the scenarios start in threads as
# soon as collection ends — only those with a selected test — and run while the rest of
# the suite does; the tests that wait for them run last. A step's assertions are the
# test's, verbatim; a failed step fails its test with the step's own traceback.
# Scenarios of one ``lane`` run one after another in one thread and share its state (one
# plant: a SuperLink, registered keys, SuperNodes): fewer processes to start on 2 cores.
# Everything a scenario starts is stopped when its lane ends, and at the latest when the
# session ends (also on Ctrl-C).


class Scenario:
    """One scenario ``fn(scenario)``. ``fn`` wraps each checked part in ``with
    scenario.step(name) as notes:`` (what fails in it is kept for its test and the scenario
    goes on with the next part, as separate tests would; ``notes``: lines the test prints);
    a test calls :meth:`result` (name) to wait for that part and re-raise what failed in it.
    ``root``: the scenario's temporary folder; ``lane``: a dict shared with the scenarios
    of its lane (e.g. the plant of :meth:`lane_plant`)."""

    def __init__(self, fn, root, lane: dict) -> None:
        import threading

        self.fn, self.root, self.lane = fn, root, lane
        self.notes: dict[str, list[str]] = {}
        self._steps: dict[str, BaseException | None] = {}
        self._done = threading.Event()
        self._changed = threading.Condition()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self.fn(self)
        except BaseException as error:  # noqa: BLE001 - reported by the tests that wait for it
            self._error = error
        finally:
            with self._changed:
                self._done.set()
                self._changed.notify_all()

    def plant(self, root):
        """A new plant under ``root``, closed at the latest with the lane."""
        from deploy_harness import LocalPlant

        if self.lane.get("aborted"):
            raise RuntimeError("the test session is ending: no new plant")
        plant = LocalPlant(root)
        self.lane.setdefault("plants", []).append(plant)
        return plant

    def lane_plant(self, site_ids, seed: int):
        """The lane's plant, set up (README, Deployment, steps 1-3) by the first scenario
        that asks; it stays up for the next scenario of the lane."""
        if "plant" not in self.lane:
            plant = self.plant(self.root / "plant")
            plant.set_up(site_ids, seed=seed)
            self.lane["plant"] = plant
        return self.lane["plant"]

    def step(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def recorded():
            self.notes.setdefault(name, [])
            try:
                yield self.notes[name]
            except Exception as error:  # the test of this step reports it; the scenario goes on
                self._record(name, error)
            else:
                self._record(name, None)

        return recorded()

    def _record(self, name: str, error: BaseException | None) -> None:
        with self._changed:
            self._steps[name] = error
            self._changed.notify_all()

    def result(self, name: str, timeout: float = 1200.0) -> list[str]:
        """Wait for step ``name``; re-raise its failure; return its notes (lines to print)."""
        with self._changed:
            if not self._changed.wait_for(lambda: name in self._steps or self._done.is_set(), timeout):
                raise TimeoutError(f"scenario {self.fn.__name__}: step {name!r} not done after {timeout:.0f} s")
        if name not in self._steps:
            if self._error is not None:
                raise self._error
            raise RuntimeError(f"scenario {self.fn.__name__} ended without step {name!r}")
        if self._steps[name] is not None:
            raise self._steps[name]
        return self.notes.get(name, [])


class Lane:
    """Scenarios run one after another in a thread; their plants are closed at the end."""

    def __init__(self, name: str) -> None:
        import threading

        self.name, self.state = name, {}
        self.scenarios: list[Scenario] = []
        self._thread = threading.Thread(target=self._run, name=f"lane-{name}", daemon=True)

    def _run(self) -> None:
        try:
            for scenario in self.scenarios:
                scenario.run()
        finally:
            self.close()

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def close(self) -> None:
        for plant in self.state.get("plants", []):
            plant.close()

    def abort(self, timeout: float = 60.0) -> None:
        self.state["aborted"] = True  # no new plant; a closed plant starts no process
        if self._thread.is_alive():
            self.close()  # the running scenario fails fast: its processes are gone
            self._thread.join(timeout)
            self.close()  # what it started meanwhile, if anything


_SCENARIOS: dict = {}  # scenario function -> Scenario
_LANES: dict[str, Lane] = {}


def _marker(item):
    marker = item.get_closest_marker("scenario")
    return marker.kwargs if marker is not None else None


def _scenario(config, run, lane: str | None = None) -> Scenario:
    """The Scenario of ``run``, created (not started) in its lane (its own if None)."""
    if run not in _SCENARIOS:
        lane = _LANES.setdefault(lane or run.__name__, Lane(lane or run.__name__))
        root = config._tmp_path_factory.mktemp(run.__name__.removesuffix("_scenario")[:30])
        _SCENARIOS[run] = Scenario(run, root, lane.state)
        lane.scenarios.append(_SCENARIOS[run])
    return _SCENARIOS[run]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "scenario(run=fn, lane=None): the test checks a step of fn, a scenario run in a thread from the end of "
        "collection (tests/conftest.py); scenarios of one lane run one after another and share a plant",
    )


def _ray_fixtures(item) -> set[str]:
    """The fixtures of tests/ray_batch.py that test ``item`` uses."""
    return set(_RAY_PARTS) & set(getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config, items):
    """Tests that wait for tests/ray_batch.py, then those that wait for a scenario, go last:
    the suite runs while the batch and the scenarios do."""
    items.sort(key=lambda item: 2 if _marker(item) is not None else int(bool(_ray_fixtures(item))))  # stable


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    for item in session.items:
        skipped = item.get_closest_marker("skip") is not None or any(
            bool(m.args[0]) for m in item.iter_markers("skipif") if m.args and isinstance(m.args[0], bool)
        )
        if (marker := _marker(item)) is not None and not skipped:
            _scenario(session.config, marker["run"], marker.get("lane"))
    for lane in _LANES.values():
        lane.start()
    needed = [name for name in _RAY_PARTS if any(name in _ray_fixtures(item) for item in session.items)]
    if needed:
        _start_ray_batch(session.config, needed)


def pytest_sessionfinish(session):
    for lane in _LANES.values():
        lane.abort()
    _stop_ray_batch()


@pytest.fixture
def scenario(request) -> Scenario:
    """The :class:`Scenario` of this test's ``scenario(run=fn, lane=...)`` marker."""
    marker = _marker(request.node)
    if marker is None:
        raise RuntimeError("the scenario fixture needs @pytest.mark.scenario(run=fn)")
    run = marker["run"]
    if run not in _SCENARIOS:  # not started at the end of collection: alone, in a lane of its own
        _scenario(request.config, run, f"{run.__name__}-late")
        _LANES[f"{run.__name__}-late"].start()
    return _SCENARIOS[run]
