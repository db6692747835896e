"""Why the step session keeps a step flat, as counted (``stats``: one reason per flat step), and
which steps it charges the cost of running from CUDA graphs (numpy only). The reference for each
verdict is ``decide()`` on the same plan with the cost model the step should be charged."""

from __future__ import annotations

import numpy as np
import pytest

from test_cost import H200_LAYER
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.planning.cost import cost_model_for, decide
from vllm_cascade_plugin.planning.planner import plan_cascade
from vllm_cascade_plugin.stats import counters as c
from vllm_cascade_plugin.step import StepSession

EAGER, GRAPHED = cost_model_for("fa3", decode_graphs=False), cost_model_for("fa3")


@pytest.fixture(autouse=True)
def counters():
    stats.reset()
    yield
    stats.reset()


def fa3_session(capture_sizes=(32, 64, 128), split_cost_model=None, capture_cost_us=0.0,
                **config) -> StepSession:
    """Planned like the FA3 executor with per-layer graphs: the eager per-step cost, and the
    graphed one for a decode step whose graph layout was planned before (``split_cost_model``:
    mixed steps split at that cost). ``capture_cost_us``: what capturing a layout's graphs
    costs (0 by default: free, so a winning layout's second step is steady; what a capture's
    cost changes is tested on its own below)."""
    session = StepSession()
    session.configure(CascadeConfig(enabled=True, **config), H200_LAYER, 16, None,
                      cost_model=EAGER, steady_cost_model=GRAPHED, capture_sizes=capture_sizes,
                      split_cost_model=split_cost_model)
    session.capture_cost_us = capture_cost_us
    return session


def prefix_rows(rows: int, prefix_pages: int = 512, own_pages: int = 12):
    """``rows`` requests behind one shared prefix of ``prefix_pages`` pages (8K tokens by
    default), each with pages of its own: (block table, sequence lengths)."""
    table = np.zeros((rows, prefix_pages + own_pages), np.int32)
    table[:, :prefix_pages] = np.arange(1, prefix_pages + 1)
    table[:, prefix_pages:] = 10_000 + np.arange(rows * own_pages).reshape(rows, own_pages)
    return table, np.full(rows, prefix_pages * 16 + 144, np.int32)


def test_a_decode_step_above_the_largest_capture_size_is_always_charged_the_eager_cost():
    """vLLM runs such a step without graphs and unpadded, and so does the plugin: however often
    its layout repeats, the step is charged the eager per-step cost (a decode step that only
    the graphed cost makes worth it stays flat), where below the largest size the same
    layout's second step gets the graphed cost."""
    table, seq = prefix_rows(64)
    q = np.ones(64, np.int32)
    plan_of = fa3_session(()).plan_step(table, seq, q).plan
    assert decide(plan_of, H200_LAYER, GRAPHED).use_cascade
    assert not decide(plan_of, H200_LAYER, EAGER).use_cascade
    below, above = fa3_session((16, 32, 64)), fa3_session((8, 16, 32))
    assert below.graphable(64) and not above.graphable(64) and above.graphable(32)
    assert StepSession().graphable(10_000)  # no capture sizes known: no limit
    verdicts = {}
    for name, session in (("below", below), ("above", above)):
        stats.reset()
        verdicts[name] = [session.plan_step(table, seq + i, q).decision.use_cascade
                          for i in range(4)]
        session.end_step()
        verdicts[name + " reasons"] = stats.snapshot().flat_reasons
    assert verdicts["below"] == [False, True, True, True]
    assert verdicts["below reasons"] == {c.NOT_CAPTURED: 1, c.UNUSED: 3}  # no builder here
    assert verdicts["above"] == [False] * 4
    assert verdicts["above reasons"] == {c.COST_MODEL: 4}


def test_each_flat_step_is_counted_with_the_reason_the_session_decided(monkeypatch):
    session = fa3_session()
    small, _ = prefix_rows(4, prefix_pages=2, own_pages=2)  # a fixed cost never repaid
    seq_small = np.full(4, 2 * 16 + 20, np.int32)
    big, seq_big = prefix_rows(64)
    expected: list[tuple[str | None, float | None]] = []  # (reason or None: cascade, ratio)

    def step(table, seq, q, runs=False, on=session):
        """One step as the runner hooks plan it and, with ``runs``, a builder runs it."""
        q = np.asarray(q, np.int32)
        planned = None
        if not on.skip_unshared(table[:, 0], seq, q):
            planned = on.plan_step(table, seq, q)
            if runs and planned is not None and planned.decision.use_cascade:
                stats.record_cascade(1, 1, planned.decode)
        on.end_step()
        return planned

    unshared = small.copy()
    unshared[:, :2] += 100 * np.arange(4)[:, None]
    assert step(unshared, seq_small, [1] * 4) is None  # skipped: no first page alike
    expected.append((c.NO_SHARED, None))
    alike = step(small, seq_small, [1] * 4, on=fa3_session(min_shared_pages=4))
    assert alike.plan.num_levels == 1  # first pages alike, but 2 shared pages are too few
    expected.append((c.NO_SHARED, None))
    # One request has nothing to share with: its own reason, skipped or (with CASCADE_DEBUG,
    # every step planned) planned.
    assert step(small[:1], seq_small[:1], [1]) is None
    expected.append((c.SINGLE, None))
    alone = step(small[:1], seq_small[:1], [1], on=fa3_session(debug=True))
    assert alone.plan.num_levels == 1 and not alone.decision.use_cascade
    expected.append((c.SINGLE, None))
    planned = [step(small, seq_small, q) for q in ([1] * 4, [1, 1, 3, 1], [3] * 4)]
    # The decode step is flat even at the graphed cost, the least it can cost; the others
    # never run from graphs: the eager cost.
    for p, reason, model in zip(planned, (c.COST_MODEL, c.MIXED, c.MULTI_TOKEN),
                                (GRAPHED, EAGER, EAGER), strict=True):
        d = decide(p.plan, H200_LAYER, model)
        assert not d.use_cascade and p.decision == d
        expected.append((reason, d.cascade_us / d.flat_us))
    first = step(big, seq_big, [1] * 64, runs=True)  # a new layout: the eager cost, flat ...
    d = decide(first.plan, H200_LAYER, EAGER)
    expected.append((c.NOT_CAPTURED, d.cascade_us / d.flat_us))
    assert step(big, seq_big + 1, [1] * 64, runs=True).decision.use_cascade  # ... then graphed
    expected.append((None, None))
    assert step(big, seq_big + 2, [1] * 64).decision.use_cascade  # no builder ran it
    expected.append((c.UNUSED, None))
    monkeypatch.setattr(session._planner, "plan", lambda *a: 1 / 0)
    assert step(big, seq_big + 3, [1] * 64) is None
    expected.append(("planner error", None))
    counted = stats.snapshot()
    flat = [(r, x) for r, x in expected if r is not None]
    assert counted.flat_reasons == {r: sum(y == r for y, _ in flat) for r, _ in flat}
    assert counted.decode_flat_reasons == {r: n for r, n in counted.flat_reasons.items()
                                           if r not in (c.MIXED, c.MULTI_TOKEN)}
    assert counted.flat_cost_ratio == pytest.approx(
        {r: sum(x for y, x in flat if y == r and x is not None) for r, x in flat
         if x is not None})
    assert counted.steps_planned == len(expected) and counted.steps_cascade == 1


def test_a_decode_step_flat_even_at_the_graphed_cost_never_works_out_its_graph_layout(
        monkeypatch):
    """Most flat steps of a serving run lose at any cost: their graph layout (host time of
    every such step) is not needed. A step that wins with graphs looks its layout up."""
    import vllm_cascade_plugin.step.layouts as step_module

    looked_up = []
    real = step_module.graph_shape
    monkeypatch.setattr(step_module, "graph_shape",
                        lambda plan, rows: looked_up.append(rows) or real(plan, rows))
    session = fa3_session()
    small, _ = prefix_rows(4, prefix_pages=2, own_pages=2)
    seq_small = np.full(4, 2 * 16 + 20, np.int32)
    q = np.ones(4, np.int32)
    assert not decide(session.plan_step(small, seq_small, q).plan, H200_LAYER,
                      GRAPHED).use_cascade
    assert not session.current.decision.use_cascade and looked_up == []
    big, seq_big = prefix_rows(64)
    assert session.plan_step(big, seq_big, np.ones(64, np.int32)) is not None
    assert looked_up == [64]
    session.end_step()
    assert stats.snapshot().decode_flat_reasons == {c.COST_MODEL: 1, c.NOT_CAPTURED: 1}


@pytest.mark.parametrize("with_facts", [False, True])
def test_a_step_the_cost_models_floor_keeps_flat_is_never_planned(monkeypatch, with_facts):
    """Rows too few for their pages to repay a cascade's fixed costs: flat for the reason the
    session would give, without the planner; under CASCADE_DEBUG the planner runs anyway.
    The reference: ``decide`` on the fresh plan with the cost model the step is charged.
    ``with_facts``: asked as the runner hooks ask, with the rows' compiled facts (which count
    the rows of one query token that tell a mixed step from a multi-token one)."""
    session = fa3_session()
    small, _ = prefix_rows(4, prefix_pages=2, own_pages=2)
    seq = np.full(4, 2 * 16 + 20, np.int32)
    monkeypatch.setattr(session._planner, "plan", lambda *a: 1 / 0)  # never asked
    for i, (q, reason, model) in enumerate((([1] * 4, c.COST_MODEL, GRAPHED),
                                            ([1, 1, 3, 1], c.MIXED, EAGER),
                                            ([3] * 4, c.MULTI_TOKEN, EAGER))):
        q = np.asarray(q, np.int32)
        assert not decide(plan_cascade(small, seq, q, 16), H200_LAYER, model).use_cascade
        facts = (session.row_facts(small[:, 0], seq, q, np.full(4, small.shape[1]))
                 if with_facts else None)
        assert session.cannot_win(seq, q, facts) and session.current is None
        session.end_step()
        now = stats.snapshot()
        assert now.flat_reasons[reason] == 1 and now.steps_planned == i + 1
    counted = stats.snapshot()
    assert counted.flat_reasons == {c.COST_MODEL: 1, c.MIXED: 1, c.MULTI_TOKEN: 1}
    assert counted.steps_planned == 3 and not counted.fallbacks
    _, seq_big = prefix_rows(64)  # worth planning: the floor leaves it to the plan
    assert not session.cannot_win(seq_big, np.ones(64, np.int32))
    debug = fa3_session(debug=True)
    assert not debug.cannot_win(seq, np.ones(4, np.int32))


SPLIT = cost_model_for("fa3", split=True)


def mixed_rows(decode_rows: int, prefill_tokens: int = 150, prefix_pages: int = 512):
    """``decode_rows`` requests decoding behind an 8K-token document and, in the middle of the
    batch, one new request's prefill chunk on the same document: (table, seq_lens, query_lens)."""
    table, seq = prefix_rows(decode_rows + 1, prefix_pages)
    q = np.ones(decode_rows + 1, np.int32)
    at = decode_rows // 2
    q[at] = prefill_tokens
    seq[at] = prefix_pages * 16 + prefill_tokens
    return table, seq, q


def test_a_mixed_step_is_planned_for_its_decode_rows_alone_and_charged_the_split_cost():
    """Where the executor splits mixed steps, the prefill row is padding to the planner, the
    plan covers the decode rows in batch order, and the verdict is decide() on that plan with
    the split cost; the step plan still describes the whole batch (its rows, tokens, lengths).
    The first mixed step of a decode layout runs flat (its per-layer graphs not captured),
    counted so; the next one of that layout splits (CASCADE_SPLIT_MIXED on)."""
    session = fa3_session(split_cost_model=SPLIT, split_mixed=True)
    decode = mixed_rows(48)[2] == 1
    for first in (True, False):
        table, seq, q = mixed_rows(48)
        seq[decode] += 0 if first else 1  # a step later: the decode rows one token longer
        step = session.plan_step(table, seq, q)
        assert step is not None and step.decode_rows is not None and not step.decode
        assert np.array_equal(step.decode_rows, decode)
        want = plan_cascade(table, seq, decode.astype(np.int32), 16)
        assert step.plan.stats == want.stats and step.plan.stats.num_tokens == 48
        wins = decide(want, H200_LAYER, SPLIT)
        assert wins.use_cascade and step.decision.use_cascade is not first
        assert (step.decision.flat_us, step.decision.cascade_us) == (wins.flat_us,
                                                                     wins.cascade_us)
        qsl = np.concatenate([[0], np.cumsum(q)])
        assert step.matches(qsl, int(q.sum()), seq)  # the whole batch, prefill row included
        assert not decide(step.plan, H200_LAYER, EAGER).use_cascade  # only the split wins
        session.end_step()
        if first:
            assert stats.snapshot().flat_reasons == {c.NOT_CAPTURED: 1}


@pytest.mark.parametrize(("split", "capture_sizes", "rows"),
                         [(False, (32, 64, 128), 48), (True, (8, 16, 32), 48),
                          (True, (32, 64, 128), 4)],
                         ids=["no split cost", "decode rows above the largest capture size",
                              "too few rows to repay it"])
def test_a_mixed_step_the_executor_cannot_or_need_not_split_stays_flat_as_mixed(
        split, capture_sizes, rows):
    """Without a split cost (FlashInfer's executor, no graphs) the step is planned whole at the
    eager cost; above vLLM's largest capture size its decode rows would launch eagerly, so it
    is not split either; a few decode rows never repay the split's per-step cost. Each runs
    flat, counted as a mixed step, and the runner hooks' floor (cannot_win) agrees."""
    table, seq, q = mixed_rows(rows)
    session = fa3_session(capture_sizes, split_cost_model=SPLIT if split else None,
                          split_mixed=True)
    skipped = session.cannot_win(seq, q)
    step = session.plan_step(table, seq, q)
    assert step is not None and not step.decision.use_cascade
    whole = split is False or capture_sizes[-1] < rows
    assert (step.decode_rows is None) is whole
    assert step.plan.stats.num_tokens == (int(q.sum()) if whole else rows)
    session.end_step()
    assert stats.snapshot().flat_reasons[c.MIXED] == 1 + skipped
    if not whole:  # the floor saw the decode rows alone, at the split cost
        assert skipped


@pytest.mark.parametrize(("prefix_pages", "decode_rows", "wins"),
                         [(512, 48, False), (2048, 200, True)],
                         ids=["48 rows behind 8K: flat", "200 rows behind 32K: cascade"])
def test_without_split_mixed_a_mixed_step_is_planned_whole_at_the_eager_cost(
        prefix_pages, decode_rows, wins):
    """CASCADE_SPLIT_MIXED off (the default): a mixed step the executor could split is planned
    whole, its prefill row's query tokens in the plan, and its verdict is decide() on that plan
    with the eager cost (the step is launched piecewise by vLLM). 48 decode rows behind an 8K
    document do not repay the eager per-step cost, though the split would (flat, counted as a
    mixed step, and the runner hooks' floor says so before any plan); 200 behind a 32K one,
    read once per row when flat, do, and the step runs as cascade."""
    session = fa3_session(split_cost_model=SPLIT)
    table, seq, q = mixed_rows(decode_rows, prefix_pages=prefix_pages)
    assert session.cannot_win(seq, q) is not wins
    session.end_step()
    step = session.plan_step(table, seq, q)
    assert step is not None and step.decode_rows is None
    want = plan_cascade(table, seq, q, 16)
    assert step.plan.stats == want.stats and step.plan.stats.num_tokens == int(q.sum())
    verdict = decide(want, H200_LAYER, EAGER)
    assert step.decision.use_cascade is verdict.use_cascade is wins
    assert (step.decision.flat_us, step.decision.cascade_us) == (verdict.flat_us,
                                                                 verdict.cascade_us)
    if not wins:
        split = plan_cascade(table, seq, (q == 1).astype(np.int32), 16)
        assert decide(split, H200_LAYER, SPLIT).use_cascade  # the split would have won
    session.end_step()  # a cascade plan no layer ran is counted apart (c.UNUSED)
    assert stats.snapshot().flat_reasons == ({c.UNUSED: 1} if wins else {c.MIXED: 2})


def test_without_split_mixed_a_verification_step_is_planned_whole():
    """Speculative decoding's verification steps (1 + drafts query tokens per row) are planned
    whole, every query token, whether every row has drafts or only some (a mixed step); with
    CASCADE_POLICY=always both run as cascade."""
    table, seq = prefix_rows(48)
    session = fa3_session(split_cost_model=SPLIT, policy="always")
    drafts = np.full(48, 4, np.int32)
    for _ in range(2):
        step = session.plan_step(table, seq, drafts)
        assert step is not None and step.decode_rows is None and step.decision.use_cascade
        assert step.plan.stats.num_tokens == int(drafts.sum())
        session.end_step()
        drafts[::2] = 1  # half the rows without a draft
    assert stats.snapshot().flat_reasons == {c.UNUSED: 2}  # no layer ran the plans here


def test_graphs_lost_split_no_more_mixed_steps():
    table, seq, q = mixed_rows(48)
    session = fa3_session(split_cost_model=SPLIT, split_mixed=True)
    session.graphs_lost()
    step = session.plan_step(table, seq, q)
    assert step is not None and step.decode_rows is None and not step.decision.use_cascade


def test_each_planned_step_is_counted_by_how_its_planning_went(monkeypatch):
    """A step stopped by a pre-check counts as that pre-check; a planned one as the planner's
    path (from scratch, following the last plan, continuing it); one that failed as "other".
    The paths' planning seconds add up to the planning time."""
    session = fa3_session()
    small, _ = prefix_rows(4, prefix_pages=2, own_pages=2)
    seq_small = np.full(4, 2 * 16 + 20, np.int32)
    unshared = small.copy()
    unshared[:, :2] += 100 * np.arange(4)[:, None]
    big, seq_big = prefix_rows(64)
    q, keys = np.ones(64, np.int32), np.arange(64, dtype=np.int64)
    with stats.planning():
        assert session.skip_unshared(unshared[:, 0], seq_small, q[:4])
    with stats.planning():
        assert session.cannot_win(seq_small, q[:4])  # two shared pages never repay the cost
    for i, row_keys in enumerate((None, None, keys, keys)):
        with stats.planning():
            assert session.plan_step(big, seq_big + i, q, row_keys) is not None
    monkeypatch.setattr(session._planner, "plan", lambda *a: 1 / 0)
    with stats.planning():
        assert session.plan_step(big, seq_big + 4, q, keys) is None
    session.end_step()
    counted = stats.snapshot()
    # Unkeyed: from scratch, then followed; keyed: from scratch (the memory had no keys),
    # then continued.
    assert counted.planning_paths == {c.PATH_UNSHARED: 1, c.PATH_COST_FLOOR: 1,
                                      c.PATH_SCRATCH: 2, c.PATH_FOLLOWED: 1,
                                      c.PATH_CONTINUED: 1, c.PATH_OTHER: 1}
    assert sum(counted.planning_paths.values()) == counted.steps_planned == 7
    assert sum(counted.planning_path_s.values()) == pytest.approx(counted.planning_s)


def graphed_gain_us(table, seq, q) -> float:
    """One step's graphed gain over flat, every layer: the reference for what a layout's steps
    go without until its graphs are captured (``decide`` on the plan, independent of the
    session)."""
    d = decide(plan_cascade(table, seq, q, 16), H200_LAYER, GRAPHED)
    assert d.use_cascade
    return (d.flat_us - d.cascade_us) * H200_LAYER.num_layers


@pytest.mark.parametrize("captures_in_steps", [0.5, 3.5, 6.2])
def test_a_layout_runs_from_graphs_once_the_gain_its_steps_went_without_pays_for_its_capture(
        captures_in_steps):
    """A decode step that wins only from graphs (64 rows behind 8K tokens) runs flat while its
    layout's graphs are not worth capturing: from the layout's second step on, once the graphed
    gain its steps went without, summed, reaches what a capture costs (here ``captures_in_steps``
    steps' gain); then cascade on every later step of the layout."""
    table, seq = prefix_rows(64)
    q = np.ones(64, np.int32)
    capture_us = captures_in_steps * graphed_gain_us(table, seq, q)
    session = fa3_session(capture_cost_us=capture_us)
    gains = np.cumsum([graphed_gain_us(table, seq + i, q) for i in range(10)])
    turn = next(i for i in range(1, 10) if gains[i] >= capture_us)
    assert turn == max(1, int(np.ceil(captures_in_steps)) - 1)  # the gains barely change
    verdicts = []
    for i in range(10):
        verdicts.append(session.plan_step(table, seq + i, q).decision.use_cascade)
        session.end_step()
    assert verdicts == [False] * turn + [True] * (10 - turn)
    assert stats.snapshot().decode_flat_reasons[c.NOT_CAPTURED] == turn


def test_a_capture_is_charged_what_the_steps_that_captured_spent_capturing():
    """Until this process captured anything, the prior (a whole Llama-3-8B-shaped step on an
    H100); then the mean over the steps that captured of the seconds they spent capturing (the
    graph caches count them: ``stats.record_capture``). Steps that captured nothing, and the
    counters starting again, change nothing."""
    from vllm_cascade_plugin.step.layouts import CAPTURE_COST_PRIOR_US

    session = StepSession()
    assert session.capture_cost_us == CAPTURE_COST_PRIOR_US
    session.end_step()
    assert session.capture_cost_us == CAPTURE_COST_PRIOR_US
    stats.record_capture(0.020)  # a whole-step graph
    session.end_step()
    assert session.capture_cost_us == pytest.approx(20_000)
    session.end_step()
    for seconds in (0.001, 0.039):  # one step, two graphs: 40 ms
        stats.record_capture(seconds)
    session.end_step()
    assert session.capture_cost_us == pytest.approx(30_000)
    stats.reset()
    session.end_step()
    stats.record_capture(0.003)
    session.end_step()
    assert session.capture_cost_us == pytest.approx((20_000 + 40_000 + 3_000) / 3)


def chat_rows(rows: int, prefix_pages: int = 4):
    """``rows`` requests behind one system prompt of ``prefix_pages`` pages (64 tokens by
    default), 300-1,000 tokens each of their own (seeded): (block table, sequence lengths),
    every row one decode token."""
    own = np.random.default_rng(rows).integers(300, 1000, rows)
    pages = prefix_pages + (own + 15) // 16 + 1
    table = np.zeros((rows, int(pages.max())), np.int32)
    table[:, :prefix_pages] = np.arange(1, prefix_pages + 1)
    next_page = 100
    for r in range(rows):
        n = int(pages[r]) - prefix_pages
        table[r, prefix_pages:prefix_pages + n] = np.arange(next_page, next_page + n)
        next_page += n
    return table, (prefix_pages * 16 + own).astype(np.int32)


@pytest.mark.parametrize("prefix_pages", [4, 96, 128])
def test_a_flat_verdict_holds_for_later_decode_steps_the_cost_model_would_keep_flat(
        monkeypatch, prefix_pages):
    """A decode step the cost model keeps flat holds the verdict: up to HOLD_STEPS decode steps
    are counted flat ('held flat') without the planner, while they have at most as many rows
    as the verdict holds for. Every step count it holds is one the cost model keeps flat too
    (the reference: ``decide`` on the plan of that many such rows, from 64 to 2K shared tokens,
    up to where cascade wins); a step with more rows, or after the hold's end, is planned
    again; a mixed step is planned and keeps the hold."""
    from vllm_cascade_plugin.step.prechecks import HOLD_STEPS

    rows = 24
    table, seq = chat_rows(rows, prefix_pages)
    q = np.ones(rows, np.int32)
    assert not decide(plan_cascade(table, seq, q, 16), H200_LAYER, GRAPHED).use_cascade
    session = fa3_session()
    assert not session.plan_step(table, seq, q).decision.use_cascade
    session.end_step()
    held, turn = [], None  # the row counts held; the fewest at which cascade wins
    for more in range(rows, 4 * rows):
        probe = fa3_session()
        probe.plan_step(table, seq, q)
        probe.end_step()
        t, s = chat_rows(more, prefix_pages)
        wins = decide(plan_cascade(t, s, np.ones(more, np.int32), 16), H200_LAYER,
                      GRAPHED).use_cascade
        if probe.held_flat({i: 1 for i in range(more)}):
            held.append(more)
            assert not wins, more
        elif wins and turn is None:
            turn = more
    assert held and held[0] == rows and held == list(range(rows, held[-1] + 1))
    if prefix_pages >= 96:  # 1.5K-2K shared tokens: cascade wins within 4x the rows
        assert turn is not None and held[-1] < turn
    stats.reset()
    planned = []
    monkeypatch.setattr(session._planner, "plan", lambda *a: planned.append(1) / 0)
    same = {f"r{i}": 1 for i in range(rows)}
    assert session.held_flat(same) and session.current is None
    assert not session.held_flat({**same, "new": 170})  # mixed: planned, still held
    assert session.held_flat(same)
    assert not session.held_flat({i: 1 for i in range(held[-1] + 1)})  # too many rows
    assert not session.held_flat(same)  # let go: planned again
    session.end_step()
    counted = stats.snapshot()
    assert counted.planning_paths[c.PATH_HELD] == 2 and planned == []
    monkeypatch.undo()
    session.plan_step(table, seq, q)
    session.end_step()
    steps = 0
    while session.held_flat(same):
        steps += 1
    assert steps == HOLD_STEPS


def test_no_verdict_is_held_after_a_cascade_step_or_where_every_step_must_be_planned():
    """A step that runs cascade, one kept flat until its graphs are worth capturing, and any
    step under CASCADE_DEBUG or CASCADE_POLICY=always hold nothing; a verdict at the very turn
    holds for no more rows than it had."""
    big, seq_big = prefix_rows(64)
    q = np.ones(64, np.int32)
    rows = {i: 1 for i in range(64)}
    session = fa3_session()
    assert session.plan_step(big, seq_big, q).decision.use_cascade is False  # first sighting
    session.end_step()
    assert not session.held_flat(rows)  # kept flat for its graphs, not by the cost model
    assert session.plan_step(big, seq_big + 1, q).decision.use_cascade
    session.end_step()
    assert not session.held_flat(rows)
    table, seq = chat_rows(24)
    for config in ({"debug": True}, {"policy": "always"}):
        other = fa3_session(**config)
        other.plan_step(table, seq, np.ones(24, np.int32))
        other.end_step()
        assert not other.held_flat({i: 1 for i in range(24)}), config
    turn = fa3_session()
    turn.hold_verdict(True, 24, 1 / (1 + turn.cost_model.margin))
    assert turn.held_flat({i: 1 for i in range(24)})
    assert not turn.held_flat({i: 1 for i in range(25)})
