"""The planner's compressed prefix trie over the rows' shareable block ids (numpy only).

A row's shareable ids are its leading block ids that it may share (see
:mod:`.planner`). A node of the trie is an id sequence that at least two rows
start with and that not all of them continue alike; node 0 is the root (no ids). Every row with
shareable ids sits at its deepest node, the longest prefix it shares with any other row, and goes
on from there with its *continuation*: its next block id, or 0 when its shareable ids end there
(block 0 is never shareable, so 0 is free to mean "none").

The kept nodes, those the limits (``max_levels``, ``min_shared_pages``) let become groups, are
fixed by the trie alone: the number of rows through a node does not matter. So a batch whose rows
fall on the same nodes, with distinct continuations and at least two ways on from every node
(:meth:`PrefixTrie.holds`), has this very trie and these very groups, whichever rows it holds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Group sequences whose levels' pages a trie keeps at most.
MAX_CACHED = 64

# Placed rows few enough to check one by one rather than by sorting every row's continuation.
FEW_PLACED = 4


@dataclass(frozen=True, eq=False)
class PrefixTrie:
    """The nodes of the trie (index 0: the root) and the groups the limits keep among them.

    Nodes are numbered in pre-order (a node's subtree follows it). Per node ``[N]`` (int64):

    depth : ids on the path from the root to the node.
    kept_depth : depth of the deepest kept node on that path (root: 0): where the per-request
        level of a row at this node starts.
    groups : ``[levels, N]`` the kept group on each shared level of the path, -1 for none.
    free_levels : levels of the plan past the path's last kept group (``levels`` - kept ones).
    child_count : children.
    children : per node, its children by their first id (the id at the node's depth).
    edges : per node, the ids from its parent's depth to its own (the root: none).

    Per kept group, ``group_pages``: the block ids it reads (the edges up from the kept node
    above). ``pages`` and ``max_page``: all groups' pages and their largest id (-1 for none),
    which every plan of this trie reads, since every kept node has rows.
    """

    depth: np.ndarray
    kept_depth: np.ndarray
    groups: np.ndarray
    free_levels: np.ndarray
    child_count: np.ndarray
    children: tuple[dict[int, int], ...]
    edges: tuple[np.ndarray, ...]
    group_pages: tuple[np.ndarray, ...]
    pages: int
    max_page: int
    # Arrays derived from the trie alone, computed on first use (plans treat them as read-only).
    cache: dict[object, Any] = field(default_factory=dict, repr=False)

    @property
    def num_levels(self) -> int:
        return self.groups.shape[0]

    def sort_weights(self, num_rows: int) -> tuple[list[int], np.ndarray] | None:
        """The digits' place values and each node's row weight of the rows' sort keys.

        A row's key is the number whose ``levels + 1`` digits in base ``num_rows`` are the
        earliest rows of its groups, then the row itself on every remaining digit; so it is
        ``sum(first(g_l) * powers[l]) + row * weight[node]``. ``None`` when the keys need more
        than an int64.
        """
        levels = self.num_levels
        if (levels + 1) * max(num_rows, 2).bit_length() > 62:
            return None
        cached = self.cache.get(("weights", num_rows))
        if cached is None:
            powers = [num_rows**k for k in range(levels, -1, -1)]
            weights = np.cumsum(np.array(powers[::-1], np.int64))  # the last k + 1 digits
            cached = self.cache[("weights", num_rows)] = powers, weights[self.free_levels]
        return cached

    def level_pages(self, groups: list[int]) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        """A shared level's int32 ``kv_page_indptr`` and ``kv_page_indices``, and its pages per
        group, for its ``groups`` in order (which change far less often than its rows)."""
        key = tuple(groups)
        cached = self.cache.get(key)
        if cached is None:
            if len(self.cache) >= MAX_CACHED:
                self.cache.clear()
            sizes = [len(self.group_pages[g]) for g in groups]
            kv_page_indptr = np.array([0, *itertools.accumulate(sizes)], np.int32)
            pages = np.concatenate([self.group_pages[g] for g in groups])
            cached = self.cache[key] = kv_page_indptr, pages, tuple(sizes)
        return cached

    def place(self, table: np.ndarray, row: int, pages: int,
              node: int = 0) -> tuple[int, int] | None:
        """The node and continuation of a row whose shareable ids are ``table[row, :pages]``.

        The row's ids are known to lie on the path to ``node`` (the root by default), from where
        it is walked down. ``None`` when the row leaves an edge midway (or ends inside one): it
        would split the edge with a new node. The continuation is checked against the node's
        children here; that no other row continues alike, and that no node lost its rows, is
        :meth:`holds`' part.
        """
        ids = table[row]
        depth = int(self.depth[node])
        while pages > depth:
            following = int(ids[depth])
            child = self.children[node].get(following)
            if child is None:
                return node, following
            end = depth + len(self.edges[child])
            if pages < end or np.count_nonzero(ids[depth + 1 : end] != self.edges[child][1:]):
                return None
            node, depth = child, end
        return node, 0

    def holds(self, node: np.ndarray, continuation: np.ndarray, *, ways: bool,
              placed: list[int]) -> bool:
        """Whether rows at ``node`` going on with ``continuation`` form exactly this trie.

        Parameters
        ----------
        node, continuation : int64 ``[R]`` each row's node and continuation, as :meth:`place`
            gives them (0 and 0 for a row without shareable ids).
        ways : check that every node but the root still has two ways on (children, and rows
            ending or continuing at it); skip only when no row left a node.
        placed : the rows whose continuation may be another row's at their node; the others'
            are known to be distinct.

        Each row must lie on its node's path and continue with an id that starts none of the
        node's children: callers check these. Then the rows form this trie exactly when both
        checks pass; otherwise a node has gone or two rows share a prefix that is no node.
        """
        if ways and len(self.depth) > 1:
            counts = np.bincount(node, minlength=len(self.depth))
            counts += self.child_count
            if np.count_nonzero(counts[1:] < 2):
                return False
        if len(placed) > FEW_PLACED:
            going_on = continuation != 0
            keys = (node[going_on] << 32) | (continuation[going_on] & 0xFFFFFFFF)
            keys.sort()
            return not np.count_nonzero(keys[1:] == keys[:-1])
        for row in placed:
            following = continuation[row]
            if following:
                alike = continuation == following
                if np.count_nonzero(alike) > 1 and np.count_nonzero(alike[node == node[row]]) > 1:
                    return False
        return True


def sorted_prefixes(
    table: np.ndarray, rows: np.ndarray, shareable: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort ``rows`` by their shareable block ids and measure neighbours' common prefixes.

    Returns the sorted rows, their block-table rows (same order, leading columns) and ``lcp``
    where ``lcp[i]`` is the number of leading pages sorted rows ``i`` and ``i + 1`` share.
    """
    lens = shareable[rows]
    width = int(lens.max())
    # Big-endian bytes compare like the id sequences themselves, and a prefix sorts first.
    big_endian = table[:, :width].astype(">u4")
    keys = [big_endian[r, :n].tobytes() for r, n in zip(rows.tolist(), lens.tolist(), strict=True)]
    order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    rows, lens = rows[order], lens[order]
    ids = table[rows, :width]
    differs = ids[1:] != ids[:-1]
    first_difference = np.where(differs.any(axis=1), differs.argmax(axis=1), width)
    lcp = np.minimum(first_difference, np.minimum(lens[1:], lens[:-1]))
    return rows, ids, lcp


def trie_nodes(lcp: list[int]) -> list[tuple[int, int, int, int]]:
    """The shared nodes of the compressed trie over sorted rows, from neighbours' prefixes.

    Returns ``(depth, first, last, parent)`` per node, parents before children: sorted rows
    ``first..last`` (at least two) share their first ``depth`` pages, and ``parent`` indexes the
    returned list (``-1`` for the root). This is the classic LCP-interval stack walk.
    """
    depth, first, last, parent = [0], [0], [len(lcp)], [-1]
    stack = [0]
    for i, common in enumerate([*lcp, 0], start=1):
        left, child = i - 1, -1
        while common < depth[stack[-1]]:
            node = stack.pop()
            last[node], left, child = i - 1, first[node], node
            if common <= depth[stack[-1]]:
                parent[node], child = stack[-1], -1
        if common > depth[stack[-1]]:
            depth.append(common)
            first.append(left)
            last.append(-1)
            parent.append(-1)
            if child >= 0:
                parent[child] = len(depth) - 1
            stack.append(len(depth) - 1)
    preorder = sorted(range(1, len(depth)), key=lambda v: (first[v], depth[v]))
    position = {v: i for i, v in enumerate(preorder)}
    position[0] = -1
    return [(depth[v], first[v], last[v], position[parent[v]]) for v in preorder]


def build_trie(
    table: np.ndarray, shareable: np.ndarray, max_levels: int, min_shared_pages: int
) -> tuple[PrefixTrie, np.ndarray, np.ndarray]:
    """The trie of the rows' shareable ids, and each row's node and continuation.

    Parameters
    ----------
    table : int32 ``[R, max_pages]`` the block table.
    shareable : int64 ``[R]`` leading ids of each row that it may share (0: none).
    max_levels, min_shared_pages : the planner's limits: a node is kept as a group when it owns
        at least ``min_shared_pages`` pages below the kept node above it and lies on a shared
        level, i.e. fewer than ``max_levels`` kept nodes deep.

    Returns
    -------
    trie : PrefixTrie
    node, continuation : int64 ``[R]`` (both 0 for a row without shareable ids).
    """
    num_rows = len(shareable)
    node = np.zeros(num_rows, np.int64)
    rows = np.flatnonzero(shareable > 0)
    nodes: list[tuple[int, int, int, int]] = []
    ids = np.empty((0, 0), np.int32)
    if rows.size >= 2:
        rows, ids, lcp = sorted_prefixes(table, rows, shareable)
        nodes = trie_nodes(lcp.tolist())
    depth, kept_depth, kept_levels = [0], [0], [0]
    child_count = [0] * (len(nodes) + 1)
    children: list[dict[int, int]] = [{} for _ in range(len(nodes) + 1)]
    edges = [np.empty(0, np.int32)]
    path_groups = [(-1,) * (max_levels - 1)]
    group_pages: list[np.ndarray] = []
    for v, (end, first, last, parent) in enumerate(nodes, start=1):
        parent += 1
        start, above, level = depth[parent], kept_depth[parent], kept_levels[parent] + 1
        edges.append(ids[first, start:end])
        children[parent][int(ids[first, start])] = v
        child_count[parent] += 1
        groups = path_groups[parent]
        # A dropped node's pages fall to its children (or the rows' own level): each row
        # still covers every page exactly once.
        if end - above >= min_shared_pages and level < max_levels:
            groups = (*groups[: level - 1], len(group_pages), *groups[level:])
            group_pages.append(ids[first, above:end])
            above = end
        else:
            level -= 1
        depth.append(end)
        kept_depth.append(above)
        kept_levels.append(level)
        path_groups.append(groups)
        node[rows[first : last + 1]] = v  # pre-order: deeper nodes overwrite
    groups = np.array(path_groups, np.int64).T[: max(kept_levels)]
    trie = PrefixTrie(
        depth=np.array(depth, np.int64),
        kept_depth=np.array(kept_depth, np.int64),
        groups=groups,
        free_levels=len(groups) - np.array(kept_levels, np.int64),
        child_count=np.array(child_count, np.int64),
        children=tuple(children),
        edges=tuple(edges),
        group_pages=tuple(group_pages),
        pages=sum(len(p) for p in group_pages),
        max_page=max((int(p.max()) for p in group_pages), default=-1),
    )
    return trie, node, continuations(table, trie, node, shareable)


def continuations(
    table: np.ndarray, trie: PrefixTrie, node: np.ndarray, shareable: np.ndarray
) -> np.ndarray:
    """int64 ``[R]``: each row's id at its node's depth, or 0 where its shareable ids end."""
    depth = trie.depth[node]
    going_on = np.flatnonzero(shareable > depth)
    continuation = np.zeros(len(node), np.int64)
    continuation[going_on] = table[going_on, depth[going_on]]
    return continuation
