"""Paillier-encrypted aggregation in Flower, the server's half: the reply check and a Strategy
wrapper. The site's half (client mod, decrypt-query handler) is :mod:`fedind.paillier.site`;
the maths is :mod:`fedind.paillier.packing`.

One round with ``encryption = "paillier"``::

    site    train -> delta = w_local - w_global (all arrays, sorted names, flattened)
            -> clip + fixed point + packed Paillier ciphertexts -> ConfigRecord
               ``encrypted-update`` (no ArrayRecord: no plaintext weights leave the site)
    server  decode each reply once (fedind.server.pipeline: format, key fingerprint, count, clip, sizes, every ciphertext
            in [1, n^2)): a bad one becomes an error reply, logged and counted in failures
            -> the inner strategy's site weights w_i (num-examples, or DWA's KL weights
            from the label histograms) -> integers k_i, sum K = 512
            -> prod_i c_i^k_i mod n^2 = Enc(sum_i k_i m_i)  (public key only)
            -> QUERY message ``encrypted-aggregate`` to one site (rotating each round)
    site    decrypt (CRT), check the sum is one honest sites can produce (every slot in
            range, guard bits and padding clear: fedind.paillier.packing.sum_fault), reply
            ArrayRecord ``aggregate`` = the weighted mean delta (float32), or the error
            ``sum-out-of-range``: with two such answers the round is refused, its model kept
    server  one synthetic reply ``w_global + mean delta`` with the summed num-examples and
            the weighted scalar metrics -> the inner strategy's aggregate_train (server
            momentum, FedAdam, DWA's momentum restart all act on the aggregate as usual)

Sparse encrypted rounds (``compression = "topk"``): ``configure_train`` adds the round's
coordinate set ``I_t`` (``paillier-set`` record: :func:`fedind.paillier.sparse.announced_set`
from the last global change and/or a seed, never from anything per site) to every train
instruction; each site encrypts its values on ``I_t`` only (its residual keeps the rest); a
payload naming another set or carrying another number of values is refused like any bad
ciphertext; the decrypted mean on ``I_t``, times ``topk-gain``, is scattered into a dense
delta (zero elsewhere) for the wrapped strategy.

The server never loads a private key (:func:`fedind.paillier.keys.load_public_key` refuses one);
it learns the round's weighted mean update, never a single site's. An aggregate of fewer
than two sites is not decrypted (it would be that site's update).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from .. import wire
from ..aggregation.weighting import GlobalHistogram, dwa_weights, padded_histogram_state
from ..config import DWA_STRATEGIES, ConfigError, RunConfig
from ..paillier.keys import KeyFileError, PublicKey, load_public_key
from ..paillier.packing import (
    FINE, MIN_SITES, SIDE, SIDE_CLIP, CiphertextError, EncryptedVector, Layout, integer_weights, weighted_sum,
)
from ..continual.expansion import HEAD_BIAS, HEAD_WEIGHT
from ..paillier.sparse import SET_RULES, announced_set, head_rows, indices_to_bytes, set_digest
from ..paillier.sums import SIDE_SUM, flatten, parse_side, unflatten
from .metering import site_id_of
from ..topk.selection import warmup_ratio
from .pipeline import Rejected, ReplyPipeline, SiteUpdate, decode_reply, update_of
from .strategies import build_strategy, edit_strategy_state, load_strategy_state, strategy_state
from .screening import InvalidUpdate as InvalidReply

REJECTED_CIPHERTEXT = wire.REJECTED_CIPHERTEXT  # the code's table: fedind.wire
DECRYPT_ATTEMPTS = 3  # sites asked in turn when a decrypt query fails
OUT_OF_RANGE_QUORUM = 2  # decrypting sites that must find the sum out of range to refuse the round


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class SparseRounds:
    """How a sparse encrypted round's set is chosen: ``k = round(warmup_ratio(ratio, t,
    warmup_rounds) * N)`` coordinates by ``rule`` (:data:`~fedind.paillier.sparse.SET_RULES`)
    with ``seed``; the decrypted mean is scaled by ``gain`` (as ``topk-gain``)."""

    ratio: float
    warmup_rounds: int
    rule: str
    seed: int
    gain: float

    def __post_init__(self) -> None:
        if self.rule not in SET_RULES:
            raise ValueError(f"Invalid rule value: {self.rule!r} (expected one of {SET_RULES})")
        if not (0 < self.ratio <= 1 and self.gain > 0 and self.warmup_rounds >= 0):
            raise ValueError(f"Invalid sparse rounds: {self!r}")


def flat_model(arrays: ArrayRecord) -> np.ndarray:
    """All arrays, sorted by name, flattened (float64): the order the sites encrypt in."""
    return flatten({name: a.numpy() for name, a in arrays.items()}, _shapes(arrays))


def _shapes(arrays: ArrayRecord) -> dict[str, tuple]:
    return {name: tuple(a.shape) for name, a in arrays.items()}


class SecureAggregation(Strategy):
    """Wraps a strategy so that it aggregates encrypted updates it cannot read.

    The wrapped strategy configures every round as usual and receives, per round, ONE reply
    holding ``w_global + sum_i (k_i/K) delta_i`` (the decrypted weighted mean) with the
    summed ``num-examples``: its weighted average of one reply is that reply, and server
    momentum / FedAdam / DWA's momentum restart act on the aggregate exactly as in a plain
    run. The site weights are computed here, before the sum: ``n_i / N``, or for DWA with
    ``weighting`` the KL weights of :func:`fedind.aggregation.weighting.dwa_weights` over a
    :class:`~fedind.aggregation.weighting.GlobalHistogram` kept here (the wrapped DWA is built with
    weighting off, since it sees one reply).
    """

    follows_grown_head = True  # fedind.server.strategies.edit_strategy_state: pass num_classes on

    def __init__(
        self,
        strategy: Strategy,
        key: PublicKey,
        clip: float,
        *,
        timeout: float,
        dwa: Mapping | None = None,
        num_classes: int | None = None,
        sparse: SparseRounds | None = None,
        layout: Layout = FINE,
    ) -> None:
        super().__init__()
        if not isinstance(key, PublicKey):
            raise TypeError("SecureAggregation takes the PUBLIC key only")
        self.strategy = strategy
        self.key = key
        self.clip = float(clip)
        self.layout = layout
        self.timeout = float(timeout)
        self.dwa = dict(dwa) if dwa else None  # {"temperature": T, "floor": f} for DWA weights
        self.num_classes = num_classes
        self.global_histogram = GlobalHistogram(num_classes) if self.dwa and num_classes else None
        self.grid: Grid | None = None
        self.arrays: ArrayRecord | None = None
        self.train_config: ConfigRecord | None = None
        self.instructions: dict[int, Message] = {}
        self.sparse = sparse
        self.coordinates: np.ndarray | None = None  # this round's announced set (sparse rounds)
        self._last_global: np.ndarray | None = None  # the model sent last round (flat), for the change
        self.refused_rounds = 0  # rounds whose sum was out of range (a site encrypted out-of-range values)
        self.holder_rows_from: int | None = None  # young rows, averaged over their holders (average_over_holders)

    def summary(self) -> None:
        log(INFO, "\t├──> Paillier-encrypted aggregation:")
        log(INFO, "\t│\t├── Public key: %d bits, fingerprint %s…", self.key.bits, self.key.fingerprint[:16])
        log(INFO, "\t│\t├── Packing: %d values per ciphertext (%d-bit slots, %d-bit levels), clip %s, up to %d sites",
            self.layout.slots(self.key), self.layout.slot_bits, self.layout.value_bits, self.clip,
            self.layout.max_weight)
        log(INFO, "\t│\t├── Site weights: %s", "DWA (KL of label histograms)" if self.dwa else "num-examples")
        if self.sparse is None:
            log(INFO, "\t│\t└── Coordinates: all (dense)")
        else:
            log(INFO, "\t│\t└── Coordinates: announced set of %s of the model per round (%s), gain %s",
                self.sparse.ratio, self.sparse.rule, self.sparse.gain)
        self.strategy.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self.grid, self.arrays, self.train_config = grid, arrays, config
        self.instructions = {m.metadata.dst_node_id: m for m in messages}
        if self.sparse is not None:
            record = self._announce(server_round, arrays)
            for message in messages:
                message.content[wire.PAILLIER_SET] = record
        if self.holder_rows_from is not None:
            holders = ConfigRecord({wire.HOLDER_ROWS_FROM: self.holder_rows_from})
            for message in messages:
                message.content[wire.HOLDER_ROWS] = holders
        return messages

    def _young_rows(self, arrays: ArrayRecord) -> tuple[np.ndarray, np.ndarray]:
        """Flat indices of the young classes' head rows and the class of each (none: empty)."""
        if self.holder_rows_from is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return head_rows(_shapes(arrays), (HEAD_WEIGHT, HEAD_BIAS), self.holder_rows_from)

    def _announce(self, server_round: int, arrays: ArrayRecord) -> ConfigRecord:
        """The round's coordinate set (from the last global change and the seed only)."""
        flat = flat_model(arrays)
        last = self._last_global
        change = flat - last if last is not None and last.size == flat.size else None
        self._last_global = flat
        k = max(1, int(round(warmup_ratio(self.sparse.ratio, server_round, self.sparse.warmup_rounds) * flat.size)))
        self.coordinates = announced_set(self.sparse.rule, server_round, int(flat.size), k,
                                         seed=self.sparse.seed, last_change=change)
        young, _ = self._young_rows(arrays)
        if young.size:  # a young class's rows: what its holders must be able to send
            self.coordinates = np.union1d(self.coordinates, young)
        digest = set_digest(self.coordinates, int(flat.size), server_round)
        return ConfigRecord({wire.SET_INDICES: indices_to_bytes(self.coordinates), wire.SET_DIGEST: digest})

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.arrays is None or self.grid is None:
            raise RuntimeError("SecureAggregation: configure_train must run before aggregate_train")
        updates = self._valid(server_round, list(replies))
        if len(updates) < MIN_SITES:
            log(
                WARNING,
                "encrypted round %d: %d valid update(s); an aggregate of fewer than %d sites is not "
                "decrypted (it would reveal a site's update): the global model stays",
                server_round, len(updates), MIN_SITES,
            )
            return None, None
        weights = self._weights(updates)
        try:
            integers = integer_weights(weights, self.layout.max_weight)
            aggregate = weighted_sum([u.change for u in updates], integers, self.key)
        except CiphertextError as err:
            log(WARNING, "encrypted round %d: refused to aggregate: %s", server_round, err)
            return None, None
        mean = self._decrypt(server_round, aggregate, updates)
        if mean is None:
            return None, None
        if self.sparse is not None:  # the mean on the announced set, scattered into a dense delta
            dense = np.zeros(self._last_global.size, dtype=np.float32)
            dense[self.coordinates] = mean * np.float32(self.sparse.gain)
            mean = dense
        mean = self._over_holders(mean, updates, integers)
        arrays, metrics = self.strategy.aggregate_train(server_round, [self._as_reply(updates, mean)])
        if metrics is not None:
            metrics.pop(wire.CONFLICT_SHARE, None)  # per-site signs are hidden: not measured
            if wire.DWA_WEIGHT_MIN in metrics:
                metrics[wire.DWA_WEIGHT_MIN] = float(np.min(weights))
                metrics[wire.DWA_WEIGHT_MAX] = float(np.max(weights))
        return arrays, metrics

    def _over_holders(self, mean: np.ndarray, updates: list[SiteUpdate], integers: list[int]) -> np.ndarray:
        """The young classes' rows of the decrypted mean turned into means over their holders.
        Each site scaled its rows of class ``c`` by its share ``p_i(c)`` of windows of ``c``
        (:func:`fedind.paillier.site.paillier_mod`), so the mean holds ``sum_i w_i p_i(c) d_ic``;
        divided by ``sum_i w_i p_i(c)`` (the weights and histograms are the server's) it is
        :func:`fedind.aggregation.weighting.class_row_scales`' average over the holders, as DWA's
        ``young-rows = holders`` in the clear. A class no site holds this round stays as summed."""
        young, classes = self._young_rows(self.arrays)
        if not young.size or any(u.histogram is None for u in updates):
            return mean
        w = np.asarray(integers, dtype=np.float64) / sum(integers)
        shares = np.array([np.asarray(u.histogram, np.float64) / max(sum(u.histogram), 1) for u in updates])
        mass = w @ shares  # per class: sum_i w_i p_i(c)
        held = mass[classes] > 0
        out = mean.copy()
        out[young[held]] = (mean[young[held]] / mass[classes[held]]).astype(np.float32)
        return out

    # ------------------------------------------------------------------ edits of the global model

    def average_over_holders(self, first: int | None) -> None:
        """From the next round, the head rows of classes ``first`` on are averaged over the
        sites that hold each (``young-rows = holders``: :meth:`_over_holders`); None: none."""
        self.holder_rows_from = first

    def follow_global_model(self, arrays: ArrayRecord, edit=None, num_classes: int | None = None) -> None:
        """The server edited the global model (a grown head, calibration): the wrapped strategy
        follows it (:func:`fedind.server.strategies.edit_strategy_state`), and a grown head pads
        the label histograms that the DWA weights are computed from."""
        edit_strategy_state(self.strategy, arrays, edit, num_classes)
        if num_classes is None or num_classes == self.num_classes:
            return
        self.num_classes = num_classes
        if self.global_histogram is not None:
            grown = GlobalHistogram(num_classes)
            grown.load_state_dict(padded_histogram_state(self.global_histogram.state_dict(), num_classes))
            self.global_histogram = grown

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        return self.strategy.aggregate_evaluate(server_round, replies)

    # ------------------------------------------------------------------ steps

    def _valid(self, server_round: int, replies: list[Message]) -> list[SiteUpdate]:
        """The round's typed updates (the pipeline's; decoded here only without one) that
        carry ciphertexts, one per site id."""
        num_classes = self.num_classes if self.global_histogram is not None else None
        decode = lambda r: decode_reply(self.instructions.get(r.metadata.src_node_id), r, self.arrays,  # noqa: E731
                                        num_classes=num_classes, cipher=(self.key, self.clip, self.layout))
        updates: list[SiteUpdate] = []
        seen: set[str] = set()
        for reply in replies:
            if reply.has_error():
                log(WARNING, "encrypted round %d: node %d failed: %s", server_round,
                    reply.metadata.src_node_id, reply.error.reason)
                continue
            try:
                update = update_of(reply, decode)
            except Rejected as err:
                log(WARNING, "encrypted round %d: dropped the reply of node %d: %s",
                    server_round, reply.metadata.src_node_id, err)
                continue
            if not update.has_update:
                log(INFO, "encrypted round %d: site %s trained on no windows; it carries no weight",
                    server_round, update.site_id)
            elif update.site_id in seen:
                log(WARNING, "encrypted round %d: dropped the reply of site %s (node %d): another reply of this "
                    "round already came from this site id", server_round, update.site_id, update.node_id)
            else:
                seen.add(update.site_id)
                updates.append(update)
        return updates

    def _weights(self, updates: list[SiteUpdate]) -> np.ndarray:
        n = np.array([u.num_examples for u in updates], dtype=np.float64)
        if self.global_histogram is None or any(u.histogram is None for u in updates):
            return n / n.sum()
        for u in updates:
            self.global_histogram.update(u.site_id, u.histogram)
        return dwa_weights(
            n, [u.histogram for u in updates], self.global_histogram.distribution(),
            temperature=self.dwa["temperature"], floor=self.dwa["floor"],
        )

    def _decrypt(self, server_round: int, aggregate: EncryptedVector, updates: list[SiteUpdate]) -> np.ndarray | None:
        """The round's decrypted weighted mean delta (:meth:`_decrypted`), or None."""
        return self._decrypted(f"encrypted round {server_round}", server_round, aggregate,
                               [(u.node_id, u.site_id) for u in updates])

    def _decrypted(self, what: str, rotation: int, aggregate: EncryptedVector, senders: list[tuple[int, str]],
                   side: bool = False) -> np.ndarray | None:
        """Ask key-holding sites among ``senders`` (node, site) in turn, starting at ``rotation``,
        to decrypt the sum (``side``: a side sum, :mod:`fedind.paillier.sums`). When
        :data:`OUT_OF_RANGE_QUORUM` of them find it out of range (or fewer, and no other one
        decrypts it), it is refused and counted: a site lied, which one the sum cannot tell."""
        query = {wire.RUN_CONFIG: str(self.train_config[wire.RUN_CONFIG])}
        if side:
            query[wire.SUM_OF] = SIDE_SUM
        content = RecordDict(
            {
                wire.ENCRYPTED_AGGREGATE: ConfigRecord(aggregate.to_config(self.key)),
                wire.CONFIG: ConfigRecord(query),
            }
        )
        nodes = [node for node, _ in senders]
        start = (rotation - 1) % len(nodes)
        out_of_range: list[str] = []
        for node in (nodes[(start + i) % len(nodes)] for i in range(min(DECRYPT_ATTEMPTS, len(nodes)))):
            message = Message(content=content, message_type=MessageType.QUERY, dst_node_id=node)
            answers = list(self.grid.send_and_receive([message], timeout=self.timeout))
            try:
                if not answers:
                    raise InvalidReply("no answer (timeout)")
                return self._check_mean(answers[0], aggregate.count, SIDE_CLIP if side else self.clip)
            except InvalidReply as err:
                log(WARNING, "%s: node %d did not decrypt the aggregate: %s", what, node, err)
                if answers and answers[0].has_error() and answers[0].error.code == wire.SUM_OUT_OF_RANGE:
                    out_of_range.append(answers[0].error.reason)
                    if len(out_of_range) == OUT_OF_RANGE_QUORUM:
                        break
        if out_of_range:
            self.refused_rounds += 1
            log(
                WARNING,
                "%s: refused the aggregate: %d decrypting site(s) found a sum honest sites cannot "
                "produce (%s); one of the sites %s encrypted out-of-range values, which one cannot be known (no "
                "single update is ever decrypted); %s (%d sum(s) refused so far)",
                what, len(out_of_range), out_of_range[0], sorted(site for _, site in senders),
                "it is left out" if side else "the global model stays", self.refused_rounds,
            )
            return None
        log(WARNING, "%s: no site decrypted the aggregate; %s", what,
            "it is left out" if side else "the global model stays")
        return None

    def side_mean(self, what: str, rotation: int, parts: list[tuple[Message, Mapping, float]], count: int
                  ) -> tuple[np.ndarray, list[tuple[Message, Mapping, float]]] | None:
        """The weighted mean of the sites' encrypted side vectors (:mod:`fedind.paillier.sums`;
        ``parts``: reply, its payload, its weight such as its windows), decrypted by one of
        them, and the parts in it; None (logged) when fewer than :data:`MIN_SITES` valid
        payloads came or no site decrypted the sum. A malformed payload is logged and left out."""
        vectors, used = [], []
        for part in parts:
            try:
                vectors.append(parse_side(part[1], self.key, count))
            except CiphertextError as err:
                log(WARNING, "%s: dropped the encrypted payload of site %s: %s", what, site_id_of(part[0]), err)
                continue
            used.append(part)
        weights = [weight for _, _, weight in used]
        if len(vectors) < MIN_SITES or not sum(weights) > 0:
            log(WARNING, "%s: %d valid encrypted payload(s); a sum of fewer than %d sites is not decrypted "
                "(it would reveal a site's)", what, len(vectors), MIN_SITES)
            return None
        aggregate = weighted_sum(vectors, integer_weights(weights, SIDE.max_weight), self.key)
        senders = [(reply.metadata.src_node_id, site_id_of(reply)) for reply, _, _ in used]
        mean = self._decrypted(what, rotation, aggregate, senders, side=True)
        return None if mean is None else (mean, used)

    def _check_mean(self, answer: Message, count: int, clip: float) -> np.ndarray:
        if answer.has_error():
            raise InvalidReply(answer.error.reason)
        record = answer.content.array_records.get(wire.AGGREGATE)
        if record is None or set(record) != {"mean"}:
            raise InvalidReply(f"expected ArrayRecord {wire.AGGREGATE!r} with one array 'mean'")
        mean = record["mean"].numpy()
        if mean.dtype != np.float32 or mean.shape != (count,):
            raise InvalidReply(f"mean is {mean.dtype}{list(mean.shape)}, expected float32[{count}]")
        if not np.all(np.isfinite(mean)) or np.abs(mean).max(initial=0) > clip * (1 + 1e-6):
            raise InvalidReply(f"mean has non-finite values or values beyond the clip {clip}")
        return mean

    def _as_reply(self, updates: list[SiteUpdate], mean: np.ndarray) -> Message:
        """One reply holding ``w_global + mean``, the summed num-examples and the scalar
        metrics every site sent, averaged by num-examples (as Flower's FedAvg)."""
        current = {name: self.arrays[name].numpy() for name in self.arrays}
        steps = unflatten(mean, _shapes(self.arrays))
        arrays = {name: Array((value.astype(np.float64) + steps[name]).astype(value.dtype))
                  for name, value in current.items()}
        keys = set.intersection(*({k for k, v in u.metrics.items() if not isinstance(v, list)} for u in updates))
        records = [RecordDict({wire.METRICS: MetricRecord({k: u.metrics[k] for k in keys})}) for u in updates]
        metrics = aggregate_metricrecords(records, wire.NUM_EXAMPLES)
        metrics[wire.NUM_EXAMPLES] = float(sum(u.num_examples for u in updates))
        metrics["paillier-sites"] = len(updates)
        if self.coordinates is not None:
            metrics["paillier-coordinates"] = int(self.coordinates.size)
        content = RecordDict({wire.ARRAYS: ArrayRecord({n: arrays[n] for n in self.arrays}), wire.METRICS: metrics})
        return Message(content, reply_to=self.instructions[updates[0].node_id])

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {
            "global_histogram": None if self.global_histogram is None else self.global_histogram.state_dict(),
            "strategy": strategy_state(self.strategy),  # e.g. FedAvgM's momentum, DWA's buffers
            "refused_rounds": self.refused_rounds,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`; a checkpoint from before ``refused_rounds`` starts its count at 0."""
        keys = {"global_histogram", "strategy"}
        if not isinstance(state, Mapping) or not keys <= set(state) <= keys | {"refused_rounds"}:
            raise ValueError("Invalid SecureAggregation state: expected keys ['global_histogram', 'strategy', "
                             "'refused_rounds']")
        refused = state.get("refused_rounds", 0)
        if type(refused) is not int or refused < 0:
            raise ValueError(f"Invalid SecureAggregation state: refused_rounds {refused!r}")
        if (state["global_histogram"] is None) != (self.global_histogram is None):
            raise ValueError("Invalid SecureAggregation state: global histogram does not match the weighting")
        load_strategy_state(self.strategy, state["strategy"])
        if self.global_histogram is not None:
            self.global_histogram.load_state_dict(state["global_histogram"])
        self.refused_rounds = refused


def encrypted_server(
    config: RunConfig, num_sites: int, num_classes: int
) -> tuple[SecureAggregation, ReplyPipeline]:
    """The strategy and reply pipeline (each ciphertext parsed and range-checked once,
    :func:`fedind.server.pipeline.decode_reply`) of an encrypted run; ConfigError (naming the key) when
    the public key cannot be used or the federation does not fit the encryption."""
    if not config.paillier_public_key:
        raise ConfigError(
            "encryption = 'paillier' needs run config paillier-public-key: create a key pair with "
            "`fedind keys paillier --out DIR`, give the server DIR/paillier.pub and every site DIR/paillier.key"
        )
    try:
        key = load_public_key(config.paillier_public_key)
    except KeyFileError as err:
        raise ConfigError(f"Invalid run config paillier-public-key: {err}") from None
    layout = Layout.of(config)
    per_round = max(1, round(config.fraction_train * num_sites))
    if per_round < MIN_SITES or num_sites > layout.max_weight:
        raise ConfigError(
            f"encryption = 'paillier' needs {MIN_SITES} to {layout.max_weight} sites per round (paillier-weight-bits "
            f"= {layout.weight_bits}); this federation has {num_sites} sites, {per_round} sampled per round "
            f"(num-sites / fraction-train / data-root)"
        )
    dwa = None
    inner_config = config
    if config.strategy in DWA_STRATEGIES and config.dwa_weighting:
        dwa = {"temperature": config.dwa_temperature, "floor": config.dwa_floor}
        inner_config = replace(config, dwa_weighting=False)  # it sees one reply: weights here
    inner = build_strategy(inner_config, num_sites, num_classes)
    sparse = None
    if config.compression == "topk":
        sparse = SparseRounds(config.paillier_set_ratio, config.topk_warmup_rounds, config.paillier_coordinates,
                              config.seed, config.paillier_gain)
    strategy = SecureAggregation(
        inner, key, config.paillier_clip, timeout=config.round_timeout, dwa=dwa, num_classes=num_classes,
        sparse=sparse, layout=layout,
    )
    return strategy, ReplyPipeline(num_classes, cipher=(key, config.paillier_clip, layout))
