"""The engine oracle's CPU-testable parts: the row judge (tests/engine_oracle.py) and the engine
driver's workloads, page corruptions and beam search call (tests/gpu/engine_driver.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import engine_oracle
import oracle_model
from gpu import engine_driver
from vllm_cascade_plugin.face import agreement
from vllm_cascade_plugin.planning import planner


def requests(*logprob_rows: list[float], tokens: list[int] | None = None) -> list[dict]:
    """One greedy request per row, every position with a wide margin."""
    out = []
    for row in logprob_rows:
        toks = tokens or list(range(1, len(row) + 1))
        out.append({"tokens": [*toks, -1], "logprobs": [*row, 0.0],
                    "margins": [1.0] * len(row) + [0.0]})
    return out


def result(reqs: list[dict] | None = None, beams: list[dict] | None = None,
           cascade: float = 1.0) -> dict:
    ran = {"requests": reqs} if beams is None else {"beams": beams}
    return {**ran, "steps_planned": 10, "steps_cascade": int(10 * cascade),
            "decode_steps_planned": 10, "decode_steps_cascade": int(10 * cascade),
            "fallbacks": {}}


OFF = result(requests([-1.0] * 8, [-2.0] * 8))


def test_a_row_has_the_plugin_and_reference_deviations_and_coverage():
    on = result(requests([-1.006] * 8, [-2.006] * 8))
    reference = result(requests([-1.005] * 8, [-2.005] * 8))
    row = engine_oracle.judge("a_one_8k_prefix_x64", "v2", on, OFF, reference)
    assert row["outcome"] == row["reference_outcome"] == "pass"
    assert row["mean_abs_dlogprob"] == pytest.approx(0.006)
    assert row["reference_mean_abs_dlogprob"] == pytest.approx(0.005)
    assert (row["compared_fraction"], row["compared_tokens"], row["positions"]) == (1.0, 16, 16)
    assert row["cascade_step_fraction"] == 1.0


def test_a_row_fails_beyond_one_and_a_half_references_though_within_the_tolerance():
    on = result(requests([-1.008] * 8, [-2.008] * 8))
    reference = result(requests([-1.005] * 8, [-2.005] * 8))
    row = engine_oracle.judge("b_4_prefixes_x16_interleaved", "v1", on, OFF, reference)
    assert row["mean_abs_dlogprob"] <= agreement.MEAN_TOL
    assert row["outcome"] == "fail" and row["reference_outcome"] == "pass"


def test_a_row_fails_when_the_comparison_stops_early():
    # The plugin's first request diverges at its second token: 1 + 8 of 16 positions compared.
    on = result(requests([-1.0] * 8, tokens=[1, 99, 3, 4, 5, 6, 7, 8]) + requests([-2.0] * 8))
    row = engine_oracle.judge("e_chunked_prefill_with_decodes", "v2", on, OFF, OFF)
    assert row["compared_fraction"] == pytest.approx(9 / 16)
    assert row["outcome"] == "pass"
    on = result(requests([-1.0] * 8, tokens=[99] * 8) + requests([-2.0] * 8, tokens=[99] * 8))
    row = engine_oracle.judge("e_chunked_prefill_with_decodes", "v2", on, OFF, OFF)
    assert (row["compared_fraction"], row["outcome"]) == (0.0, "fail")
    assert engine_oracle.fails_widely(row)


def test_a_reference_that_disagrees_is_reported_on_its_own():
    reference = result(requests([-1.05] * 8, [-2.05] * 8))  # two kernels 0.05 apart
    row = engine_oracle.judge("f_preemption_small_kv_cache", "v2", OFF, OFF, reference)
    assert row["reference_outcome"] == "fail"
    assert row["outcome"] == "pass"  # identical to plugin-off FlashInfer


def test_cascade_workloads_must_run_as_cascade():
    on = result(requests([-1.0] * 8, [-2.0] * 8), cascade=0.8)
    assert engine_oracle.judge("a_one_8k_prefix_x64", "v2", on, OFF, OFF)["outcome"] == "fail"
    assert engine_oracle.judge("h_n4_sampling_t08_2k_prefix_x8", "v2", on, OFF,
                               OFF)["outcome"] == "pass"


def test_beam_rows_compare_finished_beams_against_the_reference():
    def beams(delta: float, last: int = 7) -> list[dict]:
        return [{"beams": [[1, 2, 3, 4], [1, 2, 3, last]],
                 "cum_logprobs": [-1.0 + delta, -1.5 + delta]} for _ in range(4)]

    off, reference = result(beams=beams(0.0)), result(beams=beams(0.02))
    row = engine_oracle.judge("g_beam_search_w4_2k_prefix_x8", "v2", result(beams=beams(0.024)),
                              off, reference)
    assert (row["compared_beams"], row["beams"], row["compared_fraction"]) == (8, 8, 1.0)
    assert row["mean_abs_dlogprob"] == pytest.approx(0.006)  # 0.024 over 4 tokens
    assert row["reference_mean_abs_dlogprob"] == pytest.approx(0.005)
    assert row["outcome"] == row["reference_outcome"] == "pass"
    assert "beam" in row["metric"]
    # Every request's second beam differs (4 of 8 beams missing, the reference misses none).
    row = engine_oracle.judge("g_beam_search_w4_2k_prefix_x8", "v2",
                              result(beams=beams(0.0, last=8)), off, reference)
    assert (row["compared_fraction"], row["outcome"]) == (0.5, "fail")


def test_fails_widely_needs_a_failure_far_from_the_bounds():
    # Two kernels 0.01 apart: the plugin may be 0.015 off, so "widely" is 0.03 or more.
    row = {"outcome": "fail", "compared_fraction": 0.3, "mean_abs_dlogprob": 0.029,
           "reference_mean_abs_dlogprob": 0.01}
    assert not engine_oracle.fails_widely(row)
    assert engine_oracle.fails_widely({**row, "compared_fraction": 0.2})
    assert engine_oracle.fails_widely({**row, "mean_abs_dlogprob": 0.03})
    # Two kernels 0.02 apart: the absolute 0.02 bounds the plugin, so "widely" is 0.04.
    assert not engine_oracle.fails_widely({**row, "mean_abs_dlogprob": 0.039,
                                           "reference_mean_abs_dlogprob": 0.02})
    assert not engine_oracle.fails_widely({**row, "outcome": "pass", "compared_fraction": 0.0})


def test_a_long_workload_is_judged_by_the_coverage_two_kernels_reach():
    """Greedy runs of a long workload part at a near-tie: when two correct kernels compare only
    a third of the positions, the plugin must reach two thirds of that, not half of them all."""
    def diverging(at: int) -> dict:
        return result(requests([-1.0] * 8, tokens=[*range(1, at + 1), *([99] * (8 - at))]),
                      )

    off = result(requests([-1.0] * 8))
    row = engine_oracle.judge("f_preemption_small_kv_cache", "v2", diverging(2), off,
                              diverging(3))
    assert (row["compared_fraction"], row["reference_compared_fraction"]) == (2 / 8, 3 / 8)
    assert row["reference_outcome"] == "pass" and row["outcome"] == "pass"
    row = engine_oracle.judge("f_preemption_small_kv_cache", "v2", diverging(1), off,
                              diverging(3))
    assert row["outcome"] == "fail"  # 1/8 < 2/3 of 3/8
    row = engine_oracle.judge("f_preemption_small_kv_cache", "v2", diverging(3), off,
                              diverging(1))
    assert row["reference_outcome"] == "fail"  # two kernels part after 1 of 8: too long


def test_the_largest_deviation_is_bounded_by_the_two_kernels_largest():
    off = result(requests([-1.0] * 8, [-2.0] * 8))
    one_far = requests([-1.0] * 7 + [-1.12], [-2.0] * 8)
    reference = result(requests([-1.0] * 7 + [-1.09], [-2.0] * 8))  # largest 0.09
    row = engine_oracle.judge("e_chunked_prefill_with_decodes", "v2", result(one_far), off,
                              reference)
    assert row["max_abs_dlogprob"] == pytest.approx(0.12)
    assert row["outcome"] == "pass"  # 0.12 <= 1.5 x 0.09
    reference = result(requests([-1.0] * 7 + [-1.05], [-2.0] * 8))  # largest 0.05
    row = engine_oracle.judge("e_chunked_prefill_with_decodes", "v2", result(one_far), off,
                              reference)
    assert row["outcome"] == "fail"  # 0.12 > max(0.1, 1.5 x 0.05)


def test_a_quantised_kv_cache_is_judged_relative_to_two_kernels_only():
    """FP8: two correct kernels 0.05 apart on average, beyond the bf16 tolerances; the plugin
    0.06 off passes (within 1.5 times), 0.08 off fails, and the reference is not judged by bf16's
    tolerances."""
    reference = result(requests([-1.05] * 8, [-2.05] * 8))
    row = engine_oracle.judge("a_one_8k_prefix_x64", "v2", result(requests([-1.06] * 8,
                                                                           [-2.06] * 8)),
                              OFF, reference, quantised=True)
    assert (row["outcome"], row["reference_outcome"]) == ("pass", "pass")
    assert engine_oracle.judge("a_one_8k_prefix_x64", "v2", result(requests([-1.06] * 8,
                                                                            [-2.06] * 8)),
                               OFF, reference)["reference_outcome"] == "fail"
    row = engine_oracle.judge("a_one_8k_prefix_x64", "v2", result(requests([-1.08] * 8,
                                                                           [-2.08] * 8)),
                              OFF, reference, quantised=True)
    assert row["outcome"] == "fail"
def test_the_workloads_fit_the_engine_and_the_oracle_model():
    workloads = engine_driver.workloads()
    assert list(workloads)[:6] == ["a_one_8k_prefix_x64", "b_4_prefixes_x16_interleaved",
                                   "c_tree_2k_system_4x4k_docs_x8", "d_n8_sampling_16_prompts",
                                   "e_chunked_prefill_with_decodes",
                                   "f_preemption_small_kv_cache"]
    for name, (prompts, params) in workloads.items():
        assert max(map(len, prompts)) + params["max_tokens"] <= 9216, name  # max_model_len
        assert max(max(p) for p in prompts) < oracle_model.CONFIG["vocab_size"], name
    prompts, params = workloads["g_beam_search_w4_2k_prefix_x8"]
    assert params == {"beam_width": 4, "max_tokens": 16, "ignore_eos": True}
    assert len({tuple(p[:2048]) for p in prompts}) == 1  # one shared 2K prefix
    prompts, params = workloads["h_n4_sampling_t08_2k_prefix_x8"]
    assert (params["n"], params["temperature"], params["logprobs"]) == (4, 0.8, 2)


@dataclasses.dataclass(frozen=True)
class Level:
    kv_page_indptr: np.ndarray
    kv_page_indices: np.ndarray
    causal: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    levels: tuple[Level, ...]


SHARED = Level(np.array([0, 5, 6]), np.array([10, 11, 12, 13, 14, 20]), causal=False)
OWN = Level(np.array([0, 2, 4]), np.array([30, 31, 40, 41]), causal=True)


@pytest.mark.parametrize(("one_page", "shared", "own"), [
    (False, [11, 12, 13, 14, 15, 21], [31, 32, 41, 42]),  # every page id shifted
    (True, [10, 11, 13, 13, 14, 20], [30, 31, 40, 41]),   # the 5-page group's middle page only
])
def test_the_corrupted_planners_shift_the_page_ids(monkeypatch, one_page, shared, own):
    monkeypatch.setattr(planner.CascadePlanner, "plan", lambda self: Plan((SHARED, OWN)))
    engine_driver._corrupt_planner(one_page=one_page)
    plan = planner.CascadePlanner.plan(None)
    assert plan.levels[0].kv_page_indices.tolist() == shared
    assert plan.levels[1].kv_page_indices.tolist() == own
    assert SHARED.kv_page_indices.tolist() == [10, 11, 12, 13, 14, 20]  # the real plan untouched


def test_page_ids_wrap_inside_the_cache():
    top = engine_driver.NUM_BLOCKS - 1
    assert engine_driver._next_block(np.array([1, top - 1, top])).tolist() == [2, top, 1]


def test_beam_search_runs_with_an_id_tokenizer_and_records_the_beams():
    seen = []

    class LLM:
        renderer = SimpleNamespace(tokenizer=None)

        def beam_search(self, prompts, params):
            tokenizer = self.renderer.tokenizer
            # vLLM 0.26's input processor checks every prompt's ids against the tokenizer's.
            assert all(max(p["prompt_token_ids"]) <= tokenizer.max_token_id for p in prompts)
            seen.append((tokenizer.eos_token_id, tokenizer.decode([3, 4]), params.beam_width))
            return [SimpleNamespace(sequences=[SimpleNamespace(
                tokens=[*p["prompt_token_ids"], 7, 8], cum_logprob=-0.5)]) for p in prompts]

    llm = LLM()
    out = engine_driver._beam_search(llm, [[1, 2], [5]],
                                     {"beam_width": 2, "max_tokens": 2, "ignore_eos": True})
    assert out == [{"beams": [[7, 8]], "cum_logprobs": [-0.5]}] * 2
    assert seen == [(2, "3 4", 2)]
    assert llm.renderer.tokenizer is None  # given back
