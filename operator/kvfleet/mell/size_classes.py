"""MELL's size classes (§VI-C): their order, their bounds as fractions of C, and their names.

A request's class decides where MELL's Fig. 10 may put it, a worker reports each request's class,
the operator's routing table and the router name the classes, and the LLMPool status lists them: one
home here, so that the enum, its spellings and its bounds cannot drift apart.
"""

from __future__ import annotations

import enum
from typing import Literal


class SizeClass(enum.IntEnum):
    """MELL §VI-C size classes, ordered so that a GPU's category is the max over its items."""

    TINY = 0  # (0, C/8]: grouped into multi-items
    T = 1  # (C/8, C/4]
    S = 2  # (C/4, C/3]
    M = 3  # (C/3, C/2]
    L = 4  # (C/2, C]
    X = 5  # (C, inf): spans GPUs with DistAttention; not a failure


# Each class's upper bound as a fraction of C, (numerator, denominator): a request is in the smallest
# class whose bound holds it, X past C. Integers, so that classifying is exact (`size_class`).
UPPER_BOUND_FRACTIONS: dict[SizeClass, tuple[int, int]] = {
    SizeClass.TINY: (1, 8), SizeClass.T: (1, 4), SizeClass.S: (1, 3), SizeClass.M: (1, 2), SizeClass.L: (1, 1)}

# How reports and the status spell a class (KV-load reports carry all six).
SizeClassName = Literal["X", "L", "M", "S", "T", "tiny"]
# The classes a routing table names: the ones Fig. 10's Allocate places by (tiny requests travel as T
# multi-items, X as spans).
RoutedSizeClassName = Literal["L", "M", "S", "T"]
ROUTED_CLASS_NAMES: tuple[RoutedSizeClassName, ...] = ("L", "M", "S", "T")

CLASS_NAMES: dict[SizeClass, SizeClassName] = {
    SizeClass.X: "X", SizeClass.L: "L", SizeClass.M: "M", SizeClass.S: "S", SizeClass.T: "T", SizeClass.TINY: "tiny"}
_CLASS_OF_NAME: dict[str, SizeClass] = {name: cls for cls, name in CLASS_NAMES.items()}


def size_class(size_bytes: int, capacity_bytes: int) -> SizeClass:
    """Classify with exact integer arithmetic (MELL §VI-C, "Priority-aware GPU Categories").

    Written out rather than looped over UPPER_BOUND_FRACTIONS: the replay classifies every growth
    report, and the unrolled comparisons are what keeps that cheap (they are the same bounds).
    """
    c = capacity_bytes
    if size_bytes > c:
        return SizeClass.X
    if 2 * size_bytes > c:
        return SizeClass.L
    if 3 * size_bytes > c:
        return SizeClass.M
    if 4 * size_bytes > c:
        return SizeClass.S
    if 8 * size_bytes > c:
        return SizeClass.T
    return SizeClass.TINY


def middle_bytes(cls: SizeClass, capacity_bytes: int) -> int:
    """The middle of a bounded class's range of sizes on a worker of `capacity_bytes` (X has none): a
    representative request of the class, as the routing table previews one."""
    if cls is SizeClass.X:
        raise ValueError("class X has no upper bound, so no middle")
    upper_num, upper_den = UPPER_BOUND_FRACTIONS[cls]
    lower_num, lower_den = (0, 1) if cls is SizeClass.TINY else UPPER_BOUND_FRACTIONS[SizeClass(cls - 1)]
    return capacity_bytes * (lower_num * upper_den + upper_num * lower_den) // (2 * lower_den * upper_den)


def size_class_name(kv_bytes: int, capacity_bytes: int) -> SizeClassName:
    """The class of `kv_bytes` on a worker of `capacity_bytes`, as reports spell it."""
    return CLASS_NAMES[size_class(kv_bytes, capacity_bytes)]


def class_of_name(name: str) -> SizeClass:
    """The class a report or routing-table spelling names (KeyError for none)."""
    return _CLASS_OF_NAME[name]
