"""The compiled int8 moment codes of a host chunk (``memory/host_codes.py``) against the eager ones
(``memory/compressed_adamw.py``): decoding gives the same bits; encoding the same bits as the eager codes with a
correctly rounded square root (the eager CPU one is not, always); a chunk shorter than the compiled size (padded)
gives what the full chunk gives for its elements; the stochastic rounding is the eager carry with hashed bits."""

from __future__ import annotations

import pytest
import torch

from fsdp_speedloader.memory import compressed_adamw as eager
from fsdp_speedloader.memory.host_codes import BLOCK, host_codec

CHUNK = 8 * BLOCK


@pytest.fixture(scope="module")
def codec():
    found = host_codec()
    if found is None:
        pytest.skip("torch.compile cannot build CPU kernels here")
    return found


def _moments(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * torch.logspace(-8, -2, n)[torch.randperm(n, generator=gen)]
    v = torch.rand(n, generator=gen) ** 4 * 1e-6
    v[::97] = 0.0  # exp_avg_sq's zeros
    return m, v


def _codes(n: int):
    return (torch.empty(n, dtype=torch.int8), torch.empty(-(-n // BLOCK)), torch.empty(n, dtype=torch.uint8),
            torch.empty(-(-n // BLOCK)))


def _exact_sqrt(monkeypatch):
    """The eager codes with a correctly rounded square root (through float64)."""
    def sqrt_(self):
        return self.copy_(torch.sqrt(self.double()))
    monkeypatch.setattr(torch.Tensor, "sqrt_", sqrt_)
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: torch.sqrt(self.double()).float())


def test_decode_is_the_eager_decode(codec):
    m, v = _moments(CHUNK)
    mq, ms, vq, vs = _codes(CHUNK)
    eager._encode_signed(m.clone(), mq, ms)
    eager._encode_sqrt(v.clone(), vq, vs)
    want_m, want_v = torch.empty(CHUNK), torch.empty(CHUNK)
    eager._decode_signed(mq, ms, want_m)
    eager._decode_sqrt(vq, vs, want_v)
    got_m, got_v = torch.empty(CHUNK), torch.empty(CHUNK)
    codec.decode(mq, ms, vq, vs, got_m, got_v)
    assert torch.equal(got_m, want_m) and torch.equal(got_v, want_v)


def test_encode_is_the_eager_encode_with_an_exact_root(codec, monkeypatch):
    m, v = _moments(CHUNK, seed=1)
    got = _codes(CHUNK)
    codec.encode(m.clone(), v.clone(), *got)
    _exact_sqrt(monkeypatch)
    want = _codes(CHUNK)
    eager._encode_signed(m.clone(), want[0], want[1])
    eager._encode_sqrt(v.clone(), want[2], want[3])
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("n", [CHUNK - BLOCK, 3 * BLOCK + 5, 100])
def test_a_short_chunk_is_padded_as_the_eager_codes_pad_it(codec, n):
    """Whole blocks and a ragged last block: the codes and scales of the elements there are, and decoding them
    back gives the full chunk's values (zeros past ``n`` to the end of its last block)."""
    m, v = _moments(CHUNK, seed=2)
    m[n:], v[n:] = 0.0, 0.0
    full = _codes(CHUNK)
    codec.encode(m.clone(), v.clone(), *full)
    short = _codes(n)
    codec.encode(m.clone(), v.clone(), *short)
    blocks = -(-n // BLOCK)
    assert torch.equal(short[0], full[0][:n]) and torch.equal(short[2], full[2][:n])
    assert torch.equal(short[1], full[1][:blocks]) and torch.equal(short[3], full[3][:blocks])
    m32, v32 = torch.full((CHUNK,), float("nan")), torch.full((CHUNK,), float("nan"))
    codec.decode(*short, m32, v32)
    want_m, want_v = torch.empty(CHUNK), torch.empty(CHUNK)
    codec.decode(*full, want_m, want_v)
    assert torch.equal(m32[:n], want_m[:n]) and torch.equal(v32[:n], want_v[:n])
    whole = blocks * BLOCK
    assert not m32[n:whole].any() and not v32[n:whole].any()


def test_stochastic_rounding_is_the_carry_with_hashed_bits(codec):
    """The compiled rounding = ``bf16_master.stochastic_round_``'s carry with ``hashed_bits``; whole and short chunks
    alike, infinities and NaNs kept."""
    from fsdp_speedloader.memory.bf16_master import stochastic_round_
    from fsdp_speedloader.memory.host_codes import hashed_bits, rounding_key

    x = torch.randn(CHUNK, generator=torch.Generator().manual_seed(3))
    x[5], x[6], x[7] = float("inf"), float("-inf"), float("nan")
    for n, offset in ((CHUNK, 0), (3 * BLOCK + 7, 12 * BLOCK), (100, 7)):
        got = torch.empty(n, dtype=torch.bfloat16)
        codec.round_bf16(got, x.clone(), seed=11, index=4, step=9, offset=offset)
        key = torch.tensor(rounding_key(11, 4, 9))
        bits = hashed_bits(CHUNK, key, torch.tensor(offset)).to(torch.int32)[:n]
        want = torch.empty(n, dtype=torch.bfloat16)
        stochastic_round_(want, x[:n].clone(), bits)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), n


def test_hashed_bits_are_uniform_and_the_rounding_unbiased():
    from fsdp_speedloader.memory.host_codes import hashed_bits, rounding_key

    n = 1 << 18
    for step in (1, 2):
        bits = hashed_bits(n, torch.tensor(rounding_key(0, 0, step)), torch.tensor(0))
        assert 0 <= int(bits.min()) and int(bits.max()) < 1 << 16
        counts = torch.bincount(bits >> 12, minlength=16).double()  # 16 buckets of the 16 bits
        assert (counts / (n / 16) - 1).abs().max() < 0.03, counts
    a, b = (hashed_bits(n, torch.tensor(rounding_key(0, 0, s)), torch.tensor(0)) for s in (1, 2))
    assert (a == b).double().mean() < 1e-3  # another step, other bits
    # rounding up with probability = the fraction: 1 + 0.3 ulp(bf16) rounds up about 30% of the time
    step = 2.0 ** -7
    x = torch.full((n,), 1.0 + 0.3 * step)
    raw = x.view(torch.int32).to(torch.int64)
    up = ((raw + hashed_bits(n, torch.tensor(rounding_key(5, 1, 3)), torch.tensor(0))) & -65536) != (raw & -65536)
    assert abs(up.double().mean().item() - 0.3) < 0.01
