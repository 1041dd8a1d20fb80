"""Continual learning at the site: its replay buffer across phases and the EWC penalty of
a train message (the server's half is :class:`fedind.server.continual.PhaseController`).

Site state (``context.state``, saved across restarts by :func:`fedind.site.state.state_mod`):
ArrayRecord ``replay-buffer`` (:meth:`ReplayBuffer.state_dict`) and ConfigRecord
``replay-meta`` (``offered-phase``: a phase-end query seen twice offers its batch once).
"""

from __future__ import annotations

import zlib

import torch
from flwr.app import ConfigRecord, Context, Message

from .. import wire
from ..records import array_record
from ..config import RunConfig
from ..data.format import SiteArrays
from .ewc import EWCPenalty
from .expansion import HEAD_WEIGHT, pad_head_rows
from .phases import replay_capacity, restore_replay
from .replay import ReplayBuffer

REPLAY_STATE = "replay-buffer"  # context.state ArrayRecord: ReplayBuffer.state_dict()
REPLAY_META = "replay-meta"  # context.state ConfigRecord: {"offered-phase": int}


def replay_seed(config: RunConfig, site_id: str) -> int:
    return (config.seed * 1_000_003 + zlib.crc32(site_id.encode()) * 7 + 17) % 2**31


def load_replay(
    context: Context, config: RunConfig, site_id: str, batch: SiteArrays, num_classes: int
) -> ReplayBuffer | None:
    """The site's replay buffer, bounded for a site whose current batch is ``batch``; None
    with replay off or while the bound is below one window."""
    if not config.replay_samples:
        return None
    state = None
    if REPLAY_STATE in context.state:
        state = {name: array.numpy() for name, array in context.state[REPLAY_STATE].items()}
    offered = int(state["seen"].sum()) if state is not None else 0
    capacity = replay_capacity(config.replay_samples, config.replay_share, offered + batch.num_examples)
    if capacity < 1:
        return None
    return restore_replay(
        state,
        max_samples=capacity,
        max_bytes=config.replay_bytes,
        sample_shape=batch.sample_shape,
        num_classes=num_classes,
        policy=config.replay_policy,
        seed=replay_seed(config, site_id),
    )


def save_replay(context: Context, buffer: ReplayBuffer, offered_phase: int) -> None:
    state = buffer.state_dict()
    context.state[REPLAY_STATE] = array_record(state)
    context.state[REPLAY_META] = ConfigRecord({"offered-phase": int(offered_phase)})


def offered_phase(context: Context) -> int:
    """The last phase whose batch the site offered to its buffer (-1: none)."""
    return int(context.state[REPLAY_META]["offered-phase"]) if REPLAY_META in context.state else -1


def replay_metrics(buffer: ReplayBuffer | None, batch: SiteArrays) -> dict[str, int]:
    """What the buffer holds, and the windows the site has had (offered + current batch)."""
    offered = buffer.seen if buffer is not None else 0
    return {
        wire.REPLAY_SAMPLES: len(buffer) if buffer is not None else 0,
        wire.REPLAY_BYTES: buffer.nbytes if buffer is not None else 0,
        wire.WINDOWS_SEEN: offered + batch.num_examples,
    }


def received_penalty(
    msg: Message, config: RunConfig, model: torch.nn.Module | None = None, num_classes: int | None = None
) -> EWCPenalty | None:
    """The EWC penalty of a train message (None before the first phase end or with λ = 0).
    Records consolidated before the head grew to ``num_classes`` get zero rows for the new
    classes (F = 0: nothing to hold there), so the server need not send them again. With
    ``ewc-anchor = global`` the anchors are ``model``'s parameters as received (the round's
    global model): local training is held near where the federation is, along the
    coordinates earlier phases taught most, and the server sends no anchors."""
    records = msg.content.array_records
    lam = config.ewc_lambda_at(int(msg.content[wire.CONFIG].get(wire.SERVER_ROUND, 1)))
    if not lam or wire.EWC_FISHER not in records:
        return None
    fisher = {name: a.numpy() for name, a in records[wire.EWC_FISHER].items()}
    if num_classes is not None and HEAD_WEIGHT in fisher and fisher[HEAD_WEIGHT].shape[0] < num_classes:
        fisher = pad_head_rows(fisher, num_classes)
    if config.ewc_anchor == "global":
        if model is None:
            raise ValueError("ewc-anchor = global needs the received model")
        params = dict(model.named_parameters())
        anchors = {name: params[name].detach().cpu().numpy().copy() for name in fisher if name in params}
    else:
        anchors = {name: a.numpy() for name, a in records[wire.EWC_ANCHORS].items()}
        if num_classes is not None and HEAD_WEIGHT in anchors and anchors[HEAD_WEIGHT].shape[0] < num_classes:
            anchors = pad_head_rows(anchors, num_classes)
    return EWCPenalty(fisher, anchors, lam)


def pad_residuals(context: Context, key: str, num_classes: int) -> None:
    """Grow the head rows of an ArrayRecord in ``context.state`` (top-k error-feedback
    residuals) with zeros when the model's head grew."""
    if key not in context.state:
        return
    arrays = {name: a.numpy() for name, a in context.state[key].items()}
    rows = arrays.get("head.bias")
    if rows is not None and rows.shape[0] < num_classes:
        padded = pad_head_rows(arrays, num_classes)
        context.state[key] = array_record(padded)
