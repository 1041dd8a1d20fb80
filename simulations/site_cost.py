"""A site agent's per-message cost, stage by stage: before (a git commit), after (this checkout,
the agent in the per-message process) and relay (this checkout, the message handed to a warm
site worker: fedind.site.relay, fedind.site.worker).

Flower 1.42 starts one ``flwr-clientapp`` process per message, so everything from process
start to the first training step is paid every round. Each sample here is such a fresh
process (this file with ``--child``, fedind imported from the tree under test), timed from
just before the parent starts it:

    interpreter       until the child's first line runs
    flwr imports      what ``flwr-clientapp`` imports before it loads an app
    app import        ``import fedind.site.app`` (relay: ``import client.app``, the relay)
    hand-off          relay only: the message and context to the worker until its app starts
    data load         the site's data folder (``load_site_data``)
    model build       the global model from the message (``receive_model``)
    local score       the received model on the site's test split (``evaluate_known``)
    conditioning      the front end on the training windows (computed, or the site's cache)
    other             the rest until the first training step (e.g. optimiser set-up)
    → first step      process start until the first step's backward pass begins
    message done      the reply is built (site agent's mods included)
    process end       the process has exited (interpreter shutdown included)

The message is a round-1 train message with the pyproject's run config (model-width 32,
1 local epoch, as ``simulations/deployment_load.py``), through the whole ClientApp (mods
included), with ``data-dir`` and ``state-dir`` in the node config. Before, after and relay
alternate, after one unmeasured warm-up each (which also fills the after-tree's cache and
warms the worker). The relay's worker is this file with ``--worker`` (the stages timed there
as in the child; its marks go to a file the parent reads), started before the first sample;
its "cpu to message done" adds the worker's CPU for the message to the child's.

    python simulations/site_cost.py                          # --baseline 2ba926a --repeats 5
    python simulations/site_cost.py --baseline main --repeats 9

Writes ``--out``/results.json and results.md; the stage functions are wrapped with timers
in the child (they run as always).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("interpreter", "flwr imports", "app import", "hand-off", "data load", "model build", "local score", "conditioning",
          "other")
WORKED = STAGES[4:8]  # the stages timed around the agent's functions
MARKS = ("first step", "message done", "process end")


# --------------------------------------------------------------------------- child: one message


def _child(args: argparse.Namespace) -> None:
    """One train message in this fresh process; prints {stage: seconds} as JSON."""
    marks = {"interpreter": time.time() - args.t0}
    cpu0 = time.process_time()
    spent: dict[str, float] = {}

    def lap(name: str, since: float) -> None:
        marks[name] = time.time() - args.t0 - since

    start = time.time() - args.t0
    import flwr.supernode.runtime.run_clientapp  # noqa: F401  (flwr-clientapp's own imports)

    lap("flwr imports", start)
    start = time.time() - args.t0
    if args.relay:
        import client.app as agent
        import fedind
    else:
        import fedind

        agent = importlib.import_module(_agent_module())

    lap("app import", start)
    if not Path(fedind.__file__).resolve().is_relative_to(Path(args.tree).resolve()):
        raise SystemExit(f"fedind came from {fedind.__file__}, not from {args.tree}")
    if args.relay:  # the message as flwr-clientapp has it: parsed from protobuf (no torch here)
        from flwr.common.serde import message_from_proto
        from flwr.proto.message_pb2 import Message as ProtoMessage
        from flwr.supercore.task_identity import TaskIdentity

        from fedind.wire import stamp_message_id  # the tree's fedind (imported above), before the clock starts

        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 7, 1
        handler_start = time.time()
        message = message_from_proto(ProtoMessage.FromString(Path(args.message).read_bytes()))
        stamp_message_id(message, message.object_id)
        agent.app(message, _context(args))
        marks["message done"] = time.time() - args.t0
        worker = json.loads((Path(args.state) / "worker" / "marks.jsonl").read_text().splitlines()[-1])
        marks.update({k: worker[k] for k in WORKED})
        marks["hand-off"] = worker["started"] - handler_start
        marks["first step"] = worker["first step"] - args.t0
        marks["other"] = worker["first step"] - worker["started"] - sum(worker[k] for k in WORKED)
        marks["cpu to message done"] = time.process_time() - cpu0 + worker["cpu"]
        print("SITE_COST " + json.dumps(marks), flush=True)
        return
    first_step = _instrument(spent)
    handler_start = time.time() - args.t0
    agent.app(_message(args), _context(args))
    marks["message done"] = time.time() - args.t0
    marks.update(spent)
    marks["first step"] = first_step["time"] - args.t0
    marks["other"] = marks["first step"] - handler_start - sum(spent.get(s, 0.0) for s in WORKED)
    marks["cpu to message done"] = time.process_time() - cpu0
    print("SITE_COST " + json.dumps(marks), flush=True)


def _instrument(spent: dict) -> dict:
    """Wrap the agent's stage functions with timers (into ``spent``) and torch's backward
    (the first call's wall time into the returned dict). They run as always. The agent is
    imported first: it sets OMP_WAIT_POLICY before torch loads (the worker's case)."""
    agent = importlib.import_module(_agent_module())
    import torch
    from fedind import training

    def timed(module, name: str, stage: str) -> None:
        inner = getattr(module, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[stage] = spent.get(stage, 0.0) + time.perf_counter() - t

        setattr(module, name, wrapper)

    timed(agent, "load_site_data", "data load")
    timed(agent, "receive_model", "model build")
    timed(agent, "evaluate_known", "local score")
    timed(training, "_split_front_end", "conditioning")
    if hasattr(agent, "cached_conditioning"):
        timed(agent, "cached_conditioning", "conditioning")
    backward = torch.Tensor.backward
    first: dict = {}

    def first_backward(self, *a, **k):
        first.setdefault("time", time.time())
        return backward(self, *a, **k)

    torch.Tensor.backward = first_backward
    return first


def _agent_module() -> str:
    """The site agent's module in the tree imported: fedind.site.app, or the flat
    ``clientapp.py`` of the package before the package moves (e.g. at 2ba926a)."""
    old = ".".join(("fedind", "clientapp"))  # a module of older trees only
    return "fedind.site.app" if importlib.util.find_spec("fedind.site") else old


def _worker(args: argparse.Namespace) -> None:
    """The relay's site worker, its stages timed per message into ``folder``/marks.jsonl."""
    from fedind.site import worker

    spent: dict[str, float] = {}
    first = _instrument(spent)
    run_app = worker.run_app

    def timed_run_app(message, context):
        spent.clear()
        first.clear()
        started, cpu = time.time(), time.process_time()
        try:
            return run_app(message, context)
        finally:
            line = {"started": started, "first step": first.get("time", float("nan")), "cpu": time.process_time() - cpu}
            with open(Path(args.folder) / "marks.jsonl", "a") as f:
                f.write(json.dumps(line | {k: spent.get(k, 0.0) for k in WORKED}) + "\n")

    worker.run_app = timed_run_app
    worker.main(["--folder", args.folder, "--idle", "3600"])


def _run_config(tree: Path) -> dict:
    """The run config of ``tree``'s pyproject (an older tree knows fewer keys)."""
    import tomllib

    config = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    static = {"phases": 1, "phase-rounds": 0, "replay-samples": 0, "ewc-lambda": 0.0, "head-calibration": False}  # as deployment_load.py
    return config | static | {"model-width": 32, "local-epochs": 1, "run-name": "site-cost"}


def _message(args: argparse.Namespace):
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedind import wire
    from fedind.config import RunConfig
    from fedind.models import initial_state

    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 7, 1  # what flwr-clientapp sets
    config = RunConfig.from_flower(_run_config(Path(args.tree)))
    state = initial_state(config.seed, 1, 10, config.model_width)
    content = RecordDict({
        wire.ARRAYS: ArrayRecord({k: torch.from_numpy(v) for k, v in state.items()}),
        wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(config.to_flower()), wire.SERVER_ROUND: 1}),
    })
    return Message(content, message_type=MessageType.TRAIN, dst_node_id=7)


def _context(args: argparse.Namespace):
    from flwr.app import Context, RecordDict

    node = {"data-dir": args.site, "state-dir": args.state}
    return Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})


# --------------------------------------------------------------------------- parent


def sample(tree: Path, site: Path, state: Path, relay: Path | None = None) -> dict:
    """One fresh process of ``tree``'s site agent (or its relay, the message read from the
    file ``relay``) answering one train message."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--tree", str(tree), "--site", str(site), "--state", str(state),
         "--t0", repr(t0), *(["--relay", "--message", str(relay)] if relay else [])],
        capture_output=True, text=True, env=env, cwd=tree, timeout=600,
    )
    end = time.time() - t0
    line = next((x for x in done.stdout.splitlines() if x.startswith("SITE_COST ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"site agent of {tree} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("SITE_COST ")) | {"process end": end}


def export_commit(ref: str, folder: Path) -> Path:
    """The tracked files of git commit ``ref`` of this checkout, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def start_worker(state: Path) -> subprocess.Popen:
    """This checkout's site worker for ``state`` (timed: :func:`_worker`), once it listens."""
    folder = state / "worker"
    folder.mkdir(mode=0o700, parents=True)
    log = open(folder / "worker.log", "ab")  # noqa: SIM115 - the worker writes it
    process = subprocess.Popen([sys.executable, __file__, "--worker", "--folder", str(folder)], stdout=log,
                               stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    log.close()
    deadline = time.monotonic() + 300
    while not (folder / "worker.pid").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the site worker did not start:\n{(folder / 'worker.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return process


def median_of(samples: list[dict]) -> dict:
    return {k: statistics.median(s.get(k, 0.0) for s in samples) for k in (*STAGES, *MARKS, "cpu to message done")}


def markdown(summary: dict, args: argparse.Namespace) -> str:
    before = summary["before"]
    lines = [
        f"Median of {args.repeats} fresh processes each; one round-1 train message, {args.samples_per_site} windows "
        f"of {args.window} samples, model-width 32, 1 local epoch; {os.cpu_count()} CPU cores; "
        f"load average {summary['load'][0]:.1f} before, {summary['load'][1]:.1f} after.",
        "",
        f"| stage | before ({args.baseline}) | after, in-process | after, relay to a warm worker |",
        "|---|---|---|---|",
    ]

    def cell(value: float, base: float) -> str:
        return f"{value:.3f} s" + (f" ({value / base:.0%})" if base > 0.005 else "")

    for key in (*STAGES, *MARKS, "cpu to message done"):
        name = f"**{key}**" if key == "first step" else key
        lines.append(f"| {name} | {before[key]:.3f} s | {cell(summary['after'][key], before[key])} "
                     f"| {cell(summary['relay'][key], before[key])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="2ba926a", help="git commit of the 'before' code")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples-per-site", type=int, default=40)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("runs/site-cost"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--site", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--message", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    if args.worker:
        return _worker(args)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="fedind-site-cost-") as tmp:
        work = Path(tmp)
        trees = {"before": export_commit(args.baseline, work / "before"), "after": REPO}
        subprocess.run(
            [sys.executable, "-m", "fedind", "data", "generate", "--out", str(work / "data"), "--sites", "1",
             "--samples-per-site", str(args.samples_per_site), "--window", str(args.window), "--alpha", "1.0",
             "--seed", "1"],
            check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        site = next((work / "data" / "sites").iterdir())
        samples: dict[str, list[dict]] = {"before": [], "after": [], "relay": []}
        from flwr.common.serde import message_to_proto

        message = work / "message.pb"
        args.tree = str(REPO)
        message.write_bytes(message_to_proto(_message(args)).SerializeToString())
        worker = start_worker(work / "state-relay")
        try:
            for i in range(args.repeats + 1):  # round 0: warm-up (page cache, .pyc, the after-tree's cache, the worker)
                for name, tree in (*trees.items(), ("relay", REPO)):
                    s = sample(tree, site, work / f"state-{name}", relay=message if name == "relay" else None)
                    if i:
                        samples[name].append(s)
                    print(f"{name:6s} #{i}: first step {s['first step']:.2f} s, process end {s['process end']:.2f} s"
                          f"{' (warm-up)' if not i else ''}", flush=True)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
    summary = {name: median_of(s) for name, s in samples.items()}
    summary["load"] = load + [os.getloadavg()[0]]
    summary["first_step_ratio"] = summary["after"]["first step"] / summary["before"]["first step"]
    summary["relay_first_step_ratio"] = summary["relay"]["first step"] / summary["before"]["first step"]
    args.out.mkdir(parents=True, exist_ok=True)
    hidden = ("child", "tree", "site", "state", "t0", "relay", "worker", "folder", "message")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in hidden}
    (args.out / "results.json").write_text(json.dumps({"config": config, "summary": summary, "samples": samples}, indent=2))
    table = markdown(summary, args)
    (args.out / "results.md").write_text(table)
    print(table)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
