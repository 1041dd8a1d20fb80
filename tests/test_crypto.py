"""Paillier maths (fedind.paillier.keys, fedind.paillier.packing): keys, packing, weighted sums, bounds,
payload validation.

Real Paillier ciphertexts throughout, with small keys (512 / 1024 bits) to stay fast.
"""

from __future__ import annotations

import json
import math
import os
import stat

import gmpy2
import numpy as np
import pytest

from fedind.paillier import keys, packing
from fedind.cli import main as cli_main
from fedind.config import ConfigError, RunConfig
from fedind.paillier.keys import (
    KeyFileError,
    PublicKey,
    load_private_key,
    load_public_key,
    save_keypair,
)
from fedind.paillier.packing import (
    FINE,
    GUARD_BITS,
    Layout,
    MAX_SITES,
    SLOT_BITS,
    VALUE_MAX,
    CiphertextError,
    ObfuscatorPool,
    decrypt_sum,
    encrypt_levels,
    integer_weights,
    pack,
    parse_record,
    quantisation_bound,
    quantise,
    unpack,
    weighted_sum,
)


@pytest.fixture(scope="module")
def key():
    return keys.generate_keypair(1024)


@pytest.fixture(scope="module")
def other_key():
    return keys.generate_keypair(512)


COMPACT = Layout(value_bits=3, weight_bits=7)  # 12-bit slots: 4-bit levels, up to 128 sites


def encrypt(values, key, clip=1.0, layout=FINE):
    levels, _ = quantise(np.asarray(values), clip, np.random.default_rng(0), layout=layout)
    return encrypt_levels(levels, key, clip, layout=layout)


def raw_ciphertext(key, m: int) -> int:
    """A well-formed ciphertext of an arbitrary plaintext m (what a cheating site could send)."""
    (r,) = key.obfuscators(1)
    n, n2 = key.public.n, key.public.n_square
    return (1 + m * n) * r % n2


# --------------------------------------------------------------------------- sums


@pytest.mark.parametrize("count", [1, 32, 33, 34, 1000])
def test_decrypted_weighted_sum_matches_the_plaintext_oracle_within_the_bound(key, count):
    rng = np.random.default_rng(count)
    clip = 0.5
    updates = [rng.normal(scale=0.2, size=count).astype(np.float32) for _ in range(4)]
    updates[0][:1] = 0.7  # clipped
    updates[1][:1] = -clip  # exactly at the clip
    weights = [3.0, 1.0, 0.5, 2.5]
    k = integer_weights(weights)
    aggregate = weighted_sum([encrypt(u, key, clip) for u in updates], k, key.public)
    mean = decrypt_sum(aggregate, key)
    oracle = np.average(np.stack([np.clip(u.astype(np.float64), -clip, clip) for u in updates]), axis=0, weights=k)
    assert mean.dtype == np.float32 and mean.shape == (count,)
    tolerance = quantisation_bound(clip) + np.abs(oracle) * 2**-23
    assert np.all(np.abs(mean - oracle) <= tolerance)
    # and the integer weights are the strategy's weights to within 1/(2K) each
    assert np.allclose(np.array(k) / MAX_SITES, np.array(weights) / sum(weights), atol=0.5 / MAX_SITES)


def test_extremes_of_every_slot_survive_the_largest_weight_sum(key):
    """All sites at +clip (or -clip) with weights summing to K: the slot sums hit W * 2Q and 0."""
    count = 2 * FINE.slots(key.public) + 3
    ones = np.ones(count, dtype=np.float32)
    aggregate = weighted_sum([encrypt(ones, key), encrypt(ones, key)], [MAX_SITES - 1, 1], key.public)
    assert np.all(decrypt_sum(aggregate, key) == 1.0)
    aggregate = weighted_sum([encrypt(-ones, key), encrypt(-ones, key)], [MAX_SITES // 2] * 2, key.public)
    assert np.all(decrypt_sum(aggregate, key) == -1.0)


def test_quantisation_bound_formula():
    assert quantisation_bound(1.0) == 1.0 / (2**13 - 1)
    assert SLOT_BITS == GUARD_BITS + 1 + 13 + 9 and MAX_SITES * 2 * VALUE_MAX < 2 ** (SLOT_BITS - GUARD_BITS)


def test_pack_unpack_roundtrip_and_refusals():
    rng = np.random.default_rng(0)
    levels = rng.integers(0, 2**SLOT_BITS, size=90)
    assert np.array_equal(unpack(pack(levels, 42), 42, 90), levels)
    with pytest.raises(ValueError, match=r"\[0, 2\^24\)"):
        pack(np.array([-1]), 42)
    with pytest.raises(ValueError, match=r"\[0, 2\^24\)"):
        pack(np.array([2**SLOT_BITS]), 42)
    with pytest.raises(CiphertextError, match="bits above"):
        unpack([1 << (42 * SLOT_BITS)], 42, 1)


def test_quantise_refuses_nan_and_counts_clipped():
    levels, clipped = quantise(np.array([0.0, 2.0, -3.0, 0.5]), 1.0, np.random.default_rng(0))
    assert clipped == 2 and list(levels[:3]) == [VALUE_MAX, 2 * VALUE_MAX, 0]
    assert levels[3] - VALUE_MAX in (VALUE_MAX // 2, VALUE_MAX // 2 + 1)  # 0.5 Q = 4095.5: either neighbour
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantise(np.array([0.0, np.nan]), 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="clip"):
        quantise(np.zeros(2), 0.0, np.random.default_rng(0))


# --------------------------------------------------------------------------- headroom / overflow


def test_more_sites_than_the_headroom_allows_are_refused():
    assert sum(integer_weights(np.ones(MAX_SITES))) == MAX_SITES
    with pytest.raises(CiphertextError, match=f"at most {MAX_SITES} encrypted updates"):
        integer_weights(np.ones(MAX_SITES + 1))


def test_integer_weights_beyond_the_headroom_are_refused(key):
    v = encrypt(np.zeros(5), key)
    with pytest.raises(CiphertextError, match="slot headroom"):
        weighted_sum([v, v], [MAX_SITES, 1], key.public)
    with pytest.raises(CiphertextError, match="slot headroom"):
        weighted_sum([v, v], [-1, 3], key.public)


def test_packing_bounds_hold_for_any_number_of_sites_at_the_extremes():
    """Property: whatever the number of sites (2..K) and their weights (integer_weights of
    random, skewed or equal weights, sum K), levels at the extremes 0 / 2Q or random, the
    weighted sum of the packed plaintexts (what decryption yields) stays below n, every slot
    below 2^SLOT_BITS, and unpacks to exactly the per-slot weighted sums."""
    rng = np.random.default_rng(7)
    slots = FINE.slots(PublicKey((1 << 2047) + 1))  # 2048-bit modulus: 85 slots, sum < 2^2040
    for draw in range(60):
        sites = int(rng.choice([2, 3, 5, 64, MAX_SITES, int(rng.integers(2, MAX_SITES + 1))]))
        raw = [np.ones(sites), rng.random(sites), rng.random(sites) ** 8, np.eye(1, sites, 0).ravel() + 1e-9][draw % 4]
        k = integer_weights(raw)
        assert sum(k) == MAX_SITES and len(k) == sites
        pattern = draw % 3
        levels = [
            np.full(slots + 3, 2 * VALUE_MAX) if pattern == 0 else
            rng.choice([0, 2 * VALUE_MAX], size=slots + 3) if pattern == 1 else
            rng.integers(0, 2 * VALUE_MAX + 1, size=slots + 3)
            for _ in range(sites)
        ]
        plaintexts = [pack(lv, slots) for lv in levels]
        total = [sum(ki * m[j] for ki, m in zip(k, plaintexts)) for j in range(len(plaintexts[0]))]
        assert all(t < 2 ** (slots * SLOT_BITS) <= 2**2047 for t in total)
        sums = unpack(total, slots, slots + 3)
        expected = sum(ki * lv.astype(np.int64) for ki, lv in zip(k, levels))
        assert np.array_equal(sums, expected) and sums.max() <= MAX_SITES * 2 * VALUE_MAX < 2 ** (SLOT_BITS - GUARD_BITS)


def test_the_maximum_number_of_sites_at_the_clip_decodes_exactly(key):
    """K encrypted sites, all at +clip (or all at -clip, or alternating), weight 1 each (the
    integer weights of K equal sites): the slot sums hit W * 2Q and 0 and decode exactly."""
    count = FINE.slots(key.public) + 2
    for values, expected in ((1.0, 1.0), (-1.0, -1.0)):
        vectors = [encrypt(np.full(count, values * 3.0), key)] * MAX_SITES  # clipped to +-1
        k = integer_weights(np.ones(MAX_SITES))
        assert k == [1] * MAX_SITES
        assert np.all(decrypt_sum(weighted_sum(vectors, k, key.public), key) == expected)
    plus, minus = encrypt(np.ones(count), key), encrypt(-np.ones(count), key)
    mean = decrypt_sum(weighted_sum([plus, minus] * (MAX_SITES // 2), [1] * MAX_SITES, key.public), key)
    assert np.all(mean == 0.0)


# --------------------------------------------------------------------------- other layouts


@pytest.mark.parametrize("value_bits, weight_bits", [(3, 7), (5, 6), (2, 1), (20, 12)])
def test_a_layouts_slot_sums_never_reach_its_guard_bit_at_its_site_limit(value_bits, weight_bits):
    """Any layout: K = 2^weight_bits sites at the top level 2Q sum to K 2Q, below the guard
    bit, and the slots of a 2048-bit key stay below n; the sums unpack exactly."""
    layout = Layout(value_bits, weight_bits)
    q, k = layout.value_max, layout.max_weight
    assert k * 2 * q < 2 ** (layout.slot_bits - GUARD_BITS)
    slots = layout.slots(PublicKey((1 << 2047) + 1))
    assert slots * layout.slot_bits <= 2047
    rng = np.random.default_rng(value_bits)
    levels = [np.full(slots + 1, 2 * q)] * (k - 1) + [rng.integers(0, 2 * q + 1, size=slots + 1)]
    plaintexts = [pack(lv, slots, layout.slot_bits) for lv in levels]
    total = [sum(m[j] for m in plaintexts) for j in range(2)]
    sums = unpack(total, slots, slots + 1, slot_bits=layout.slot_bits)
    assert np.array_equal(sums, sum(lv.astype(np.int64) for lv in levels))
    assert packing.sum_fault(np.append(sums, [0] * (slots - 1)), k, slots + 1, layout) is None


def test_the_compact_layout_decodes_the_weighted_mean_within_its_step(key):
    """4-bit levels in 12-bit slots: 170 values per 2048-bit plaintext (85 in the fine layout);
    the decrypted weighted mean is the clipped oracle within one step c/7, unbiased, and K =
    128 sites at the clip decode exactly."""
    assert COMPACT.slot_bits == 12 and COMPACT.slots(PublicKey((1 << 2047) + 1)) == 170
    clip, count = 0.5, COMPACT.slots(key.public) + 5
    rng = np.random.default_rng(11)
    updates = [rng.normal(scale=0.2, size=count) for _ in range(5)]
    k = integer_weights([3.0, 1.0, 0.5, 2.5, 1.0], COMPACT.max_weight)
    assert sum(k) == 128
    aggregate = weighted_sum([encrypt(u, key, clip, COMPACT) for u in updates], k, key.public)
    assert len(aggregate.ciphertexts) == 2 and aggregate.layout == COMPACT
    mean = decrypt_sum(aggregate, key)
    oracle = np.average(np.stack([np.clip(u, -clip, clip) for u in updates]), axis=0, weights=k)
    assert np.all(np.abs(mean - oracle) <= quantisation_bound(clip, COMPACT) + 1e-6)
    assert abs(float(np.mean(mean - oracle))) < 0.1 * quantisation_bound(clip, COMPACT)  # unbiased
    top = [encrypt(np.full(count, 9.0), key, clip, COMPACT)] * COMPACT.max_weight
    assert np.all(decrypt_sum(weighted_sum(top, [1] * 128, key.public), key) == np.float32(clip))
    with pytest.raises(CiphertextError, match="slot headroom"):
        weighted_sum(top[:2], [128, 1], key.public)


def test_a_payload_of_another_layout_is_refused_naming_the_run_config_keys(key):
    """A site on the fine layout, a server on the compact one (or the reverse): refused, and
    the message names the keys to align; mixing layouts in one sum is refused too."""
    fine = encrypt(np.zeros(10), key)
    compact = encrypt(np.zeros(10), key, layout=COMPACT)
    with pytest.raises(CiphertextError, match="expected 12, 7 .run config paillier-value-bits = 3, paillier-weight-bits = 7"):
        parse_record(fine.to_config(key.public), key.public, kind="update", layout=COMPACT)
    with pytest.raises(CiphertextError, match="slot-bits 12, value-max 7: expected 24, 8191"):
        parse_record(compact.to_config(key.public), key.public, kind="update")
    assert parse_record(compact.to_config(key.public), key.public, kind="update", layout=COMPACT).layout == COMPACT
    with pytest.raises(CiphertextError, match="layout"):
        weighted_sum([fine, compact], [1, 1], key.public)


def test_stochastic_rounding_is_unbiased_and_stays_on_the_neighbouring_levels():
    rng = np.random.default_rng(3)
    clip, draws = 1.0, 40_000
    step = clip / VALUE_MAX
    for exact in (0.1 * step, 0.37 * step, 1234.5 * step, -0.9 * step, -(VALUE_MAX - 0.25) * step):
        levels, _ = quantise(np.full(draws, exact), clip, rng)
        values = (levels - VALUE_MAX) * step
        low = np.floor(exact / step) * step
        assert set(np.round((values - low) / step).astype(int)) <= {0, 1}  # floor or ceil only
        frac = exact / step - np.floor(exact / step)
        sigma = step * math.sqrt(frac * (1 - frac) / draws)
        assert abs(values.mean() - exact) <= 5 * sigma + 1e-15
    # deterministic rounding would be biased by up to half a step on such values; this is not
    levels, _ = quantise(np.full(draws, 0.25 * step), clip, rng)
    assert abs(((levels - VALUE_MAX) * step).mean() - 0.25 * step) < 0.05 * step


def textbook_decrypt(key, c: int) -> int:
    """Paillier's decryption without CRT: L(c^lambda mod n^2) * lambda^-1 mod n (g = n + 1)."""
    n, n2 = key.public.n, key.public.n_square
    lam = (key.p - 1) * (key.q - 1)
    return (pow(c, lam, n2) - 1) // n * pow(lam, -1, n) % n


def test_crt_short_exponent_decryption_equals_the_plain_one(key):
    assert key.short_exponents and key.order_p.bit_length() == keys.ORDER_BITS
    assert (key.p - 1) % key.order_p == 0 and (key.q - 1) % key.order_q == 0
    n = key.public.n
    plaintexts = [0, 1, n - 1, 2 ** (FINE.slots(key.public) * SLOT_BITS) - 1] + [secrets_below(n) for _ in range(20)]
    ciphertexts = [raw_ciphertext(key, m) for m in plaintexts]
    assert key.decrypt_many(ciphertexts) == plaintexts == [textbook_decrypt(key, c) for c in ciphertexts]
    assert [int(key.phe.raw_decrypt(c)) for c in ciphertexts] == plaintexts  # phe's CRT decryption
    # and on a real weighted sum
    v = encrypt(np.linspace(-1, 1, 100), key)
    agg = weighted_sum([v, v, v], [3, 250, 259], key.public)
    assert key.decrypt_many(agg.ciphertexts) == [textbook_decrypt(key, c) for c in agg.ciphertexts]


def test_a_key_without_subgroups_still_encrypts_and_decrypts(key):
    from phe import paillier

    _, phe_private = paillier.generate_paillier_keypair(n_length=512)
    try:
        plain_key = keys.PrivateKey(phe_private.p, phe_private.q)
    except KeyFileError:
        pytest.skip("phe drew primes without the CRT condition")
    assert not plain_key.short_exponents
    v = encrypt(np.linspace(-1, 1, 50), plain_key)
    agg = weighted_sum([v, v], [1, 1], plain_key.public)
    assert plain_key.decrypt_many(agg.ciphertexts) == [textbook_decrypt(plain_key, c) for c in agg.ciphertexts]
    assert np.abs(decrypt_sum(agg, plain_key) - np.linspace(-1, 1, 50)).max() <= quantisation_bound(1.0)


def secrets_below(n: int) -> int:
    import secrets

    return secrets.randbelow(n)


def test_a_site_that_encrypts_an_out_of_range_slot_makes_decryption_refuse(key):
    honest = encrypt(np.zeros(3), key)
    # slot 1 far above 2Q (the largest level a site can quantise to), short of a carry:
    # decryption catches slot sums above W * 2Q (not every in-range lie; README threat model)
    cheat = [raw_ciphertext(key, (2**SLOT_BITS - 2**FINE.value_bits) << SLOT_BITS)]
    forged = packing.EncryptedVector("update", key.public.fingerprint, 3, 1.0, 1, 1, cheat)
    aggregate = weighted_sum([honest, forged], [1, 1], key.public)
    with pytest.raises(CiphertextError, match=r"value 1: decrypted slot sum .* exceeds .*overflow"):
        decrypt_sum(aggregate, key)


def lying_update(key, levels: list[int], count: int) -> packing.EncryptedVector:
    """One site's update whose plaintext is ``sum_s levels[s] 2^(24 s)``, whatever the levels
    (a level past 2^24 spills into the next slot): what a lying site can encrypt."""
    m = sum(int(level) << (SLOT_BITS * s) for s, level in enumerate(levels))
    return packing.EncryptedVector("update", key.public.fingerprint, count, 1.0, 1, 1, [raw_ciphertext(key, m)])


def test_a_sum_exactly_at_the_honest_maximum_decodes_and_one_level_more_is_refused(key):
    """Two sites at +clip with weights K - 1 and 1: every slot at W * 2Q, the largest honest
    sum, decodes exactly; a lying site one level above 2Q in slot 2 is refused."""
    honest = encrypt(np.ones(3), key)
    assert np.all(decrypt_sum(weighted_sum([honest, lying_update(key, [2 * VALUE_MAX] * 3, 3)],
                                           [MAX_SITES - 1, 1], key.public), key) == 1.0)
    liar = lying_update(key, [2 * VALUE_MAX, 2 * VALUE_MAX, 2 * VALUE_MAX + 1], 3)
    with pytest.raises(packing.SumOutOfRange, match=r"value 2: decrypted slot sum 8387585 exceeds 8387584"):
        decrypt_sum(weighted_sum([honest, liar], [MAX_SITES - 1, 1], key.public), key)


def test_a_value_that_carries_into_the_next_slot_sets_the_guard_bit_and_is_refused(key):
    """A level of 2^24 + 2^23 - Q in slot 0 carries 1 into slot 1 and leaves 2^23 (the guard
    bit, which no honest sum sets) in slot 0: refused, nothing decoded."""
    honest = encrypt(np.zeros(3), key)  # levels Q exactly
    liar = lying_update(key, [2**SLOT_BITS + 2 ** (SLOT_BITS - 1) - VALUE_MAX, VALUE_MAX, VALUE_MAX], 3)
    sums = unpack(key.decrypt_many(weighted_sum([honest, liar], [1, 1], key.public).ciphertexts), FINE.slots(key.public), 3)
    assert sums.tolist() == [2 ** (SLOT_BITS - 1), 2 * VALUE_MAX + 1, 2 * VALUE_MAX]  # the carry
    with pytest.raises(packing.SumOutOfRange, match=r"value 0: .*1 with the guard bit set\): overflow"):
        decrypt_sum(weighted_sum([honest, liar], [1, 1], key.public), key)


def test_a_carry_that_lands_inside_the_range_cannot_be_told_from_an_honest_sum(key):
    """The limit of the check (module docstring): a lie whose sum stays in range decodes. A
    level of 2^24 in slot 0 leaves slot 0 as it was and adds one level to slot 1."""
    honest = encrypt(np.zeros(3), key)
    liar = lying_update(key, [2**SLOT_BITS + VALUE_MAX, VALUE_MAX, VALUE_MAX], 3)
    mean = decrypt_sum(weighted_sum([honest, liar], [1, 1], key.public), key)
    assert mean.tolist() == pytest.approx([0.0, 0.5 / VALUE_MAX, 0.0])


def test_a_lie_in_the_padding_after_the_last_value_is_refused(key):
    honest = encrypt(np.zeros(3), key)
    liar = lying_update(key, [VALUE_MAX, VALUE_MAX, VALUE_MAX, 1], 3)  # slot 3 is padding
    with pytest.raises(packing.SumOutOfRange, match="padding slot 3 sums to 1, not 0"):
        decrypt_sum(weighted_sum([honest, liar], [1, 1], key.public), key)
    assert packing.sum_fault(np.array([0, 4 * VALUE_MAX, 0]), 2, 2) is None  # both bounds are honest


def test_a_plaintext_above_the_last_slot_makes_decryption_refuse(key):
    cheat = [raw_ciphertext(key, 1 << (FINE.slots(key.public) * SLOT_BITS))]
    forged = packing.EncryptedVector("aggregate", key.public.fingerprint, 3, 1.0, 2, 2, cheat)
    with pytest.raises(CiphertextError, match="bits above its 42 slots: overflow"):
        decrypt_sum(forged, key)


# --------------------------------------------------------------------------- payload checks


def test_payload_roundtrip_and_size(key):
    count = 100
    record = encrypt(np.linspace(-1, 1, count), key).to_config(key.public)
    parsed = parse_record(record, key.public, kind="update", count=count, clip=1.0)
    assert parsed.count == count and len(parsed.ciphertexts) == math.ceil(count / 42) == 3
    assert len(record["ciphertexts"]) == 3 * 256


@pytest.mark.parametrize("bits, slots", [(1024, 42), (2048, 85), (3072, 127)])
def test_ciphertext_bytes_are_at_most_1_6_times_the_float32_bytes(bits, slots):
    pub = PublicKey((1 << (bits - 1)) + 1)
    assert FINE.slots(pub) == slots and pub.ciphertext_bytes / (4 * FINE.slots(pub)) <= 1.6
    assert FINE.slots(pub) * SLOT_BITS <= bits - 1  # every packed plaintext is below n


def _tamper(record: dict, **changes) -> dict:
    out = dict(record)
    out.update(changes)
    return out


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r, k: _tamper(r, ciphertexts=r["ciphertexts"][:-1]), "truncated or padded"),
        (lambda r, k: _tamper(r, ciphertexts=r["ciphertexts"] + b"\0" * 256), "truncated or padded"),
        (lambda r, k: _tamper(r, ciphertexts=b"\xff" * len(r["ciphertexts"])), "out of range"),
        (lambda r, k: _tamper(r, ciphertexts=b"\0" * len(r["ciphertexts"])), "out of range"),
        (lambda r, k: _tamper(r, ciphertexts=k.public.n.to_bytes(256, "big") + r["ciphertexts"][256:]), "not a unit"),
        (lambda r, k: _tamper(r, key="0" * 64), "key fingerprint 0000000000000000… does not match"),
        (lambda r, k: _tamper(r, count=99), "count 99: expected 40"),
        (lambda r, k: _tamper(r, clip=2.0), "clip 2.0: expected 1.0"),
        (lambda r, k: _tamper(r, version=1), "version 1: expected 'fedind.paillier' version 3"),
        (lambda r, k: _tamper(r, version=True), "version True"),
        (lambda r, k: _tamper(r, kind="aggregate"), "kind 'aggregate'"),
        (lambda r, k: _tamper(r, weight=5), "weight 1 and sites 1"),
        (lambda r, k: _tamper(r, **{"slot-bits": 32}), "layout slot-bits 32"),
        (lambda r, k: {x: v for x, v in r.items() if x != "count"}, r"missing \['count'\]"),
        (lambda r, k: _tamper(r, extra=1), r"unexpected \['extra'\]"),
        (lambda r, k: _tamper(r, ciphertexts="abc"), "expected bytes"),
    ],
)
def test_tampered_payloads_are_rejected_naming_the_fault(key, change, message):
    record = encrypt(np.zeros(40), key).to_config(key.public)
    with pytest.raises(CiphertextError, match=message):
        parse_record(change(record, key), key.public, kind="update", count=40, clip=1.0)


def test_a_payload_of_the_old_layout_or_the_wrong_size_is_refused(key):
    """A version-1 payload (31-bit slots, Q = 2^20 - 1: ceil(count / 33) ciphertexts for this
    key) is refused by version; a version-2 header over that many ciphertexts by size."""
    count = 200
    record = encrypt(np.zeros(count), key).to_config(key.public)
    width = key.public.ciphertext_bytes
    old_size = math.ceil(count / ((key.public.bits - 1) // 31)) * width
    old = _tamper(record, version=1, ciphertexts=b"\1" * old_size, **{"slot-bits": 31, "value-max": 2**20 - 1})
    with pytest.raises(CiphertextError, match="version 1: expected 'fedind.paillier' version 3 "):
        parse_record(old, key.public, kind="update", count=count, clip=1.0)
    resized = _tamper(record, ciphertexts=record["ciphertexts"] + record["ciphertexts"][: old_size - len(record["ciphertexts"])])
    with pytest.raises(CiphertextError, match=f"hold {old_size} bytes, expected 5 x 256 = 1280 for 200 values"):
        parse_record(resized, key.public, kind="update", count=count, clip=1.0)


def test_a_payload_under_another_key_is_rejected(key, other_key):
    record = encrypt(np.zeros(40), other_key).to_config(other_key.public)
    with pytest.raises(CiphertextError, match="does not match the federation's public key"):
        parse_record(record, key.public, kind="update", count=40, clip=1.0)
    aggregate = weighted_sum([encrypt(np.zeros(4), other_key)] * 2, [1, 1], other_key.public)
    with pytest.raises(CiphertextError, match="is not this site's key"):
        decrypt_sum(aggregate, key)


def test_aggregate_record_checks_weight_and_sites(key):
    v = encrypt(np.zeros(4), key)
    record = weighted_sum([v, v], [300, MAX_SITES - 300], key.public).to_config(key.public)
    assert parse_record(record, key.public, kind="aggregate").weight == MAX_SITES
    with pytest.raises(CiphertextError, match="need 1 <= sites <= weight"):
        parse_record(_tamper(record, weight=MAX_SITES + 1), key.public, kind="aggregate")


# --------------------------------------------------------------------------- obfuscators


def test_short_exponent_obfuscators_lie_in_the_secret_subgroup(key):
    order, n2 = key.order_p * key.order_q, key.public.n_square
    for y in key.obfuscators(4):
        assert gmpy2.powmod(y, order, n2) == 1 and y != 1


def test_key_files_keep_the_subgroup_orders(tmp_path, key):
    save_keypair(key, tmp_path / "k", tmp_path / "k.pub", passphrase="pw")
    loaded = load_private_key(tmp_path / "k", passphrase="pw")
    assert (loaded.order_p, loaded.order_q) == (key.order_p, key.order_q)
    body = json.loads((tmp_path / "k.pub").read_text())
    assert set(body) == {"format", "version", "fingerprint", "n"}  # the orders never reach the server
    with pytest.raises(KeyFileError, match="prime factor of p-1"):
        keys.PrivateKey(key.p, key.q, key.order_p + 2, key.order_q)


def test_crt_obfuscators_are_nth_residues(key):
    p, q = key.p, key.q
    for y in key.obfuscators(4):
        assert 0 < y < key.public.n_square and gmpy2.powmod(y, (p - 1) * (q - 1), key.public.n_square) == 1


def test_pool_drawn_in_background_and_in_processes_encrypts_correctly(key):
    pool = ObfuscatorPool(key)
    pool.fill_async(3, chunk=2)
    assert len(pool.take(3)) == 3 and len(pool) == 0
    parallel = ObfuscatorPool(key, workers=2)
    parallel.fill(6)
    assert len(parallel) == 6
    levels, _ = quantise(np.linspace(-0.5, 0.5, 6 * FINE.slots(key.public)), 1.0, np.random.default_rng(0))
    v = encrypt_levels(levels, key, 1.0, parallel)
    out = decrypt_sum(weighted_sum([v, v], [1, 1], key.public), key)
    assert np.abs(out - np.linspace(-0.5, 0.5, levels.size)).max() <= quantisation_bound(1.0) + 1e-7


# --------------------------------------------------------------------------- key files


def test_key_files_roundtrip_with_modes(tmp_path, key):
    save_keypair(key, tmp_path / "k", tmp_path / "k.pub")
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o600
    assert load_private_key(tmp_path / "k").public == key.public == load_public_key(tmp_path / "k.pub")
    with pytest.raises(FileExistsError):
        save_keypair(key, tmp_path / "k", tmp_path / "other.pub")


def test_the_server_loader_refuses_a_private_key_file(tmp_path, key):
    save_keypair(key, tmp_path / "k", tmp_path / "k.pub")
    with pytest.raises(KeyFileError, match="PRIVATE key file; the server takes the public key"):
        load_public_key(tmp_path / "k")


def test_private_key_readable_by_others_is_refused(tmp_path, key):
    save_keypair(key, tmp_path / "k", tmp_path / "k.pub")
    os.chmod(tmp_path / "k", 0o644)
    with pytest.raises(KeyFileError, match=r"accessible by others \(mode 0o644\); chmod 600"):
        load_private_key(tmp_path / "k")


def test_sealed_private_key_needs_the_passphrase(tmp_path, key, monkeypatch):
    save_keypair(key, tmp_path / "k", tmp_path / "k.pub", passphrase="correct horse")
    assert '"p"' not in (tmp_path / "k").read_text()
    monkeypatch.delenv(keys.PASSPHRASE_ENV, raising=False)
    with pytest.raises(KeyFileError, match="sealed with a passphrase; set FEDIND_PAILLIER_PASSPHRASE"):
        load_private_key(tmp_path / "k")
    with pytest.raises(KeyFileError, match="wrong passphrase"):
        load_private_key(tmp_path / "k", passphrase="wrong")
    monkeypatch.setenv(keys.PASSPHRASE_ENV, "correct horse")
    assert load_private_key(tmp_path / "k").public == key.public


def test_edited_key_files_are_refused(tmp_path, key):
    save_keypair(key, tmp_path / "k", tmp_path / "k.pub")
    body = json.loads((tmp_path / "k.pub").read_text())
    body["n"] = format(key.public.n + 2, "x")
    (tmp_path / "k.pub").write_text(json.dumps(body))
    with pytest.raises(KeyFileError, match="fingerprint does not match"):
        load_public_key(tmp_path / "k.pub")
    (tmp_path / "x.pub").write_text("not json")
    with pytest.raises(KeyFileError, match="not a JSON key file"):
        load_public_key(tmp_path / "x.pub")


def test_cli_writes_the_pair_and_never_overwrites(tmp_path, capsys, monkeypatch):
    assert cli_main(["keys", "paillier", "--out", str(tmp_path / "keys"), "--bits", "512"]) == 0
    out = capsys.readouterr().out
    private, public = tmp_path / "keys" / "paillier.key", tmp_path / "keys" / "paillier.pub"
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert load_public_key(public).fingerprint in out
    assert cli_main(["keys", "paillier", "--out", str(tmp_path / "keys"), "--bits", "512"]) == 2
    assert "already exists" in capsys.readouterr().err
    monkeypatch.setenv("PLANT_PASS", "s3cret")
    assert cli_main(["keys", "paillier", "--out", str(tmp_path / "sealed"), "--bits", "512",
                     "--passphrase-env", "PLANT_PASS"]) == 0
    assert load_private_key(tmp_path / "sealed" / "paillier.key", passphrase="s3cret").public.bits == 512
    assert cli_main(["keys", "paillier", "--out", str(tmp_path / "x"), "--bits", "500"]) == 2


# --------------------------------------------------------------------------- run config


@pytest.mark.parametrize(
    "settings, key_name",
    [
        (dict(compression="topk", topk_feedback="estimate"), "topk-feedback"),
        (dict(compression="topk", paillier_coordinates="union"), "paillier-coordinates"),
        (dict(strategy="dwa", conflict_buffer=True, dwa_momentum=0.0), "conflict-buffer"),
        (dict(strategy="dwa", conflict_damping=0.5), "conflict-damping"),
        (dict(num_sites=1), "num-sites"),
        (dict(num_sites=3, fraction_train=0.2), "num-sites"),
        (dict(paillier_clip=0.0), "paillier-clip"),
        (dict(paillier_key_bits=1000), "paillier-key-bits"),
        (dict(encryption="rsa"), "encryption"),
    ],
)
def test_features_that_cannot_work_under_encryption_fail_at_start(settings, key_name):
    settings = {"encryption": "paillier", **settings}
    with pytest.raises(ConfigError, match=f"Invalid run config {key_name}"):
        RunConfig(**settings)


@pytest.mark.parametrize(
    "settings",
    [
        dict(strategy="dwa"),  # default DWA: restart momentum acts on the aggregate only
        dict(compression="topk"),  # sparse encrypted rounds on the announced coordinate set
        dict(strategy="dwa", conflict_buffer=False, dwa_momentum=0.0),
        dict(strategy="fedavgm"),
        dict(strategy="fedadam"),
        dict(strategy="fedprox"),
        dict(strategy="fedavg", fraction_train=0.5),
    ],
)
def test_features_that_work_under_encryption_are_accepted(settings):
    assert RunConfig(encryption="paillier", **settings).encryption == "paillier"


def test_the_packing_headroom_holds_for_the_maximum_number_of_sites_on_a_set(key):
    """The set changes which values go in, not the slots: K sites at the clip on a set of k
    values sum to W * 2Q per slot and decode exactly."""
    from fedind.paillier import sparse

    indices = np.arange(0, 1000, 7)
    digest = sparse.set_digest(indices, 1000, 4)
    feedback = sparse.SetFeedback(1.0)
    levels, clipped = feedback.encode(np.full(1000, 5.0), indices, np.random.default_rng(0))
    assert clipped == indices.size and np.all(levels == 2 * packing.VALUE_MAX)
    vector = packing.encrypt_levels(levels, key, 1.0, coordinates=digest)
    aggregate = packing.weighted_sum([vector] * packing.MAX_SITES, [1] * packing.MAX_SITES, key.public)
    assert aggregate.coordinates == digest and aggregate.count == indices.size
    assert np.all(packing.decrypt_sum(aggregate, key) == 1.0)
    assert np.allclose(feedback.residual[indices], 4.0) and np.allclose(np.delete(feedback.residual, indices), 5.0)
