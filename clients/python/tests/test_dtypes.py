"""numpy round trips, byte for byte, for every KV dtype."""

from __future__ import annotations

import numpy as np
import pytest

import kvkeep
from kvkeep import pb


def _every_bit_pattern(layout: pb.Layout, n: int, rng) -> tuple:
    """keys/values [layers][n][kv_heads][head_dim] covering special values:
    zeros of both signs, subnormals, infinities, NaNs with payloads, extremes."""
    shape = (layout.num_layers, n, layout.kv_heads, layout.head_dim)
    count = int(np.prod(shape))
    if layout.dtype == pb.DTYPE_F32:
        bits = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32)
        bits[:8] = [0, 0x80000000, 1, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F7FFFFF, 0x00800000]
        return tuple(bits.view(np.float32).reshape(shape) for _ in range(1)) + (
            np.flip(bits).view(np.float32).reshape(shape),)
    bits = rng.integers(0, 2**16, count, dtype=np.uint32).astype(np.uint16)
    bits[:8] = [0, 0x8000, 1, 0x7C00, 0xFC00, 0x7E01, 0x7BFF, 0x0400]
    dt = np.float16 if layout.dtype == pb.DTYPE_F16 else np.uint16
    return bits.view(dt).reshape(shape), np.flip(bits).view(dt).reshape(shape)


@pytest.mark.parametrize("layout_name,want", [("t_f32", np.float32), ("t_f16", np.float16),
                                              ("t_bf16", np.uint16)])
def test_round_trip_byte_exact(client, layout_name, want):
    rng = np.random.default_rng(11)
    lay = client.layout(layout_name)
    assert kvkeep.numpy_dtype(lay) == np.dtype(want)
    with client.create_session(layout_name, "full") as s:
        k, v = _every_bit_pattern(lay, 300, rng)
        s.append_prefill(k, v, np.arange(0, 600, 2))  # several messages
        k2, v2 = _every_bit_pattern(lay, 1, rng)
        s.step((k2, v2, 601))  # one decode token, [layers][1][kvh][hd]
        k3, v3 = _every_bit_pattern(lay, 1, rng)
        s.append(k3[:, 0], v3[:, 0], 700)  # a scalar position: [layers][kvh][hd]
        allk = np.concatenate([k, k2, k3], axis=1)
        allv = np.concatenate([v, v2, v3], axis=1)
        got = s.read_kv()
        for layer in got:
            assert layer.keys.dtype == np.dtype(want)
            assert layer.keys.shape == (302, lay.kv_heads, lay.head_dim)
            assert list(layer.positions) == list(range(0, 600, 2)) + [601, 700]
            assert layer.keys.tobytes() == np.ascontiguousarray(allk[layer.layer]).tobytes()
            assert layer.values.tobytes() == np.ascontiguousarray(allv[layer.layer]).tobytes()
        with s.map_pool() as pool:
            for l in range(lay.num_layers):
                keys, values = pool.gather(pool.tables[l])
                assert keys.tobytes() == np.ascontiguousarray(allk[l]).tobytes()
                assert values.tobytes() == np.ascontiguousarray(allv[l]).tobytes()
            del keys, values


def test_non_contiguous_and_big_endian_inputs(client):
    rng = np.random.default_rng(12)
    base = rng.standard_normal((2, 2, 5, 16)).astype(np.float32)
    k = base[:, :, :, ::2].transpose(0, 2, 1, 3)  # [layers][n=5][kvh][hd], strided
    v = k.astype(">f4")  # big-endian: sent little-endian
    with client.create_session("t_f32", "full") as s:
        s.append(k, v, np.arange(5))
        got = s.read_kv([0])[0]
        assert got.keys.tobytes() == np.ascontiguousarray(k[0]).tobytes()
        assert got.values.tobytes() == np.ascontiguousarray(k[0]).tobytes()


def test_wrong_dtype_or_shape_is_refused_before_sending(client):
    with client.create_session("t_bf16", "full") as s:
        f32 = np.zeros((2, 1, 2, 8), np.float32)
        with pytest.raises(kvkeep.InvalidArgument) as e:
            s.append(f32, f32, [0])  # f32 bytes into a bf16 layout: never converted
        assert e.value.client_side and "bf16" in e.value.message
        bits = kvkeep.f32_to_bf16(f32)
        with pytest.raises(kvkeep.InvalidArgument) as e:
            s.append(bits[:, :, :1], bits[:, :, :1], [0])  # one kv head short
        assert "[num_layers][n][kv_heads][head_dim]" in e.value.message
        with pytest.raises(kvkeep.InvalidArgument):
            s.append(bits[:1], bits[:1], [0])  # one layer short
        with pytest.raises(kvkeep.InvalidArgument):
            s.append(np.concatenate([bits] * 2, 1), np.concatenate([bits] * 2, 1), [3, 3])
        assert s.stats().resident_tokens == 0  # nothing was sent
        s.append(bits, bits, [0])
        assert s.stats().resident_tokens == 2


def test_bf16_conversions():
    f = np.array([1.0, -2.5, 3.140625, 1e-40, np.inf, -np.inf, 65504.0, 1.00390625],
                 np.float32)
    b = kvkeep.f32_to_bf16(f)
    assert b.dtype == np.uint16
    back = kvkeep.bf16_to_f32(b)
    assert back[:7].tolist()[:4] == [1.0, -2.5, 3.140625, back[3]]
    assert np.isinf(back[4]) and np.isinf(back[5])
    assert back[7] == 1.0  # ties round to even
    assert np.isnan(kvkeep.bf16_to_f32(kvkeep.f32_to_bf16(np.float32(np.nan))))
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    assert np.array_equal(kvkeep.f32_to_bf16(kvkeep.bf16_to_f32(kvkeep.f32_to_bf16(x))),
                          kvkeep.f32_to_bf16(x))
    assert np.all(np.abs(kvkeep.bf16_to_f32(kvkeep.f32_to_bf16(x)) - x) <= np.abs(x) / 256)
