"""What a step's plan is, what a metadata builder brings to planning (see :mod:`.step`), and
why a step the session plans runs flat.

numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import CascadeConfig
from ..planning.cost import AttentionShape, CostModel, Decision
from ..planning.plan import CascadePlan
from ..stats.counters import COST_MODEL, MIXED, MULTI_TOKEN, NO_SHARED, SINGLE


@dataclass(frozen=True, eq=False)
class StepPlan:
    plan: CascadePlan
    decision: Decision
    query_start_loc: np.ndarray  # int32 [num_reqs + 1], the batch this plan is for
    decode: bool  # every row has one query token
    seq_lens: np.ndarray  # int32 [num_reqs], each row's tokens after this step, as planned
    page_size: int  # of the block ids the plan reads
    shape: AttentionShape  # of the layers whose cost decided cascade or flat
    # A mixed step run split (``execution.fa3_split``): the rows (bool [num_reqs]) of one query
    # token, which ``plan`` covers alone, in batch order; the other rows run flat. None: the
    # plan covers every row.
    decode_rows: np.ndarray | None = None
    # The layers of the KV-cache group whose block table the plan read, where the engine has
    # several (a hybrid model's full-attention group beside its sliding-window ones); None: one.
    group_layers: frozenset[str] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc) - 1

    def matches(self, query_start_loc: np.ndarray, num_actual_tokens: int,
                seq_lens: np.ndarray) -> bool:
        """Same rows, tokens and sequence lengths (rows past ours may only be padding with no
        tokens, whatever their length: they attend to nothing)."""
        n = self.num_reqs
        qsl = np.asarray(query_start_loc)
        lens = np.asarray(seq_lens)
        total = int(self.query_start_loc[-1])
        return (len(qsl) >= n + 1 and len(lens) >= n and num_actual_tokens == total
                and np.array_equal(qsl[: n + 1], self.query_start_loc)
                and bool(np.all(qsl[n + 1:] == total))
                and np.array_equal(lens[:n], self.seq_lens))

    def planned_for(self, settings: BuilderSettings) -> bool:
        """Whether the plan was made for layers like ``settings``': its pages are numbered in
        their page size, its cascade-or-flat decision was costed for their shape, and its block
        ids are their KV-cache group's."""
        return (self.page_size == settings.page_size and self.shape == settings.shape
                and (self.group_layers is None or settings.layers <= self.group_layers))


@dataclass(frozen=True)
class BuilderSettings:
    """What one metadata builder (one attention group's layers) brings to the session."""

    config: CascadeConfig
    shape: AttentionShape
    page_size: int
    unsupported: str | None  # why cascade cannot serve these layers; None: it can
    # The calibrations of the executor the builder runs (see StepSession.configure).
    cost_model: CostModel = field(default_factory=CostModel)
    steady_cost_model: CostModel | None = None
    capture_sizes: tuple[int, ...] = ()
    page_bytes: int = 0  # one KV page over these layers, K and V (the log line's saving)
    backend: str = "FLASHINFER"  # the vLLM backend whose flat attention these layers run
    # The executor's cost of a mixed prefill+decode step run split (its decode rows as cascade,
    # the others flat: ``execution.fa3_split``), charged to the decode rows' plan; None: the
    # executor does not split mixed steps (they are planned whole, at the eager cost).
    split_cost_model: CostModel | None = None
    # The steady cost where the executor's whole-step graphs cannot be used (an engine of
    # several KV-cache groups: per-layer graphs); None: ``steady_cost_model``.
    layer_graphs_cost_model: CostModel | None = None
    layers: frozenset[str] = frozenset()  # the builder's attention layers


def flat_attention(backend: str) -> str:
    """How the log lines name what a layer runs instead of cascade."""
    return f"vLLM's flat {backend} attention"


def unshared_reason(requests: int) -> str:
    """Why a step of ``requests`` rows without a shared level is flat: one row has nothing to
    share with."""
    return SINGLE if requests == 1 else NO_SHARED


def flat_reason(decode: bool, query_lens: np.ndarray, decodes: int | None = None) -> str:
    """Why the cost model keeps a step flat: a decode step's cost, or its kind of step
    (``decodes``: its rows of one query token, where counted already)."""
    if decode:
        return COST_MODEL
    if decodes is None:
        decodes = int(np.count_nonzero(np.asarray(query_lens) == 1))
    return MIXED if decodes else MULTI_TOKEN
