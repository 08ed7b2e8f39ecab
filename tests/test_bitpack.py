import pytest
import torch

from kvbackend import bitpack


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(24,), (3, 5, 48), (1, 64)])
def test_round_trip(bits, shape):
    codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8)
    packed = bitpack.pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == bitpack.packed_size(shape[-1], bits)
    assert torch.equal(bitpack.unpack(packed, bits), codes)


def test_first_value_in_top_bits():
    codes = torch.tensor([3, 0, 1, 2], dtype=torch.uint8)
    assert bitpack.pack(codes, 2).tolist() == [0b11_00_01_10]
    assert bitpack.pack(torch.tensor([0xA, 0x5], dtype=torch.uint8), 4).tolist() == [0xA5]
    # 3 bits: 8 values in 3 bytes, big-endian 24-bit word
    three = torch.tensor([7, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert bitpack.pack(three, 3).tolist() == [0b11100000, 0, 1]


def test_bad_width_and_length():
    with pytest.raises(ValueError, match="not supported"):
        bitpack.pack(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="whole groups"):
        bitpack.pack(torch.zeros(6, dtype=torch.uint8), 2)
