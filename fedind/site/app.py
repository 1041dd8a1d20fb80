"""The site agent: a Flower ClientApp that trains the global model on one line's data.

Hyperparameters come from the run config the server sends with each message, so the
agent behaves the same under ``flwr run``, ``run_simulation`` and a deployed SuperNode.
Where the data is comes from the node config: ``data-dir`` (deployment, one site's folder)
or ``partition-id`` / ``num-partitions`` (simulation). With ``serve-dir`` in the node config
the agent also publishes each round's model into that folder, for the line's
``fedind serve --watch`` (:func:`publish_for_line`: with ``served-ema`` the same average of
the global models that the server scores).
"""

from __future__ import annotations

import os
import resource
import time

# Flower starts a process per message; on a shared host (ten agents on two cores) torch's
# OpenMP threads spinning while they wait cost more CPU than the work: a round of ten sites
# took 35 s of wall time with spinning threads, 23 s with sleeping ones. Read by libgomp when
# torch loads, so set before the import; a value in the environment is kept. Same numbers.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from .. import wire
from ..records import array_record, numpy_arrays
from ..config import RunConfig
from ..continual.calibration import agreeing, class_moments, encode_moments, moments_vector
from ..continual.phases import classes_seen, evaluate_known, known, propose_new_rows
from ..continual.site import (
    load_replay,
    offered_phase,
    pad_residuals,
    received_penalty,
    replay_metrics,
    save_replay,
)
from ..data.format import DataFormatError, SiteArrays
from ..data.sources import SiteData, site_from_dir, site_from_partition
from ..topk.downlink import downlink_mod
from ..continual.ewc import diagonal_fisher, focus
from ..models import FaultCNN
from ..aggregation.averaging import ema_step
from ..edge.publish import SERVE_DIR_KEY, publish_received
from ..training import (
    cosine_lr, pick_device, prior_logit_adjustment, sample_losses, train_local, trained_label_counts,
    window_features,
)
from .cache import cached_conditioning
from .state import NODE_CONFIG_KEY as STATE_DIR_KEY
from .state import run_scope_mod, state_mod
from ..topk.uplink import RESIDUALS, topk_mod

def run_config_of(msg: Message) -> RunConfig:
    return RunConfig.from_json(str(msg.content[wire.CONFIG][wire.RUN_CONFIG]))


def load_site_data(context: Context, config: RunConfig, phase: int = 0) -> SiteData:
    """The site's data of ``phase`` (its newest batch then; phase 0 with static data)."""
    node = context.node_config
    if "data-dir" in node:
        return site_from_dir(str(node["data-dir"]), str(node.get("site-id", "")), phase)
    if config.data_root:
        spec = None
    else:
        spec = config.drift_spec() if config.phases > 1 else config.federation_spec()
    return site_from_partition(spec, config.data_root, int(node["partition-id"]), int(node["num-partitions"]), phase)


def receive_model(msg: Message, site: SiteData, config: RunConfig) -> FaultCNN:
    """The global model of ``msg``. With static data a label beyond its head is a data
    error; with phases it is a new class: the site leaves it out and reports it."""
    model = FaultCNN.from_state_dict(msg.content[wire.ARRAYS].to_torch_state_dict())
    num_classes = model.head.out_features
    for split in (site.train, site.test):
        if config.phases == 1 and split is not None and split.y.max() >= num_classes:
            raise DataFormatError(
                f"site {site.site_id}: label {int(split.y.max())} but the global model has "
                f"{num_classes} classes"
            )
    return model


def publish_for_line(msg: Message, context: Context, config: RunConfig, model_round: int,
                     as_sent: bool = False) -> None:
    """With ``serve-dir`` in the node config, publish a model for the line's service
    (:func:`fedind.edge.publish.publish_received`: written once per distinct file,
    atomically, digest file last; a failure is a logged warning, never the message's).

    With ``served-ema`` the line gets what the server scores: the same average of the global
    models (:func:`line_average`), kept by the site since the server sends only the global
    model. ``as_sent`` (the final evaluate message: the server's own served model,
    calibrated where that is on) publishes the message's model as it is. The untrained
    starting model (round 0) is not published. Without the key nothing is computed."""
    folder = context.node_config.get(SERVE_DIR_KEY)
    if not folder or model_round < 1:
        return
    received = numpy_arrays(msg.content[wire.ARRAYS])
    if not as_sent and config.served_ema > 0:
        received = line_average(context, received, model_round, config.served_ema)
        if received is None:  # this round's model is folded in and published already
            return
    publish_received(str(folder), received, model_round)


SERVED_AVERAGE, SERVED_ROUND = "served-average", "served-average-round"  # context.state records


def line_average(context: Context, model: dict[str, np.ndarray], model_round: int,
                 decay: float) -> dict[str, np.ndarray] | None:
    """Fold the global model of ``model_round`` into the line's average in ``context.state``
    (saved across restarts by :mod:`fedind.site.state`) and return it; None when that
    round is folded in already (a phase end and the next train message carry the same model).

    The server folds every round's global model (:func:`fedind.aggregation.averaging.ema_step`);
    a line that took part in every round holds the very same average (dense downlink). For
    ``k`` rounds missed, the old average keeps ``decay ** k``: the missed models are
    stood in for by the newest, the nearest estimate the line has."""
    folded = int(context.state[SERVED_ROUND]["round"]) if SERVED_ROUND in context.state else 0
    if model_round <= folded:
        return None
    average = None
    if SERVED_AVERAGE in context.state:
        average = numpy_arrays(context.state[SERVED_AVERAGE])
    average = ema_step(average, model, decay ** (model_round - folded))
    context.state[SERVED_AVERAGE] = array_record(average)  # a 0-d array stays 0-d, or the average would restart
    context.state[SERVED_ROUND] = ConfigRecord({"round": int(model_round)})
    return average


def _state(model: torch.nn.Module) -> ArrayRecord:
    return ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})


def refit_from(msg: Message, num_classes: int) -> int:
    """The first class whose row the server asks holders to refit (``num_classes``: none)."""
    value = msg.content.config_records.get(wire.NEW_CLASSES, {}).get(wire.REFIT_FROM)
    valid = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= num_classes
    return value if valid else num_classes


def announced_masks(msg: Message, model: torch.nn.Module, config: RunConfig) -> dict[str, torch.Tensor] | None:
    """In a sparse encrypted round with ``paillier-train-set``: each parameter's coordinates
    on the round's announced set, the only ones the site trains (None: train everything).
    Training on the set puts the whole update where the sum can carry it, instead of leaving
    most of it in the residual (docs/encryption.md). The Paillier mod has checked the set."""
    if not (config.encryption == "paillier" and config.compression == "topk" and config.paillier_train_set):
        return None
    from ..paillier.site import announced
    from ..paillier.sparse import coordinate_masks

    shapes = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    indices, _ = announced(msg, sum(int(np.prod(shape)) for shape in shapes.values()))
    masks = coordinate_masks(indices, shapes)
    return {name: torch.from_numpy(masks[name]) for name, _ in model.named_parameters()}


def train(msg: Message, context: Context) -> Message:
    config = run_config_of(msg)
    server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
    site = load_site_data(context, config, config.phase_of(server_round))
    device = pick_device(config.device)
    model = receive_model(msg, site, config)
    publish_for_line(msg, context, config, server_round - 1)  # the global model after the previous round
    num_classes = model.head.out_features
    # New classes (phases > 1) wait until the head has them; classes-seen tells the server.
    train_data = known(site.train, num_classes)
    seen = classes_seen(site.train, site.test) if config.phases > 1 else num_classes
    # Classes the head lacks, and the phase's young classes (the server's refit-from): propose
    # their rows, fitted on the model as received (fedind.continual.phases).
    first = min(num_classes, refit_from(msg, num_classes))
    buffer = load_replay(context, config, site.site_id, train_data, num_classes)
    replay = buffer.arrays() if buffer is not None else None
    proposal = None
    if seen > first and np.any(site.train.y >= first):  # replayed: counter-examples if the line has none
        proposal = propose_new_rows(model, site.train, seen, config.logit_adjustment, device, first=first,
                                    replayed=replay)
    seed = config.site_seed(site.site_id, server_round)
    torch.manual_seed(seed)
    histogram = np.bincount(train_data.y, minlength=num_classes)
    replay_ratio = config.replay_ratio if replay is not None else 0.0
    adjustment = None
    if train_data.num_examples and config.logit_adjustment:  # the prior of what the loss sees: new windows and replayed ones
        replayed = buffer.class_counts() if buffer is not None else None
        trained = trained_label_counts(histogram, replayed, replay_ratio)
        adjustment = prior_logit_adjustment(trained, config.logit_adjustment)
    if config.compression == "topk":  # the error-feedback residuals follow a grown head
        pad_residuals(context, RESIDUALS, num_classes)
    # With a state-dir, the front end's output comes from the site's verified cache: a fresh
    # process per message need not recompute it (fedind.site.cache; same numbers).
    state_dir = context.node_config.get(STATE_DIR_KEY)
    cached = state_dir and train_data.num_examples
    conditioned = cached_conditioning(str(state_dir), model, train_data.x, device) if cached else None
    started = time.process_time()
    # A line whose windows are all of classes the head lacks trains nothing this round, but
    # still replies (0 examples, the model as received): its classes-seen and proposed rows
    # are how the server learns of the new class.
    if train_data.num_examples:
        train_local(
            model,
            train_data,
            epochs=config.local_epochs,
            batch_size=config.batch_size,
            lr=cosine_lr(config.learning_rate, config.lr_progress(server_round)),
            seed=seed,
            device=device,
            proximal_mu=float(msg.content[wire.CONFIG].get("proximal-mu", 0.0)),
            momentum=config.local_momentum,
            logit_adjustment=adjustment,
            replay=replay,
            replay_ratio=replay_ratio,
            penalty=received_penalty(msg, config, model, num_classes),
            grad_clip=config.local_grad_clip,
            stretch=config.local_stretch_at(server_round),
            conditioned=conditioned,
            trainable=announced_masks(msg, model, config),
        )
    # What the server reads every round, and the site's cost. The replay buffer changes only
    # at phase ends: its figures ride the phase-end and final replies (docs/compression.md).
    metrics = MetricRecord(
        {
            wire.NUM_EXAMPLES: train_data.num_examples,
            wire.LABEL_HISTOGRAM: [int(c) for c in histogram],
            wire.TRAIN_SECONDS: time.process_time() - started,
            wire.PEAK_RSS_MB: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )
    if config.phases > 1:
        metrics[wire.CLASSES_SEEN] = seen
    content = RecordDict(
        {wire.ARRAYS: _state(model), wire.METRICS: metrics, wire.SITE: ConfigRecord({wire.SITE_ID: site.site_id})}
    )
    if proposal is not None:
        rows, biases, counts = proposal
        content[wire.NEW_CLASSES] = ConfigRecord(
            {wire.NEW_ROWS: [float(v) for v in np.concatenate([rows.ravel(), biases])],
             wire.NEW_COUNTS: [int(c) for c in counts]}
        )
    return Message(content=content, reply_to=msg)


def evaluate_global(msg: Message, context: Context) -> Message:
    """The final model on the site's own test split (of the last phase; labels beyond the
    head count as errors). A site without one scores nothing (``num-examples`` 0, no
    accuracy): its training data would flatter the model, and the summary says so."""
    config = run_config_of(msg)
    site = load_site_data(context, config, config.phases - 1)
    model = receive_model(msg, site, config)
    # The final model (the one evaluate round after the last); a strategy's per-round
    # evaluate names its round.
    publish_for_line(msg, context, config,
                     int(msg.content[wire.CONFIG].get(wire.SERVER_ROUND, config.num_server_rounds)), as_sent=True)
    if site.test is None:
        metrics = MetricRecord({wire.NUM_EXAMPLES: 0})
    else:
        result = evaluate_known(model, site.test, pick_device(config.device))
        metrics = MetricRecord(
            {wire.NUM_EXAMPLES: result.num_examples, "accuracy": result.accuracy, "loss": result.loss}
        )
    if config.replay_samples and config.phases > 1:  # the last phase's batch counts in windows-seen
        num_classes = model.head.out_features
        data = known(site.train, num_classes)
        metrics.update(replay_metrics(load_replay(context, config, site.site_id, data, num_classes), data))
    content = RecordDict({wire.METRICS: metrics, wire.SITE: ConfigRecord({wire.SITE_ID: site.site_id})})
    return Message(content=content, reply_to=msg)


def phase_end(msg: Message, context: Context) -> Message:
    """End of a phase (``query.phase_end``, fedind.continual.phases): offer this phase's batch to
    the replay buffer, scored by the loss of the global model it came with, and (EWC)
    return the diagonal Fisher of that model on the batch."""
    config = run_config_of(msg)
    phase = int(msg.content[wire.CONFIG][wire.PHASE])
    site = load_site_data(context, config, phase)
    device = pick_device(config.device)
    model = receive_model(msg, site, config)
    server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
    publish_for_line(msg, context, config, server_round)  # the model the next round trains from
    num_classes = model.head.out_features
    data = known(site.train, num_classes)
    seed = config.site_seed(site.site_id, server_round)
    content = RecordDict({wire.SITE: ConfigRecord({wire.SITE_ID: site.site_id})})
    metrics = MetricRecord({wire.NUM_EXAMPLES: data.num_examples})
    if config.replay_samples:
        buffer = load_replay(context, config, site.site_id, data, num_classes)
        if buffer is not None and offered_phase(context) < phase and data.num_examples:
            if len(buffer):  # scores taken at admission went stale as the model learnt
                buffer.rescore(sample_losses(model, buffer.arrays(), device))
            buffer.offer(data.x, data.y, sample_losses(model, data, device))
            save_replay(context, buffer, phase)
        metrics.update(replay_metrics(buffer, data))
        if buffer is not None:
            metrics[wire.WINDOWS_SEEN] = buffer.seen  # the batch is now offered
    if config.ewc_lambda and data.num_examples:
        fisher = diagonal_fisher(model, data, device, seed=seed % 2**31)
        fisher, _ = focus(fisher, fisher, config.ewc_keep)  # the server keeps that share of the sum too
        if config.encryption == "paillier":  # summed under encryption: the server never sees one site's Fisher
            from ..paillier.sums import flatten

            shapes = {name: tuple(a.shape) for name, a in msg.content[wire.ARRAYS].items()}
            refused = _encrypt_side(msg, context, config, flatten(fisher, shapes), content, wire.EWC_FISHER_ENCRYPTED,
                                    metrics)
            if refused is not None:
                return refused
        else:
            content[wire.EWC_FISHER] = array_record(fisher)
    content[wire.METRICS] = metrics
    return Message(content=content, reply_to=msg)


def calibrate(msg: Message, context: Context) -> Message:
    """After the run's last round, head calibration (``query.calibrate``,
    fedind.continual.calibration): per class the site holds, the count, mean and covariance
    of the received model's features over this phase's windows and the replay buffer's,
    without the windows whose label the received model contradicts (``calibration-label-floor``).
    Moments only: no window leaves the site."""
    config = run_config_of(msg)
    server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
    site = load_site_data(context, config, config.phase_of(server_round))
    model = receive_model(msg, site, config)
    data = known(site.train, model.head.out_features)
    buffer = load_replay(context, config, site.site_id, data, model.head.out_features)
    if buffer is not None and len(buffer):
        replayed = buffer.arrays()
        data = SiteArrays(np.concatenate([data.x, replayed.x]), np.concatenate([data.y, replayed.y]))
    features = window_features(model, data.x, pick_device(config.device))
    kept = agreeing(features, data.y, model.head.weight.detach().cpu().numpy(), model.head.bias.detach().cpu().numpy(),
                    config.calibration_label_floor)
    moments = class_moments(features[kept], data.y[kept])
    content = RecordDict({
        wire.SITE: ConfigRecord({wire.SITE_ID: site.site_id}),
        wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: int(moments.counts.sum())}),
    })
    if config.encryption == "paillier":  # summed under encryption (fedind.paillier.sums)
        refused = _encrypt_side(msg, context, config, moments_vector(moments, model.head.out_features), content,
                                wire.FEATURE_MOMENTS_ENCRYPTED, content[wire.METRICS])
        if refused is not None:
            return refused
    else:
        content[wire.FEATURE_MOMENTS] = ConfigRecord(encode_moments(moments))
    return Message(content=content, reply_to=msg)


def _encrypt_side(msg: Message, context: Context, config: RunConfig, values: np.ndarray, content: RecordDict,
                  name: str, metrics: MetricRecord) -> Message | None:
    """A side vector (fedind.paillier.sums) encrypted into ``content[name]``, its clipped
    values counted in ``metrics``; the error reply when the site has no key (None otherwise).
    The crypto stack is imported here, only for encrypted runs."""
    from ..paillier.keys import KeyFileError
    from ..paillier.site import encrypted_side, rounding_rng

    server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
    rng = rounding_rng(config, str(content[wire.SITE][wire.SITE_ID]), server_round, name)
    try:
        content[name], metrics[wire.CLIPPED_VALUES] = encrypted_side(context, config, values, rng)
    except KeyFileError as err:
        return Message(Error(code=wire.SITE_KEY_MISSING, reason=str(err)), reply_to=msg)
    return None


def paillier_mod(msg: Message, context: Context, call_next) -> Message:
    """:func:`fedind.paillier.site.paillier_mod` for a train message with ``encryption =
    "paillier"``; any other message passes without importing the crypto stack (phe,
    cryptography, the server's strategies): Flower starts a fresh process per message."""
    if msg.metadata.message_type == MessageType.TRAIN and run_config_of(msg).encryption == "paillier":
        from ..paillier.site import paillier_mod as encrypting

        return encrypting(msg, context, call_next)
    return call_next(msg, context)


def decrypt_query(msg: Message, context: Context) -> Message:
    """:func:`fedind.paillier.site.decrypt_query`, imported when a query asks for it."""
    from ..paillier.site import decrypt_query as decrypt

    return decrypt(msg, context)


def site_app(*inner_mods, transport=topk_mod, outer_mods=()) -> ClientApp:
    """fedind's site agent. ``inner_mods`` go innermost, after the transport (top-k) and
    Paillier mods, so they see the dense trained weights: how a benchmark puts an attacker
    or a recorder into a site. ``transport`` replaces the top-k mod: how a benchmark tries
    another uplink (``simulations/compression_trials.py``). ``outer_mods`` go outermost, before
    the site's state is restored: how a benchmark takes a line off the network for some rounds."""
    # state_mod first (outermost): it saves context.state after the inner mods wrote to it;
    # run_scope_mod next: it sees the restored state.
    # downlink_mod before the transport: the top-k delta is taken from the rebuilt model.
    site = ClientApp(mods=[*outer_mods, state_mod, run_scope_mod, downlink_mod, transport, paillier_mod, *inner_mods])
    site.train()(train)
    site.evaluate()(evaluate_global)
    site.query("phase_end")(phase_end)
    site.query("calibrate")(calibrate)
    site.query()(decrypt_query)  # encryption = "paillier": decrypt the round's summed ciphertexts
    return site


app = site_app()
