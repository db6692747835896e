"""Speculative decoding: verification steps (1 + k query tokens per row) run cascade where the
host knows each row's exact sequence length and no drafter runs attention of its own (ngram,
suffix, synchronous scheduling); everything else runs flat with its reason. The FLASH_ATTN
builder and impl of ``test_flash_attn_cpu``, a real VllmConfig with vLLM's ngram method."""

from __future__ import annotations

import numpy as np
import pytest

import vllm_cpu
from test_fa3_executor_cpu import fake_flash_attn_varlen_func, fake_merge_attn_states
from test_flash_attn_cpu import fa_builder, restored_session, run_layers  # noqa: F401
from test_integration_cpu import batch, common_metadata
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.execution import vllm_kernels
from vllm_cascade_plugin.integration import support
from vllm_cascade_plugin.step import session


@pytest.fixture(scope="module")
def ngram_config(tmp_path_factory):
    return vllm_cpu.engine_config(
        str(tmp_path_factory.mktemp("tiny-ngram")), backend="FLASH_ATTN",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 3, "prompt_lookup_min": 1})


def verification_batch(drafts=3):
    """A verification step of speculative decoding: every row its last token and ``drafts``
    draft tokens (uniform 1 + k); rows 0, 2, 4, 5 share pages 11-15."""
    table, seq, q = batch()
    return table, seq - q + 1 + drafts, np.full_like(q, 1 + drafts)


def test_ngram_verification_steps_run_cascade_exactly(ngram_config, monkeypatch):
    """Rows of 1 + k query tokens: the shared level (pages before each row's first query token)
    non-causal, each row's own pages causal; the FA3 executor against dense attention."""
    from vllm.config import set_current_vllm_config

    assert ngram_config.speculative_config.method == "ngram"
    assert not ngram_config.scheduler_config.async_scheduling  # vLLM's default for ngram
    monkeypatch.setenv("CASCADE_POLICY", "always")
    monkeypatch.setattr(vllm_kernels, "fa3_kernels",
                        lambda: (fake_flash_attn_varlen_func, fake_merge_attn_states))
    builder, layers = fa_builder(ngram_config)
    assert builder._settings.unsupported is None
    table, seq, q = verification_batch()
    step = session.plan_step(table, seq, q)
    assert step is not None and step.decision.use_cascade and not step.decode
    *shared, own = step.plan.levels
    assert shared and not any(level.causal for level in shared) and own.causal
    with set_current_vllm_config(ngram_config):
        metadata = builder.build(0, common_metadata(table, seq, q))
        assert metadata.cascade is not None and metadata.max_query_len == 4
        run_layers(layers, metadata, table, seq, q)
    assert stats.snapshot().steps_cascade == 1 and not stats.snapshot().fallbacks


@pytest.mark.parametrize(("change", "reason"), [
    ({"scheduler_config.async_scheduling": True}, support.ASYNC_SPECULATIVE),
    ({"speculative_config.method": "eagle"}, support.speculative_reason("eagle", False)),
    ({"speculative_config.method": "draft_model"},
     support.speculative_reason("draft_model", False)),
])
def test_speculative_decoding_the_cascade_cannot_serve_runs_flat(ngram_config, change, reason):
    import copy

    config = copy.deepcopy(ngram_config)
    for path, value in change.items():
        owner_path, name = path.split(".")
        object.__setattr__(getattr(config, owner_path), name, value)
    builder, _ = fa_builder(config)
    assert builder._settings.unsupported == reason


def test_the_v1_runner_hook_plans_a_verification_step_from_its_scheduled_draft_tokens(
        monkeypatch):
    """The V1 runner's scheduled tokens of a row include its draft tokens (1 + k), its
    computed tokens only the accepted ones: the hook plans exactly the batch the builder gets
    and keeps the step off FULL graphs (vLLM's uniform-decode graphs of 1 + k tokens)."""
    from vllm.config import CUDAGraphMode

    from test_hooks import v1_runner
    from vllm_cascade_plugin.config import CascadeConfig
    from vllm_cascade_plugin.integration import hooks_dispatch, hooks_step
    from vllm_cascade_plugin.planning.cost import AttentionShape

    session.configure(CascadeConfig(enabled=True, policy="always"), AttentionShape(8, 2, 128, 2),
                      16, None)
    table, seq, q = verification_batch()
    runner, so = v1_runner(table, seq, q)
    modes = []

    def vllm_dispatch(self, num_tokens, uniform_decode=False, has_lora=False,
                      num_active_loras=0, valid_modes=None, invalid_modes=None):
        modes.append(invalid_modes)
        return CUDAGraphMode.PIECEWISE, None

    step = hooks_step.PendingStep(runner, so)
    monkeypatch.setattr(hooks_step, "pending", step)
    assert hooks_dispatch.plan_once(step, hooks_dispatch.v1_plan)
    planned = session.current
    assert np.array_equal(planned.seq_lens, seq) and int(planned.query_start_loc[-1]) == q.sum()
    assert planned.matches(planned.query_start_loc, int(q.sum()), seq) and not planned.decode
    hooks_dispatch.v1_dispatch(vllm_dispatch)(runner.cudagraph_dispatcher, int(q.sum()),
                                      uniform_decode=True)
    assert modes == [{CUDAGraphMode.FULL}]
