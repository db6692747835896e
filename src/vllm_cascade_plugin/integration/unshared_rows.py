"""Steps that provably share no page, known without reading their rows (Model Runner V2; the V1
runner with ``CASCADE_UNVERIFIED``, until its engine test has run on a GPU).

Once the pre-check has proved a step's rows share no page
(:meth:`~..step.prechecks.PreChecks.skip_unshared`), the runner keeps each request's first block
id (:func:`remember`). A later step is known to share none either when every request it runs
has a first block id of its own among those kept (:func:`unshared_again`): only the requests
not kept yet (new, resumed, or not run since) are looked up, one block id each, and those that
finished or were preempted are let go. Most steps of a serving run without shared prompts stop
here, the batch changing or not, at a cost that does not grow with the batch.

Why distinct first block ids suffice: a page two requests share is the first page of both
(prefix caching shares whole prefixes, from the first page on), and a request's block ids stay
where they are until it finishes or is preempted (then it comes back as new or resumed, and is
looked up again). A block id freed and handed to a new request may still be kept for a request
that left unseen: that reads as shared, and the step is planned. Whatever this module answers,
its only answer is "flat": it can cost a step its cascade, never its correctness.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..step import session

KEPT = "_cascade_unshared_rows"  # runner attribute: the kept first block ids (UnsharedRows)


class UnsharedRows:
    """The first block id of each request seen since the pre-check's proof, all distinct."""

    __slots__ = ("first", "pages")

    def __init__(self, first: dict[str, int]) -> None:
        self.first = first  # request id -> its first block id
        self.pages = set(first.values())


def remember(runner: Any, req_ids: list[str], first_pages: np.ndarray) -> None:
    """After the pre-check proved a step unshared: keep its requests' first block ids (row
    ``r``: ``req_ids[r]``, ``first_pages[r]``), unless two are alike (a request whose first
    page the pre-check passed over) or one is the null block."""
    first = dict(zip(req_ids, first_pages.tolist(), strict=True))
    kept = UnsharedRows(first)
    if len(kept.pages) == len(first) and 0 not in kept.pages:
        runner.__dict__[KEPT] = kept


def unshared_again(runner: Any, so: Any, first_page: Callable[[str], int]) -> bool:
    """Whether the step is known to share no page (then counted as planned and flat, for the
    reason the pre-check gives, by the step session); False: read its rows. ``first_page``: a
    request's first block id in the planned KV-cache group, by its id (Model Runner V2: from
    the CPU mirror of the block ids; V1: from the runner's CPU block table, which vLLM has
    written for the step before the hook plans it)."""
    kept: UnsharedRows | None = runner.__dict__.pop(KEPT, None)
    if kept is None:
        return False
    finished, new = getattr(so, "finished_req_ids", None), getattr(so, "scheduled_new_reqs", None)
    if finished is None or new is None:  # who left or came is not known: read the rows
        return False
    first, pages = kept.first, kept.pages
    cached = getattr(so, "scheduled_cached_reqs", None)
    for gone in (finished, getattr(so, "preempted_req_ids", None) or (),
                 [req.req_id for req in new], getattr(cached, "resumed_req_ids", None) or ()):
        for req_id in gone:
            page = first.pop(req_id, None)
            if page is not None:
                pages.discard(page)
    tokens = so.num_scheduled_tokens
    if not tokens.keys() <= first.keys():  # requests not kept yet: their first block ids
        for req_id in tokens.keys() - first.keys():
            page = first_page(req_id)
            if page == 0 or page in pages:
                return False
            first[req_id] = page
            pages.add(page)
    if not session.unshared_again(sum(tokens.values()) == len(tokens), len(tokens)):
        return False
    runner.__dict__[KEPT] = kept
    return True
