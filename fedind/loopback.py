"""An in-process loopback Grid: every message goes straight to a ClientApp in this process.

:class:`LoopbackGrid` is a ``flwr.serverapp.Grid`` for tests and benchmarks that need the
server's round logic (strategies, screening, metering, checkpoints, continual learning)
but not Flower's runtime: no Ray, no SuperLink, no worker processes, no polling. The sites
run one after another, in the order the messages were sent.

What it keeps of the real runtimes (so that :func:`fedind.server.app.run_server`,
:mod:`fedind.server.rounds` and :class:`fedind.server.metering.MeteredGrid` work unchanged):

* **Nodes and contexts.** One ``Context`` per simulated node, as Flower's Simulation
  Runtime makes them: ``node_config`` ``{"partition-id": i, "num-partitions": n}``, a
  ``state`` RecordDict that persists across the node's messages, the ``run_config`` given
  (``{}`` by default, as ``run_simulation`` gives one). Node ids are large and distinct
  like Flower's, but deterministic and increasing with the partition id, so that a
  strategy sampling ``sorted(node_ids)`` picks the same partitions in every run. (Flower
  draws them at random at every start: a Ray run with ``fraction-train`` < 1 samples other
  sites after each Ray start, and its model differs from one start to the next; measured
  with fedprox, 4 sites, fraction-train 0.5. Runs that train every site are unaffected.)
* **Message metadata.** ``push_messages`` stamps a fresh message id on each instruction,
  as Flower's grids do; the ClientApp builds its reply with ``reply_to`` (src/dst node
  ids, ``reply_to_message_id``, group id); the reply gets its own message id.
* **Errors.** An exception in the ClientApp becomes an error reply as on a SuperNode
  (``flwr.supernode.runtime.run_clientapp``): ``Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
  reason="<class '...'>:<'message'>")``, logged at ERROR with the traceback; the node's
  context is then left as it was before the message (Flower does not update it either).
* **Copies.** With ``serialize=True`` (default) every instruction and every reply goes
  through Flower's protobuf serialization (``message_to_proto`` / ``message_from_proto``,
  the bytes a deployment sends), and the node's context through ``context_to_proto`` and
  back: nothing the site keeps aliases the server's objects or the other way round, as
  across Ray's pickling or gRPC. The byte counts :class:`fedind.server.metering.MeteredGrid`
  reports (``recorddict_to_proto(content).ByteSize()``) are those of the real runtimes.
* **A process per side.** A site in Ray or on a SuperNode has its own random generators
  and its own torch thread count. Around each ClientApp call the grid saves and restores
  the server's ``random``, ``numpy.random`` and torch generator states, and runs the site
  with ``client_threads`` torch threads (1, as a Ray actor with ``num_cpus=1`` gets:
  Ray sets ``OMP_NUM_THREADS`` to the actor's CPUs). With that, a run is bit for bit the
  run of Flower's Simulation Runtime (``fedind.simulation.simulate(runtime="ray")``) for
  the same seed on CPU (checked by tests/test_simulation.py).
* **Timeouts.** Sites run one after another, so a round-timeout cannot cut a site short;
  instead each site is timed on its own, as if all ran at once: a reply that took longer
  than the ``timeout`` of ``send_and_receive`` is dropped (the server sees no reply, as
  with a late reply in Flower).

What it does not model: concurrency between sites, transport failures, node churn
(every node is always connected), message TTLs, heartbeats.
"""

from __future__ import annotations

import copy
import random
import time
import traceback
from collections.abc import Iterable, Mapping
from logging import ERROR, WARNING
from uuid import uuid4

import numpy as np
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.logger import log
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from .wire import stamp_message_id

PARTITION_ID_KEY = "partition-id"
NUM_PARTITIONS_KEY = "num-partitions"


def loopback_node_ids(num_nodes: int, seed: int = 0) -> list[int]:
    """``num_nodes`` distinct 63-bit node ids, ascending (partition i gets the i-th), never
    Flower's reserved 0 or SuperLink id 1. Drawn from their own generator: the global
    ``random`` the server seeds is not touched."""
    rng = random.Random(f"fedind.loopback:{seed}")
    ids: set[int] = set()
    while len(ids) < num_nodes:
        node_id = rng.getrandbits(63)
        if node_id > SUPERLINK_NODE_ID:
            ids.add(node_id)
    return sorted(ids)


class _ServerRandomness:
    """Save the server's generator states (``random``, ``numpy.random``, torch CPU) and its
    torch thread count on entry, set ``threads`` torch threads, put everything back on exit:
    the site in between acts as if it were in a process of its own."""

    def __init__(self, threads: int | None) -> None:
        self._threads = threads

    def __enter__(self) -> None:
        self._states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self._saved_threads = torch.get_num_threads()
        if self._threads is not None and self._threads != self._saved_threads:
            torch.set_num_threads(self._threads)

    def __exit__(self, *exc) -> None:
        python_state, numpy_state, torch_state = self._states
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if torch.get_num_threads() != self._saved_threads:
            torch.set_num_threads(self._saved_threads)


def _copy_message(message: Message, serialize: bool) -> Message:
    if serialize:
        return message_from_proto(ProtoMessage.FromString(message_to_proto(message).SerializeToString()))
    return copy.deepcopy(message)


def _copy_context(context: Context, serialize: bool) -> Context:
    if serialize:
        return context_from_proto(context_to_proto(context))
    return copy.deepcopy(context)


def error_reply(message: Message, ex: BaseException) -> Message:
    """The reply a SuperNode sends when its ClientApp raises ``ex`` handling ``message``."""
    reason = str(type(ex)) + ":<'" + str(ex) + "'>"
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)


class LoopbackGrid(Grid):
    """A Grid whose nodes are ``client_app`` called in this process (module docstring).

    ``num_nodes`` simulated nodes; ``run_config`` each node context's run config;
    ``node_configs`` extra node-config entries per partition (merged over partition-id and
    num-partitions); ``client_threads`` torch threads for a site (None: leave as is);
    ``serialize`` copy every message and context through protobuf.
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        *,
        run_id: int = 1_000_001,
        run_config: Mapping | None = None,
        node_configs: list[Mapping] | None = None,
        client_threads: int | None = 1,
        serialize: bool = True,
        seed: int = 0,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"a loopback grid needs at least one node, got {num_nodes}")
        if node_configs is not None and len(node_configs) != num_nodes:
            raise ValueError(f"{len(node_configs)} node configs for {num_nodes} nodes")
        self.client_app = client_app
        self.serialize = serialize
        self.client_threads = client_threads
        self._run = Run.create_empty(run_id=run_id)
        self._run.primary_task_id = 1
        self._node_ids = loopback_node_ids(num_nodes, seed)
        self.contexts: dict[int, Context] = {}
        for partition, node_id in enumerate(self._node_ids):
            node_config = {PARTITION_ID_KEY: partition, NUM_PARTITIONS_KEY: num_nodes}
            if node_configs is not None:
                node_config.update(node_configs[partition])
            self.contexts[node_id] = Context(
                run_id=run_id,
                node_id=node_id,
                node_config=node_config,
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
        self._pending: dict[str, Message] = {}  # message id -> instruction (as the node receives it)
        self.messages_delivered = 0

    # ------------------------------------------------------------------ Grid

    def set_run(self, run: Run) -> None:
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run

    @property
    def run(self) -> Run:
        return Run(**vars(self._run))

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Stamp a message id on each message (as Flower's grids do) and queue it for its
        node; a message to a node that does not exist is not queued (no id returned)."""
        ids = []
        for message in messages:
            stamp_message_id(message, str(uuid4()))
            metadata = message.metadata
            if metadata.reply_to_message_id or metadata.ttl <= 0:
                raise ValueError(f"Invalid message: {message}")
            if metadata.dst_node_id not in self.contexts:
                log(ERROR, "loopback grid: no node %s; message %s dropped", metadata.dst_node_id, metadata.message_id)
                continue
            self._pending[metadata.message_id] = _copy_message(message, self.serialize)
            ids.append(metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Deliver the queued messages among ``message_ids`` (in push order) and return the
        replies; each message is delivered once."""
        return [reply for reply, _ in self._deliver(message_ids)]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        replies = []
        for reply, seconds in self._deliver(ids):
            if timeout is not None and seconds > timeout:
                log(
                    WARNING, "loopback grid: node %s took %.1f s, more than the timeout of %.1f s; reply dropped",
                    reply.metadata.src_node_id, seconds, timeout,
                )
                continue
            replies.append(reply)
        return replies

    # ------------------------------------------------------------------ delivery

    def _deliver(self, message_ids: Iterable[str]) -> list[tuple[Message, float]]:
        wanted = set(message_ids)
        out = []
        for message_id in [i for i in self._pending if i in wanted]:  # push order
            message = self._pending.pop(message_id)
            started = time.monotonic()
            reply = self._call(message)
            out.append((reply, time.monotonic() - started))
        return out

    def _call(self, message: Message) -> Message:
        node_id = message.metadata.dst_node_id
        context = _copy_context(self.contexts[node_id], self.serialize)
        try:
            with _ServerRandomness(self.client_threads):
                reply = self.client_app(message, context)
            if not isinstance(reply, Message):
                raise TypeError(f"the ClientApp returned a {type(reply).__name__}, not a Message")
            if reply.metadata.reply_to_message_id != message.metadata.message_id:
                raise ValueError("the ClientApp's reply does not answer the message (create it with reply_to=message)")
            self.contexts[node_id] = context  # kept only when the ClientApp succeeded, as in Flower
        except Exception as ex:  # pylint: disable=broad-exception-caught
            log(ERROR, "ClientApp raised an exception: %s", ex)
            log(ERROR, traceback.format_exc())
            reply = error_reply(message, ex)
        stamp_message_id(reply, str(uuid4()))
        self.messages_delivered += 1
        return _copy_message(reply, self.serialize)


class task_identity:  # noqa: N801 - used as a context manager, like a function
    """Set Flower's ``TaskIdentity`` (what ``Message(...)`` stamps as run id, source node and
    task) as a ServerApp sees it — run ``run_id``, the SuperLink's node id — and put the
    previous values back on exit. Flower's runtimes set it for their ServerApp process;
    an in-process run without a runtime must set it itself."""

    def __init__(self, run_id: int, task_id: int = 1) -> None:
        self._values = {"_run_id": run_id, "_node_id": SUPERLINK_NODE_ID, "_task_id": task_id}

    def __enter__(self) -> None:
        self._saved = {name: getattr(TaskIdentity, name) for name in self._values}
        for name, value in self._values.items():
            setattr(TaskIdentity, name, value)

    def __exit__(self, *exc) -> None:
        for name, value in self._saved.items():
            setattr(TaskIdentity, name, value)
