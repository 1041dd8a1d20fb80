r"""Fixed-point slot packing and encrypted weighted sums of Paillier ciphertexts (pure Python + numpy).

No Flower import: the Flower plumbing is :mod:`fedind.paillier.site` (client mod, decrypt
query) and :mod:`fedind.server.encrypted` (server validation and aggregation); the keys are
:mod:`fedind.paillier.keys`. Arithmetic is phe's Paillier with gmpy2 underneath.

Fixed point, clipping, packing (layout version 3; version 2 is the same without ``set``)
-------------------------------------------------
A :class:`Layout` has ``V`` value bits and ``B`` weight bits (run config
``paillier-value-bits``, default 13, and ``paillier-weight-bits``, default 9); a slot has
``b = 2 + V + B`` bits (24 by default). A site's update ``delta`` (float32, all arrays of the
model flattened in sorted-name order) is clipped to ``[-c, c]`` (``c`` = ``paillier-clip``)
and rounded stochastically to

.. math::  \ell_j = \big\lfloor \mathrm{clip}(\delta_j, c) \cdot Q / c + u_j \big\rfloor + Q
           \in [0, 2Q], \qquad u_j \sim U[0, 1), \qquad Q = 2^V - 1,

an offset (non-negative) level whose mean is exact: :math:`E[\ell_j] - Q = \mathrm{clip}(\delta_j, c) Q / c`.
(The site keeps ``delta - `` the dequantised level in its error-feedback residual and adds
it to its next update: :class:`fedind.paillier.sparse.SetFeedback`.)
``S = floor((bits(n) - 1) / b)`` levels go into one plaintext, slot ``s`` at bits
``[b s, b s + b)``:

.. math::  m = \sum_{s<S} \ell_s \, 2^{b s} < 2^{b S} \le 2^{bits(n)-1} < n

(for a 2048-bit key: 85 slots of 24 bits, 170 of 12; the last plaintext is padded with zero levels).
The server weights the sites with integers :math:`k_i \ge 0`, :math:`\sum_i k_i = W \le K`,
:math:`K = 2^B` (:func:`integer_weights` rounds the strategy's weights to multiples of
:math:`1/K`, whatever the number of sites, so the headroom is for the weight sum, not the site
count) and computes :math:`\prod_i c_i^{k_i} = \mathrm{Enc}(\sum_i k_i m_i)`. Each slot then
holds :math:`T = \sum_i k_i \ell_i \le W \cdot 2Q \le 2^B(2^{V+1}-2) < 2^{b-1}`: the bit budget
is ``b`` = 1 (guard) + 1 (sign, as the offset) + V (value) + B (weight headroom), so no honest
slot sum carries into the next whatever the number of sites, a sum of more than K sites
(some would get weight 0) is refused, and the top bit of every slot is a guard bit no
honest sum sets. A payload names its layout (``slot-bits``, ``value-max``); one of another
layout is refused.

Range check (the decrypting site, :func:`sum_fault`): a lying site may encrypt any plaintext
mod ``n``; it is caught when the SUM leaves what honest sites can produce: a slot above
:math:`W \cdot 2Q` (the guard bit, or a value past the honest maximum), a padding slot of
the last plaintext that is not 0, or a bit above the last slot. Then :func:`decrypt_sum`
raises :class:`SumOutOfRange` and nothing is decoded. What it cannot catch: a lie whose sum
stays in range (a site that knows the others' sum can move every value of the mean anywhere
in ``[-c, c]``: only zero-knowledge range proofs would stop it), and which site lied (the
check sees the sum only; decrypting one site's update is never done). A lie that wraps a
slot past :math:`2^b` lands in the guard half with probability about 1/2 per slot.
The decrypting site returns

.. math::  \hat d_j = \frac{T_j - W Q}{W Q}\, c
           = \sum_i \frac{k_i}{W}\, \frac{(\ell_{ij} - Q)\,c}{Q}.

Quantisation: every site's level is within one step :math:`c/Q` of its exact value and
unbiased, so :math:`|\hat d_j - \sum_i \frac{k_i}{W} \mathrm{clip}(\delta_{ij}, c)| < c / Q`
(:func:`quantisation_bound`; 1.2e-4 for ``c = 1``) with mean 0 and standard deviation at
most :math:`c / (2Q)` per site, shrinking with the number of sites, plus float32 rounding.

Payload (ConfigRecord, no pickle)
---------------------------------
:func:`update_to_record` / :func:`parse_update`; all keys are required, nothing else allowed:

================  ======  ============================================================
key               type    meaning
================  ======  ============================================================
``format``        str     ``"fedind.paillier"``
``version``       int     layout version, ``3`` (version 2: the same slots, no ``set``, read
                          as a dense payload; version 1: 31-bit slots, refused)
``kind``          str     ``"update"`` (site -> server) or ``"aggregate"`` (server -> site)
``key``           str     key fingerprint: SHA-256 of ``n`` (big-endian bytes), hex
``count``         int     number of values (the model's parameters, or ``k`` on a set)
``set``           str     ``""``: every coordinate (dense); else the digest of the round's
                          announced coordinate set (:func:`fedind.paillier.sparse.set_digest`),
                          the values in the order of the set
``slot-bits``     int     b = 2 + V + B (24 by default)
``value-max``     int     Q = 2**V - 1
``clip``          float   c
``weight``        int     1 for an update; W = sum of the integer weights for an aggregate
``sites``         int     1 for an update; number of sites in an aggregate
``ciphertexts``   bytes   ceil(count / S) ciphertexts, each big-endian in exactly
                          ``ceil(bits(n^2) / 8)`` bytes (512 for a 2048-bit key), each
                          in ``[1, n^2)``
================  ======  ============================================================
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import gmpy2
import numpy as np

from .keys import PrivateKey, PublicKey

__all__ = [
    "CiphertextError",
    "EncryptedVector",
    "FINE",
    "SIDE",
    "SIDE_CLIP",
    "Layout",
    "MAX_SITES",
    "MIN_SITES",
    "ObfuscatorPool",
    "SumOutOfRange",
    "VALUE_MAX",
    "decrypt_sum",
    "encrypt_levels",
    "integer_weights",
    "parse_record",
    "quantisation_bound",
    "quantise",
    "sum_fault",
    "weighted_sum",
]

FORMAT = "fedind.paillier"
VERSION = 3
DENSE_VERSION = 2  # read as a dense payload: version 3 without "set"
GUARD_BITS = 1  # the top bit of a slot: no honest sum sets it (sum_fault)
MIN_SITES = 2  # an aggregate of fewer sites would be one site's update


@dataclass(frozen=True)
class Layout:
    """The bits of one packed slot: ``GUARD_BITS`` + 1 (sign, as the offset) + ``value_bits``
    (the level, ``Q = 2^value_bits - 1``) + ``weight_bits`` (headroom for integer site weights
    summing to ``K = 2^weight_bits``, so at most K sites per sum). Run config
    ``paillier-value-bits`` / ``paillier-weight-bits`` (up to 20 value bits there; up to 48
    here, so a slot fits the int64 arithmetic: :data:`SIDE`); the payload names it
    (``slot-bits``, ``value-max``) and a payload of another layout is refused."""

    value_bits: int = 13
    weight_bits: int = 9

    def __post_init__(self) -> None:
        for name, value, low, high in (("value_bits", self.value_bits, 2, 48), ("weight_bits", self.weight_bits, 1, 12)):
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"Invalid {name} value: {value!r} (expected an int in {low}..{high})")

    @classmethod
    def of(cls, config) -> "Layout":
        """The layout a :class:`~fedind.config.RunConfig` names (paillier-value-bits, paillier-weight-bits)."""
        return cls(config.paillier_value_bits, config.paillier_weight_bits)

    @property
    def slot_bits(self) -> int:
        return GUARD_BITS + 1 + self.value_bits + self.weight_bits

    @property
    def value_max(self) -> int:
        """Q: levels lie in ``[-Q, Q]`` before the offset, ``[0, 2Q]`` after."""
        return 2**self.value_bits - 1

    @property
    def max_weight(self) -> int:
        """K: the integer weights of a sum add up to at most this (and so at most K sites)."""
        return 2**self.weight_bits

    def slots(self, key: PublicKey) -> int:
        """Values per plaintext: ``floor((bits(n) - 1) / slot_bits)``."""
        return (key.bits - 1) // self.slot_bits

    def num_ciphertexts(self, key: PublicKey, count: int) -> int:
        return -(-count // self.slots(key))


FINE = Layout()  # 24-bit slots, 13-bit levels, up to 512 sites: 85 values per 2048-bit key
# Side sums (a phase end's Fisher, head calibration's feature moments: fedind.paillier.sums):
# per-example means whose scale is not an update's, once per phase, so 40-bit levels under a
# clip of 2^16: a step of 6e-8, 51-bit slots, 40 values per 2048-bit key.
SIDE = Layout(value_bits=40, weight_bits=9)
SIDE_CLIP = float(2**16)
SLOT_BITS = FINE.slot_bits
VALUE_MAX = FINE.value_max
MAX_SITES = FINE.max_weight
KINDS = ("update", "aggregate")
DENSE_KEYS = frozenset(
    {"format", "version", "kind", "key", "count", "slot-bits", "value-max", "clip", "weight", "sites", "ciphertexts"}
)
RECORD_KEYS = DENSE_KEYS | {"set"}


class CiphertextError(ValueError):
    """An encrypted payload that fails validation; the message names the field and the fault."""


class SumOutOfRange(CiphertextError):
    """A decrypted sum that honest sites cannot produce: a site encrypted out-of-range values."""


# --------------------------------------------------------------------------- fixed point


def quantise(
    values: np.ndarray, clip: float, rng: np.random.Generator, layout: Layout = FINE
) -> tuple[np.ndarray, int]:
    """``(levels int64 in [0, 2Q], number of clipped values)`` of finite float ``values``,
    rounded stochastically (unbiased: module docstring) with draws from ``rng``, which the
    caller seeds (a site: :func:`fedind.paillier.site.rounding_rng`), so a run repeats."""
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"Invalid clip value: {clip!r}")
    x = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(x)):
        raise ValueError(f"cannot encrypt {int(np.size(x) - np.isfinite(x).sum())} NaN/Inf values")
    clipped = int(np.count_nonzero(np.abs(x) > clip))
    q = layout.value_max
    scaled = np.clip(x, -clip, clip) * (q / clip)  # in [-Q, Q]
    levels = np.floor(scaled + rng.random(scaled.size)).astype(np.int64)
    return np.clip(levels, -q, q) + q, clipped


def dequantise(sums: np.ndarray, weight: int, clip: float, layout: Layout = FINE) -> np.ndarray:
    """The weighted mean of slot sums ``T = sum_i k_i l_i`` with ``W = sum_i k_i = weight``
    (``weight`` 1: the values of one site's offset levels)."""
    q = layout.value_max
    return ((sums.astype(np.float64) - weight * q) * (clip / (weight * q))).astype(np.float32)


def quantisation_bound(clip: float, layout: Layout = FINE) -> float:
    """Largest |decrypted aggregate - weighted mean of the clipped float updates| (per value):
    one quantisation step (stochastic rounding; its mean error is 0)."""
    return clip / layout.value_max


def pack(levels: np.ndarray, slots: int, slot_bits: int = SLOT_BITS) -> list[int]:
    """Plaintexts ``m = sum_s l_s 2^(slot_bits s)``, ``slots`` levels each (the last padded with 0)."""
    levels = np.asarray(levels, dtype=np.int64)
    if levels.size and (levels.min() < 0 or levels.max() >= 2**slot_bits):
        raise ValueError(f"levels must lie in [0, 2^{slot_bits})")
    rows = -(-levels.size // slots)
    padded = np.zeros(rows * slots, dtype=np.uint64)
    padded[: levels.size] = levels
    bits = ((padded.reshape(rows, slots, 1) >> np.arange(slot_bits, dtype=np.uint64)) & 1).astype(np.uint8)
    packed = np.packbits(bits.reshape(rows, slots * slot_bits), axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def unpack(plaintexts: Sequence[int], slots: int, count: int | None = None, slot_bits: int = SLOT_BITS) -> np.ndarray:
    """Inverse of :func:`pack` for slot sums: int64 ``[count]`` (None: every slot, the padding
    included). SumOutOfRange when a plaintext has bits above its last slot."""
    width = slots * slot_bits
    nbytes = (width + 7) // 8
    rows = []
    for i, m in enumerate(plaintexts):
        if m >> width:
            raise SumOutOfRange(
                f"ciphertext {i}: the decrypted sum has bits above its {slots} slots: "
                f"overflow (a site encrypted an out-of-range plaintext)"
            )
        rows.append(np.frombuffer(m.to_bytes(nbytes, "little"), dtype=np.uint8))
    if not rows:
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(np.stack(rows), axis=1, bitorder="little")[:, :width].reshape(-1, slots, slot_bits)
    powers = (1 << np.arange(slot_bits, dtype=np.int64))
    return (bits.astype(np.int64) * powers).sum(axis=2).ravel()[:count]


def sum_fault(sums: np.ndarray, weight: int, count: int, layout: Layout = FINE) -> str | None:
    """Why the slot sums ``sums`` (every slot, :func:`unpack`) of ``count`` values under the
    weight sum ``weight`` cannot come from honest sites, or None when they can: honest levels
    lie in ``[0, 2Q]``, so each value's sum lies in ``[0, W 2Q]`` (below the guard bit) and
    the padding after the last value sums to 0."""
    values, padding = sums[:count], sums[count:]
    limit = weight * 2 * layout.value_max
    over = np.flatnonzero(values > limit)
    if over.size:
        j = int(over[0])
        guard = int(np.count_nonzero(values[over] >> (layout.slot_bits - GUARD_BITS)))
        return (
            f"value {j}: decrypted slot sum {int(values[j])} exceeds {limit} = weight {weight} x 2Q "
            f"({over.size} of {count} values out of range, {guard} with the guard bit set): "
            f"overflow (a site encrypted an out-of-range plaintext)"
        )
    if np.any(padding):
        j = int(np.flatnonzero(padding)[0])
        return (
            f"padding slot {count + j} sums to {int(padding[j])}, not 0: "
            f"overflow (a site encrypted an out-of-range plaintext)"
        )
    return None


# --------------------------------------------------------------------------- encryption


class ObfuscatorPool:
    """Obfuscators (n-th residues mod n^2) drawn ahead of use (they do not depend on the plaintext).

    ``fill(count)`` draws now (``workers`` > 1: in that many processes); ``fill_async``
    draws in a background thread (e.g. while the site trains) and ``take`` waits for it.
    Every obfuscator is used once: ``take`` removes what it returns.
    """

    def __init__(self, key: PrivateKey, workers: int = 1) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"Invalid workers value: {workers!r}")
        self.key = key
        self.workers = workers
        self._ready: list[int] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ready)

    def fill(self, count: int) -> None:
        drawn = _draw(self.key, count, self.workers)
        with self._lock:
            self._ready.extend(drawn)

    def fill_async(self, count: int, chunk: int = 32) -> None:
        """Draw ``count`` in a daemon thread, ``chunk`` at a time (the GIL is released between)."""

        def run() -> None:
            left = count
            while left > 0:
                drawn = self.key.obfuscators(min(chunk, left))
                with self._lock:
                    self._ready.extend(drawn)
                left -= len(drawn)

        self.wait()
        self._thread = threading.Thread(target=run, name="paillier-obfuscators", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, count: int) -> list[int]:
        self.wait()
        with self._lock:
            taken, self._ready = self._ready[:count], self._ready[count:]
        if len(taken) < count:
            taken += _draw(self.key, count - len(taken), self.workers)
        return taken


def _draw(key: PrivateKey, count: int, workers: int) -> list[int]:
    if workers == 1 or count < 2 * workers:
        return key.obfuscators(count)
    sizes = [count // workers + (i < count % workers) for i in range(workers)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        parts = pool.map(_obfuscators_in_worker, [(key.p, key.q, key.order_p, key.order_q, s) for s in sizes])
        return [y for part in parts for y in part]


def _obfuscators_in_worker(args: tuple) -> list[int]:
    p, q, order_p, order_q, count = args
    return PrivateKey(p, q, order_p, order_q).obfuscators(count)


@dataclass(frozen=True)
class EncryptedVector:
    """Packed ciphertexts of ``count`` values under the key ``fingerprint`` (layout v3);
    ``coordinates``: the digest of the announced set they are the values of (``""``: dense)."""

    kind: str
    fingerprint: str
    count: int
    clip: float
    weight: int
    sites: int
    ciphertexts: list[int]
    coordinates: str = ""
    layout: Layout = FINE

    def to_config(self, key: PublicKey) -> dict:
        """The ConfigRecord content (module docstring); ``key`` gives the ciphertext width."""
        width = key.ciphertext_bytes
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "key": self.fingerprint,
            "count": int(self.count),
            "slot-bits": self.layout.slot_bits,
            "value-max": self.layout.value_max,
            "clip": float(self.clip),
            "weight": int(self.weight),
            "sites": int(self.sites),
            "set": self.coordinates,
            "ciphertexts": b"".join(int(c).to_bytes(width, "big") for c in self.ciphertexts),
        }


def encrypt_levels(
    levels: np.ndarray, key: PrivateKey, clip: float, pool: ObfuscatorPool | None = None, coordinates: str = "",
    layout: Layout = FINE,
) -> EncryptedVector:
    """Pack ``levels`` (from :func:`quantise` under ``layout``) and encrypt: ``(1 + m n) y mod n^2``;
    ``coordinates``: the digest of the announced set the levels are on (``""``: dense)."""
    pub = key.public
    plaintexts = pack(levels, layout.slots(pub), layout.slot_bits)
    obfuscators = (pool or ObfuscatorPool(key)).take(len(plaintexts))
    n, n2 = gmpy2.mpz(pub.n), gmpy2.mpz(pub.n_square)
    ciphertexts = [int(((1 + m * n) % n2) * r % n2) for m, r in zip(plaintexts, obfuscators)]
    return EncryptedVector("update", pub.fingerprint, int(np.size(levels)), float(clip), 1, 1, ciphertexts,
                           str(coordinates), layout)


def integer_weights(weights: Sequence[float], total: int = MAX_SITES) -> list[int]:
    """Non-negative integers summing to ``total`` with ``k_i / total`` nearest ``w_i / sum w``
    (largest remainders), ``total`` the layout's ``max_weight``. More than ``total`` sites is
    refused: the slot headroom is for a weight sum of ``total``."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"Invalid weights: {weights!r} (need non-negative finite values, positive sum)")
    if not (isinstance(total, int) and total >= 1):
        raise ValueError(f"Invalid weight total {total!r}: a positive int")
    if w.size > total:
        raise CiphertextError(
            f"{w.size} sites exceed the slot headroom: at most {total} encrypted updates can be "
            f"summed (weights are multiples of 1/{total})"
        )
    exact = w / w.sum() * total
    k = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - k), kind="stable")
    k[order[: total - int(k.sum())]] += 1
    return [int(x) for x in k]


def weighted_sum(vectors: Sequence[EncryptedVector], weights: Sequence[int], key: PublicKey) -> EncryptedVector:
    """``Enc(sum_i k_i m_i) = prod_i c_i^k_i mod n^2`` (server side: public key only).

    The vectors must be validated updates under ``key`` of equal count, clip and layout; the
    integer weights must be >= 0 and sum to at most the layout's ``max_weight`` (the slot headroom)."""
    if len(vectors) != len(weights) or not vectors:
        raise ValueError("weighted_sum needs one integer weight per encrypted update")
    first = vectors[0]
    limit = first.layout.max_weight
    if any(not isinstance(k, int) or k < 0 for k in weights) or not 0 < sum(weights) <= limit:
        raise CiphertextError(
            f"integer weights {list(weights)} must be >= 0 with a sum in 1..{limit} (the slot headroom)"
        )
    for v in vectors:
        if v.kind != "update" or v.fingerprint != key.fingerprint:
            raise CiphertextError("weighted_sum takes updates under the server's key only")
        if (v.count, v.clip, len(v.ciphertexts), v.coordinates, v.layout) != (
            first.count, first.clip, len(first.ciphertexts), first.coordinates, first.layout
        ):
            raise CiphertextError(
                "encrypted updates of one round differ in count, clip, length, coordinate set or layout"
            )
    n2 = gmpy2.mpz(key.n_square)
    terms = [(v.ciphertexts, k) for v, k in zip(vectors, weights) if k > 0]
    out = []
    for j in range(len(first.ciphertexts)):
        acc = gmpy2.mpz(1)
        for cts, k in terms:
            acc = acc * (cts[j] if k == 1 else gmpy2.powmod(cts[j], k, n2)) % n2
        out.append(int(acc))
    return EncryptedVector("aggregate", key.fingerprint, first.count, first.clip, sum(weights), len(terms), out,
                           first.coordinates, first.layout)


def decrypt_sum(aggregate: EncryptedVector, key: PrivateKey) -> np.ndarray:
    """The weighted mean (float32 ``[count]``) of an aggregate; SumOutOfRange when the sum is
    one honest sites cannot produce (:func:`sum_fault`, or bits above the slots)."""
    if aggregate.fingerprint != key.public.fingerprint:
        raise CiphertextError(
            f"key fingerprint {aggregate.fingerprint[:16]}… is not this site's key {key.public.fingerprint[:16]}…"
        )
    layout = aggregate.layout
    sums = unpack(key.decrypt_many(aggregate.ciphertexts), layout.slots(key.public), slot_bits=layout.slot_bits)
    fault = sum_fault(sums, aggregate.weight, aggregate.count, layout)
    if fault is not None:
        raise SumOutOfRange(fault)
    return dequantise(sums[: aggregate.count], aggregate.weight, aggregate.clip, layout)


# --------------------------------------------------------------------------- payload


def parse_record(
    record: Mapping, key: PublicKey, *, kind: str, count: int | None = None, clip: float | None = None,
    coordinates: str | None = None, layout: Layout = FINE,
) -> EncryptedVector:
    """Validate a ConfigRecord (as a mapping) against ``key``; CiphertextError names the fault.

    Checks keys, format, version (3, or 2 read as dense), kind, key fingerprint, layout
    constants, the coordinate set, ``count`` and ``clip`` (when given: what the server
    expects; ``coordinates``: the announced set's digest, ``""`` dense), weight/sites ranges, the exact byte
    length (``ceil(count / S)`` ciphertexts of fixed width) and every ciphertext in
    ``[1, n^2)``.
    """
    if not isinstance(record, Mapping):
        raise CiphertextError(f"encrypted payload must be a ConfigRecord, got {type(record).__name__}")
    version = record.get("version")
    if record.get("format") != FORMAT or type(version) is not int or version not in (DENSE_VERSION, VERSION):
        raise CiphertextError(
            f"format {record.get('format')!r} version {version!r}: expected {FORMAT!r} version {VERSION} "
            f"(with a coordinate set; or {DENSE_VERSION}, dense; the server and every "
            f"site must run the same packing layout)"
        )
    expected_keys = RECORD_KEYS if version == VERSION else DENSE_KEYS
    keys = set(record)
    if keys != expected_keys:
        raise CiphertextError(
            f"encrypted payload keys: missing {sorted(expected_keys - keys)}, unexpected {sorted(keys - expected_keys)}"
        )
    named = record["set"] if version == VERSION else ""
    if not isinstance(named, str) or (coordinates is not None and named != coordinates):
        what = "every coordinate (dense)" if coordinates == "" else f"the announced set {str(coordinates)[:16]}…"
        got = "every coordinate (dense)" if named == "" else f"set {str(named)[:16]}…"
        raise CiphertextError(
            f"coordinate set: version {version} payload of {got}, expected {what} "
            f"(a stale reply, or a site that did not encrypt the round's set)"
        )
    if record["kind"] != kind:
        raise CiphertextError(f"kind {record['kind']!r}: expected {kind!r}")
    if record["key"] != key.fingerprint:
        raise CiphertextError(
            f"key fingerprint {str(record['key'])[:16]}… does not match the federation's public key "
            f"{key.fingerprint[:16]}… (encrypted under another key: provision the current key pair)"
        )
    if (type(record["slot-bits"]), type(record["value-max"])) != (int, int) or (
        record["slot-bits"] != layout.slot_bits or record["value-max"] != layout.value_max
    ):
        raise CiphertextError(
            f"layout slot-bits {record['slot-bits']!r}, value-max {record['value-max']!r}: "
            f"expected {layout.slot_bits}, {layout.value_max} (run config paillier-value-bits = "
            f"{layout.value_bits}, paillier-weight-bits = {layout.weight_bits}: the server and every site "
            f"must run the same layout)"
        )
    n = record["count"]
    if type(n) is not int or n < 1 or (count is not None and n != count):
        raise CiphertextError(f"count {n!r}: expected {count if count is not None else 'a positive int'}")
    c = record["clip"]
    if type(c) is not float or not (math.isfinite(c) and c > 0) or (clip is not None and c != clip):
        raise CiphertextError(f"clip {c!r}: expected {clip if clip is not None else 'a positive float'}")
    weight, sites = record["weight"], record["sites"]
    if kind == "update" and (type(weight) is not int or type(sites) is not int or weight != 1 or sites != 1):
        raise CiphertextError(f"an update has weight 1 and sites 1, got {weight!r}, {sites!r}")
    if kind == "aggregate" and not (
        type(weight) is int and type(sites) is int and 1 <= sites <= weight <= layout.max_weight
    ):
        raise CiphertextError(
            f"aggregate weight {weight!r} / sites {sites!r}: need 1 <= sites <= weight <= {layout.max_weight}"
        )
    blob = record["ciphertexts"]
    if not isinstance(blob, bytes):
        raise CiphertextError(f"ciphertexts is a {type(blob).__name__}, expected bytes")
    width, expected = key.ciphertext_bytes, layout.num_ciphertexts(key, n)
    if len(blob) != width * expected:
        raise CiphertextError(
            f"ciphertexts hold {len(blob)} bytes, expected {expected} x {width} = {width * expected} "
            f"for {n} values (truncated or padded)"
        )
    n2 = key.n_square
    ciphertexts = [int.from_bytes(blob[i : i + width], "big") for i in range(0, len(blob), width)]
    for i, ct in enumerate(ciphertexts):
        if not 0 < ct < n2:
            raise CiphertextError(f"ciphertext {i} is out of range (must lie in [1, n^2))")
        if gmpy2.gcd(ct, key.n) != 1:
            raise CiphertextError(f"ciphertext {i} is not a unit mod n^2 (shares a factor with n)")
    return EncryptedVector(kind, key.fingerprint, n, c, int(weight), int(sites), ciphertexts, named, layout)
