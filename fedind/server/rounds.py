"""The round loop: Flower's ``Strategy.start``, able to begin at any round.

Flower 1.42's ``Strategy.start`` always counts rounds from 1, so a run resumed from a
checkpoint could not tell the strategy (FedAdam's bias correction) or the sites (cosine
learning rate, top-k warm-up) which round it is. This loop makes the same calls in the same
order (configure_train, send_and_receive, aggregate_train, configure_evaluate,
send_and_receive, aggregate_evaluate, evaluate_fn), starting at ``first_round``, and adds two
things a plant needs: a round with fewer than ``min_sites`` successful replies leaves the
global model unchanged, ``after_round`` runs after every round (the checkpoint), and the
aggregate keeps the global model's dtypes (:func:`in_dtypes_of`).

Two optional hooks serve continual learning (:mod:`fedind.continual.phases`): ``train_records``
adds records to every train message of a round (EWC Fisher and anchors, the young
classes to refit), and ``end_of_round`` sees the round's train replies right after
aggregation and may replace the global arrays (a grown classifier head, refitted rows) or
talk to the sites (the phase-end query) before the round is scored and checkpointed; the
strategy then steps from the replaced arrays (:func:`fedind.server.strategies.adopt_global_model`).

``serve`` turns each round's global arrays into the model that is scored and published
(:mod:`fedind.server.serving`: an average of the last global models, calibrated after the
last round); the sites go on training from the global arrays, which ``after_round`` checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from .strategies import adopt_global_model


def in_dtypes_of(arrays: ArrayRecord, reference: ArrayRecord) -> ArrayRecord:
    """``arrays`` with each array cast to the dtype of ``reference``'s array of the same name
    (names only in ``arrays`` keep theirs); ``arrays`` itself when nothing differs.

    A strategy's step can promote dtypes: Flower's FedAdam multiplies by a numpy float64
    scalar, which under NumPy 2 turns float32 weights into float64. Sent on, that model made
    every site's float32 reply fail the server's dtype check from round 2 on, and the run froze.
    """
    dtypes = {name: array.dtype for name, array in reference.items()}
    if all(dtypes.get(name, array.dtype) == array.dtype for name, array in arrays.items()):
        return arrays
    return ArrayRecord(
        {
            name: Array(np.ascontiguousarray(array.numpy().astype(dtypes.get(name, array.dtype), copy=False)))
            for name, array in arrays.items()
        }
    )


def run_rounds(
    strategy: Strategy,
    grid: Grid,
    arrays: ArrayRecord,
    *,
    first_round: int,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None],
    min_sites: int = 1,
    after_round: Callable[[int, ArrayRecord], None] | None = None,
    train_records: Callable[[int], Mapping[str, ArrayRecord | ConfigRecord]] | None = None,
    end_of_round: Callable[[int, ArrayRecord, list[Message]], ArrayRecord] | None = None,
    serve: Callable[[int, ArrayRecord], ArrayRecord] | None = None,
) -> ArrayRecord:
    """Run rounds ``first_round .. num_rounds`` from global ``arrays``; return the last round's
    served model (the global arrays without ``serve``; ``arrays`` when no round runs).

    ``evaluate_fn(0, arrays)`` scores the starting model only when ``first_round == 1``
    (a resumed run scored it before the crash)."""
    log(INFO, "Starting %s strategy at round %d of %d", type(strategy).__name__, first_round, num_rounds)
    strategy.summary()
    if first_round == 1:
        evaluate_fn(0, arrays)
    served = arrays
    for server_round in range(first_round, num_rounds + 1):
        log(INFO, "")
        log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
        messages = list(strategy.configure_train(server_round, arrays, train_config, grid))
        extra = train_records(server_round) if train_records is not None else {}
        for message in messages:
            for name, record in extra.items():
                message.content[name] = record
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        arrived = sum(not reply.has_error() for reply in replies)
        if arrived < min_sites:
            log(
                WARNING,
                "round %d: %d site update(s) arrived, fewer than min-sites = %d; the global model is unchanged",
                server_round, arrived, min_sites,
            )
        else:
            new_arrays, _ = strategy.aggregate_train(server_round, replies)
            if new_arrays is not None:
                arrays = in_dtypes_of(new_arrays, arrays)
        if end_of_round is not None:
            edited = end_of_round(server_round, arrays, replies)
            if edited is not arrays:  # the strategy steps from the edited model next round
                adopt_global_model(strategy, edited)
            arrays = edited
        served = serve(server_round, arrays) if serve is not None else arrays
        evaluate_replies = grid.send_and_receive(
            strategy.configure_evaluate(server_round, served, ConfigRecord(), grid), timeout=timeout
        )
        strategy.aggregate_evaluate(server_round, evaluate_replies)
        evaluate_fn(server_round, served)
        if after_round is not None:
            after_round(server_round, arrays)
    return served
