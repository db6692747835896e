"""When does a cascade plan beat flat attention? An analytic model, numpy/stdlib only.

Flat decode streams every row's KV pages: FlashInfer's, or with vLLM's FLASH_ATTN backend
FlashAttention 3's, ~25% slower at large batches (:data:`FLASH_ATTN_FLAT`). A cascade reads a
group's shared pages once but pays a fixed cost per level, a small cost per request, runs each
shared group as one dense prefill whose KV streaming is limited by how few thread blocks one
group keeps busy, and pays once per step for planning its levels on the host and running
attention outside FULL CUDA graphs. Estimates are per attention layer call (µs); the per-step
cost is spread over the model's layers.

``CostModel()``'s defaults are FlashInfer's executor; ``COST_MODELS`` holds one calibration per
executor (``CASCADE_KERNEL``). Both are fitted by ``benchmarks/calibration/cost.py`` on an H200
(bf16, 32 q / 8 kv heads, head_dim 128, page 16, vLLM 0.26.0, FlashInfer 0.6.14): the per-layer
terms on the 22 rows of ``benchmarks/results/gpu/kernel_grid.json`` (decode, B requests behind P
shared tokens, 128 own each), the per-step term on end-to-end runs with cascade on every step
(``e2e_step_cost_fa3.json``, ``e2e_step_cost_flashinfer.json``, ``demo_flashinfer_executor.txt``;
``benchmarks/README.md`` says what each run is; FA3's from ``e2e_step_cost_fa3_serving.json``);
FA3's flat side on the grid's ``fa3_decode`` alone. Some rows, per layer without the per-step
term (µs; measured / model, from ``cost_calibration.json``):

=====  =====  ======  ===============  ===========  ===================  ============
B      P      groups  flat FlashInfer  flat FA3     FlashInfer executor  FA3 executor
=====  =====  ======  ===============  ===========  ===================  ============
8      512    1       19 / 20          18 / 20      34 / 34              23 / 25
128    2048   1       151 / 143        192 / 180    202 / 212            54 / 54
256    8192   1       942 / 977        1222 / 1265  435 / 460            120 / 117
256    32768  1       3602 / 3810      4569 / 4952  761 / 780            279 / 248
256    8192   16      954 / 977        1219 / 1265  784 / 466            184 / 186
=====  =====  ======  ===============  ===========  ===================  ============

The 16-group row shows what FlashInfer's model misses: many small groups cost more than their
bytes say. The grid's rows put each group's requests side by side, so flat decode finds a shared
page in L2 when the next row reads it; a server's batch interleaves its requests' documents, and
with FLASH_ATTN a page read again more than ``l2_window_rows`` rows later streams from HBM
(``miss_bandwidth``, :data:`FLASH_ATTN_MISS_BANDWIDTH`, :func:`missed_pages`).

The per-step term (FA3: 0.45 ms, FlashInfer: 3.08 ms over 32 layers) is what a
cascade step costs beyond its kernels: attention runs outside vLLM's FULL CUDA graphs, so a
cascade step's host work sets its pace. The FA3 executor's decode steps replay the plugin's own
CUDA graph of the whole step (``CASCADE_FULL_GRAPHS``): against flat FLASH_ATTN at 32 to 128
requests behind 16 documents of 2K tokens, 4 of 8K or a chat prompt of 1.5K
(``e2e_step_cost_fa3_serving.json``), a cascade step cost at most 0.45 ms beyond the model's
kernel saving, on most of them less than nothing (flat FA3 ran slower than its model); the
largest is the term. (Runs of older code at 128 requests behind 16K and 8 x 8K prefixes, which
built vLLM's flat metadata on every cascade step, said 1.1 to 1.5 ms against flat FlashInfer:
``e2e_step_cost_fa3.json``.) With a graph
per layer inside vLLM's piecewise path instead (``CASCADE_FULL_GRAPHS=0``, or where whole-step
graphs are not used: tensor parallelism, LoRA, weight offloading, a KV connector) 1.5 ms
(``FA3_LAYER_GRAPHS_STEP_FIXED_US``, ``e2e_step_cost_fa3_layer_graphs.json``); launched from
Python (108 to 128 µs of host time per layer against 25 to 33 µs for flat decode,
``kernel_grid.json`` ``host_us``) 7.57 ms (``FA3_EAGER_STEP_FIXED_US``,
``e2e_step_cost_fa3_eager.json``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from .plan import CascadeLevel, CascadePlan

if TYPE_CHECKING:
    from .compiled import RowFacts

__all__ = ["COST_MODELS", "FLASH_ATTN_FLAT", "FLASH_ATTN_MISS_BANDWIDTH", "AttentionShape",
           "CostModel", "Decision", "cost_model_for", "decide", "decode_flat_us", "flash_attn_flat",
           "flat_floor", "flat_floor_from_facts", "missed_pages"]


@dataclass(frozen=True)
class AttentionShape:
    """The attention layer's shape; ``dtype_bytes`` is the KV cache element size."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_layers: int = 1  # attention layers one step's plan serves; per-step costs spread over them


@dataclass(frozen=True)
class CostModel:
    """Knobs of the model; times in microseconds, rates per second.

    flat_fixed_us : launch and split-KV merge of one flat FlashInfer decode call
        (FlashAttention 3's with the FLASH_ATTN backend: :data:`FLASH_ATTN_FLAT`).
    flat_bandwidth : bytes/s a flat call streams KV at; above HBM's 4.8 TB/s because rows
        sharing pages hit in L2 (FlashInfer's 9.09 TB/s, FlashAttention 3's 6.99 TB/s).
    flat_prefill_tile, flat_prefill_flops : flat attention of a row with several query tokens
        (a prefill chunk, the last page vLLM recomputes when a whole prompt hits the prefix
        cache) runs FlashInfer's prefill kernel, whose thread blocks each take ``tile`` query
        tokens of one request and one head: a 16-token row pays for 128. Its compute is
        ``ceil(q / tile) * tile`` query tokens at ``flat_prefill_flops``. Fitted on the H200:
        128 rows of 16 query tokens behind a cached 16K prefix took 7.7 ms per layer
        (``profile_step/profile-flashinfer.json``, ``PrefillWithKVCacheKernel``), 573 TFLOP/s
        of padded work; the unpadded model said 0.97 ms and kept such steps flat.
    level_fixed_us : launch and state merge per cascade level.
    request_us : per request per cascade call (the per-request level runs one-token rows
        through a prefill kernel); fitted: the cascade's intercept grows ~1.3 µs per request.
    flops : FLOP/s of a shared level's dense attention (``4 * head_dim`` FLOPs per query head
        and key token); fitted 400 TFLOP/s (200 overestimates B=256, P=32K by 40%).
    group_bandwidth : bytes/s one shared group streams its pages at: one group keeps only a few
        thread blocks busy, so this is far below HBM; fitted from the cascade's slope in P.
    shared_bandwidth : bytes/s all groups of one level together can reach (HBM).
    own_bandwidth : bytes/s the cascade's per-request level streams its pages at; None: at
        ``flat_bandwidth`` (the executors' calibrations fit their cascade terms with it so).
        :func:`flash_attn_flat` pins it where it changes the flat terms.
    step_fixed_us : what a cascade step costs beyond its kernels, once per step (spread over
        ``AttentionShape.num_layers``): planning every level on the host and running attention
        outside FULL CUDA graphs. Measured end to end: the gap between the step times of flat
        and cascade-on-every-step runs and the model's kernel saving over 32 layers
        (FlashInfer's executor against flat FlashInfer: 3.3 ms at 64 requests, 2.9 ms at 128;
        FA3's with whole-step graphs against flat FLASH_ATTN at 32 to 128 requests: at most
        0.45 ms; Llama-3-8B shape, H200; ``cost_calibration.json``, ``end_to_end``).
    miss_bandwidth : bytes/s flat decode streams a shared page at when the row that read it
        before it in the batch is more than ``l2_window_rows`` rows back (requests of many
        documents interleaved, as a server's batch holds them: the page has left L2); None:
        every page at ``flat_bandwidth`` (whose L2 hits the grid's rows, each group's requests
        side by side, measured). Decode steps only: what the end-to-end runs measured.
    l2_window_rows : how many rows back a shared page read before still hits in L2.
    margin : the cascade must be faster by this fraction to be chosen (model error, noise).
    """

    flat_fixed_us: float = 17.3
    flat_bandwidth: float = 9.09e12
    flat_prefill_tile: int = 128
    flat_prefill_flops: float = 573e12
    level_fixed_us: float = 8.35
    request_us: float = 1.26
    flops: float = 790e12
    group_bandwidth: float = 0.315e12
    shared_bandwidth: float = 4.8e12
    own_bandwidth: float | None = None
    step_fixed_us: float = 3080.0
    miss_bandwidth: float | None = None
    l2_window_rows: int = 8
    margin: float = 0.1


# Per executor (``kernels.KERNELS``, ``CASCADE_KERNEL``): its calibration by
# ``benchmarks/calibration/cost.py`` (see ``cost_calibration.json``). FlashInfer's executor is the
# defaults above.
COST_MODELS: dict[str, CostModel] = {
    "flashinfer": CostModel(),
    "fa3": CostModel(flat_fixed_us=17.3, flat_bandwidth=9.09e12, level_fixed_us=11.4,
                     request_us=0.141, flops=790e12, group_bandwidth=3.37e12,
                     shared_bandwidth=4.8e12, step_fixed_us=447.0),
}
# The FA3 executor's per-step cost when its decode steps replay a CUDA graph per layer inside
# vLLM's piecewise path, not a whole-step graph (``CASCADE_FULL_GRAPHS`` off, or an engine that
# cannot use it, see ``hooks_graphs.full_graphs_reason``): what ``benchmarks/calibration/cost.py``
# fits from ``e2e_step_cost_fa3_layer_graphs.json`` (``tests/planning/test_cost.py`` checks it).
FA3_LAYER_GRAPHS_STEP_FIXED_US = 1500.0
# The FA3 executor's per-step cost when its decode steps launch their kernels from Python
# (``CASCADE_CUDA_GRAPHS=0``, ``CASCADE_FUSED_DECODE=0``, vLLM without CUDA graphs, or a step
# above vLLM's largest capture size): the same calibration on runs without the plugin's CUDA
# graphs (``e2e_step_cost_fa3_eager.json``, checked the same way).
FA3_EAGER_STEP_FIXED_US = 7570.0
# The FA3 executor's per-step cost of a mixed prefill+decode step run split
# (``execution.fa3_split``), charged to the decode rows' plan against their flat attention: the
# per-layer graphs' term (FA3_LAYER_GRAPHS_STEP_FIXED_US) and three FlashAttention 3 launches per
# layer over 32 layers, 3.1 ms. Measured (``benchmarks/kernels/split_step.py``, ``split_step.json``:
# 16-128 decode rows behind 4 documents of 8K or 16 of 2K tokens and one prefill row, 32
# layers, H200): on the GPU the split costs what the model says or less (at most 1.2 ms more),
# 0.20-0.98x flat's attention time behind 8K documents; but it launches 0.45-3.1 ms more host
# work per step (median 1.3 ms), which a mixed step, launched piecewise, pays where the host sets
# its pace. Served at 90% load (``serve.json``, run 20261203T072428), splitting at no per-step
# cost was slower than not splitting: TPOT p50 12.9 against 9.3 ms behind 2K documents (flat
# 11.7), 7.8 against 7.3 ms behind 8K ones. So the term stays at the host's upper bound. Even
# so the split did not pay served (run 20261203T093105: an 8K x 4 burst 1.71x flat's output with
# it, 2.49x with mixed steps flat, its per-layer graph captures and launches included). Planned
# whole at the eager cost, mixed steps gave bursts a lower TPOT p50 than flat ones did in two
# runs with the servers in either order (runs 20261203T163808 and T181304: behind one 32K
# document 8.4-8.8 ms against 14.2-43.1), and so they are unless CASCADE_SPLIT_MIXED is on.
FA3_SPLIT_STEP_FIXED_US = FA3_LAYER_GRAPHS_STEP_FIXED_US + 3 * 16.9 * 32
# The flat side with vLLM's FLASH_ATTN backend: FlashAttention 3's flat decode, ~25% slower than
# FlashInfer's at large batches. Fitted alone by ``benchmarks/calibration/cost.py`` on the same
# H200 grid (``kernel_grid.json``, column ``fa3_decode``; ``cost_calibration.json``,
# ``flat_backends``, ``FLASH_ATTN``); :func:`flash_attn_flat` applies it.
FLASH_ATTN_FLAT = {"flat_fixed_us": 16.9, "flat_bandwidth": 6.99e12}
# FlashAttention 3's flat decode of a shared page whose previous reader is more than
# ``CostModel.l2_window_rows`` rows back: fitted by ``benchmarks/calibration/cost.py`` on the
# end-to-end runs at serving batch sizes (``e2e_step_cost_fa3_serving.json``) whose requests
# interleave 16 documents of 2K tokens (each document's rows 16 apart): cascade on every step
# saved 0.5-3.1 ms per step more there than the model without it said, at 32 to 128 requests
# (flat FLASH_ATTN ran slower than the grid's rows, each document's requests side by side, say).
# With 4 documents (rows 4 apart) or one, it did not: the window lies between 4 and 15 rows, and
# 8 is taken. Of the three points' own fits (2.8-3.8 TB/s) the fastest, rounded up.
FLASH_ATTN_MISS_BANDWIDTH = 3.9e12


def flash_attn_flat(model: CostModel) -> CostModel:
    """``model`` with FlashAttention 3 as its flat side (vLLM's FLASH_ATTN backend): its decode,
    :data:`FLASH_ATTN_FLAT`, and no prefill-tile padding (FA3 packs a row's query tokens with
    its GQA heads instead of padding them to FlashInfer's 128-token tiles). Its cascade
    estimate unchanged: the per-request level keeps streaming at the bandwidth ``model`` gave
    it."""
    own = model.flat_bandwidth if model.own_bandwidth is None else model.own_bandwidth
    return replace(model, flat_fixed_us=FLASH_ATTN_FLAT["flat_fixed_us"],
                   flat_bandwidth=FLASH_ATTN_FLAT["flat_bandwidth"], own_bandwidth=own,
                   flat_prefill_tile=1, miss_bandwidth=FLASH_ATTN_MISS_BANDWIDTH)


def cost_model_for(kernel: str, decode_graphs: bool = True,
                   full_graphs: bool = True, split: bool = False) -> CostModel:
    """The calibration of ``kernel``'s executor (``COST_MODELS``, whole-step graphs for FA3);
    for FA3 with per-layer graphs only, :data:`FA3_LAYER_GRAPHS_STEP_FIXED_US` as its per-step
    cost; without decode-step CUDA graphs, :data:`FA3_EAGER_STEP_FIXED_US`; ``split``: a mixed
    step's decode rows run split from the rest, :data:`FA3_SPLIT_STEP_FIXED_US`."""
    model = COST_MODELS[kernel]
    if kernel == "fa3" and split:
        if not decode_graphs:
            raise ValueError("split mixed steps need the FA3 executor's decode-step graphs")
        model = replace(model, step_fixed_us=FA3_SPLIT_STEP_FIXED_US)
    elif kernel == "fa3" and not decode_graphs:
        model = replace(model, step_fixed_us=FA3_EAGER_STEP_FIXED_US)
    elif kernel == "fa3" and not full_graphs:
        model = replace(model, step_fixed_us=FA3_LAYER_GRAPHS_STEP_FIXED_US)
    return model


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` chose, its two estimates (µs) and why, for logs; the pages of the
    plan flat decode reads again past the L2 window (what its flat estimate charged them)."""

    use_cascade: bool
    flat_us: float
    cascade_us: float
    reason: str
    missed_pages: int = 0


def _prefill_padding_pairs(plan: CascadePlan, tile: int) -> float:
    """Query-key pairs a flat prefill kernel computes beyond the plan's own: each row with
    ``q > 1`` query tokens is padded to whole ``tile``-token query tiles against all its keys
    (full pages). 0.0 for decode steps (one query per row) and for a kernel that pads nothing
    (``tile`` 1: FlashAttention 3's), without touching the levels."""
    if plan.stats.num_tokens == plan.stats.num_requests or tile <= 1:
        return 0.0  # every row has one query token (the cost model runs every decode step)
    own = plan.levels[-1]
    queries = np.diff(own.qo_indptr)
    # The per-request level has one row per group: its queries and rows. Rows are the batch's
    # (rows without queries have none), so keys are kept by batch row.
    rows = own.rows[own.row_indptr[:-1]]
    keys = np.zeros(int(np.maximum.reduce(rows)) + 1, dtype=np.float64)
    for level in plan.levels:
        group_keys = np.diff(level.kv_page_indptr).astype(np.float64) * plan.page_size
        np.add.at(keys, level.rows, np.repeat(group_keys, np.diff(level.row_indptr)))
    padded = np.where(queries > 1, -(-queries // tile) * tile, queries)
    return float((padded - queries).astype(np.float64) @ keys[rows])


def _flat_us(tokens: int, pairs: float, padding: float, shape: AttentionShape,
             model: CostModel, missed: float = 0.0) -> float:
    """Flat attention per layer: ``tokens`` KV tokens streamed (every row's pages), ``pairs``
    query-key pairs computed; ``padding``: the pairs a prefill kernel adds by padding rows of
    several query tokens to whole tiles (FlashInfer's prefill kernel), 0 for none; ``missed``:
    of the tokens, those of shared pages read again past the L2 window (``miss_bandwidth``)."""
    token_bytes = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes  # K and V
    flop_per_pair = 4 * shape.head_dim * shape.num_qo_heads  # QK^T and PV, all query heads
    stream = tokens * token_bytes / model.flat_bandwidth
    if missed and model.miss_bandwidth is not None:  # never faster than an L2 hit
        stream += missed * token_bytes * max(
            1 / model.miss_bandwidth - 1 / model.flat_bandwidth, 0.0)
    flat_us = model.flat_fixed_us + 1e6 * max(stream, pairs * flop_per_pair / model.flops)
    if padding:
        flat_us = max(flat_us, model.flat_fixed_us + 1e6 * (pairs + padding) * flop_per_pair
                      / model.flat_prefill_flops)
    return flat_us


def _cascade_fixed_us(levels: int, requests: int, shape: AttentionShape,
                      model: CostModel) -> float:
    """What a cascade of ``levels`` levels over ``requests`` requests costs per layer before it
    streams a page: each level's, each request's and the step's share of fixed costs."""
    return (levels * model.level_fixed_us + requests * model.request_us
            + model.step_fixed_us / max(shape.num_layers, 1))


def decide(plan: CascadePlan, shape: AttentionShape, model: CostModel = CostModel()) -> Decision:
    """Estimate flat and cascade attention for ``plan`` and pick the cheaper one.

    A plan without a shared level is never run as a cascade: it would be flat attention plus
    the cascade's overheads. Estimates are per layer call, in microseconds.
    """
    own = plan.levels[-1] if plan.levels else None
    if own is None:
        return Decision(False, 0.0, 0.0, "empty step")
    token_bytes = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes  # K and V
    flop_per_pair = 4 * shape.head_dim * shape.num_qo_heads  # QK^T and PV, all query heads

    def pairs(level: CascadeLevel) -> float:
        """Query-key token pairs of a level (full pages: the model's resolution)."""
        return level.query_pages * plan.page_size

    def stream_us(pages: int, flop: float, bandwidth: float) -> float:
        return 1e6 * max(pages * plan.page_size * token_bytes / bandwidth, flop / model.flops)

    # Flat reads every row's pages once; its query-key pairs are those of all levels together.
    all_pairs = sum(pairs(level) for level in plan.levels)
    missed = missed_pages(plan, model)
    flat_us = _flat_us(plan.stats.pages_flat * plan.page_size, all_pairs,
                       _prefill_padding_pairs(plan, model.flat_prefill_tile), shape, model,
                       missed * plan.page_size)
    if plan.num_levels < 2:
        return Decision(False, flat_us, flat_us, "no shared prefix")
    cascade_us = _cascade_fixed_us(plan.num_levels, plan.stats.num_requests, shape, model)
    cascade_us += stream_us(
        len(own.kv_page_indices), pairs(own) * flop_per_pair,
        model.flat_bandwidth if model.own_bandwidth is None else model.own_bandwidth)
    for level in plan.levels[:-1]:
        bandwidth = min(level.num_groups * model.group_bandwidth, model.shared_bandwidth)
        cascade_us += stream_us(len(level.kv_page_indices), pairs(level) * flop_per_pair, bandwidth)
    use_cascade = cascade_us * (1 + model.margin) < flat_us
    verdict = "cascade" if use_cascade else "flat"
    reason = f"{verdict}: cascade {cascade_us:.0f} us vs flat {flat_us:.0f} us"
    return Decision(use_cascade, flat_us, cascade_us, reason, missed)


def missed_pages(plan: CascadePlan, model: CostModel) -> int:
    """Pages flat decode reads again more than ``model.l2_window_rows`` rows after the last row
    that read them (:attr:`~.plan.CascadeLevel.repeat_reads` of each shared level); 0 without
    ``miss_bandwidth`` or for a step with a row of several query tokens (not measured)."""
    if model.miss_bandwidth is None or plan.stats.num_tokens != plan.stats.num_requests:
        return 0
    missed = 0
    for level in plan.levels[:-1]:
        gaps, pages = level.repeat_reads
        missed += int(np.add.reduce(pages[gaps > model.l2_window_rows]))
    return missed


def _cascade_least_us(requests: int, pairs: float, shape: AttentionShape,
                      model: CostModel) -> float:
    """The least :func:`decide` charges any cascade of ``requests`` rows whose query-key pairs
    are ``pairs``: two levels' fixed costs, and the pairs' compute (every level's time is at
    least its pairs' at ``model.flops``, and the levels split the rows' pairs between them).
    A mixed step whose prefill rows make flat attention compute-bound stops here."""
    flop_per_pair = 4 * shape.head_dim * shape.num_qo_heads
    return _cascade_fixed_us(2, requests, shape, model) + 1e6 * pairs * flop_per_pair / model.flops


def _floor(requests: int, tokens: int, pairs: float, padding: float, missed: float,
           shape: AttentionShape, model: CostModel) -> Decision | None:
    """The floor's verdict from the rows' sums (:func:`_flat_us`'s arguments): flat, or None
    where the least any cascade costs (:func:`_cascade_least_us`) beats flat's estimate."""
    flat_us = _flat_us(tokens, pairs, padding, shape, model, missed)
    least = _cascade_least_us(requests, pairs, shape, model)
    if least * (1 + model.margin) < flat_us:
        return None
    return Decision(False, flat_us, least,
                    f"flat: cascade at least {least:.0f} us vs flat {flat_us:.0f} us")


def flat_floor_from_facts(facts: RowFacts, num_rows: int, page_size: int, shape: AttentionShape,
                          model: CostModel) -> Decision | None:
    """:func:`flat_floor` from the rows' :class:`~.compiled.RowFacts` (computed with
    ``model.flat_prefill_tile`` and ``model.l2_window_rows``) of a step of ``num_rows`` rows:
    the same verdict without reading the rows again."""
    if not facts.requests:
        return None
    padding, missed = 0.0, 0
    if facts.requests != facts.tokens:  # rows of several query tokens: padded prefill tiles
        if model.flat_prefill_tile > 1:
            padding = float(facts.padding) * page_size
    elif model.miss_bandwidth is not None and num_rows > model.l2_window_rows + 1:
        missed = facts.late_pages * page_size
    return _floor(facts.requests, facts.pages * page_size, float(facts.pairs) * page_size,
                  padding, missed, shape, model)


def decode_flat_us(facts: RowFacts, page_size: int, shape: AttentionShape, model: CostModel,
                   missed: int) -> float:
    """:func:`decide`'s flat estimate of a decode step (one query token per active row) from
    its rows' :class:`~.compiled.RowFacts`, given ``missed``: :func:`missed_pages` of a plan of
    its shared levels. Exact: a plan reads every row's pages once over its levels, and its
    query-key pairs are its rows' pages."""
    return _flat_us(facts.pages * page_size, float(facts.pairs) * page_size, 0.0, shape, model,
                    missed * page_size)


def flat_floor(seq_lens: np.ndarray, query_lens: np.ndarray, page_size: int,
               shape: AttentionShape, model: CostModel) -> Decision | None:
    """:func:`decide`'s verdict for a step no plan of which could run as cascade, from the rows'
    lengths alone (no block ids, no plan); None where some plan might.

    Flat attention's estimate needs only each row's page count and query tokens, and is exactly
    :func:`decide`'s (a plan reads every row's pages once over its levels) but for the pages read
    again past the L2 window (:func:`missed_pages`), which need the block ids: at most every page
    of the rows more than ``l2_window_rows`` rows into the batch, which this takes. Any cascade of
    the rows costs at least two levels' fixed costs, every request's and the per-step cost, and
    the compute of the rows' query-key pairs (:func:`_cascade_least_us`); when that, with the
    margin, does not beat flat, :func:`decide` keeps every plan of them flat.
    """
    queries = np.asarray(query_lens, dtype=np.int64)
    active = queries > 0
    requests = int(np.count_nonzero(active))
    if not requests:
        return None
    pages = (np.asarray(seq_lens, dtype=np.int64)[active] + (page_size - 1)) // page_size
    queries = queries[active]
    padding, missed = 0.0, 0
    if requests != int(queries.sum()):  # rows of several query tokens: padded prefill tiles
        tile = model.flat_prefill_tile
        if tile > 1:
            padded = np.where(queries > 1, -(-queries // tile) * tile, queries)
            padding = float((padded - queries) @ pages) * page_size
    elif model.miss_bandwidth is not None and len(active) > model.l2_window_rows + 1:
        late = active.nonzero()[0] > model.l2_window_rows  # a previous reader that far back
        missed = int(np.add.reduce(pages[late])) * page_size
    return _floor(requests, int(pages.sum()) * page_size, float(queries @ pages) * page_size,
                  padding, missed, shape, model)
