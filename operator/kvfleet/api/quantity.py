"""Kubernetes resource quantities ("40Gi", "1.5G", "500M") as exact byte counts.

The CRDs take memory sizes the way every other Kubernetes object does, and the API server checks their
syntax with CEL's `isQuantity`. The operator still has to turn them into bytes, and a dependency on
the Kubernetes client just for that would leak into code that has no other reason to import it.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# The suffixes of k8s.io/apimachinery/pkg/api/resource (binary SI, decimal SI; no decimal exponent
# forms beyond plain `e`, which Kubernetes also accepts).
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|)$")


def parse_quantity(text: str | int) -> Decimal:
    """The value of a Kubernetes quantity; raises ValueError with the offending text."""
    if isinstance(text, int):
        return Decimal(text)
    match = _QUANTITY.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (examples: 40Gi, 500M, 1.5G)")
    number, suffix = match.groups()
    try:
        value = Decimal(number)
    except InvalidOperation as err:
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from err
    if suffix in _BINARY:
        return value * _BINARY[suffix]
    if suffix in _DECIMAL:
        return value * _DECIMAL[suffix]
    return value * (Decimal(10) ** int(suffix[1:]))


def quantity_bytes(text: str | int) -> int:
    """A memory quantity as whole bytes (rounded up, as the kubelet does for memory)."""
    value = parse_quantity(text)
    whole = int(value)
    return whole if whole == value else whole + 1


def format_bytes(num_bytes: int) -> str:
    """The shortest exact binary-suffixed quantity for a byte count (for status and messages)."""
    for suffix, factor in reversed(_BINARY.items()):
        if num_bytes and num_bytes % factor == 0:
            return f"{num_bytes // factor}{suffix}"
    return str(num_bytes)
