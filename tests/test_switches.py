import pytest

from kvbackend.switches import switched_off


@pytest.mark.parametrize("value,off", [(None, False), ("1", False), ("on", False), ("", False), ("0", True),
                                       (" Off ", True), ("FALSE", True), ("no", True), ("nope", False)])
def test_a_switch_is_off_only_when_told(value, off, monkeypatch):
    if value is None:
        monkeypatch.delenv("KVBACKEND_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("KVBACKEND_TEST_SWITCH", value)
    assert switched_off("KVBACKEND_TEST_SWITCH") is off
