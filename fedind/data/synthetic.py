"""Physically motivated bearing-vibration signals, one regime per production line.

A window of an accelerometer on a rolling-element bearing is modelled as

    x(t) = gain * [ shaft(t) + sum_k a_k h(t - t_k) + noise(t) ] + offset

- ``shaft(t)``: imbalance at the shaft rate f_r and its 2nd/3rd harmonics;
- ``t_k``: fault impacts at the bearing's characteristic frequency (with 1-2 % slip
  jitter), ``h``: the impulse response of a structural resonance (a damped sinusoid);
- ``a_k``: impact amplitudes set by fault type and severity
    * outer race (BPFO): the defect sits still in the load zone -> steady impacts;
    * inner race (BPFI): the defect rotates through the load zone -> amplitude
      modulated at the shaft rate;
    * ball (2 x BSF): the defect hits both races as the ball spins, modulated at the
      cage rate (FTF), with irregular amplitudes;
- ``noise``: broadband Gaussian sensor and process noise.

Bearing geometry is the SKF 6205-2RS of the CWRU data set (9 balls, d = 7.94 mm,
D = 39.04 mm, contact angle 0), and the 10 classes follow the CWRU benchmark:
healthy plus three fault locations at three defect sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

# SKF 6205 geometry -> characteristic frequencies as multiples of the shaft rate.
_N_BALLS, _BALL_D, _PITCH_D = 9, 7.94, 39.04
_RATIO = _BALL_D / _PITCH_D
BPFO = _N_BALLS / 2 * (1 - _RATIO)  # outer-race pass frequency ≈ 3.585 f_r
BPFI = _N_BALLS / 2 * (1 + _RATIO)  # inner-race pass frequency ≈ 5.415 f_r
BSF = _PITCH_D / (2 * _BALL_D) * (1 - _RATIO**2)  # ball spin ≈ 2.357 f_r
FTF = 0.5 * (1 - _RATIO)  # cage (fundamental train) ≈ 0.398 f_r

FAULT_TYPES = ("inner-race", "ball", "outer-race")
DEFECT_SIZES_IN = (0.007, 0.014, 0.021)  # CWRU defect diameters, inches
# Impact amplitude (relative to the 1x shaft component) for each defect size.
SEVERITY_AMPLITUDE = (1.5, 3.0, 6.0)
# Transmission path: outer-race impacts reach the sensor directly; inner-race and ball
# impacts pass through rolling contacts that damp them more (shorter ringing).
PATH_DAMPING = {"inner-race": 2.5, "ball": 1.6, "outer-race": 1.0}

CLASS_NAMES: tuple[str, ...] = ("healthy",) + tuple(
    f"{fault}-{size:.3f}" for fault in FAULT_TYPES for size in DEFECT_SIZES_IN
)
NUM_CLASSES = len(CLASS_NAMES)


@dataclass(frozen=True)
class Regime:
    """Operating and sensing conditions of one production line."""

    shaft_hz: float  # shaft rotation rate
    sample_rate: float  # accelerometer sampling rate, Hz
    resonance_hz: float  # structural resonance excited by impacts
    damping: float  # damping ratio of that resonance
    gain: float  # sensor sensitivity (arbitrary units per g)
    offset: float  # DC offset of the sensor channel
    noise_std: float  # broadband noise, relative to the 1x shaft amplitude
    imbalance: float  # 1x shaft amplitude

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def sample_regime(rng: np.random.Generator) -> Regime:
    """Draw a plausible production-line regime (1200-1800 rpm, 12 or 16 kHz sensors)."""
    sample_rate = float(rng.choice([12000.0, 16000.0]))
    return Regime(
        shaft_hz=float(rng.uniform(20.0, 30.0)),
        sample_rate=sample_rate,
        resonance_hz=float(rng.uniform(0.15, 0.25) * sample_rate),
        damping=float(rng.uniform(0.04, 0.06)),
        gain=float(np.exp(rng.uniform(np.log(0.2), np.log(5.0)))),
        offset=float(rng.uniform(-2.0, 2.0)),
        noise_std=float(rng.uniform(0.1, 0.35)),
        imbalance=float(rng.uniform(0.8, 1.2)),
    )


def _impulse_response(regime: Regime, length: int, damping_scale: float) -> np.ndarray:
    """Unit damped sinusoid of the structural resonance, truncated when it has died out."""
    t = np.arange(length) / regime.sample_rate
    omega = 2 * np.pi * regime.resonance_hz
    zeta = min(regime.damping * damping_scale, 0.5)
    envelope = np.exp(-zeta * omega * t)
    keep = max(8, int(np.searchsorted(-envelope, -1e-3)))
    return (envelope * np.sin(omega * np.sqrt(1 - zeta**2) * t))[:keep]


def _ring(impacts: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Linear convolution of each impact train with ``h`` (FFT), cut to the window."""
    length = impacts.shape[1]
    size = length + h.shape[0] - 1
    return np.fft.irfft(np.fft.rfft(impacts, size) * np.fft.rfft(h, size), size)[:, :length]


def _impacts(label: int, regime: Regime, length: int, rng: np.random.Generator) -> np.ndarray:
    """Impact train (amplitude at each impact sample) for one window of class ``label``."""
    train = np.zeros(length)
    if label == 0:
        return train
    fault = (label - 1) // len(DEFECT_SIZES_IN)
    severity = SEVERITY_AMPLITUDE[(label - 1) % len(DEFECT_SIZES_IN)] * regime.imbalance
    f_r = regime.shaft_hz * rng.uniform(0.99, 1.01)  # small speed fluctuation
    f_fault = f_r * (BPFI, 2 * BSF, BPFO)[fault]
    period = regime.sample_rate / f_fault  # samples between impacts
    count = int(length / period) + 2
    jitter = rng.normal(0.0, 0.015 * period, count)  # bearing slip
    positions = rng.uniform(-period, 0) + np.arange(count) * period + jitter
    times = positions / regime.sample_rate
    phase = rng.uniform(0, 2 * np.pi)
    if FAULT_TYPES[fault] == "inner-race":
        amplitude = severity * (0.75 + 0.25 * np.cos(2 * np.pi * f_r * times + phase))
    elif FAULT_TYPES[fault] == "ball":
        cage = 0.8 + 0.2 * np.cos(2 * np.pi * FTF * f_r * times + phase)
        amplitude = severity * cage * rng.lognormal(0.0, 0.2, count)
    else:
        amplitude = severity * rng.uniform(0.9, 1.1, count)
    inside = (positions >= 0) & (positions < length)
    np.add.at(train, positions[inside].astype(np.int64), amplitude[inside])
    return train


def synthesize(
    labels: np.ndarray, regime: Regime, length: int, rng: np.random.Generator
) -> np.ndarray:
    """Vibration windows ``float32 [N, 1, length]`` for ``labels`` under ``regime``."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise ValueError(f"labels must lie in [0, {NUM_CLASSES}), got {labels.min()}..{labels.max()}")
    n = labels.shape[0]
    t = np.arange(length) / regime.sample_rate
    impacts = np.zeros((n, length))
    for i, c in enumerate(labels):
        impacts[i] = _impacts(int(c), regime, length, rng)
    ringing = np.zeros((n, length))
    fault_of = (labels - 1) // len(DEFECT_SIZES_IN)  # -1 for healthy
    for fault, name in enumerate(FAULT_TYPES):
        rows = fault_of == fault
        if rows.any():
            ringing[rows] = _ring(impacts[rows], _impulse_response(regime, length, PATH_DAMPING[name]))
    phase = rng.uniform(0, 2 * np.pi, (n, 1))
    omega_r = 2 * np.pi * regime.shaft_hz * t[None, :]
    shaft = regime.imbalance * (
        np.sin(omega_r + phase) + 0.3 * np.sin(2 * omega_r + 2 * phase) + 0.1 * np.sin(3 * omega_r)
    )
    noise = rng.normal(0.0, regime.noise_std, (n, length))
    x = regime.gain * (shaft + ringing + noise) + regime.offset
    return x[:, None, :].astype(np.float32)
