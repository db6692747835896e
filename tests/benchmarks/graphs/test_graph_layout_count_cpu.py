"""``benchmarks.graphs.layout_count``: the layouts a decode run needs, counted as the executor
keys its graphs."""

from __future__ import annotations

from benchmarks.graphs import layout_count as glc


def test_a_batch_that_only_decodes_needs_one_layout():
    """64 requests arrive at once on two documents and decode 15 tokens each: every decode step
    has the same rows, groups and (bucketed) widths, so one layout serves them all."""
    run = glc.Run("steady", requests=64, documents=2, document_pages=40, own_tokens=16,
                  output_tokens=(16, 17), arrivals_per_step=1000.0)
    counted = glc.count(run)
    assert counted["decode_steps"] == 15
    assert counted["padded_sizes"] == counted["shapes"] == counted["layouts"] == 1


def test_a_batch_that_shrinks_needs_a_layout_per_padded_size_at_least():
    run = glc.Run("draining", requests=64, documents=2, document_pages=40, own_tokens=16,
                  output_tokens=(2, 40), arrivals_per_step=1000.0)
    counted = glc.count(run)
    assert counted["layouts"] >= counted["shapes"] >= counted["padded_sizes"] > 1
    assert counted["replayable_at_most"] == round(
        1 - counted["layouts"] / counted["decode_steps"], 3)


def test_a_cache_of_a_few_graphs_captures_again_what_it_evicted_least_recently_replayed():
    assert glc.captures(["a", "b", "a", "c", "a", "b"], held=2) == 4  # b was evicted by c
    assert glc.captures(["a", "b", "a", "c", "a", "b"], held=3) == 3


def test_the_graphs_a_runner_holds_are_the_whole_step_graphs_limit():
    from vllm_cascade_plugin.graphs import fullgraph

    assert glc.MAX_GRAPHS == fullgraph.MAX_GRAPHS


def test_rows_that_come_and_go_need_fewer_layouts_than_with_exact_widths():
    """Long answers arriving while others finish: the longest row's width goes up and down, and
    every layout keeps the widest table it has had, so the run needs fewer graphs than with
    each step's own width (and never more)."""
    run = glc.Run("coming and going", requests=120, documents=2, document_pages=8,
                  own_tokens=16, output_tokens=(2, 400), arrivals_per_step=0.5)
    counted = glc.count(run)
    assert counted["layouts"] < counted["layouts_exact"]
    assert counted["captures"] <= counted["captures_exact"]
    assert counted["captures"] >= counted["layouts"]  # each layout captured at least once
