"""Which of a worker's standard streams to redirect to files or tee to the console."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping

__all__ = ["Std", "to_map"]

_SINGLE = re.compile(r"\s*([0-3])\s*", re.ASCII)
_ITEM = re.compile(r"\s*([0-9]+)\s*:\s*([0-3])\s*", re.ASCII)
_ACCEPTED_FORMS = (
    "a single digit 0-3 for every rank (e.g. '3'), or comma-separated 'rank:digit' items "
    "for some ranks (e.g. '0:3,1:0'), where 0=NONE, 1=OUT, 2=ERR, 3=ALL"
)


class Std(enum.IntFlag):
    """The standard streams of a worker, combinable as flags.

    Attributes:
        NONE: neither stream.
        OUT: stdout.
        ERR: stderr.
        ALL: stdout and stderr.
    """

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parse torchrun's ``--redirects``/``--tee`` syntax.

        Args:
            vm: ``"3"`` (one value for every rank) or ``"0:3,1:0"`` (per local rank; ranks not
                named get ``Std.NONE`` once passed through `to_map`). Whitespace around items
                is allowed.

        Returns:
            A `Std` for the single-value form, otherwise a ``{local_rank: Std}`` dict.

        Raises:
            TypeError: ``vm`` is not a str.
            ValueError: ``vm`` is in neither form, or names a rank twice.
        """
        if not isinstance(vm, str):
            raise TypeError(f"Std.from_str expects a str, got {type(vm).__name__} {vm!r}")
        single = _SINGLE.fullmatch(vm)
        if single:
            return cls(int(single.group(1)))
        result: dict[int, Std] = {}
        for item in vm.split(","):
            match = _ITEM.fullmatch(item)
            if match is None:
                raise ValueError(f"invalid Std value {vm!r}: expected {_ACCEPTED_FORMS}")
            rank = int(match.group(1))
            if rank in result:
                raise ValueError(f"invalid Std value {vm!r}: rank {rank} is given twice")
            result[rank] = cls(int(match.group(2)))
        return result


def to_map(val_or_map: Std | Mapping[int, Std], local_world_size: int) -> dict[int, Std]:
    """Expand a `Std` or a partial per-rank mapping to one `Std` per local rank.

    Args:
        val_or_map: a `Std` applied to every rank, or ``{local_rank: Std}``; ranks it does
            not name get ``Std.NONE``.
        local_world_size: number of local ranks (``0..local_world_size-1``).

    Returns:
        ``{local_rank: Std}`` for every local rank.

    Raises:
        TypeError: a value is not a `Std` (plain ints and strings are refused: use
            ``Std(n)`` or `Std.from_str`), a rank is not an int, or ``local_world_size``
            is not an int.
        ValueError: a rank is outside ``0..local_world_size-1``, a value is outside
            ``Std.ALL``, or ``local_world_size`` is negative.
    """
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int):
        raise TypeError(f"local_world_size must be an int, got {local_world_size!r}")
    if local_world_size < 0:
        raise ValueError(f"local_world_size must be >= 0, got {local_world_size}")
    if isinstance(val_or_map, Std):
        _check_value(val_or_map, None)
        return dict.fromkeys(range(local_world_size), val_or_map)
    if not isinstance(val_or_map, Mapping):
        raise TypeError(
            f"expected a Std or a {{local_rank: Std}} mapping, got "
            f"{type(val_or_map).__name__} {val_or_map!r}; for a torchrun-style string "
            "use Std.from_str"
        )
    result = dict.fromkeys(range(local_world_size), Std.NONE)
    for rank, value in val_or_map.items():
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"local rank keys must be ints, got {rank!r} in {val_or_map!r}")
        if not 0 <= rank < local_world_size:
            raise ValueError(
                f"local rank {rank} in {val_or_map!r} is out of range: "
                f"local ranks are 0..{local_world_size - 1}"
            )
        _check_value(value, rank)
        result[rank] = value
    return result


def _check_value(value: object, rank: int | None) -> None:
    where = "" if rank is None else f" for local rank {rank}"
    if not isinstance(value, Std):
        raise TypeError(
            f"expected a Std{where}, got {type(value).__name__} {value!r}; "
            "use Std.NONE/OUT/ERR/ALL or Std(n)"
        )
    # IntFlag keeps unknown bits (Std(4) is a valid object), so reject them explicitly.
    if int(value) & ~int(Std.ALL):
        raise ValueError(f"invalid Std value {int(value)}{where}: valid values are 0..3")
