"""MELL's size classes have one home (kvfleet.mell.size_classes): the bounds, the names and the middles
the routing table previews all come from it."""

from __future__ import annotations

import pytest

from kvfleet.mell.size_classes import (
    CLASS_NAMES,
    ROUTED_CLASS_NAMES,
    SizeClass,
    class_of_name,
    middle_bytes,
    size_class,
)

C = 2**30


def test_the_middles_of_the_routed_classes_are_their_ranges_middles() -> None:
    assert {name: middle_bytes(class_of_name(name), 48 * 1024) for name in ROUTED_CLASS_NAMES} == {
        "L": 36 * 1024, "M": 20 * 1024, "S": 14 * 1024, "T": 9 * 1024}


@pytest.mark.parametrize("cls", [c for c in SizeClass if c is not SizeClass.X])
def test_a_middle_is_in_its_own_class(cls: SizeClass) -> None:
    assert size_class(middle_bytes(cls, C), C) is cls


def test_class_x_has_no_middle_and_every_class_one_name() -> None:
    with pytest.raises(ValueError, match="no upper bound"):
        middle_bytes(SizeClass.X, C)
    assert sorted(class_of_name(name) for name in CLASS_NAMES.values()) == sorted(SizeClass)
