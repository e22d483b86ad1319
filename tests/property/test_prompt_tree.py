"""The prompt tree (kvfleet.serving.prompt_tree): exact small cases, and random operations against a
plain model of what is cached, pinned and evictable."""

from __future__ import annotations

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


OPS = st.lists(st.tuples(st.sampled_from(["insert", "match", "acquire", "release", "evict"]),
                         st.lists(st.integers(0, 2), min_size=0, max_size=8), st.integers(0, 4)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_random_operations_keep_the_books_exact(ops: list[tuple[str, list[int], int]]) -> None:
    tree: PromptTree[int] = PromptTree(BS)
    cached: dict[tuple[int, ...], int] = {}  # every cached prefix (whole blocks) -> its value
    pins: list[tuple[tuple[int, ...], ...]] = []  # the prefixes each acquired match pins
    matches = []
    values = iter(range(10**6))
    for op, tokens, n in ops:
        blocks = len(tokens) // BS
        prefixes = [tuple(tokens[: (i + 1) * BS]) for i in range(blocks)]
        if op == "insert":
            mine = [next(values) for _ in range(blocks)]
            dupes = tree.insert(tokens, mine)
            assert dupes == [v for p, v in zip(prefixes, mine) if p in cached]
            for p, v in zip(prefixes, mine):
                cached.setdefault(p, v)
        elif op in ("match", "acquire"):
            match = tree.match(tokens)
            expected = []
            for p in prefixes:
                if p not in cached:
                    break
                expected.append(cached[p])
            assert list(match.values) == expected
            if op == "acquire":
                tree.acquire(match)
                matches.append(match)
                pins.append(tuple(prefixes[: len(expected)]))
        elif op == "release" and matches:
            tree.release(matches.pop())
            pins.pop()
        elif op == "evict":
            pinned = {p for path in pins for p in path}
            freed = tree.evict(n)
            assert len(freed) <= n
            gone = {p for p, v in cached.items() if v in freed}
            assert not gone & pinned, "a pinned block was evicted"
            for p in gone:
                # Only leaves go: nothing cached may extend an evicted prefix.
                assert not any(q[: len(p)] == p and q not in gone for q in cached if len(q) > len(p))
                del cached[p]
            if len(freed) < n:
                # Nothing evictable was left: every unpinned block leads to a pinned one.
                assert all(any(q[: len(p)] == p for q in pinned) for p in cached.keys() - pinned)
        pinned = {p for path in pins for p in path}
        assert tree.num_blocks == len(cached)
        assert tree.num_evictable_blocks == len(cached.keys() - pinned)
