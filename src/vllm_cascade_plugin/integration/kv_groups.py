"""Which KV-cache group's block table the runner hooks plan a step from.

An engine of one KV-cache group plans from it. vLLM's hybrid KV-cache manager (its default)
gives a model whose layers are of several kinds a group per kind, each with a block table of its
own: Gemma 3 and gpt-oss put their sliding-window layers in groups beside the full-attention
one; a Mamba or linear-attention hybrid (Jamba, NemotronH, Qwen3-Next) its recurrent layers'
state, whose builders the plugin never touches. Such a step is planned from the group of the
layers steps are planned for (the first builder that can run cascade:
``session.planning_layers``, a full-attention one), and only builders of that group's layers may
run the plan (``StepPlan.group_layers``); the sliding-window layers' builders run flat, as they
do in an engine of one group. Beside the planned group only sliding-window and recurrent groups
are accepted (any other kind keeps the step flat).

Beside sliding-window groups this runs by default: it agrees with flat attention in engines on
a GPU (tests/gpu/test_sliding_window_engine.py: Gemma 3's stack and a Mistral-style model, V1
and V2) and served Gemma 3's stack faster than flat, or as fast where the cost model kept every
step flat (docs/performance.md). Beside recurrent groups it agrees on a GPU too
(tests/gpu/test_hybrid_engine.py) but served slower than flat (vLLM's prefix caching of Mamba
state is experimental, and such a model's attention pages are as large as a state's), so there
it needs ``CASCADE_UNVERIFIED=1``; without it the first such step runs flat, counted as
:data:`SEVERAL_GROUPS`, and the session stands down (:meth:`~..step.StepSession.stand_down`):
every later step runs vLLM's path with no planning at all, as in an engine without the plugin.
"""

from __future__ import annotations

from typing import Any

from .. import stats
from ..step import session
from . import compat

SEVERAL_GROUPS = "more than one KV cache group"
_KNOWN = "_cascade_kv_group"  # runner attribute: (the planning layers, what planned_group said)


def planned_group(runner: Any, count: int) -> tuple[int, frozenset[str] | None] | None:
    """The index of the KV-cache group to plan from (of the runner's ``count``) and its layers
    (None for an engine of one group), or None where the step runs flat (the reason counted as
    a fallback). For a group beside others, the session charges a graphed decode step what
    per-layer graphs cost: the executor's whole-step graphs are off in such an engine
    (``hooks_graphs.full_graphs``)."""
    if count == 1:
        return 0, None
    groups = runner.kv_cache_config.kv_cache_groups
    layers = session.planning_layers
    known = runner.__dict__.get(_KNOWN)
    if known is None or known[0] is not layers:
        known = runner.__dict__[_KNOWN] = (layers, _choose(groups, layers))
    found = known[1]
    if isinstance(found[0], str):  # (reason, detail): the same for every step of this engine
        stats.record_fallback(*found)
        session.stand_down(found[0])
        return None
    session.whole_step_graphs_off()
    return found


def _choose(groups: list[Any], layers: frozenset[str],
            ) -> tuple[int, frozenset[str]] | tuple[str, str]:
    """(group, its layers), or (fallback reason, detail)."""
    held = [g for g, group in enumerate(groups) if layers and layers <= set(group.layer_names)]
    if len(held) != 1:
        return SEVERAL_GROUPS, "the planned layers are in no one KV-cache group"
    beside = {compat.kv_cache_kind(group.kv_cache_spec)
              for g, group in enumerate(groups) if g != held[0]}
    if others := sorted(beside - {compat.SLIDING, compat.RECURRENT}):
        return SEVERAL_GROUPS, (f"KV-cache groups of {', '.join(others)} layers beside the "
                                "planned one (only sliding-window and recurrent ones are "
                                "supported)")
    config = session.config
    if compat.RECURRENT in beside and (config is None or not config.unverified):
        return SEVERAL_GROUPS, ("the attention layers of a recurrent hybrid (Mamba or linear "
                                "attention layers in KV-cache groups of their own) run flat: "
                                "correct on a GPU but served slower than flat; "
                                "CASCADE_UNVERIFIED=1 runs their group as cascade")
    return held[0], frozenset(groups[held[0]].layer_names)
