import pytest

from omni_rl.errors import OmniRLError
from omni_rl.registry import Registry, closest


def test_register_get_and_aliases():
    reg = Registry("widget")
    reg.register("alpha", aliases=("a",))(1)
    assert reg.get("alpha") == 1
    assert reg.get("a") == 1
    assert reg.canonical("a") == "alpha"
    assert "a" in reg and "beta" not in reg
    assert list(reg) == ["alpha"]


def test_duplicate_name_or_alias_is_an_error():
    reg = Registry("widget")
    reg.register("alpha", aliases=("a",))(1)
    with pytest.raises(ValueError, match="duplicate widget name 'alpha'"):
        reg.register("alpha")(2)
    with pytest.raises(ValueError, match="duplicate widget name 'a'"):
        reg.register("other", aliases=("a",))(2)


def test_unknown_name_lists_known_and_closest():
    reg = Registry("widget")
    reg.register("temporal_grounding")(1)
    reg.register("counting")(2)
    with pytest.raises(OmniRLError) as err:
        reg.get("temporal_grounding_")
    message = str(err.value)
    assert "unknown widget 'temporal_grounding_'" in message
    assert "did you mean 'temporal_grounding'" in message
    assert "known: counting, temporal_grounding" in message


def test_closest_returns_none_when_nothing_is_close():
    assert closest("zzzz", ["steps", "seed"]) is None
    assert closest("stpes", ["steps", "seed"]) == "steps"
