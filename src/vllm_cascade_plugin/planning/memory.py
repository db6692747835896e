"""What the cascade planner remembers between steps, and how it carries it to the next one.

numpy only. The memory is the last step's :class:`~vllm_cascade_plugin.planning.layout.Structure`
and a snapshot of its block table's leading columns. For the next step it keeps the prefix trie
and finds each row's node in it: a row that still holds, at the same place, the shareable ids
it was planned with keeps its node; any other row (new, moved, or changed) is looked up in the
trie (:meth:`~.trie.PrefixTrie.place`). If the rows then form the same trie
(:meth:`~.trie.PrefixTrie.holds`), only the layout is redone, and not even
that while every row keeps its node; otherwise the caller plans from scratch. Either way the
structure is exactly the one a fresh plan finds for the step.

Which rows still hold their ids is found one of two ways. Without row keys, by comparing the
block table with the snapshot, id by id: ``O(rows x pages)``, the largest cost of a steady step.
With row keys (the caller's promise, one integer per row: a row whose key some row had in the
last step planned with keys holds, in every column that step read, that row's ids, vLLM having
at most appended to them), by comparing the keys: ``O(rows)``, and only rows with a new key are
read again. A row that moved keeps its node by its key: Model Runner V2 orders a step's rows
by request, so a request that finishes moves every row after it, and its rows of several query
tokens (prefills, chunks) go behind the decode rows, so a request that goes from one to the
other moves too. Keys that repeat within a step promise nothing beyond their place. No
snapshot is kept then; a step planned without keys after one planned with them is planned from
scratch. A keyed step of the last step's decode rows, each one token longer, is steady decode:
its inputs and structure are the last step's with each row's new page, if it started one
(:meth:`PlanMemory.continue_decode`), without reading or checking the rows again.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .layout import Step, Structure, first_zero, layout

# Pages a snapshot of the block table keeps beyond the longest shareable prefix, so that rows
# growing by a page in steady decode do not force a re-copy of the snapshot every step.
SNAPSHOT_SLACK_PAGES = 16

# Rows looked at (and looked up in the trie) one by one, each some microseconds: past this many
# (a batch reordered throughout), planning from scratch is about as fast.
MOST_PLACED_ROWS = 8
MOST_PLACED_FRACTION = 4  # ... or past a quarter of the rows, if that is more


class PlanMemory:
    """The structure of the step last planned, and a copy of the block-table columns it read."""

    def __init__(self, step: Step, structure: Structure, keys: np.ndarray | None = None) -> None:
        self.page_size = step.page_size
        self.structure = structure
        self._active = step.active
        self._all_active = step.all_active
        self._num_rows = len(step.seq_lens)
        self._snapshot: np.ndarray = np.empty((0, 0), np.int32)
        self._differs: np.ndarray = np.empty((0, 0), bool)
        # The rows' keys of the step last planned, while it was planned with keys: then there is
        # no snapshot.
        self._keys = None if keys is None else keys.copy()
        if keys is None:
            self._copy(step.dense(), structure.shareable)
        self._decode_step: Step | None = None  # see continue_decode
        self._seq_next = np.empty(0, np.int64)
        self._query = np.empty(0, np.int64)
        self._index: np.ndarray | None = None
        # The arguments :meth:`continues` last said yes to, which the next continue_decode
        # takes without comparing them again (the runner hooks ask both of the same arrays).
        self._confirmed: tuple[object, ...] | None = None
        self._remember(step, keys)

    def _remember(self, step: Step, keys: np.ndarray | None) -> None:
        """Keep ``step`` for :meth:`continue_decode` when it was a keyed step of decode rows
        only (every row one query token, no padding)."""
        decode = keys is not None and step.all_active and step.num_tokens == len(step.seq_lens)
        self._decode_step = step if decode else None
        self._confirmed = None
        if decode:  # copies: a caller may update its arrays in place for the next step
            self._seq_next = step.seq_lens + 1
            self._query = step.query_lens.copy()
            self._index = None if step.row_index is None else step.row_index.copy()

    def continues(self, seq_lens: np.ndarray, query_lens: np.ndarray,
                  keys: np.ndarray | Callable[[], np.ndarray | None] | None,
                  row_index: np.ndarray | None) -> bool:
        """Whether a step is the last step's decode rows, each one token longer: the same rows
        (their keys, and rows of the table, unchanged) of one query token each, after a step
        planned with keys that was that too. ``keys`` may be a function that reads them: called
        only where the lengths match. A yes holds for :meth:`continue_decode` of the very same
        arrays, unchanged, next."""
        self._confirmed = None
        last = self._decode_step
        if (last is None or keys is None or self._keys is None
                or not np.array_equal(seq_lens, self._seq_next)
                or not np.array_equal(query_lens, self._query)):
            return False
        if callable(keys):
            keys = keys()
        if not (keys is not None and np.array_equal(keys, self._keys)
                and (row_index is None if self._index is None
                     else row_index is not None and np.array_equal(row_index, self._index))):
            return False
        self._confirmed = (seq_lens, query_lens, keys, row_index)
        return True

    def continue_decode(self, block_table: np.ndarray, seq_lens: np.ndarray,
                        query_lens: np.ndarray, keys: np.ndarray | None,
                        row_index: np.ndarray | None) -> tuple[Step, Structure] | None:
        """The step and its structure where it :meth:`continues` the last one, else None.

        What :func:`~.layout.read_step` and :meth:`follow` give such a step, found from the last
        step: a row's new token starts a new page where its position is a multiple of the page
        size, and then its last full page may be shareable (up to a block 0, read as
        :meth:`follow` reads it). The rows keep their nodes, and the structure its layout, unless
        a row that ended at its node grew past it: then None, and :meth:`follow` places it.
        """
        table = np.asarray(block_table)
        last = self._decode_step
        confirmed, self._confirmed = self._confirmed, None
        if last is None or table.dtype != np.int32 or table.ndim != 2:
            return None
        asked = (seq_lens, query_lens, keys, row_index)
        trusted = confirmed is not None and all(
            a is b for a, b in zip(confirmed, asked, strict=True))
        if not (trusted or self.continues(*asked)):
            return None
        seq = self._seq_next
        crossed = (seq - 1) % self.page_size == 0
        num_pages, bound = last.num_pages, last.shareable_bound
        if np.count_nonzero(crossed):
            num_pages, bound = num_pages + crossed, bound + crossed
            if int(np.maximum.reduce(num_pages)) > table.shape[1]:
                return None  # read_step refuses it
        step = Step(block_table=table, seq_lens=seq, query_lens=self._query,
                    page_size=self.page_size, active=last.active, all_active=True,
                    rows=last.rows, num_pages=num_pages, shareable_bound=bound,
                    query_start=last.query_start, num_tokens=last.num_tokens,
                    row_index=self._index)
        old = self.structure
        shareable = old.shareable
        longer = (bound > shareable).nonzero()[0]
        if longer.size:  # as follow: new pages are shareable up to a block 0
            index = self._index
            grown = first_zero(table, longer if index is None else index[longer],
                               shareable[longer], bound[longer])
            moved = longer[grown != shareable[longer]]
            if moved.size:
                if np.count_nonzero(old.continuation[moved] == 0):
                    return None  # it ended at its node and now goes on: placed anew
                shareable = shareable.copy()
                shareable[longer] = grown
        self.structure = Structure(old.trie, shareable, old.node, old.continuation,
                                   old.own_start, old.order, old.order_is_batch, old.levels)
        self._decode_step, self._seq_next = step, seq + 1
        return step, self.structure

    def _copy(self, table: np.ndarray, shareable: np.ndarray) -> None:
        """Snapshot ``table`` anew, as wide as the longest shareable prefix needs, and then some.

        A table not much wider is copied whole: comparing whole rows of a contiguous table is
        one flat loop, about twice as fast per id as comparing the leading columns of each row.
        """
        width = min(table.shape[1], int(shareable.max(initial=0)) + SNAPSHOT_SLACK_PAGES)
        if table.flags.c_contiguous and 2 * table.shape[1] <= 3 * width:
            width = table.shape[1]
        self._snapshot = table[:, :width].copy()
        self._differs = np.empty(self._snapshot.shape, bool)

    def follow(self, step: Step, keys: np.ndarray | None = None) -> Structure | None:
        """The structure of ``step``, carried over from the last one; ``None`` if it may not be.

        ``keys``: int64 ``[R]``, the rows' keys (the module docstring says what they promise).
        On ``None`` the memory may be half updated: the caller builds a new one.
        """
        if step.page_size != self.page_size or (keys is None) != (self._keys is None):
            return None
        # With keys, rows are read where needed, through the step's row index if it has one;
        # without, compared whole with the snapshot.
        index = step.row_index if keys is not None else None
        table = step.block_table if keys is not None else step.dense()
        if keys is None and table.shape[1] < self._snapshot.shape[1]:
            return None
        old = self.structure
        trie = old.trie
        num_rows = len(step.seq_lens)
        same_rows = num_rows == self._num_rows
        source, broken = (None, None) if keys is None else self._rekey(keys)
        if source is not None:  # rows moved: each takes the place its key had
            was, node, continuation = (
                _take(a, source) for a in (old.shareable, old.node, old.continuation))
        elif same_rows:
            was, node, continuation = old.shareable, old.node, old.continuation
        else:
            was, node, continuation = (
                _fit(a, num_rows) for a in (old.shareable, old.node, old.continuation))
        if broken is None:
            broken = self._refresh(table, was)
        start = was
        if broken.size:  # their leading ids changed: read them from the first page on
            start = was.copy()
            start[broken] = 0
        bound = step.shareable_bound
        shareable = np.minimum(bound, start)
        longer = (bound > start).nonzero()[0]
        widest = 0  # of the rows that grew: the others are no wider than the snapshot
        if longer.size:  # new pages are shareable up to a block 0
            grown = first_zero(table, longer if index is None else index[longer],
                               start[longer], bound[longer])
            shareable[longer] = grown
            widest = int(np.maximum.reduce(grown))
        # A row keeps its node and continuation while it holds its planned ids and still reaches
        # past its node (rows that only grew, as in decode, do), and keeps its node alone when it
        # now ends there. One that grew past its node's end (it ended there), shrank above it, or
        # holds other ids, is placed anew; so is a row new in the trie (it had nothing shareable).
        suspicious = (shareable < was) | ((continuation == 0) & (shareable != was))
        suspicious[broken] = True
        suspect = suspicious.nonzero()[0]
        if suspect.size > max(MOST_PLACED_ROWS, num_rows // MOST_PLACED_FRACTION):
            return None
        placed: list[int] = []
        if suspect.size:
            node, continuation = node.copy(), continuation.copy()
            depths, unheld = trie.depth, set(broken.tolist())
            for row, pages, at, going in zip(suspect.tolist(), shareable[suspect].tolist(),
                                             node[suspect].tolist(),
                                             continuation[suspect].tolist(), strict=True):
                depth, held = int(depths[at]), row not in unheld
                if held and pages == depth and pages > 0:  # it now ends at its node
                    continuation[row] = 0
                elif not (held and pages > depth and going):
                    node[row] = continuation[row] = 0
                    if pages > 0:
                        # One that still holds its node's path is placed from its node on.
                        where = trie.place(table, row if index is None else int(index[row]), pages,
                                           at if held and pages > depth else 0)
                        if where is None:
                            return None
                        node[row], continuation[row] = where
                        placed.append(row)
        # Rows that left a node may leave it with one way on; rows placed may continue alike.
        same_nodes = same_rows and (not (suspect.size or source is not None)
                                    or not np.count_nonzero(node != old.node))
        if not trie.holds(node, continuation, ways=not same_nodes, placed=placed):
            return None
        if same_nodes and ((self._all_active and step.all_active)
                           or not np.count_nonzero(step.active != self._active)):
            structure = Structure(trie, shareable, node, continuation, old.own_start, old.order,
                                  old.order_is_batch, old.levels)
        else:
            structure = layout(trie, node, continuation, shareable, step)
        if keys is None and widest > self._snapshot.shape[1]:
            self._copy(table, shareable)
        self.structure = structure
        self._active, self._all_active = step.active, step.all_active
        self._num_rows = num_rows
        self._remember(step, keys)
        return structure

    def _rekey(self, keys: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """How this step's rows relate to the last one's by their keys (kept for the next step):
        ``(None, broken)`` where every row holding a key from the last step is at its place,
        ``broken`` the rows whose key is not their place's (rows past the last step's are new:
        they have nothing planned, and need no listing); ``(source, [])`` where some moved,
        ``source`` each row's place in the last step (its key's), -1 for a row with a new key.
        A key found more than once, in this step or the last, is trusted at its place only."""
        last = self._keys
        assert last is not None
        self._keys = keys.copy()
        known = min(len(keys), len(last))
        broken = (keys[:known] != last[:known]).nonzero()[0]
        differ = broken
        if len(keys) > known:  # rows past the last step's: new, or moved there
            differ = np.concatenate((broken, np.arange(known, len(keys))))
        if not differ.size or not len(last):
            return None, broken
        source = np.arange(len(keys))
        source[differ] = -1
        if differ.size <= MOST_PLACED_ROWS:  # a few rows: look each key up
            for row in differ.tolist():
                at = (last == keys[row]).nonzero()[0]
                if at.size == 1 and np.count_nonzero(keys == keys[row]) == 1:
                    source[row] = at[0]
        else:
            order = last.argsort(kind="stable")
            ordered, wanted = last[order], keys[differ]
            at = np.searchsorted(ordered, wanted).clip(max=len(ordered) - 1)
            found = ordered[at] == wanted
            now = np.sort(keys)
            repeated = np.concatenate((ordered[1:][ordered[1:] == ordered[:-1]],
                                       now[1:][now[1:] == now[:-1]]))
            if repeated.size:
                found &= ~np.isin(wanted, repeated)
            source[differ] = np.where(found, order[at], -1)
        if not np.count_nonzero(source[differ] >= 0):
            return None, broken
        return source, np.empty(0, np.int64)

    def _refresh(self, table: np.ndarray, planned: np.ndarray) -> np.ndarray:
        """The rows ``r`` whose ``table[r, :planned[r]]`` is not what the snapshot has.

        The snapshot is then made to mirror ``table``'s rows (all of them, the new included).
        """
        snapshot, differs = self._snapshot, self._differs
        width = snapshot.shape[1]
        known = min(table.shape[0], self._num_rows)
        if width == 0:  # nothing was shareable, and nothing is copied
            return np.empty(0, np.int64)
        np.not_equal(table[:known, :width], snapshot[:known], out=differs[:known])
        first = differs[:known].argmax(axis=1)  # 0 also where nothing differs
        changed = (first | differs[:known, 0]).nonzero()[0]
        broken = changed[first[changed] < planned[changed]]
        snapshot[changed] = table[changed, :width]
        num_rows = table.shape[0]
        if num_rows > known:
            if num_rows > len(snapshot):  # room for more rows than now, as batches grow back
                grown = np.empty((max(num_rows, 2 * len(snapshot)), width), np.int32)
                grown[:known] = snapshot[:known]
                self._snapshot = snapshot = grown
                self._differs = np.empty(grown.shape, bool)
            snapshot[known:num_rows] = table[known:, :width]
        return broken


def _take(values: np.ndarray, source: np.ndarray) -> np.ndarray:
    """``values[source]``, 0 where ``source`` is -1 (a row new to the memory)."""
    out = values[np.maximum(source, 0)] if len(values) else np.zeros(len(source), values.dtype)
    out[source < 0] = 0
    return out


def _fit(values: np.ndarray, num_rows: int) -> np.ndarray:
    """``values`` cut or padded with zeros to ``num_rows`` entries."""
    if len(values) >= num_rows:
        return values[:num_rows]
    return np.concatenate((values, np.zeros(num_rows - len(values), values.dtype)))
