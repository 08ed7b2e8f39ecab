import torch

from kvbackend import Geometry, codecs
from kvbackend.layout import ALIGN


def test_fields_aligned_and_disjoint():
    layout = codecs.get("qvg-pro").layout(Geometry(1, 3, 64, torch.bfloat16), 16)
    spans = sorted((f.offset, f.offset + f.nbytes) for f in layout.page.fields.values())
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert all(f.offset % ALIGN == 0 for f in layout.page.fields.values())
    assert layout.page_bytes % ALIGN == 0 and layout.page_bytes >= spans[-1][1]
    assert set(layout.page.fields) == {"k_codes", "k_scales", "k_zeros", "k_assign",
                                       "v_codes", "v_scales", "v_zeros", "v_assign"}
    assert layout.codebook.fields["k_centroids"].shape == (4, 3, 16, 64)


def test_views_write_through():
    layout = codecs.get("rtn:bits=4,group=32").layout(Geometry(1, 2, 64, torch.float32), 16)
    pages = torch.zeros(3, layout.page_bytes, dtype=torch.uint8)
    scales = layout.page.view(pages, "v_scales")
    assert scales.shape == (3, 16, 2, 2) and scales.dtype == torch.float16
    scales[1] = 2.5
    assert torch.all(layout.page.view(pages, "v_scales")[1] == 2.5)
    assert torch.all(layout.page.view(pages, "v_scales")[0] == 0)
    assert torch.all(layout.page.view(pages, "k_codes") == 0)


def test_fingerprint_depends_on_everything():
    g = Geometry(1, 2, 64)
    base = codecs.get("qvg").layout(g, 64).fingerprint
    assert base == codecs.get("qvg").layout(g, 64).fingerprint
    assert base != codecs.get("qvg").layout(g, 32).fingerprint
    assert base != codecs.get("qvg:centroids=32").layout(g, 64).fingerprint
    assert base != codecs.get("qvg").layout(Geometry(1, 4, 64), 64).fingerprint
    assert base != codecs.get("qvg").layout(Geometry(2, 2, 64), 64).fingerprint  # layers shape a page group
    assert base != codecs.get("qvg").layout(Geometry(1, 2, 64, torch.float16), 64).fingerprint
