"""The prompt tree (kvfleet.serving.prompt_tree): exact small cases, and random operations against a
plain model of what is cached, on which tier, pinned and evictable."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.serving.prompt_tree import PromptTree

BS = 2  # tokens per block, small so that prefixes collide often


def test_match_finds_the_longest_cached_prefix_in_whole_blocks() -> None:
    tree: PromptTree[str] = PromptTree(BS)
    assert tree.insert([1, 2, 3, 4, 5], ["a", "b"]) == []  # the partial block (5) is not cached
    match = tree.match([1, 2, 3, 4, 9, 9])
    assert (match.values, match.num_tokens) == (("a", "b"), 4)
    assert tree.match([1, 2, 7, 7]).values == ("a",)
    assert tree.match([9, 9]).values == ()
    # A second request with the same first block keeps the cached block and gets its own copy back.
    assert tree.insert([1, 2, 6, 6], ["a2", "c"]) == ["a2"]
    assert (tree.num_blocks, tree.num_evictable_blocks) == (3, 3)
    # Inserting blocks it matched (the same values) frees nothing.
    assert tree.insert([1, 2, 3, 4, 8, 8], ["a", "b", "e"]) == []


def test_pinned_blocks_are_never_evicted_and_leaves_go_least_recently_used_first() -> None:
    tree: PromptTree[str] = PromptTree(BS)
    tree.insert([1, 2, 3, 4], ["a", "b"])
    tree.insert([1, 2, 5, 6], ["a", "c"])
    tree.insert([7, 8], ["d"])
    pinned = tree.match([1, 2, 3, 4])  # a and b, used now
    tree.acquire(pinned)
    assert tree.num_evictable_blocks == 2  # c, d
    assert tree.evict(10) == ["c", "d"]  # c older than d; a, b pinned
    assert tree.num_blocks == 2
    tree.release(pinned)
    assert tree.evict(1) == ["b"]  # the leaf first, then its parent
    assert tree.evict(1) == ["a"] and tree.num_blocks == tree.num_evictable_blocks == 0


def test_swapped_out_blocks_stay_matchable_and_come_back_in_order() -> None:
    tree: PromptTree[str] = PromptTree(BS)
    tree.insert([1, 2, 3, 4, 5, 6], ["a", "b", "c"])
    tree.insert([7, 8], ["d"])
    places = iter(["h1", "h2", "h3"])
    # Least recently used first, and only blocks with nothing on the device below them: c, then b.
    assert tree.swap_out(2, lambda value: next(places)) == ["c", "b"]
    assert (tree.num_blocks, tree.num_evictable_blocks, tree.num_host_blocks) == (2, 2, 2)
    match = tree.match([1, 2, 3, 4, 5, 6])
    assert match.values == ("a", "h2", "h1") and [n.on_host for n in match.nodes] == [False, True, True]
    with pytest.raises(ValueError):
        tree.swap_in(match.nodes[2], "c2")  # its parent is on the host
    # Inserting over a block on the host stops there: the caller's copies are its own to free.
    assert tree.insert([1, 2, 3, 4, 5, 6], ["a", "b2", "c2"]) == ["b2", "c2"]
    assert tree.swap_in(match.nodes[1], "b2") == "h2"
    assert tree.insert([1, 2, 3, 4, 5, 6], ["a", "b2", "c2"]) == ["c2"]
    assert tree.swap_out(1, lambda value: next(places)) == ["d"]  # used least recently of b2 and d
    assert tree.swap_out(1, lambda value: None) == []  # the host has no room: nothing moves
    tree.acquire(match)
    assert (tree.num_evictable_blocks, tree.num_evictable_host_blocks) == (0, 1)
    assert tree.drop_host(5) == ["h3"]  # c is pinned
    tree.release(match)
    assert tree.drop_host(5) == ["h1"] and tree.evict(5) == ["b2", "a"]
    assert tree.num_blocks == tree.num_host_blocks == 0


def placing(places: dict[int, int], values: Iterator[int]) -> Callable[[int], int]:
    """A host tier with room for everything: each block gets a new place, recorded in `places`."""

    def place(value: int) -> int:
        places[value] = next(values)
        return places[value]

    return place


OPS = st.lists(st.tuples(st.sampled_from(["insert", "match", "acquire", "release", "evict", "swap_out", "drop_host",
                                          "swap_in"]),
                         st.lists(st.integers(0, 2), min_size=0, max_size=8), st.integers(0, 4)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_random_operations_keep_the_books_exact(ops: list[tuple[str, list[int], int]]) -> None:
    tree: PromptTree[int] = PromptTree(BS)
    cached: dict[tuple[int, ...], int] = {}  # every cached prefix (whole blocks) -> its value
    host: set[tuple[int, ...]] = set()  # the cached prefixes on the host tier
    pins: list[tuple[tuple[int, ...], ...]] = []  # the prefixes each acquired match pins
    matches = []
    values = iter(range(10**6))

    def below(p: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [q for q in cached if len(q) > len(p) and q[: len(p)] == p]

    for op, tokens, n in ops:
        blocks = len(tokens) // BS
        prefixes = [tuple(tokens[: (i + 1) * BS]) for i in range(blocks)]
        pinned = {p for path in pins for p in path}
        if op == "insert":
            mine = [next(values) for _ in range(blocks)]
            dupes = tree.insert(tokens, mine)
            expected_dupes = []
            for i, (p, v) in enumerate(zip(prefixes, mine)):
                if p in host:  # the insert stops at a block on the host
                    expected_dupes += mine[i:]
                    break
                if p in cached:
                    expected_dupes.append(v)
                else:
                    cached[p] = v
            assert dupes == expected_dupes
        elif op in ("match", "acquire", "swap_in"):
            match = tree.match(tokens)
            expected = []
            for p in prefixes:
                if p not in cached:
                    break
                expected.append(cached[p])
            assert list(match.values) == expected
            assert [node.on_host for node in match.nodes] == [p in host for p in prefixes[: len(expected)]]
            if op == "acquire":
                tree.acquire(match)
                matches.append(match)
                pins.append(tuple(prefixes[: len(expected)]))
            elif op == "swap_in":
                for p, node in zip(prefixes, match.nodes):
                    if node.on_host:
                        v = next(values)
                        assert tree.swap_in(node, v) == cached[p]
                        cached[p] = v
                        host.discard(p)
        elif op == "release" and matches:
            tree.release(matches.pop())
            pins.pop()
        elif op == "evict":
            freed = tree.evict(n)
            assert len(freed) <= n
            gone = {p for p, v in cached.items() if v in freed}
            assert len(gone) == len(freed) and not gone & (pinned | host), "a pinned or host block was evicted"
            for p in gone:
                # Only leaves go: nothing cached may extend an evicted prefix.
                assert not [q for q in below(p) if q not in gone]
            for p in gone:
                del cached[p]
            if len(freed) < n:
                # Nothing evictable was left: every unpinned device block leads to a pinned or a host one.
                assert all(any(q in pinned or q in host for q in below(p)) for p in cached.keys() - pinned - host)
        elif op == "swap_out":
            places: dict[int, int] = {}
            freed = tree.swap_out(n, placing(places, values))
            assert len(freed) <= n and list(places) == freed
            moved = {p for p, v in cached.items() if v in freed}
            assert len(moved) == len(freed) and not moved & (pinned | host), "a pinned or host block was swapped out"
            for p in moved:
                cached[p] = places[cached[p]]
                host.add(p)
            if len(freed) < n:
                # No candidate was left: below every unpinned device block is a pinned device block.
                assert all(any(q in pinned and q not in host for q in below(p)) for p in cached.keys() - pinned - host)
        elif op == "drop_host":
            dropped = tree.drop_host(n)
            assert len(dropped) <= n
            gone = {p for p, v in cached.items() if v in dropped}
            assert len(gone) == len(dropped) and gone <= host - pinned, "a pinned or device block was dropped"
            for p in gone:
                assert not [q for q in below(p) if q not in gone]
            for p in gone:
                del cached[p]
                host.discard(p)
            if len(dropped) < n:
                assert not host - pinned
        pinned = {p for path in pins for p in path}
        # The tiers' invariant: below a block on the host, every block is on the host.
        assert all(q in host for p in host for q in below(p))
        assert tree.num_blocks == len(cached.keys() - host)
        assert tree.num_evictable_blocks == len(cached.keys() - host - pinned)
        assert tree.num_host_blocks == len(host)
        assert tree.num_evictable_host_blocks == len(host - pinned)
