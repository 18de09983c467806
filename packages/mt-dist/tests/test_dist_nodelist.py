"""SLURM host-list and tasks-per-node parsers (pure)."""

from __future__ import annotations

import pytest

from mt_dist import expand_nodelist, expand_tasks_per_node, first_host


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5", ["gpu5"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[3],y[1-2]z", ["x3", "y1z", "y2z"]),
        ("node-1.cluster,node-2.cluster", ["node-1.cluster", "node-2.cluster"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize(
    ("nodelist", "pattern"),
    [
        ("node[01-03", r"unclosed '\['"),
        ("node01]", r"unmatched '\]'"),
        ("n[[1-2]]", r"nested '\['"),
        ("n[a-b]", r"bad range 'a-b'"),
        ("n[5-3]", r"runs backwards \(5 > 3\)"),
        ("", r"names no host"),
        (",", r"names no host"),
    ],
)
def test_malformed_nodelists(nodelist: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        expand_nodelist(nodelist)
    with pytest.raises(ValueError):
        first_host(nodelist)


def test_large_nodelist_first_host() -> None:
    assert first_host("big[0001-4096],other") == "big0001"
    assert len(expand_nodelist("big[0001-4096],other")) == 4097


@pytest.mark.parametrize(
    ("spec", "counts"),
    [("8", [8]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,2,3", [1, 2, 3])],
)
def test_expand_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "2(3)", "x", "2(x)"])
def test_malformed_tasks_per_node(spec: str) -> None:
    with pytest.raises(ValueError, match="tasks-per-node"):
        expand_tasks_per_node(spec)


def test_huge_lists_are_refused_without_expanding() -> None:
    """A range of 10**20 hosts hung first_host; 10**9 nodes of tasks filled the memory."""
    assert first_host("n[1-1000000],m") == "n1"
    assert first_host("rack[07-9]-n[001-2]x") == "rack07-n001x"
    for nodelist in ("n[1-99999999999999999999]", "n[1-1000000]-r[1-1000000]",
                     "n[1-1048577]"):
        for parse in (first_host, expand_nodelist):
            with pytest.raises(ValueError, match=r"names more than 1,048,576 hosts"):
                parse(nodelist)
    with pytest.raises(ValueError, match=r"names more than 1,048,576 hosts"):
        expand_nodelist("a[1-600000],b[1-600000]")
    with pytest.raises(ValueError, match=r"'2\(x1000000000\)' names more than 1,048,576 nodes"):
        expand_tasks_per_node("2(x1000000000)")
    assert len(expand_tasks_per_node("1(x1048576)")) == 1 << 20
