"""Std parsing (torchrun's --redirects/--tee syntax) and expansion to one value per rank."""

from __future__ import annotations

from typing import Any

import pytest

from aioelastic._core.output._std import Std, to_map


def test_flags_combine() -> None:
    assert Std.OUT | Std.ERR == Std.ALL
    assert [int(s) for s in (Std.NONE, Std.OUT, Std.ERR, Std.ALL)] == [0, 1, 2, 3]
    assert Std.ERR in Std.ALL
    assert Std.OUT not in Std.ERR


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", Std.NONE), ("1", Std.OUT), ("2", Std.ERR), ("3", Std.ALL), (" 3 ", Std.ALL)],
)
def test_from_str_single_value(text: str, expected: Std) -> None:
    value = Std.from_str(text)
    assert value is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0:3", {0: Std.ALL}),
        ("0:3,1:0", {0: Std.ALL, 1: Std.NONE}),
        ("1:2,0:1", {1: Std.ERR, 0: Std.OUT}),
        ("12:1,123:2", {12: Std.OUT, 123: Std.ERR}),
        ("007:3", {7: Std.ALL}),
        (" 0 : 3 , 1:1 ", {0: Std.ALL, 1: Std.OUT}),
    ],
)
def test_from_str_per_rank(text: str, expected: dict[int, Std]) -> None:
    value = Std.from_str(text)
    assert value == expected
    assert isinstance(value, dict)
    assert all(type(v) is Std for v in value.values())


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "4",
        "-1",
        "01",
        "33",
        "3 3",
        "ALL",
        "a",
        "1.0",
        "0:4",
        "0:",
        ":1",
        "0:1,",
        ",0:1",
        "0:1,,1:2",
        "0=1",
        "0:1;1:2",
        "0:1:2",
        "0:1 1:2",
        "-1:3",
        "a:1",
        "0:a",
        "0:03",
        "\u0663",  # ARABIC-INDIC DIGIT THREE: str.isdigit() but not an accepted digit
        "0:\u0663",
    ],
)
def test_from_str_rejects_bad_forms(text: str) -> None:
    with pytest.raises(ValueError, match="invalid Std value") as info:
        Std.from_str(text)
    message = str(info.value)
    assert repr(text) in message
    assert "'3'" in message
    assert "'0:3,1:0'" in message


def test_from_str_rejects_duplicate_rank() -> None:
    with pytest.raises(ValueError, match="rank 0 is given twice"):
        Std.from_str("0:1,1:2,0:3")


@pytest.mark.parametrize("value", [3, None, b"3", Std.ALL])
def test_from_str_rejects_non_str(value: Any) -> None:
    with pytest.raises(TypeError, match="expects a str"):
        Std.from_str(value)


def test_to_map_single_value_applies_to_every_rank() -> None:
    assert to_map(Std.ERR, 3) == {0: Std.ERR, 1: Std.ERR, 2: Std.ERR}
    assert to_map(Std.ALL, 0) == {}


def test_to_map_fills_unnamed_ranks_with_none() -> None:
    assert to_map({1: Std.OUT}, 3) == {0: Std.NONE, 1: Std.OUT, 2: Std.NONE}
    assert to_map({}, 2) == {0: Std.NONE, 1: Std.NONE}


def test_to_map_accepts_from_str_output() -> None:
    assert to_map(Std.from_str("0:3,2:2"), 3) == {0: Std.ALL, 1: Std.NONE, 2: Std.ERR}
    assert to_map(Std.from_str("1"), 2) == {0: Std.OUT, 1: Std.OUT}


def test_to_map_does_not_alias_the_input() -> None:
    given = {0: Std.OUT}
    result = to_map(given, 2)
    result[0] = Std.ERR
    assert given == {0: Std.OUT}


@pytest.mark.parametrize("rank", [-1, 2, 10])
def test_to_map_rejects_out_of_range_rank(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"local rank {rank} .* out of range.*0\.\.1"):
        to_map({rank: Std.ALL}, 2)


@pytest.mark.parametrize("value", [3, 0, "3", None, True])
def test_to_map_rejects_non_std_value(value: Any) -> None:
    with pytest.raises(TypeError, match="expected a Std"):
        to_map(value, 2)
    with pytest.raises(TypeError, match="expected a Std for local rank 1"):
        to_map({0: Std.ALL, 1: value}, 2)


def test_to_map_rejects_unknown_bits() -> None:
    with pytest.raises(ValueError, match="invalid Std value 4"):
        to_map(Std(4), 2)
    with pytest.raises(ValueError, match="invalid Std value 7 for local rank 0"):
        to_map({0: Std(7)}, 2)


@pytest.mark.parametrize("rank", ["0", 0.0, True, None])
def test_to_map_rejects_non_int_rank(rank: Any) -> None:
    with pytest.raises(TypeError, match="local rank keys must be ints"):
        to_map({rank: Std.ALL}, 2)


def test_to_map_rejects_bad_local_world_size() -> None:
    with pytest.raises(TypeError, match="local_world_size must be an int"):
        to_map(Std.ALL, "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_world_size must be >= 0"):
        to_map(Std.ALL, -1)


def test_to_map_error_points_to_from_str_for_strings() -> None:
    with pytest.raises(TypeError, match=r"Std\.from_str"):
        to_map("0:3", 2)  # type: ignore[arg-type]
