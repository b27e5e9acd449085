"""SLURM's host-list syntax: every form SLURM writes, and a malformed list told exactly."""

from __future__ import annotations

import pytest

from aioelastic._cli.schedulers._hostlist import first_host, hosts

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("n1", ["n1"]),
        ("n[5]", ["n5"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
        ("x[1-2]y", ["x1y", "x2y"]),
        ("node-a.example.org,127.0.0.1", ["node-a.example.org", "127.0.0.1"]),
    ],
)
def test_every_form_expands_in_slurms_order(text: str, expected: list[str]) -> None:
    assert list(hosts(text)) == expected
    assert first_host(text) == expected[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("n[1-", "'n[1-': '[' at 1 is never closed"),
        ("n[3-1]", "'n[3-1]': the range '3-1' in [3-1] goes down"),
        ("n[a-b]", "'n[a-b]': 'a-b' in [a-b] is not a number or a range LOW-HIGH"),
        ("n[]", "'n[]': [] has an empty element; give e.g. [1-3,7]"),
        ("n[1,,2]", "'n[1,,2]': [1,,2] has an empty element; give e.g. [1-3,7]"),
        (",", "',': an empty host name (a comma at an end, or two in a row)"),
        ("a,,b", "'a,,b': an empty host name (a comma at an end, or two in a row)"),
        ("", "'': an empty host name (a comma at an end, or two in a row)"),
        ("n[1[2]]", "'n[1[2]]': '[' at 3 is inside another '[...]'"),
        ("n]", "'n]': ']' at 1 closes no '['"),
        ("n[-1]", "'n[-1]': '-1' in [-1] is not a number or a range LOW-HIGH"),
        ("n[1-2000000]", "'n[1-2000000]': the range '1-2000000' names more hosts than 1000000"),
    ],
)
def test_a_malformed_list_is_refused_saying_where(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^'") as caught:
        first_host(text)
    assert str(caught.value) == message


def test_a_malformed_pattern_after_the_first_host_is_refused_too() -> None:
    with pytest.raises(ValueError, match="goes down"):
        first_host("n1,n[3-1]")
