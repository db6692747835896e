"""The plugin's counters survive vLLM's own engine-to-client serializer, as a function sent with
``collective_rpc`` returns them (the soak, the engine tests and the benchmarks read them so).

vLLM records the exact type of every value of a utility result and rebuilds it with msgspec on
the client side. A ``collections.Counter`` cannot be rebuilt: the client's output handler dies
and every request in flight hangs. This happened on the GPU once the counters gained their flat
reasons; :func:`stats.plain` is the one conversion every reader uses."""

from __future__ import annotations

import logging

import pytest

from benchmarks.soak import worker as soak_worker
from vllm_cascade_plugin import stats


def _round_trip(result: object, monkeypatch) -> object:
    """``result`` as the client of a multiprocess engine receives it from ``collective_rpc``."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the readers set it too
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    outputs = EngineCoreOutputs(utility_output=UtilityOutput(call_id=7, result=UtilityResult(
        [result])))  # one worker's answer
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert decoded.utility_output.failure_message is None
    return decoded.utility_output.result.result[0]


@pytest.fixture
def busy_counters():
    """Counters with every kind of value set: counts, reasons, ratios, histogram buckets."""
    stats.reset()
    stats.record_planned(decode=True)
    stats.flat_decision(stats.counters.COST_MODEL, 1.25)
    stats.record_planning(0.0004)
    stats.record_fallback("kernel error", level=logging.DEBUG)
    stats.end_step()
    yield stats.snapshot()
    stats.reset()


def test_a_counter_does_not_survive_the_serializer(busy_counters, monkeypatch):
    """The failure this guards against, shown on vLLM's serializer: a ``Counter`` in the result
    makes the client's decoder raise (if vLLM learns to rebuild it, the guard is still right)."""
    import msgspec

    try:
        back = _round_trip({"flat_reasons": busy_counters.flat_reasons}, monkeypatch)
    except msgspec.ValidationError as error:
        assert "Counter" in str(error)
    else:
        assert back["flat_reasons"] == {stats.counters.COST_MODEL: 1}


@pytest.mark.parametrize("reader", ["stats.plain", "soak_worker.plugin_counters"])
def test_the_counters_as_the_readers_return_them_arrive_intact(reader, busy_counters,
                                                                monkeypatch):
    sent = (stats.plain(busy_counters) if reader == "stats.plain"
            else soak_worker.plugin_counters(None))
    back = _round_trip(sent, monkeypatch)
    assert back == sent
    assert back["flat_reasons"] == {stats.counters.COST_MODEL: 1}
    assert back["decode_flat_reasons"] == {stats.counters.COST_MODEL: 1}
    assert back["fallbacks"] == {"kernel error": 1}
    assert back["flat_cost_ratio"] == {stats.counters.COST_MODEL: pytest.approx(1.25)}
    assert sum(back["planning_buckets"]) == 1 and back["steps_planned"] == 1
