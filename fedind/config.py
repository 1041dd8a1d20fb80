"""The run configuration: read once from Flower's run config into a frozen dataclass.

Keys are the kebab-case names of ``[tool.flwr.app.config]`` in pyproject.toml; each field
below documents one. Invalid values fail here, before any round runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .data.drift import DriftSpec
from .data.federation import FederationSpec
from .data.synthetic import NUM_CLASSES
from .continual.replay import POLICIES as REPLAY_POLICIES

# "fedind" is the recipe's server: DWA weights and the conflict momentum buffer (fedind.server.dwa.DWA),
# the same strategy as "dwa", named for the recipe it is the default of.
STRATEGIES = (
    "fedind", "fedavg", "fedprox", "fedavgm", "fedadam", "fedmedian", "fedtrimmedavg", "krum", "trimmedavgm", "dwa"
)
DWA_STRATEGIES = ("fedind", "dwa")
EWC_ANCHORS = ("phase-end", "global")  # what the EWC penalty holds the kept coordinates near (fedind.continual.ewc)
YOUNG_ROWS = ("refit", "holders")  # how a grown class's head rows learn in its phase (fedind.continual.phases)
COMPRESSIONS = ("none", "topk")
TOPK_ALLOCATIONS = ("model", "tensor", "mixed")  # how a top-k budget is shared between arrays (fedind.topk.selection.allocated_topk)
ENCRYPTIONS = ("none", "paillier")
PAILLIER_COORDINATES = ("mixed", "change", "random")  # fedind.paillier.sparse.SET_RULES


class ConfigError(ValueError):
    """A run-config value that cannot work; the message names the key."""


@dataclass(frozen=True)
class RunConfig:
    num_server_rounds: int = 80  # federated rounds
    local_epochs: int = 2  # passes over the site's data per round
    batch_size: int = 16
    learning_rate: float = 0.05  # site SGD learning rate at round 1 (cosine decay over the run)
    strategy: str = "fedavgm"  # one of STRATEGIES
    fraction_train: float = 1.0  # share of sites sampled per round
    data_root: str = ""  # site data folder (format: docs/data-format.md); empty = synthetic sites
    num_sites: int = 10  # synthetic sites (ignored with data-root: the folder decides)
    dirichlet_alpha: float = 0.3  # label skew of synthetic sites (smaller = more skewed)
    samples_per_site: int = 240  # mean windows per synthetic site
    seed: int = 0
    run_dir: str = "runs"  # results go to run-dir/<run-name>/
    run_name: str = ""  # empty = <strategy>-<timestamp>
    target_accuracy: float = 0.75  # rounds-to-target is reported for this global accuracy
    local_momentum: float = 0.9  # site SGD momentum (reset every round)
    local_grad_clip: float = 1.0  # site SGD: clip each step's gradient to this L2 norm (0 = off)
    local_stretch: float = 1.0  # site SGD: each batch time-scaled by a factor in [1/r, r] (other lines' speeds); 1 = off
    local_stretch_phase: int = 0  # first data phase whose batches are stretched (0 = from the start; 1 = once conditions first change)
    local_stretch_delay: int = 0  # local-stretch: its first rounds trained plain (the gearboxes' sparse uplink stalled at chance when the stretch came from round 1)
    local_stretch_ramp: int = 0  # the stretch grows over this many rounds from its start: r**(k/ramp) in its k-th round (0 = whole at once)
    logit_adjustment: float = 0.5  # site loss on logits + tau * log(local label prior); 0 = plain cross-entropy
    model_width: int = 32  # channels of the first conv layer of FaultCNN
    proximal_mu: float = 0.01  # fedprox only
    server_learning_rate: float = 1.0  # fedavgm and trimmedavgm (fedadam has fedadam-eta)
    server_momentum: float = 0.9  # fedavgm and trimmedavgm: Flower's heavy-ball server momentum
    fedadam_eta: float = 0.01  # fedadam server learning rate
    fedadam_tau: float = 0.001  # fedadam adaptivity (larger = closer to FedAvgM)
    trimmed_beta: float = 0.2  # fedtrimmedavg: share of the lowest and of the highest values cut per coordinate
    krum_malicious: int = 1  # krum: number of malicious sites it assumes per round
    dwa_weighting: bool = True  # dwa: weight sites by n_i * exp(-KL(P_i || P_global) / T)
    dwa_temperature: float = 3.0  # dwa: T; larger = closer to FedAvg weights
    dwa_floor: float = 0.1  # dwa: every site keeps at least this share of its FedAvg weight
    dwa_momentum: float = 0.95  # dwa: beta of its restarting server momentum (0 = none); the restart lets it run heavier than FedAvgM's
    conflict_buffer: bool = True  # dwa: route sign-conflicting coordinates through a momentum buffer
    conflict_threshold: float = 0.3  # dwa: sign agreement below this = conflict
    conflict_momentum: float = 0.9  # dwa with dwa-momentum = 0: beta of the conflict buffer
    server_restart: bool = True  # dwa: reset a coordinate's server momentum when it opposes the round's mean
    conflict_damping: float = 1.0  # dwa: scale of low-agreement coordinates' momentum input (1 = off)
    restart_agreement: float = 0.5  # dwa: restart a coordinate only where the sites' sign agreement is at least this (0 = wherever the mean opposes the buffer)
    cclip_radius: float = 0.0  # dwa: centered clipping of bucketed updates at this many times their median distance to the server momentum (0 = off; fedind.aggregation.robust)
    cclip_bucket: int = 2  # dwa, with cclip-radius: sites averaged per random bucket before clipping
    alignment_threshold: float = -0.4  # screen: reject a site whose decayed label alignment is below this (-1 = off; fedind.server.screening)
    consensus_threshold: float = -0.25  # screen: a site whose decayed mean cosine to the rounds' median updates is negative is weighed down and clipped to the median norm, and rejected for the round below this (-1 = off; fedind.server.screening)
    norm_clip: float = 0.0  # screen: every accepted update longer than this many times the round's median update norm is scaled down to it (0 = off; fedind.server.screening)
    alignment_release: float = 1.1  # screen: a rejected site is let back in once its decayed label alignment is back at this (above 1 = never: rejected for the rest of the run)
    compression: str = "none"  # site -> server updates: none (dense weights) | topk (sparse delta)
    topk_ratio: float = 0.015  # topk: share of coordinates sent per round
    topk_quantization: str = "int4"  # topk: int8 | int4 (linear, per-tensor scale) | sign (1 bit + scale)
    topk_threshold: str = "exact"  # topk: exact top-k | sampled (DGC-style threshold estimate)
    topk_allocation: str = "model"  # topk: how the budget is shared between arrays: model (the largest over the whole model) | tensor (each array its share by size, as DGC) | mixed (half each way)
    topk_feedback: str = "residual"  # topk: residual (classic error feedback) | estimate (EF21: server keeps each site's update estimate)
    topk_residual_decay: float = 0.8  # topk, residual: share of the error-feedback residual carried to the next round
    topk_gain: float = 1.5  # topk, residual: the server scales each decoded sparse delta by this (not with estimate)
    topk_estimate_decay: float = 1.0  # topk, estimate: share of the EF21 estimate carried to the next round (1 = EF21)
    topk_warmup_rounds: int = 3  # topk: density falls geometrically from 1 to topk-ratio over these first rounds
    downlink: str = "none"  # server -> site models: none (dense every round) | topk (sparse steps of a mirrored model; fedind.topk.downlink)
    downlink_ratio: float = 0.2  # downlink topk: share of coordinates of the model's change sent per round (at 0.05 the sites' copy lagged: 20 points lost on the plant, 6 under encryption)
    downlink_quantization: str = "int4"  # downlink topk: int8 | int4 | sign
    downlink_momentum: float = 0.0  # downlink topk: both ends predict the copy's next move as this times its last; the step corrects the prediction
    encryption: str = "none"  # none | paillier (the server sums site updates it cannot read; fedind.server.encrypted)
    paillier_public_key: str = ""  # paillier: the server's public key file ("": simulate() makes a throwaway pair)
    paillier_private_key: str = ""  # paillier: the sites' private key file, unless node config paillier-private-key
    paillier_clip: float = 1.0  # paillier: update values are clipped to [-clip, clip] before fixed-point encoding
    paillier_value_bits: int = 13  # paillier: bits of a value's level (stochastic rounding to 2^bits - 1 steps on each side of 0)
    paillier_weight_bits: int = 9  # paillier: headroom bits for the integer site weights: at most 2^bits sites per sum
    paillier_key_bits: int = 2048  # paillier: size of the throwaway key pair that simulate() generates
    paillier_coordinates: str = "mixed"  # paillier with compression = topk: the round's announced set: mixed (half the largest of the last global change, half random) | change | random
    paillier_set_ratio: float = 0.045  # paillier with compression = topk: share of the model in the round's announced set, what every site sends (topk-ratio is the plaintext uplink's)
    paillier_gain: float = 1.5  # paillier with compression = topk: the server's step is this times the decrypted mean on the set (topk-gain is the plaintext uplink's)
    paillier_train_set: bool = True  # paillier with compression = topk: sites train only the round's announced coordinates (the rest stay as received), so their whole update is on the set
    device: str = "auto"  # auto | cpu | cuda (site training and server evaluation)
    round_timeout: float = 600.0  # seconds to wait for site replies in a round
    min_sites: int = 1  # a round with fewer successful site updates leaves the global model unchanged
    checkpoint_interval: int = 1  # save a verified server checkpoint every this many rounds (0 = by time only)
    checkpoint_seconds: float = 0.0  # also save when this many seconds passed since the last one (0 = off)
    checkpoint_keep: int = 3  # newest checkpoints kept in run-dir/<run-name>/checkpoints/
    resume: bool = False  # continue run-dir/<run-name> (newest run there if run-name is empty) from its newest valid checkpoint
    overwrite: bool = False  # start over in a run-dir/<run-name> that holds results (false: a new run refuses it, and resume refuses one without a valid checkpoint)
    metrics_port: int = 0  # Prometheus /metrics of the server during a run (0 = off; fedind.server.monitoring)
    metrics_address: str = "127.0.0.1"  # address the metrics endpoint binds (0.0.0.0 = every interface)
    # Continual learning (fedind.continual.phases): data arriving in phases, replay, EWC, new classes.
    phases: int = 1  # data phases (1 = static data); phase p = rounds p*phase-rounds+1 .. (p+1)*phase-rounds
    phase_rounds: int = 0  # rounds per phase (needed with phases > 1); the last phase runs to num-server-rounds
    drift_regime_share: float = 0.5  # synthetic, each phase >= 1: share of lines whose operating regime changes
    drift_new_classes: int = 1  # synthetic: last classes held out of phase 0, first seen at one line in phase 1
    drift_speed_factor: float = 1.5  # synthetic: a line's new regime runs at this times a drawn shaft speed
    replay_samples: int = 0  # site replay buffer bound in windows (0 = no replay)
    replay_bytes: int = 0  # replay buffer bound in bytes (0 = what replay-samples windows take)
    replay_share: float = 0.1  # the buffer also holds at most this share of the windows the site has had
    replay_ratio: float = 0.5  # replayed windows per new window in each local batch
    replay_policy: str = "balanced-loss"  # reservoir | balanced | balanced-loss (fedind.continual.replay)
    ewc_lambda: float = 0.0  # EWC penalty weight at the sites (0 = off)
    ewc_gamma: float = 1.0  # online EWC: Fisher of earlier phases is scaled by gamma at each consolidation
    ewc_server_lambda: float = 0.0  # server damps each coordinate's drift from its anchor by 1/(1 + this*F) (0 = off)
    ewc_keep: float = 1.0  # EWC: share of the Fisher's coordinates kept at each consolidation (the largest; 1 = all)
    ewc_fade_rounds: int = 0  # EWC's weight fades linearly to 0 over this many rounds after each phase end (0 = constant)
    ewc_anchor: str = "phase-end"  # EWC anchors: phase-end (the model at the last phase end) | global (the model each round starts from)
    served_ema: float = 0.0  # the model scored and published is this EMA of the global models (sites still train from the global model; 0 = the global model itself; fedind.server.serving)
    head_calibration: bool = False  # phases: after the last round, refit the head on virtual features from the sites' per-class feature moments (CCVR)
    calibration_label_floor: float = 0.0  # head-calibration (no effect without it): a site leaves out of its moments the windows whose label the received model gives a probability below this (0 = keep all)
    young_rows: str = "refit"  # a class's head rows in the phase it grew: refit (holders' fit replaces the average) | holders (dwa averages them over its holders; other strategies refit)

    def __post_init__(self) -> None:
        checks = {
            "num-server-rounds": self.num_server_rounds >= 1,
            "local-epochs": self.local_epochs >= 1,
            "batch-size": self.batch_size >= 1,
            "learning-rate": self.learning_rate > 0,
            "strategy": self.strategy in STRATEGIES,
            "fraction-train": 0 < self.fraction_train <= 1,
            "num-sites": self.num_sites >= 1,
            "seed": self.seed >= 0,
            "dirichlet-alpha": math.isfinite(self.dirichlet_alpha) and self.dirichlet_alpha > 0,
            "samples-per-site": self.samples_per_site >= 20,
            "target-accuracy": 0 < self.target_accuracy <= 1,
            "local-momentum": 0 <= self.local_momentum < 1,
            "local-grad-clip": math.isfinite(self.local_grad_clip) and self.local_grad_clip >= 0,
            "local-stretch": math.isfinite(self.local_stretch) and self.local_stretch >= 1,
            "local-stretch-phase": self.local_stretch_phase >= 0,
            "local-stretch-ramp": self.local_stretch_ramp >= 0,
            "local-stretch-delay": self.local_stretch_delay >= 0,
            "logit-adjustment": math.isfinite(self.logit_adjustment) and self.logit_adjustment >= 0,
            "model-width": self.model_width >= 4 and self.model_width % 4 == 0,
            "proximal-mu": self.proximal_mu >= 0,
            "server-learning-rate": self.server_learning_rate > 0,
            "server-momentum": 0 <= self.server_momentum < 1,
            "fedadam-eta": self.fedadam_eta > 0,
            "fedadam-tau": self.fedadam_tau > 0,
            "trimmed-beta": 0 <= self.trimmed_beta < 0.5,
            "krum-malicious": self.krum_malicious >= 0,
            "dwa-temperature": self.dwa_temperature > 0,
            "dwa-floor": 0 <= self.dwa_floor <= 1,
            "dwa-momentum": 0 <= self.dwa_momentum < 1,
            "conflict-threshold": 0 <= self.conflict_threshold <= 1,
            "conflict-momentum": 0 <= self.conflict_momentum < 1,
            "conflict-damping": 0 <= self.conflict_damping <= 1,
            "restart-agreement": 0 <= self.restart_agreement <= 1,
            "cclip-radius": math.isfinite(self.cclip_radius) and self.cclip_radius >= 0,
            "cclip-bucket": self.cclip_bucket >= 1,
            "alignment-threshold": -1 <= self.alignment_threshold <= 1,
            "consensus-threshold": -1 <= self.consensus_threshold < 0,
            "norm-clip": math.isfinite(self.norm_clip) and (self.norm_clip == 0 or self.norm_clip >= 1),
            "calibration-label-floor": 0 <= self.calibration_label_floor < 1,
            "served-ema": 0 <= self.served_ema < 1,
            "alignment-release": math.isfinite(self.alignment_release) and self.alignment_release >= self.alignment_threshold,
            "compression": self.compression in COMPRESSIONS,
            "topk-ratio": 0 < self.topk_ratio <= 1,
            "topk-quantization": self.topk_quantization in ("int8", "int4", "sign"),
            "topk-threshold": self.topk_threshold in ("exact", "sampled"),
            "topk-allocation": self.topk_allocation in TOPK_ALLOCATIONS,
            "topk-feedback": self.topk_feedback in ("residual", "estimate"),
            "topk-residual-decay": 0 <= self.topk_residual_decay <= 1,
            "topk-gain": math.isfinite(self.topk_gain) and self.topk_gain > 0,
            "topk-estimate-decay": 0 <= self.topk_estimate_decay <= 1,
            "topk-warmup-rounds": self.topk_warmup_rounds >= 0,
            "downlink": self.downlink in ("none", "topk"),
            "downlink-ratio": 0 < self.downlink_ratio <= 1,
            "downlink-quantization": self.downlink_quantization in ("int8", "int4", "sign"),
            "downlink-momentum": 0 <= self.downlink_momentum < 1,
            "encryption": self.encryption in ENCRYPTIONS,
            "paillier-clip": math.isfinite(self.paillier_clip) and self.paillier_clip > 0,
            "paillier-value-bits": 2 <= self.paillier_value_bits <= 20,
            "paillier-weight-bits": 1 <= self.paillier_weight_bits <= 12,
            "paillier-key-bits": self.paillier_key_bits >= 512 and self.paillier_key_bits % 64 == 0,
            "paillier-coordinates": self.paillier_coordinates in PAILLIER_COORDINATES,
            "paillier-set-ratio": 0 < self.paillier_set_ratio <= 1,
            "paillier-gain": math.isfinite(self.paillier_gain) and self.paillier_gain > 0,
            "device": self.device in ("auto", "cpu", "cuda"),
            "round-timeout": self.round_timeout > 0,
            "min-sites": self.min_sites >= 1,
            "checkpoint-interval": self.checkpoint_interval >= 0,
            "checkpoint-seconds": math.isfinite(self.checkpoint_seconds) and self.checkpoint_seconds >= 0,
            "checkpoint-keep": self.checkpoint_keep >= 1,
            "metrics-port": 0 <= self.metrics_port <= 65535,
            "metrics-address": bool(self.metrics_address.strip()),
            "phases": self.phases >= 1,
            "phase-rounds": self.phase_rounds >= 0,
            "drift-regime-share": 0 <= self.drift_regime_share <= 1,
            "drift-new-classes": 0 <= self.drift_new_classes <= NUM_CLASSES - 2,
            "drift-speed-factor": 0.25 <= self.drift_speed_factor <= 4,
            "replay-samples": self.replay_samples >= 0,
            "replay-bytes": self.replay_bytes >= 0,
            "replay-share": 0 < self.replay_share <= 1,
            "replay-ratio": math.isfinite(self.replay_ratio) and self.replay_ratio >= 0,
            "replay-policy": self.replay_policy in REPLAY_POLICIES,
            "ewc-lambda": math.isfinite(self.ewc_lambda) and self.ewc_lambda >= 0,
            "ewc-gamma": 0 <= self.ewc_gamma <= 1,
            "ewc-server-lambda": math.isfinite(self.ewc_server_lambda) and self.ewc_server_lambda >= 0,
            "ewc-keep": 0 < self.ewc_keep <= 1,
            "ewc-anchor": self.ewc_anchor in EWC_ANCHORS,
            "ewc-fade-rounds": self.ewc_fade_rounds >= 0,
            "young-rows": self.young_rows in YOUNG_ROWS,
        }
        for key, ok in checks.items():
            if not ok:
                value = getattr(self, key.replace("-", "_"))
                hint = f" (choose from {', '.join(STRATEGIES)})" if key == "strategy" else ""
                raise ConfigError(f"Invalid run config {key} = {value!r}{hint}")
        self._check_phases()
        if self.cclip_radius > 0 and self.strategy not in DWA_STRATEGIES:
            raise ConfigError(
                f"Invalid run config cclip-radius = {self.cclip_radius!r} with strategy = {self.strategy!r}: "
                f"centered clipping runs inside {' and '.join(DWA_STRATEGIES)}; set cclip-radius = 0"
            )
        if self.encryption == "paillier":
            self._check_encryption()

    def _needing_phases(self) -> list[tuple[str, Any, str]]:
        """(key, value, why) of each setting that is on and needs phases > 1."""
        return [(key, value, why) for key, value, why in (
            ("phase-rounds", self.phase_rounds, "there is one phase"),
            ("replay-samples", self.replay_samples, "a site's buffer is filled at the end of a phase"),
            ("ewc-lambda", self.ewc_lambda, "the Fisher is taken at the end of a phase"),
            ("head-calibration", self.head_calibration, "the moments include the replay buffer's windows"),
        ) if value]

    def phases_off(self) -> dict[str, Any]:
        """The run-config values (kebab-case keys) that make this configuration one phase:
        ``phases`` 1 and every setting that needs phases off."""
        return {"phases": 1, **{key: False if value is True else type(value)(0)
                                for key, value, _ in self._needing_phases()}}

    def _check_phases(self) -> None:
        """The phase schedule must give every phase a round; replay and EWC need phases."""
        if self.phases == 1:
            for key, value, why in self._needing_phases():
                raise ConfigError(f"Invalid run config {key} = {value!r}: it needs phases > 1 ({why})")
            return
        if self.local_stretch_phase >= self.phases:  # with one phase, 1 means "static data never stretches"
            raise ConfigError(
                f"Invalid run config local-stretch-phase = {self.local_stretch_phase!r}: the run has phases "
                f"0..{self.phases - 1}, so no batch would ever be stretched; set it below phases = {self.phases} "
                f"(or local-stretch = 1.0)"
            )
        if self.phase_rounds < 1 or (self.phases - 1) * self.phase_rounds >= self.num_server_rounds:
            raise ConfigError(
                f"Invalid run config phase-rounds = {self.phase_rounds!r}: phases = {self.phases} need "
                f"phase-rounds >= 1 and (phases - 1) * phase-rounds < num-server-rounds = "
                f"{self.num_server_rounds} (every phase gets at least one round)"
            )
        if self.ewc_server_lambda and not self.ewc_lambda:
            raise ConfigError(
                f"Invalid run config ewc-server-lambda = {self.ewc_server_lambda!r} with ewc-lambda = 0: "
                "the server damps by the Fisher the EWC sites send; set ewc-lambda > 0"
            )
        if self.ewc_server_lambda and self.ewc_anchor != "phase-end":
            raise ConfigError(
                f"Invalid run config ewc-server-lambda = {self.ewc_server_lambda!r} with ewc-anchor = "
                f"{self.ewc_anchor!r}: the server damps drift from the phase-end anchors; set ewc-anchor = \"phase-end\""
            )
        if self.replay_samples and self.replay_ratio == 0:
            raise ConfigError(
                f"Invalid run config replay-ratio = 0.0 with replay-samples = {self.replay_samples}: "
                "the buffer would never be replayed; set replay-ratio > 0 or replay-samples = 0"
            )

    def site_seed(self, site_id: str, server_round: int) -> int:
        """The seed of one site's randomness in one round (local shuffling, the Fisher's
        batches, stochastic rounding under encryption): from the run's seed, the site and the
        round only, so a run repeats bit for bit."""
        return (self.seed * 1_000_003 + zlib.crc32(site_id.encode()) * 101 + server_round) % 2**31

    def phase_of(self, server_round: int) -> int:
        """The data phase of ``server_round`` (0-based; round 0, the initial model, is phase 0)."""
        if self.phases == 1 or server_round <= 0:
            return 0
        return min((server_round - 1) // self.phase_rounds, self.phases - 1)

    def local_stretch_at(self, server_round: int) -> float:
        """The time stretch the sites train ``server_round`` with: 1 (off) before data phase
        ``local-stretch-phase`` and in that phase's first ``local-stretch-delay`` rounds, then
        ``local-stretch`` = r, or with ``local-stretch-ramp`` = K ``r ** (k / K)`` in the k-th
        stretched round (k = 1..K): the plain task is learnt before the harder, stretched one.
        From phase 1, static data never stretches."""
        if self.local_stretch == 1.0 or self.phase_of(server_round) < self.local_stretch_phase:
            return 1.0
        k = server_round - self.local_stretch_phase * self.phase_rounds - self.local_stretch_delay
        if k < 1:
            return 1.0
        if self.local_stretch_ramp == 0:
            return self.local_stretch
        return float(self.local_stretch ** (min(k, self.local_stretch_ramp) / self.local_stretch_ramp))

    def lr_progress(self, server_round: int) -> float:
        """Where ``server_round`` lies in the sites' cosine learning-rate schedule, in [0, 1):
        over the whole run, or with phases over its phase (a restart per phase: a new batch
        is learnt at the full rate)."""
        if self.phases == 1:
            return (server_round - 1) / self.num_server_rounds
        phase = self.phase_of(server_round)
        start = phase * self.phase_rounds
        length = self.phase_rounds if phase < self.phases - 1 else self.num_server_rounds - start
        return (server_round - 1 - start) / length

    def ewc_lambda_at(self, server_round: int) -> float:
        """The EWC weight the sites train ``server_round`` with: ``ewc-lambda``, or with
        ``ewc-fade-rounds`` = F, ``ewc-lambda`` (1 - k/F) in the k-th round after the last
        phase end (k = 0 the first) and 0 from the F-th on: consolidation while the new
        conditions' first updates would tear down what the old ones taught, none once the
        federation has re-learnt (the replay buffer keeps the old phase in later batches)."""
        if not self.ewc_fade_rounds:
            return self.ewc_lambda
        since = (server_round - 1) - self.phase_of(server_round) * self.phase_rounds
        return self.ewc_lambda * max(0.0, 1.0 - since / self.ewc_fade_rounds)

    @property
    def screen_rules(self) -> dict[str, float | None]:
        """The update screen's rules across rounds as :class:`fedind.server.screening.UpdateScreen`
        takes them: a threshold of -1 is None (the rule is off), a release above 1 is None
        (a banned site is never let back in)."""
        return {
            "alignment_threshold": None if self.alignment_threshold <= -1 else self.alignment_threshold,
            "alignment_release": self.alignment_release if self.alignment_release <= 1 else None,
            "consensus_threshold": None if self.consensus_threshold <= -1 else self.consensus_threshold,
            "clip_ratio": self.norm_clip if self.norm_clip > 0 else None,
        }

    @property
    def refits_young_rows(self) -> bool:
        """Whether the holders of a class grown in this phase refit its head rows every round
        (fedind.continual.phases). ``young-rows = holders`` averages them over the holders instead,
        which only DWA can; with another strategy they are refit."""
        return not (self.young_rows == "holders" and self.strategy in DWA_STRATEGIES)

    def phase_end_rounds(self) -> tuple[int, ...]:
        """The last round of every phase but the last: after it the sites consolidate."""
        return tuple(p * self.phase_rounds for p in range(1, self.phases))

    def drift_spec(self) -> DriftSpec:
        return DriftSpec(
            federation=self.federation_spec(),
            phases=self.phases,
            regime_share=self.drift_regime_share,
            new_classes=self.drift_new_classes,
            speed_factor=self.drift_speed_factor,
        )

    def _check_encryption(self) -> None:
        """Features that need each site's plaintext update cannot run under encryption: say so."""
        why = "with encryption = 'paillier' the server only ever sees the sum of the sites' updates"
        if self.strategy in ("fedmedian", "fedtrimmedavg", "krum", "trimmedavgm"):
            raise ConfigError(
                f"Invalid run config strategy = {self.strategy!r}: {why}, and a robust aggregator needs "
                f"every site's update; use fedavg, fedprox, fedavgm, fedadam or dwa"
            )
        # compression = "topk" runs as sparse encrypted rounds: every site encrypts its values on the
        # server's announced coordinate set (fedind.paillier.sparse); the EF21 estimate cannot.
        if self.compression == "topk" and self.topk_feedback != "residual":
            raise ConfigError(
                f"Invalid run config topk-feedback = {self.topk_feedback!r}: {why}, and the EF21 estimate "
                f"needs each site's sparse change in the clear; set topk-feedback = 'residual'"
            )
        # phases > 1 run: the Fisher and the feature moments are summed under Paillier like the
        # updates (fedind.paillier.sums), and young rows are averaged over their holders there.
        if self.cclip_radius > 0:
            raise ConfigError(
                f"Invalid run config cclip-radius = {self.cclip_radius!r}: {why}, and centered clipping "
                f"needs every site's update; set cclip-radius = 0"
            )
        if self.strategy in DWA_STRATEGIES and self.conflict_buffer and self.dwa_momentum == 0:
            raise ConfigError(
                f"Invalid run config conflict-buffer = true (with dwa-momentum = 0): {why}, so the "
                f"per-site sign conflicts it needs are hidden; set conflict-buffer = false or dwa-momentum > 0"
            )
        if self.strategy in DWA_STRATEGIES and self.conflict_buffer and self.conflict_damping < 1:
            raise ConfigError(
                f"Invalid run config conflict-damping = {self.conflict_damping!r}: {why}, so the per-site "
                f"sign agreement it needs is hidden; set conflict-damping = 1.0"
            )
        # restart-agreement needs no check: DWA sees one (aggregate) reply, whose agreement is
        # 1 everywhere, so its restart is the ungated one (as with restart-agreement = 0).
        if not self.data_root and max(1, round(self.fraction_train * self.num_sites)) < 2:
            raise ConfigError(
                f"Invalid run config num-sites = {self.num_sites} / fraction-train = {self.fraction_train}: "
                f"{why}, and a sum over one site is that site's update; sample at least 2 sites per round"
            )

    @classmethod
    def from_flower(cls, run_config: Mapping[str, Any]) -> "RunConfig":
        """Parse Flower's run config (kebab-case keys); unknown keys are an error."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(f"Unknown run config key {key!r}{suggest_key(key)}")
            values[name] = _coerce(key, value, type(fields[name].default))
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        """The run config the server sends to sites with every message (JSON text), parsed
        and checked once per distinct text: a site's mods and handler read it from the same
        message, and the server sends the same text every round."""
        if cls is not RunConfig:
            return cls.from_flower(json.loads(text))
        return _parsed_run_config(text)

    def to_flower(self) -> dict[str, Any]:
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}

    def federation_spec(self) -> FederationSpec:
        return FederationSpec(
            num_sites=self.num_sites,
            alpha=self.dirichlet_alpha,
            samples_per_site=self.samples_per_site,
            seed=self.seed,
        )


# The recipe: what ``flwr run .`` runs (pyproject.toml declares ``RunConfig(**RECIPE)``),
# the mission's parts together on a two-phase plant scenario. RunConfig's own defaults are
# the plain baseline (Flower's FedAvgM, dense, one phase) that tests and ablations start from.
# Each part and the measurement that keeps it: docs/recipe.md (python simulations/plant.py).
RECIPE: dict[str, Any] = {
    "strategy": "fedind",  # DWA weights + the conflict momentum buffer
    "local_epochs": 3,  # more work per round for fewer rounds: on the gearboxes two left the sparse uplink at chance for up to 20 rounds of phase 0
    "local_stretch": 1.25,  # batches time-scaled by 0.8-1.25x: a line learns its faults at nearby speeds (1.1-2.0 tried on seeds 0-4)
    "dwa_momentum": 0.9,  # 0.97 with the sparse uplink overshot: accuracy swung 0.41-0.70 late in phase 1
    "young_rows": "holders",  # a new class's rows averaged over its holders, not refit a round behind
    "compression": "topk",  # error-feedback top-k uplink
    "topk_ratio": 0.02,
    "topk_gain": 2.0,
    "topk_warmup_rounds": 1,  # one denser round (14 %): three (38 %, 14 %, 5 %) cost twice the uplink to the target for the same accuracy
    "downlink": "topk",  # sparse steps of a mirrored model; whole models to sites that missed rounds
    "replay_samples": 256,  # bounded replay buffer (replay-share caps it at 10 % of a line's windows)
    "ewc_lambda": 3.0,  # EWC consolidation at phase ends (10 with three local epochs cost the narrowest line at alpha 0.1)...
    "ewc_keep": 0.1,  # ...of the 10 % of coordinates the earlier phases taught most (sparse records)...
    "ewc_anchor": "global",  # ...held near each round's global model: anchoring at the phase-end model held back a model still learning
    "served_ema": 0.5,  # the published model averages the last global models: the plant's curve swung ~8 points a round
    "head_calibration": True,  # after the last round the head is refit on virtual features from the lines' feature moments (CCVR)
    "calibration_label_floor": 0.01,  # ...without the windows whose label the final model contradicts (a mislabelling line's)
    # with encryption = "paillier": twice the announced set in 12-bit slots, for the bytes of the 24-bit
    # layout's 4.5 % (+2.3 points on the plant's seeds 0-4 at alpha 0.3; docs/benchmarks/sparse-paillier.md)
    "paillier_set_ratio": 0.087,  # with a young class's 129 head values, 27 ciphertexts of 170 slots
    "paillier_value_bits": 3,
    "paillier_weight_bits": 7,
    "paillier_clip": 0.1,
    # the plant scenario: two phases, half the lines change speed, a new fault class at one line
    "phases": 2,
    "phase_rounds": 20,
    "num_server_rounds": 40,
    # every line changes speed at phase 1: with half the lines on their old regime, FedAvgM
    # fine-tuning forgot nothing to consolidate (docs/benchmarks/continual.md)
    "drift_regime_share": 1.0,
}


@functools.lru_cache(maxsize=8)  # keyed by the text, bounded; a RunConfig is frozen, so sharing it is safe
def _parsed_run_config(text: str) -> RunConfig:
    return RunConfig.from_flower(json.loads(text))


def recipe(**overrides: Any) -> RunConfig:
    """The recipe's run config, with ``overrides`` (snake_case field names)."""
    return RunConfig(**{**RECIPE, **overrides})


def suggest_key(key: str) -> str:
    """``" (did you mean 'x'?)"`` for the run-config key closest to a mistyped ``key``, else ``""``."""
    known = [f.name.replace("_", "-") for f in dataclasses.fields(RunConfig)]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(key: str, value: Any, kind: type) -> Any:
    # TOML gives int for "1" where a float is meant; never silently turn text into numbers.
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"Invalid run config {key} = {value!r}: expected {kind.__name__}")
    return value
