import pytest

from kvbackend import SpecError, codecs


def test_presets_and_options():
    qvg = codecs.parse("qvg")
    assert (qvg.stages, qvg.group, qvg.bits) == (1, 64, 2)
    pro = codecs.parse("qvg-pro")
    assert (pro.stages, pro.group) == (4, 16)
    custom = codecs.parse("qvg:bits=2,group=64,centroids=256,stages=1,iters=4,symmetric=false")
    assert custom.centroids == 256 and custom.symmetric is False
    assert codecs.parse("kivi:bits=2,group=32").group == 32
    assert codecs.parse("rtn:bits=4, group=32 ,symmetric=yes").symmetric is True


def test_canonical_string_round_trips():
    for text in ["qvg-pro:centroids=64", "kivi:bits=4", "rtn", "fp8", "identity"]:
        codec = codecs.get(text)
        assert codecs.get(codec.spec_string).spec == codec.spec


def test_unknown_codec_lists_valid_names():
    with pytest.raises(SpecError) as err:
        codecs.parse("zip:bits=2")
    for name in ("qvg", "kivi", "rtn", "fp8"):
        assert name in str(err.value)


def test_unknown_option_lists_valid_options():
    with pytest.raises(SpecError) as err:
        codecs.parse("qvg:clusters=16")
    assert "clusters" in str(err.value) and "centroids" in str(err.value)


@pytest.mark.parametrize("text", ["qvg:bits=two", "qvg:symmetric=maybe", "qvg:bits", "qvg:bits=2,bits=3", "", "kivi:=3"])
def test_malformed(text):
    with pytest.raises(SpecError):
        codecs.parse(text)
