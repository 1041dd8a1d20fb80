"""fedind.compression: top-k with error feedback, quantisation bounds, the wire codec and
every way :func:`decode` rejects a malformed payload."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedind.compression import (
    MAGIC,
    MODES,
    THRESHOLDS,
    ErrorFeedback,
    PayloadError,
    SparseTensor,
    decode,
    dense_size_bytes,
    dequantise,
    encode,
    encoded_size,
    expected_of,
    from_record,
    quantise,
    sampled_topk_indices,
    to_record,
    topk_indices,
)

# FaultCNN(width=32).state_dict() shapes (the run config's model-width): 51,018 float32s.
MODEL_SHAPES = {
    "features.1.weight": (32, 3, 64),
    "features.2.weight": (32,),
    "features.2.bias": (32,),
    "features.5.weight": (64, 32, 3),
    "features.6.weight": (64,),
    "features.6.bias": (64,),
    "features.9.weight": (64, 64, 3),
    "features.10.weight": (64,),
    "features.10.bias": (64,),
    "features.13.weight": (128, 64, 3),
    "features.14.weight": (128,),
    "features.14.bias": (128,),
    "head.weight": (10, 128),
    "head.bias": (10,),
}


def model_update(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: (rng.standard_normal(s) * 0.01).astype(np.float32) for k, s in MODEL_SHAPES.items()}


def expected_for(update) -> dict:
    return {k: (np.shape(v), np.float32) for k, v in update.items()}


def int8_bound(scale: float) -> float:
    """The documented per-coordinate error bound of int8 quantisation."""
    return scale / 254 + scale * 2.0**-22


# --------------------------------------------------------------------------- round trip

shapes_st = st.lists(
    st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=shapes_st,
    seed=st.integers(0, 2**32 - 1),
    ratio=st.floats(0.001, 1.0),
    mode=st.sampled_from(MODES),
    threshold=st.sampled_from(THRESHOLDS),
    log_scale=st.floats(-30, 30),
    zero_share=st.floats(0.0, 1.0),
    rounds=st.integers(1, 3),
)
def test_round_trip_error_feedback(shapes, seed, ratio, mode, threshold, log_scale, zero_share, rounds):
    """decode(encode(x)) is the dequantised sparse update bit for bit, and what was sent plus
    the new residual is the update plus the old residual."""
    rng = np.random.default_rng(seed)
    names = [f"layer{i}.w" for i in range(len(shapes))]
    ef = ErrorFeedback(mode=mode, threshold=threshold, seed=seed % 1000)
    old = {n: np.zeros(s, np.float32) for n, s in zip(names, shapes)}
    for _ in range(rounds):
        update = {}
        for n, s in zip(names, shapes):
            a = np.array(rng.standard_normal(s) * 10.0**log_scale)
            a[np.asarray(rng.random(s) < zero_share)] = 0.0
            update[n] = a.astype(np.float32)
        sparse = ef.compress(update, ratio)
        decoded = decode(encode(sparse), expected_for(update))
        assert list(decoded) == names
        new = ef.state_dict()["residuals"]
        total = sum(math.prod(s) for s in shapes)
        k = min(total, max(1, round(ratio * total)))
        assert sum(t.count for t in sparse.values()) <= k
        for n in names:
            assert decoded[n].dtype == np.float32 and decoded[n].shape == update[n].shape
            np.testing.assert_array_equal(decoded[n], sparse[n].to_dense())
            lhs = decoded[n].astype(np.float64) + new[n]
            rhs = (update[n] + old[n]).astype(np.float64)  # u' as the site computed it
            assert np.all(np.abs(lhs - rhs) <= 2.0**-23 * np.abs(new[n]) + 1e-45)
        old = new


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
    data=st.data(),
    mode=st.sampled_from(MODES),
)
def test_round_trip_any_sparse_tensor(shape, data, mode):
    """Any valid SparseTensor, at any density (so both index encodings), decodes exactly."""
    numel = math.prod(shape)
    chosen = data.draw(st.sets(st.integers(0, numel - 1), max_size=numel))
    indices = np.array(sorted(chosen), dtype=np.int64)
    if mode == "int8":
        codes = data.draw(st.lists(st.integers(-127, 127), min_size=indices.size, max_size=indices.size))
    else:
        codes = data.draw(st.lists(st.sampled_from([-1, 1]), min_size=indices.size, max_size=indices.size))
    scale = float(np.float32(data.draw(st.floats(1e-30, 1e30)))) if indices.size else 0.0
    t = SparseTensor(shape, indices, np.array(codes, dtype=np.int8), scale, mode)
    out = decode(encode({"t": t}), {"t": (shape, np.float32)})
    np.testing.assert_array_equal(out["t"], t.to_dense())


# --------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("mode", MODES)
def test_error_feedback_invariant_over_rounds(mode, threshold):
    rng = np.random.default_rng(7)
    ef = ErrorFeedback(mode=mode, threshold=threshold)
    old = {k: np.zeros(s, np.float32) for k, s in MODEL_SHAPES.items()}
    sent_sum = {k: np.zeros(s) for k, s in MODEL_SHAPES.items()}
    update_sum = {k: np.zeros(s) for k, s in MODEL_SHAPES.items()}
    for _ in range(6):
        update = model_update(rng)
        sparse = ef.compress(update, 0.01)
        new = ef.state_dict()["residuals"]
        for k in MODEL_SHAPES:
            sent = sparse[k].to_dense()
            if mode == "int8":  # Sterbenz: the residual subtraction is exact
                np.testing.assert_array_equal(sent + new[k], update[k] + old[k])
            else:
                np.testing.assert_allclose(sent + new[k], update[k] + old[k], rtol=1e-6, atol=1e-9)
            sent_sum[k] += sent
            update_sum[k] += update[k]
        old = new
    # Nothing is lost, only delayed: everything sent plus what is left is everything computed.
    for k in MODEL_SHAPES:
        np.testing.assert_allclose(sent_sum[k] + old[k], update_sum[k], rtol=1e-5, atol=1e-7)


def test_int8_at_ratio_one_is_within_the_documented_bound():
    rng = np.random.default_rng(3)
    update = {k: (v * rng.lognormal(0, 2, v.shape)).astype(np.float32) for k, v in model_update(rng).items()}
    sparse = ErrorFeedback(mode="int8").compress(update, 1.0)
    decoded = decode(encode(sparse), expected_for(update))
    for k, u in update.items():
        assert sparse[k].count == np.count_nonzero(u)
        scale = float(np.abs(u).max())
        assert sparse[k].scale == scale
        err = np.abs(decoded[k].astype(np.float64) - u)
        assert err.max() <= int8_bound(scale)
        assert err.max() > 0  # it is a lossy code; the bound is not vacuous


def test_sign_mode_sends_sign_times_mean_magnitude():
    v = np.array([0.5, -2.0, 1.5, -0.25], dtype=np.float32)
    codes, scale = quantise(v, "sign")
    assert codes.tolist() == [1, -1, 1, -1]
    assert scale == pytest.approx(np.abs(v).mean())
    np.testing.assert_array_equal(dequantise(codes, scale, "sign"), np.sign(v) * np.float32(scale))


def test_exact_topk_picks_the_k_largest_across_the_model():
    rng = np.random.default_rng(0)
    update = {"a": rng.standard_normal((40, 5)).astype(np.float32), "b": rng.standard_normal(300).astype(np.float32)}
    update["b"][:10] *= 100  # the ten largest all live in "b": global, not per-tensor, top-k
    ef = ErrorFeedback(mode="int8", threshold="exact")
    ratio = 0.05
    sparse = ef.compress(update, ratio)
    flat = np.concatenate([update["a"].ravel(), update["b"].ravel()])
    k = round(ratio * flat.size)
    oracle = set(np.argsort(-np.abs(flat), kind="stable")[:k].tolist())
    got = set(sparse["a"].indices.tolist()) | {200 + i for i in sparse["b"].indices.tolist()}
    assert got == oracle and len(got) == k
    assert set(range(10)) <= set(sparse["b"].indices.tolist())


def test_topk_never_sends_zeros_and_keeps_k_at_least_one():
    assert topk_indices(np.array([0.0, 3.0, 0.0, 1.0]), 3).tolist() == [1, 3]
    sparse = ErrorFeedback().compress({"w": np.array([0.0, 0.0, 2.0, 1.0], np.float32)}, 1e-6)
    assert sparse["w"].indices.tolist() == [2]  # k = max(1, round(ratio * N))
    empty = ErrorFeedback().compress({"w": np.zeros(5, np.float32)}, 0.5)
    assert empty["w"].count == 0 and empty["w"].scale == 0.0
    np.testing.assert_array_equal(decode(encode(empty), {"w": ((5,), np.float32)})["w"], np.zeros(5))


@pytest.mark.parametrize("dist", ["normal", "student-t", "lognormal"])
def test_sampled_count_is_within_documented_tolerance(dist):
    """Documented: never more than k, fewer with probability ~1e-4; when exactly k it is the
    exact top-k (the candidates then contain every true top-k coordinate)."""
    n, k = 100_000, 1_000
    counts, same = [], 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        if dist == "normal":
            x = rng.standard_normal(n)
        elif dist == "student-t":
            x = rng.standard_t(2, n)
        else:
            x = rng.lognormal(0, 2, n)
        mag = np.abs(x).astype(np.float32)
        got = sampled_topk_indices(mag, k, np.random.default_rng(1000 + seed))
        counts.append(got.size)
        assert np.all(np.diff(got) > 0)
        same += np.array_equal(got, topk_indices(mag, k))
    assert max(counts) <= k
    assert min(counts) >= k // 2 and np.mean(counts) >= 0.99 * k
    assert same >= 38


def test_sampled_falls_back_to_exact_when_the_sample_would_cover_the_vector():
    mag = np.abs(np.random.default_rng(1).standard_normal(5_000)).astype(np.float32)
    # k = 5: s = 100 * N / k = 100_000 > N
    np.testing.assert_array_equal(sampled_topk_indices(mag, 5, np.random.default_rng(0)), topk_indices(mag, 5))


# --------------------------------------------------------------------------- index encodings


def parse_layout(payload: bytes) -> list[tuple[str, int, int]]:
    """An independent reader of the documented layout: (name, index encoding, index block length)."""
    assert payload[:4] == b"FIDZ" and payload[4] == 1
    (num,) = struct.unpack_from("<I", payload, 6)
    pos, out = 10, []
    for _ in range(num):
        (nlen,) = struct.unpack_from("<H", payload, pos)
        name = payload[pos + 2 : pos + 2 + nlen].decode()
        pos += 2 + nlen
        numel, count, scale, enc, ilen = struct.unpack_from("<IIfBI", payload, pos)
        pos += 17 + ilen
        (vlen,) = struct.unpack_from("<I", payload, pos)
        pos += 4 + vlen
        out.append((name, enc, ilen))
    assert pos == len(payload)
    return out


def test_index_encoding_is_bitmap_when_dense_and_varint_when_sparse():
    rng = np.random.default_rng(2)
    update = {"dense": rng.standard_normal(1000).astype(np.float32), "sparse": np.zeros(1000, np.float32)}
    update["sparse"][[3, 400, 999]] = 50.0  # large: they are surely sent
    sparse = ErrorFeedback().compress(update, 0.5)
    payload = encode(sparse)
    layout = {name: (enc, ilen) for name, enc, ilen in parse_layout(payload)}
    assert layout["dense"] == (2, 125)  # bitmap: ceil(1000 / 8) bytes < ~500 varints
    assert layout["sparse"] == (1, 1 + 2 + 2)  # varints of 3, 397, 599
    decoded = decode(payload, expected_for(update))
    for k in update:
        np.testing.assert_array_equal(decoded[k], sparse[k].to_dense())


# --------------------------------------------------------------------------- state


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_state_dict_round_trip_continues_identically(threshold):
    n = 60_000  # big enough that "sampled" really samples at ratio 0.01
    rng = np.random.default_rng(4)
    updates = [
        {"w": rng.standard_normal(n).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
        for _ in range(4)
    ]
    a = ErrorFeedback(mode="int8", threshold=threshold, seed=3)
    for u in updates[:2]:
        a.compress(u, 0.01)
    state = a.state_dict()
    b = ErrorFeedback(mode="int8", threshold=threshold, seed=3)
    b.load_state_dict(state)
    state["residuals"]["w"][:] = 123.0  # state_dict returns copies
    for u in updates[2:]:
        sa, sb = a.compress(u, 0.01), b.compress(u, 0.01)
        for k in u:
            np.testing.assert_array_equal(sa[k].indices, sb[k].indices)
            np.testing.assert_array_equal(sa[k].codes, sb[k].codes)
            assert sa[k].scale == sb[k].scale
    for k in updates[0]:
        np.testing.assert_array_equal(a.state_dict()["residuals"][k], b.state_dict()["residuals"][k])
    assert a.state_dict()["step"] == b.state_dict()["step"] == 4
    assert a.residual_norm() > 0


@pytest.mark.parametrize(
    "state, match",
    [
        ({"residuals": {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}, "step": 1}, "shape"),
        ({"residuals": {"w": np.zeros(3, np.float32)}, "step": 1}, "names"),
        ({"residuals": {"w": np.zeros(3, np.float32), "b": np.full(2, np.nan, np.float32)}, "step": 1}, "finite"),
        ({"residuals": {"w": np.zeros(3, np.int64), "b": np.zeros(2, np.float32)}, "step": 1}, "finite floats"),
        ({"residuals": {"w": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}, "step": -1}, "step"),
        ({"residuals": {}}, "keys"),
    ],
)
def test_load_state_dict_rejects_bad_state(state, match):
    ef = ErrorFeedback()
    ef.compress({"w": np.ones(3, np.float32), "b": np.ones(2, np.float32)}, 0.5)
    before = ef.state_dict()
    with pytest.raises(ValueError, match=match):
        ef.load_state_dict(state)
    after = ef.state_dict()  # unchanged
    assert after["step"] == before["step"]
    for k in before["residuals"]:
        np.testing.assert_array_equal(after["residuals"][k], before["residuals"][k])


@pytest.mark.parametrize(
    "kwargs", [{"mode": "int4"}, {"threshold": "approx"}, {"seed": -1}, {"seed": 1.5}]
)
def test_invalid_hyperparameters(kwargs):
    with pytest.raises(ValueError, match="Invalid"):
        ErrorFeedback(**kwargs)


@pytest.mark.parametrize(
    "update, ratio, match",
    [
        ({"w": np.ones(3, np.float32)}, 0.0, "ratio"),
        ({"w": np.ones(3, np.float32)}, 1.5, "ratio"),
        ({"w": np.ones(3, np.float32)}, float("nan"), "ratio"),
        ({"w": np.ones(3, np.int64)}, 0.5, "not floating"),
        ({"w": np.array([1.0, np.inf], np.float32)}, 0.5, "non-finite"),
        ({}, 0.5, "non-empty"),
    ],
)
def test_compress_rejects_bad_input(update, ratio, match):
    with pytest.raises(ValueError, match=match):
        ErrorFeedback().compress(update, ratio)


def test_compress_rejects_a_changed_model_and_keeps_the_residual():
    ef = ErrorFeedback()
    ef.compress({"w": np.arange(4, dtype=np.float32)}, 0.5)
    before = ef.state_dict()
    with pytest.raises(ValueError, match="shape"):
        ef.compress({"w": np.ones(5, np.float32)}, 0.5)
    with pytest.raises(ValueError, match="names"):
        ef.compress({"v": np.ones(4, np.float32)}, 0.5)
    np.testing.assert_array_equal(ef.state_dict()["residuals"]["w"], before["residuals"]["w"])
    assert ef.state_dict()["step"] == before["step"]


def test_encode_rejects_mixed_modes():
    a = SparseTensor((2,), np.array([0]), np.array([1], np.int8), 1.0, "int8")
    b = SparseTensor((2,), np.array([0]), np.array([1], np.int8), 1.0, "sign")
    with pytest.raises(ValueError, match="mixed modes"):
        encode({"a": a, "b": b})


# --------------------------------------------------------------------------- malformed payloads

EXPECTED = {"w": ((2, 4), np.float32), "b": ((3,), np.float32)}


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def raw_tensor(
    name: bytes = b"w",
    numel: int = 8,
    count: int = 2,
    scale: float = 1.0,
    enc: int = 1,
    index: bytes = varint(1) + varint(5),  # indices 1, 6
    values: bytes = bytes([5, 256 - 7]),  # int8 codes 5, -7
    index_len: int | None = None,
    value_len: int | None = None,
) -> bytes:
    return (
        struct.pack("<H", len(name))
        + name
        + struct.pack("<IIfB", numel, count, scale, enc)
        + struct.pack("<I", len(index) if index_len is None else index_len)
        + index
        + struct.pack("<I", len(values) if value_len is None else value_len)
        + values
    )


EMPTY_B = raw_tensor(name=b"b", numel=3, count=0, scale=0.0, index=b"", values=b"")


def raw_payload(*tensors: bytes, magic=MAGIC, version=1, mode=1, num=None) -> bytes:
    tensors = tensors or (raw_tensor(), EMPTY_B)
    return magic + bytes([version, mode]) + struct.pack("<I", len(tensors) if num is None else num) + b"".join(tensors)


def test_raw_builder_makes_a_valid_payload():
    out = decode(raw_payload(), EXPECTED)
    step = np.float32(np.float32(1.0) / 127)
    np.testing.assert_array_equal(out["w"].ravel(), [0, 5 * step, 0, 0, 0, 0, -7 * step, 0])
    np.testing.assert_array_equal(out["b"], np.zeros(3))
    sign = decode(raw_payload(raw_tensor(values=bytes([0b10])), EMPTY_B, mode=2), EXPECTED)
    np.testing.assert_array_equal(sign["w"].ravel()[[1, 6]], [1.0, -1.0])


MALFORMED = {
    "bad magic": (raw_payload(magic=b"FIDY"), "bad magic"),
    "unknown version": (raw_payload(version=2), "unknown version 2"),
    "unknown mode": (raw_payload(mode=3), "unknown mode 3"),
    "trailing bytes": (raw_payload() + b"\x00", "1 trailing bytes"),
    "too many tensors": (raw_payload(num=3), "declares 3 tensors, expected 2"),
    "unexpected name": (raw_payload(raw_tensor(name=b"v"), EMPTY_B), "'v': not an expected tensor"),
    "duplicate name": (raw_payload(raw_tensor(), raw_tensor()), "'w': appears twice"),
    "missing tensor": (raw_payload(raw_tensor()), r"missing tensor\(s\): \['b'\]"),
    "name not utf-8": (raw_payload(raw_tensor(name=b"\xff"), EMPTY_B), "not valid UTF-8"),
    "numel mismatch": (raw_payload(raw_tensor(numel=9), EMPTY_B), "numel 9 != expected 8"),
    "count > numel": (raw_payload(raw_tensor(count=9), EMPTY_B), "count 9 > numel 8"),
    "nan scale": (raw_payload(raw_tensor(scale=float("nan")), EMPTY_B), "non-finite scale"),
    "inf scale": (raw_payload(raw_tensor(scale=float("inf")), EMPTY_B), "non-finite scale"),
    "negative scale": (raw_payload(raw_tensor(scale=-1.0), EMPTY_B), "must be > 0"),
    "zero scale with values": (raw_payload(raw_tensor(scale=0.0), EMPTY_B), "must be > 0"),
    "scale without values": (
        raw_payload(raw_tensor(), raw_tensor(name=b"b", numel=3, count=0, scale=1.0, index=b"", values=b"")),
        "must be 0 when no values",
    ),
    "unknown index encoding": (raw_payload(raw_tensor(enc=3), EMPTY_B), "unknown index encoding 3"),
    "index out of range": (raw_payload(raw_tensor(index=varint(1) + varint(7)), EMPTY_B), "index 8 out of range"),
    "first index out of range": (
        raw_payload(raw_tensor(count=1, index=varint(8), values=b"\x05"), EMPTY_B),
        "index 8 out of range",
    ),
    "duplicate index": (raw_payload(raw_tensor(index=varint(1) + varint(0)), EMPTY_B), "duplicate"),
    "varint too long": (
        raw_payload(raw_tensor(count=1, index=b"\x81\x80\x80\x80\x80\x00", values=b"\x05"), EMPTY_B),
        "varint too long",
    ),
    "varint overflow": (
        raw_payload(raw_tensor(count=1, index=b"\x81\x80\x80\x80\x10", values=b"\x05"), EMPTY_B),
        "varint overflow",
    ),
    "varint not minimal": (
        raw_payload(raw_tensor(count=1, index=b"\x81\x00", values=b"\x05"), EMPTY_B),
        "non-minimal varint",
    ),
    "varint truncated": (raw_payload(raw_tensor(index=varint(1) + b"\x85"), EMPTY_B), "truncated varint"),
    "fewer varints than count": (
        raw_payload(raw_tensor(count=3, values=b"\x01\x02\x03"), EMPTY_B),
        "holds 2 varints, count is 3",
    ),
    "index block without count": (
        raw_payload(raw_tensor(), raw_tensor(name=b"b", numel=3, count=0, scale=0.0, index=b"\x01", values=b"")),
        "index block has 1 bytes but count is 0",
    ),
    "bitmap length": (raw_payload(raw_tensor(enc=2, index=b"\x42\x00"), EMPTY_B), "bitmap block is 2 bytes"),
    "bitmap popcount": (raw_payload(raw_tensor(enc=2, index=b"\x43"), EMPTY_B), "popcount 3 != count 2"),
    "bitmap past numel": (
        raw_payload(raw_tensor(), raw_tensor(name=b"b", numel=3, count=1, enc=2, index=b"\x08", values=b"\x05")),
        "bits past numel 3",
    ),
    "int8 value block length": (raw_payload(raw_tensor(values=b"\x05"), EMPTY_B), "value block is 1 bytes, expected 2"),
    "sign value block length": (
        raw_payload(raw_tensor(values=b"\x00\x00"), EMPTY_B, mode=2),
        "value block is 2 bytes, expected 1",
    ),
    "int8 code -128": (raw_payload(raw_tensor(values=b"\x05\x80"), EMPTY_B), "-128 out of range"),
    "sign padding bits": (raw_payload(raw_tensor(values=b"\x04"), EMPTY_B, mode=2), "padding bits"),
    "index length past end": (
        raw_payload(raw_tensor(index_len=99), EMPTY_B),
        "truncated payload: tensor 'w' index block",
    ),
    "value length past end": (raw_payload(raw_tensor(value_len=99), EMPTY_B), "value block is 99 bytes"),
}


@pytest.mark.parametrize("payload, match", list(MALFORMED.values()), ids=list(MALFORMED))
def test_decode_rejects_malformed_payload(payload, match):
    with pytest.raises(PayloadError, match=match):
        decode(payload, EXPECTED)


def test_decode_rejects_every_truncation():
    """Cut anywhere, every field (header, name, numbers, blocks) is reported as truncated."""
    payload = raw_payload()
    for cut in range(len(payload)):
        with pytest.raises(PayloadError, match="truncated payload"):
            decode(payload[:cut], EXPECTED)


@pytest.mark.parametrize("payload", ["FIDZ", None, [1, 2]])
def test_decode_rejects_non_bytes(payload):
    with pytest.raises(PayloadError, match="must be bytes"):
        decode(payload, EXPECTED)


@pytest.mark.parametrize("expected", [{}, {"w": (2, 4)}, {"w": ((2, 4), np.int64)}])
def test_decode_blames_the_caller_not_the_site_for_bad_expected(expected):
    with pytest.raises(ValueError) as info:
        decode(raw_payload(), expected)
    assert not isinstance(info.value, PayloadError)


# --------------------------------------------------------------------------- size


def test_one_percent_int8_is_over_100x_smaller_than_dense():
    rng = np.random.default_rng(0)
    ef = ErrorFeedback(mode="int8")
    update = model_update(rng)
    dense = dense_size_bytes(MODEL_SHAPES)
    assert dense == 4 * 51_018 == dense_size_bytes(expected_for(update)) == dense_size_bytes(update)
    for _ in range(3):  # with a residual, too
        sparse = ef.compress(model_update(rng), 0.01)
        size = encoded_size(sparse)
        # Measured: 1,712 bytes vs 204,072 -> 119x (about 540 of them are the 14 tensor headers).
        assert dense / size >= 100, (size, dense / size)


# --------------------------------------------------------------------------- Flower record


def test_config_record_round_trip_through_protobuf():
    from flwr.app import ConfigRecord, RecordDict
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

    update = model_update(np.random.default_rng(5))
    sparse = ErrorFeedback(mode="sign").compress(update, 0.01)
    record = to_record(encode(sparse))
    assert isinstance(record, ConfigRecord)
    wire = recorddict_to_proto(RecordDict({"update": record}))
    back = recorddict_from_proto(wire)["update"]
    decoded = decode(from_record(back), expected_of(update))
    for k in update:
        np.testing.assert_array_equal(decoded[k], sparse[k].to_dense())


@pytest.mark.parametrize(
    "record, match",
    [
        ({"format": "fedind.topk", "version": 1}, "keys"),
        ({"format": "fedind.other", "version": 1, "payload": b""}, "format"),
        ({"format": "fedind.topk", "version": 2, "payload": b""}, "version"),
        ({"format": "fedind.topk", "version": True, "payload": b""}, "version"),
        ({"format": "fedind.topk", "version": 1, "payload": "FIDZ"}, "must be bytes"),
        (b"FIDZ", "must be a ConfigRecord"),
    ],
)
def test_from_record_rejects_foreign_records(record, match):
    with pytest.raises(PayloadError, match=match):
        from_record(record)
