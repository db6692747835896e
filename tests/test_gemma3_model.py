"""The Gemma 3 oracle (``oracle_model.build_gemma3``): its kernel noise and its teeth, on the CPU.

``tests/gpu/test_sliding_window_engine.py``'s Gemma 3 test runs it in vLLM (bf16 throughout) with
the plugin on and off, and first checks that two correct flat kernels (FLASH_ATTN, TRITON_ATTN)
agree within the engine rule's tolerance: otherwise the rule cannot tell a right cascade from a
wrong one on this model. That rests on what is measured here, in transformers with the whole
model in bf16 as vLLM runs it (weights, activations, norms; attention as a bf16 FlashAttention
kernel computes it, ``test_oracle_model.flash_attention``), teacher-forced on the greedy tokens of
transformers' own attention:

* two tilings of that kernel (as two correct GPU kernels differ) and the kernel without bf16
  rounding inside agree within the tolerance (0.012-0.013 mean |Δlogprob|). With the head of
  the other oracles (``LM_HEAD_SCALE``) they did not (0.024 here, and FLASH_ATTN and TRITON_ATTN
  0.023 on an H100): the reason for ``GEMMA3_HEAD_SCALE``;
* ignoring the window on the five sliding-window layers moves the chosen-token logprobs by more
  than ten tolerances and twenty times the two tilings' difference.
"""

from __future__ import annotations

import pytest
import torch

import oracle_model
from test_oracle_model import KERNELS, assert_far_beyond_kernels, greedy_ids, records, scored_last
from vllm_cascade_plugin.face import agreement

PREFIX, SUFFIX, REQUESTS, GENERATED = 2 * oracle_model.WINDOW, 16, 4, 16


def _in_query_dtype(attend):
    """A kernel of ``test_oracle_model`` returning its output in the model's dtype (bf16)."""
    def run(module, query, *args, **kwargs):
        out, weights = attend(module, query, *args, **kwargs)
        return out.to(query.dtype), weights
    return run


@pytest.fixture(scope="module")
def runs() -> dict:
    from transformers import AttentionInterface

    for name, attend in KERNELS.items():
        AttentionInterface.register(f"bf16_{name}", _in_query_dtype(attend))
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = oracle_model.build_gemma3().eval()  # bf16, as saved and as vLLM runs it
    assert model.dtype == torch.bfloat16
    out: dict = {}
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ids = greedy_ids(model, PREFIX, SUFFIX, REQUESTS, GENERATED)
        for name in KERNELS:
            model.set_attn_implementation(f"bf16_{name}")
            out[name] = scored_last(model, ids, GENERATED)
        windows = [layer.self_attn.sliding_window for layer in model.model.layers]
        assert windows.count(oracle_model.WINDOW) == 5 and windows.count(None) == 1
        for layer in model.model.layers:  # every layer attends to all tokens
            layer.self_attn.sliding_window = None
        model.set_attn_implementation("bf16_oracle_tile128")
        out["windowless"] = scored_last(model, ids, GENERATED)
    return out


def test_two_correct_kernels_in_bf16_agree_within_the_tolerance_on_most_positions(runs):
    reference = records(runs["oracle_tile128"])
    for other in ("oracle_tile48", "oracle_fp32"):
        dev = agreement.measure(records(runs[other]), reference)
        # Teacher-forced, a sequence is compared up to the first position whose chosen token
        # the two differ on (a near tie): about half to three quarters of the positions here.
        assert dev.fraction >= 0.4, (other, dev)
        assert dev.mean <= agreement.MEAN_TOL and dev.worst <= agreement.MAX_TOL / 2, (other, dev)


def test_ignoring_the_window_moves_the_logprobs_ten_tolerances(runs):
    assert_far_beyond_kernels(runs["windowless"], runs["oracle_tile128"], runs["oracle_tile48"])
