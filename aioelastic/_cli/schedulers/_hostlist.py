"""SLURM's host-list syntax, read without SLURM's tools: ``n[1-3,7],gpu[001-004]``.

A list is host patterns joined by commas; a pattern is text with bracketed ranges, each a
comma-separated list of numbers and ``LOW-HIGH`` ranges. A range keeps the zero padding
of its low end (``gpu[008-010]``: gpu008, gpu009, gpu010), and a pattern with several
brackets stands for every combination, the first bracket varying slowest, as
``scontrol show hostnames`` prints them (``rack[1-2]-n[01-02]``: rack1-n01, rack1-n02,
rack2-n01, rack2-n02). The whole list is checked before anything is expanded, and it is
expanded lazily: the first host of a list of thousands costs nothing more than one.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

__all__ = ["first_host", "hosts"]

#: The most hosts one range may name (SLURM's own lists are far shorter): a typo such as
#: ``n[1-10000000000]`` is refused instead of filling memory.
_MOST = 1_000_000

#: One element of a bracket: ``7`` or ``1-3``, digits only.
_ELEMENT = re.compile(r"(\d+)(?:-(\d+))?")

#: A pattern's pieces: literal text, or the numbers of one bracket as texts.
_Piece = str | tuple[str, ...]


def hosts(text: str) -> Iterator[str]:
    """Every host ``text`` names, in SLURM's order.

    Raises:
        ValueError: ``text`` is not a host list; the message quotes it and says where.
    """
    patterns = [_pattern(text, item) for item in _split(text)]
    for pieces in patterns:
        choices = [(piece,) if isinstance(piece, str) else piece for piece in pieces]
        for combination in itertools.product(*choices):
            yield "".join(combination)


def first_host(text: str) -> str:
    """The first host of ``text``, the whole list checked.

    Raises:
        ValueError: as `hosts`.
    """
    return next(hosts(text))


def _split(text: str) -> list[str]:
    """The patterns of ``text``: split at the commas outside brackets."""
    items, start, depth = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            if depth:
                raise ValueError(f"{text!r}: '[' at {index} is inside another '[...]'")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"{text!r}: ']' at {index} closes no '['")
            depth = 0
        elif char == "," and not depth:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"{text!r}: '[' at {text.rindex('[')} is never closed")
    items.append(text[start:])
    if not all(items):
        raise ValueError(f"{text!r}: an empty host name (a comma at an end, or two in a row)")
    return items


def _pattern(text: str, item: str) -> list[_Piece]:
    """One pattern's pieces, each bracket as the number texts it stands for."""
    pieces: list[_Piece] = []
    start = 0
    for bracket in re.finditer(r"\[([^\]]*)\]", item):
        if bracket.start() > start:
            pieces.append(item[start : bracket.start()])
        pieces.append(_numbers(text, bracket.group(1)))
        start = bracket.end()
    if start < len(item):
        pieces.append(item[start:])
    return pieces


def _numbers(text: str, bracket: str) -> tuple[str, ...]:
    """The numbers one bracket's body names, zero padding kept."""
    numbers: list[str] = []
    for element in bracket.split(","):
        match = _ELEMENT.fullmatch(element)
        if not element:
            raise ValueError(f"{text!r}: [{bracket}] has an empty element; give e.g. [1-3,7]")
        if match is None:
            raise ValueError(
                f"{text!r}: {element!r} in [{bracket}] is not a number or a range LOW-HIGH"
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"{text!r}: the range {element!r} in [{bracket}] goes down")
        if int(high) - int(low) >= _MOST:
            raise ValueError(f"{text!r}: the range {element!r} names more hosts than {_MOST}")
        width = len(low) if low.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return tuple(numbers)
