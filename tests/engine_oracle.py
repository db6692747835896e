"""How the engine tests (``tests/gpu/test_engine.py``) judge a workload: a correctness.json row.

Three engines run the same workload with the oracle model (``tests/oracle_model.py``): the plugin
on (FlashInfer wrapped), the plugin off with FlashInfer, and the plugin off with FlashAttention.
The plugin is judged against plugin-off FlashInfer; the two plugin-off engines are two correct
kernels, and their deviation on the same workload in the same run is the reference the plugin's
must stay within (``agreement.agrees_with_reference``, ``agreement.beams_agree`` for beam
search; on an FP8 KV cache, relative bounds only). Pure Python; the CPU tests in
``tests/test_engine_oracle.py`` cover it.
"""

from __future__ import annotations

from typing import Any

from vllm_cascade_plugin.face import agreement

CASCADE_WORKLOADS = ("a_", "b_", "c_", "d_")  # cascade must run on >= 90% of their decode steps
MIN_CASCADE_STEPS = 0.9
BEAM_METRIC = ("beam search: of the plugin-off FlashInfer run's finished beams, those the other "
               "run found too (same tokens); |Δ cumulative logprob| per generated token")


def _reference_ok(kernels: agreement.Deviation | agreement.BeamDeviation) -> bool:
    """The two correct kernels themselves agree by the absolute tolerances, over at least a
    quarter of the positions: otherwise the model is too sensitive for bf16 (or the workload too
    long for it) and the relative bounds mean nothing."""
    return (kernels.fraction >= agreement.MIN_COMPARED / 2
            and kernels.worst <= agreement.MAX_TOL and kernels.mean <= agreement.MEAN_TOL)


def _within_kernels(plugin: agreement.Deviation | agreement.BeamDeviation,
                    kernels: agreement.Deviation | agreement.BeamDeviation) -> bool:
    """A quantised KV cache's rule: the two correct kernels' deviation (FP8 rounding of K, V
    and, in FA3, of the softmax weights) is the yardstick for the mean, the largest deviation
    and the coverage alike; the bf16 tolerances do not apply."""
    compared = plugin.compared if isinstance(plugin, agreement.Deviation) else plugin.matched
    return (compared > 0 and agreement.within_reference(plugin.mean, kernels.mean)
            and plugin.worst <= max(agreement.MAX_TOL, agreement.RELATIVE * kernels.worst)
            and plugin.fraction >= kernels.fraction / agreement.RELATIVE)


def verdicts(name: str, plugin: agreement.Deviation | agreement.BeamDeviation,
             kernels: agreement.Deviation | agreement.BeamDeviation, steps: float,
             quantised: bool = False) -> tuple[bool, bool]:
    """(the plugin agrees, the two kernels agree) for workload ``name``: ``plugin`` and
    ``kernels`` are the plugin's and the second kernel's deviations from the plugin-off run,
    ``steps`` the share of (decode) steps that ran cascade."""
    if quantised:
        ok, reference_ok = _within_kernels(plugin, kernels), kernels.fraction > 0
    elif isinstance(plugin, agreement.BeamDeviation):
        assert isinstance(kernels, agreement.BeamDeviation)
        ok, reference_ok = agreement.beams_agree(plugin, kernels), _reference_ok(kernels)
    else:
        assert isinstance(kernels, agreement.Deviation)
        ok = agreement.agrees_with_reference(plugin, kernels)
        reference_ok = _reference_ok(kernels)
    if name.startswith(CASCADE_WORKLOADS):
        ok = ok and steps >= MIN_CASCADE_STEPS
    return ok, reference_ok


def judge(name: str, runner: str, on: dict, off: dict, reference: dict,
          tp: int = 1, quantised: bool = False) -> dict[str, Any]:
    """One workload's row: ``on``, ``off`` and ``reference`` are engine_driver.py's results for
    it (plugin on; plugin off, same backend; plugin off, the other backend). ``quantised``: an
    FP8 KV cache, judged by :func:`_within_kernels`."""
    row: dict[str, Any] = {"workload": name, "runner": runner, "tensor_parallel_size": tp}
    plugin: agreement.Deviation | agreement.BeamDeviation
    kernels: agreement.Deviation | agreement.BeamDeviation
    if "beams" in off:
        plugin = agreement.compare_beams(on["beams"], off["beams"])
        kernels = agreement.compare_beams(reference["beams"], off["beams"])
        # Beam search runs each step as new one-token requests: prefills, no decode steps.
        steps = on["steps_cascade"] / max(on["steps_planned"], 1)
        row.update(metric=BEAM_METRIC, compared_beams=plugin.matched, beams=plugin.beams)
    else:
        plugin = agreement.measure(on["requests"], off["requests"])
        kernels = agreement.measure(reference["requests"], off["requests"])
        steps = on["decode_steps_cascade"] / max(on["decode_steps_planned"], 1)
        row.update(compared_tokens=plugin.compared, positions=plugin.positions)
    ok, reference_ok = verdicts(name, plugin, kernels, steps, quantised)
    if quantised:
        row["rule"] = "quantised KV cache: relative to two correct kernels only"
    row.update(
        max_abs_dlogprob=plugin.worst, mean_abs_dlogprob=plugin.mean,
        compared_fraction=plugin.fraction,
        reference_max_abs_dlogprob=kernels.worst, reference_mean_abs_dlogprob=kernels.mean,
        reference_compared_fraction=kernels.fraction,
        reference_outcome="pass" if reference_ok else "fail",
        cascade_step_fraction=steps, fallbacks=on["fallbacks"],
        outcome="pass" if ok else "fail")
    return row


def fails_widely(row: dict[str, Any]) -> bool:
    """A corrupted plan's row: failed, and not narrowly: the comparison covers under a quarter of
    the positions, or the compared ones are off on average by at least twice what the plugin may
    be (:data:`agreement.MEAN_TOL`, or :data:`agreement.RELATIVE` times the two kernels')."""
    allowed = min(agreement.MEAN_TOL, agreement.RELATIVE * max(
        row["reference_mean_abs_dlogprob"], agreement.REFERENCE_FLOOR))
    return row["outcome"] == "fail" and (
        row["compared_fraction"] < agreement.MIN_COMPARED / 2
        or row["mean_abs_dlogprob"] >= 2 * allowed)
