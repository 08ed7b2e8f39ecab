"""Code widths and group sizes codec specs may take, and separate key and value code widths: the
`kbits=`/`vbits=` options some codec specs take."""

from __future__ import annotations

from kvbackend.errors import SpecError

WIDTHS = (2, 3, 4, 8)  # code widths every codec packs
SPLIT_WIDTHS = (0, *WIDTHS)  # kbits=/vbits=: 0 means "as bits"
MAX_GROUP = 1024  # largest group of channels or tokens sharing a scale (head_dim / page_size bound it further)


class SplitWidths:
    """Mixin of a spec dataclass with ``bits``, ``kbits`` and ``vbits`` fields (0 = ``bits``)."""

    bits: int
    kbits: int
    vbits: int

    @property
    def key_bits(self) -> int:
        return self.kbits or self.bits

    @property
    def value_bits(self) -> int:
        return self.vbits or self.bits


def check_split_widths(spec: SplitWidths) -> None:
    """Raise `SpecError` for a ``kbits``/``vbits`` the codes cannot take."""
    for name, bits in (("kbits", spec.kbits), ("vbits", spec.vbits)):
        if bits and bits not in WIDTHS:
            raise SpecError(f"{spec.name}: {name}={bits} not supported; choose 2, 3, 4 or 8 (0 = bits)")
