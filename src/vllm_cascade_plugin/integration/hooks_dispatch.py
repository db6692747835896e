"""The runner hooks that plan a step and keep a cascade step off FULL CUDA graphs.

vLLM's metadata builder learns of a step only after the step's CUDA-graph mode is fixed, so each
runner's wrapper plans the step on the CPU first (:func:`plan_rows`), then, on cascade steps
only, asks vLLM's dispatcher for a mode that is not a FULL graph (which would replay vLLM's flat
attention and skip the plugin's Python). V1: planned in ``_determine_batch_execution_and_padding``
from the runner's CPU block table, FULL added to ``CudagraphDispatcher.dispatch``'s
``invalid_modes``. V2: its block ids live on the GPU only, so ``append_block_ids`` keeps a CPU
mirror; planned in ``CudaGraphManager.dispatch``, asked without the arguments that select FULL
decode graphs. The never-raise rules are :mod:`.hooks_step`'s.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import stats
from ..step import session
from . import compat, hooks_step, kv_groups, row_keys, unshared_rows
from .hooks_step import PendingStep, failed, run_flat


def plan_rows(first_pages: np.ndarray, block_table: np.ndarray, num_blocks: np.ndarray,
              seq_lens: np.ndarray, query_lens: np.ndarray,
              keys: Callable[[], np.ndarray | None],
              row_index: np.ndarray | None = None,
              group_layers: frozenset[str] | None = None) -> bool:
    """Plan a step from CPU rows; True when it will run cascade.

    ``block_table``: the rows' block ids; with ``row_index``, row ``r``'s are
    ``block_table[row_index[r]]`` (the planner reads the rows it needs, nothing is copied
    whole). ``keys`` (the rows' keys: :mod:`.row_keys`) are read, with
    ``CASCADE_PLAN_FROM_CHANGES``, once a step is to be planned or may continue the last one
    (its lengths do). The pre-checks (the rows' first block ids leave sharing
    possible, their lengths leave cascade a chance to beat flat: the cost model's floor) are
    skipped for a step that continues the last one
    (:meth:`~.planning.planner.CascadePlanner.continues`). ``group_layers``: the layers of
    the KV-cache group ``block_table`` is, in an engine of several (:mod:`.kv_groups`).
    """
    facts = session.row_facts(first_pages, seq_lens, query_lens, num_blocks)
    if facts.short:
        session.flat_step("block table shorter than the sequence", query_lens)
        return False
    config = session.config
    read: list[np.ndarray | None] = []  # the rows' keys once read (at most once)

    def row_keys() -> np.ndarray | None:
        if not read:
            read.append(keys())
        return read[0]

    keyed = config is not None and config.plan_from_changes
    # The last step's decode rows one token longer: it shares and may win as that one did,
    # or stays flat as that one did (never a step with a row of several query tokens).
    if not (facts.all_decode(len(query_lens))
            and session.continues(seq_lens, query_lens, row_keys if keyed else None, row_index)):
        if session.skip_unshared(first_pages, seq_lens, query_lens, facts):
            return False
        if session.cannot_win(seq_lens, query_lens, facts):  # no plan of them could beat flat
            return False
    elif session.continued_flat(block_table, seq_lens, query_lens, facts, row_keys(),
                                row_index):
        return False
    keys_read = row_keys() if keyed else None
    if keys_read is not None:
        stats.log_once("planned from changes", "vllm-cascade-plugin: steps are planned from "
                       "the rows vLLM changed (CASCADE_PLAN_FROM_CHANGES).")
    step = session.plan_step(block_table, seq_lens, query_lens, keys_read, row_index,
                             group_layers)
    return step is not None and step.decision.use_cascade


def plan_once(step: PendingStep, plan: Callable[[PendingStep], bool]) -> bool:
    """The step's verdict, planned on first use (dispatch runs again under data parallelism).
    All of it, reading vLLM's rows included, is the step's planning time."""
    if step.cascade is None:
        try:
            with stats.planning():
                step.cascade = plan(step)
        except Exception as exc:
            run_flat(step)
            stats.record_fallback("runner hook error", f"{type(exc).__name__}: {exc}")
    return bool(step.cascade)


def guarded_call(where: str, step: PendingStep | None,
                 make: Callable[[], inspect.BoundArguments | None],
                 ) -> inspect.BoundArguments | None:
    """``make()``: a dispatch wrapper's changed call for a cascade step, or None for vLLM's call
    as it came; also None, with the step flat and the failure counted, when ``make`` fails (vLLM
    may then pick a FULL graph)."""
    try:
        return make()
    except Exception as exc:
        run_flat(step)
        failed(where, exc)
        return None


def record_padding(num_tokens: Callable[[], int]) -> None:
    """Tell the session the token count vLLM padded a cascade step to (the rows of its
    tensors, what a graphed step runs); on any surprise, 0 (no padding used). Never raises."""
    try:
        session.padded_tokens = int(num_tokens())
    except Exception as exc:
        session.padded_tokens = 0
        try:
            stats.log_once("padding unknown", "vllm-cascade-plugin: vLLM's padded token count "
                           "is not readable here (%s: %s); graphed cascade steps run unpadded.",
                           type(exc).__name__, exc)
        except Exception:
            pass


# ----------------------------------------------------------------------------------- V1 runner

def v1_plan(step: PendingStep) -> bool:
    runner, so = step.runner, step.scheduler_output
    group = kv_groups.planned_group(runner, len(runner.kv_cache_config.kv_cache_groups))
    if group is None:
        return False
    g, group_layers = group
    batch = runner.input_batch
    n = batch.num_reqs
    if n == 0:  # a step without requests runs a dummy batch (external launcher under DP)
        return False

    def first_page(req_id: str) -> int:  # the group's block table, written for this step
        return int(batch.block_table[g].block_table.np[batch.req_id_to_index[req_id], 0])

    # Steps known unshared without their rows, as on V2: not yet run on a GPU on this runner,
    # so only with CASCADE_UNVERIFIED (its one answer is "flat"; off, every step is read).
    known_unshared = session.config is not None and session.config.unverified
    if known_unshared and unshared_rows.unshared_again(runner, so, first_page):
        return False
    if session.held_flat(so.num_scheduled_tokens):  # as on V2: its rows are not read
        return False
    table = batch.block_table[g]
    req_ids = list(batch.req_ids[:n])
    query_lens = np.fromiter(map(so.num_scheduled_tokens.__getitem__, req_ids),
                             dtype=np.int32, count=n)
    seq_lens = np.asarray(batch.num_computed_tokens_cpu[:n], dtype=np.int32) + query_lens
    step.rows = req_ids  # who the rows are: checked when a builder takes the plan
    rows = table.block_table.np[:n]
    session.unshared = False
    cascade = plan_rows(rows[:, 0], rows, table.num_blocks_per_row[:n], seq_lens, query_lens,
                        lambda: row_keys.v1_rows(runner, batch.req_ids, n),
                        group_layers=group_layers)
    if known_unshared and session.unshared:  # the next steps may be known unshared
        unshared_rows.remember(runner, req_ids, rows[:, 0])
    return cascade


def v1_determine_batch_execution(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = hooks_step.pending
        try:
            if step is not None and step.runner is self:
                plan_once(step, v1_plan)
        except Exception as exc:
            run_flat(step)
            failed("_determine_batch_execution_and_padding", exc)
        return original(self, *args, **kwargs)
    return wrapper


def v1_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def cascade_call(step: PendingStep | None, self: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> inspect.BoundArguments | None:
        """The call that keeps a cascade step off FULL graphs; None: vLLM's call as it came."""
        if step is None or not step.cascade or step.runner.cudagraph_dispatcher is not self:
            return None
        call = signature.bind(self, *args, **kwargs)
        # A re-dispatch to the mode data-parallel ranks agreed on (valid_modes) stays as it is.
        if call.arguments.get("valid_modes") is None:
            from vllm.config import CUDAGraphMode

            call.arguments["invalid_modes"] = {
                CUDAGraphMode.FULL, *(call.arguments.get("invalid_modes") or ())}
        return call

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = hooks_step.pending
        call = guarded_call("CudagraphDispatcher.dispatch", step,
                            lambda: cascade_call(step, self, args, kwargs))
        if call is None:
            return original(self, *args, **kwargs)
        result = original(*call.args, **call.kwargs)
        record_padding(lambda: result[1].num_tokens)
        hooks_step.note_graph_mode(step, lambda: result[0])
        return result
    return wrapper


# ----------------------------------------------------------------------------------- V2 runner

# BlockTables attribute: the CPU mirror, one array per KV-cache group, or False once unusable
MIRROR = "_cascade_block_ids"


def _mirror_failed(tables: Any, exc: BaseException) -> None:
    """Never plan from a mirror that missed a write: no V2 step plans from now on. Never
    raises."""
    try:
        tables.__dict__[MIRROR] = False
        stats.record_fallback("block id mirror error", f"{type(exc).__name__}: {exc}")
    except Exception:
        pass


def v2_append_block_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, req_index: int, new_block_ids: Any, overwrite: bool) -> Any:
        starts: list[int] | None
        try:  # where the ids go: the row's length in each group before vLLM's write
            starts = [0 if overwrite else int(self.num_blocks.np[g, req_index])
                      for g in range(self.num_kv_cache_groups)]
        except Exception as exc:
            starts = None
            _mirror_failed(self, exc)
        result = original(self, req_index, new_block_ids, overwrite)
        if starts is None:
            return result
        try:
            mirrors = self.__dict__.get(MIRROR)
            if mirrors is False:  # a write was missed before: the mirror stays unusable
                return result
            if mirrors is None:  # zeros: the pages of slots never written are never touched
                mirrors = [np.zeros(tuple(table.gpu.shape), dtype=np.int32)
                           for table in self.block_tables]
                self.__dict__[MIRROR] = mirrors
            for g, start in enumerate(starts):
                ids = compat.v2_block_ids_written(self, g, new_block_ids[g])
                mirrors[g][req_index, start:start + len(ids)] = ids
            row_keys.v2_written(self, req_index, overwrite, len(mirrors[0]))
        except Exception as exc:
            _mirror_failed(self, exc)
        return result
    return wrapper


MIRROR_DIFFERS = "block id mirror differs from vLLM's block table"


def mirror_differs(tables: Any, group: int, mirror: np.ndarray, index: np.ndarray,
                   pages: np.ndarray) -> str | None:
    """``CASCADE_DEBUG``: where the CPU mirror's block ids of the planned rows (of KV-cache
    group ``group``) differ from the ones vLLM holds on the GPU (read back: a device sync,
    debug only), or None. ``pages``: the pages each row's tokens fill."""
    import torch

    width = int(pages.max(initial=0))
    held = tables.block_tables[group].gpu[torch.from_numpy(np.array(index)), :width]
    held = held.cpu().numpy()
    used = np.arange(width)[None, :] < pages[:, None]
    wrong = used & (held != mirror[index, :width])
    if not wrong.any():
        return None
    row, page = (int(x[0]) for x in np.nonzero(wrong))
    return (f"request slot {int(index[row])}, page {page}: mirrored {int(mirror[index[row], page])}"
            f", vLLM's {int(held[row, page])} ({int(wrong.sum())} ids differ)")


def v2_rows(runner: Any, so: Any) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """A step's request ids and their tokens (int32) in the scheduler's order, and the
    permutation that puts them in Model Runner V2's batch order (None: they are in it).

    Without draft tokens vLLM's ``sort_batch_req_ids`` puts the rows of ``decode_query_len``
    tokens first, in the scheduler's order, then the others by their token count, stably (its
    key in 0.26-0.33, checked against the installed vLLM by tests/integration/test_hooks.py):
    here a stable argsort, cheaper than Python's sort with a key function on large batches
    (benchmarks/results/cpu/step_host_v2_batch_order_cold.json). With
    draft tokens, vLLM's own sort (:func:`~.compat.v2_batch_order`).
    """
    tokens = so.num_scheduled_tokens
    req_ids = list(tokens)
    counts = np.fromiter(tokens.values(), dtype=np.int32, count=len(req_ids))
    if getattr(so, "scheduled_spec_decode_tokens", None):
        position = {r: i for i, r in enumerate(req_ids)}
        return req_ids, counts, np.fromiter(
            map(position.__getitem__, compat.v2_batch_order(runner, so)), dtype=np.int64,
            count=len(req_ids))
    decode = counts == runner.decode_query_len
    if decode.all():
        return req_ids, counts, None
    return req_ids, counts, np.argsort(np.where(decode, -1, counts), kind="stable")


LAST_SLOTS = "_cascade_last_slots"  # runner attribute: (request ids, their slots) last step


def _v2_slots(runner: Any, so: Any, req_ids: list[str]) -> np.ndarray:
    """The request-state slots of ``req_ids`` (read-only). A step with no request new,
    resumed (a new one in 0.34) or finished whose ids are the last step's, in its order (steady
    decode), has its slots: a list comparison instead of a dict lookup per row."""
    last = runner.__dict__.get(LAST_SLOTS)
    if last is not None and last[0] == req_ids and _steady(so):
        return last[1]
    index = np.fromiter(map(runner.req_states.req_id_to_index.__getitem__, req_ids),
                        dtype=np.int64, count=len(req_ids))
    index.flags.writeable = False
    runner.__dict__[LAST_SLOTS] = (req_ids, index)
    return index


def v2_plan(step: PendingStep) -> bool:
    runner, so = step.runner, step.scheduler_output
    tables = runner.block_tables
    group = kv_groups.planned_group(runner, tables.num_kv_cache_groups)
    if group is None:
        return False
    g, group_layers = group
    mirrors = tables.__dict__.get(MIRROR)
    if mirrors is None or mirrors is False:
        stats.record_fallback("no CPU block ids")
        return False
    mirror = mirrors[g]
    slot_of = runner.req_states.req_id_to_index
    if unshared_rows.unshared_again(runner, so, lambda req_id: int(mirror[slot_of[req_id], 0])):
        return False
    if session.held_flat(so.num_scheduled_tokens):
        return False
    req_ids, query_lens, order = v2_rows(runner, so)
    index = slots = _v2_slots(runner, so, req_ids)
    if order is not None:
        index, query_lens = index[order], query_lens[order]
    step.rows = index  # who the rows are: checked against idx_mapping when a builder takes it
    seq_lens = runner.req_states.num_computed_tokens_np[index] + query_lens
    if session.config is not None and session.config.debug:
        differs = mirror_differs(tables, g, mirror, index,
                                 -(-seq_lens // max(session.page_size, 1)))
        if differs is not None:
            tables.__dict__[MIRROR] = False  # never plan from it again
            stats.record_fallback(MIRROR_DIFFERS, differs)
            return False
    # The planner reads the rows of the mirror it needs (a copy of 256 rows x 2K pages would
    # take ~70 us).
    session.unshared = False
    cascade = plan_rows(mirror[index, 0], mirror, tables.num_blocks.np[g, index], seq_lens,
                        query_lens, lambda: row_keys.v2_rows(tables, index), index, group_layers)
    if session.unshared:  # the next steps may be known unshared without their rows
        unshared_rows.remember(runner, req_ids, mirror[slots, 0])
    return cascade


def _steady(so: Any) -> bool:
    """No request new, resumed (a new one in 0.34) or finished in the step."""
    cached = getattr(so, "scheduled_cached_reqs", None)
    return (getattr(so, "finished_req_ids", None) == set()
            and getattr(so, "scheduled_new_reqs", None) == []
            and not getattr(cached, "resumed_req_ids", None))


def v2_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    full_graph_arguments = [a for a in compat.V2_FULL_GRAPH_ARGUMENTS
                            if a in signature.parameters]

    def cascade_call(step: PendingStep | None, self: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> inspect.BoundArguments | None:
        """The call that matches no FULL decode graph, on a cascade step (planned here); None:
        vLLM's call as it came."""
        if (step is None or step.runner.cudagraph_manager is not self
                or not plan_once(step, v2_plan)):
            return None
        call = signature.bind(self, *args, **kwargs)
        # Neither a uniform token count nor a query-length bound: no FULL decode graph matches,
        # PIECEWISE ones still do.
        for name in full_graph_arguments:
            call.arguments[name] = None
        return call

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = hooks_step.pending
        call = guarded_call("CudaGraphManager.dispatch", step,
                            lambda: cascade_call(step, self, args, kwargs))
        if call is None:
            return original(self, *args, **kwargs)
        desc = original(*call.args, **call.kwargs)
        try:
            from vllm.config import CUDAGraphMode

            if desc.cg_mode == CUDAGraphMode.FULL:  # a FULL graph for any batch: eager instead
                desc = dataclasses.replace(desc, cg_mode=CUDAGraphMode.NONE,
                                           num_tokens=call.arguments["num_tokens"],
                                           num_reqs=call.arguments["num_reqs"])
        except Exception as exc:  # vLLM's choice stands, perhaps a FULL graph: run flat
            run_flat(step)
            failed("CudaGraphManager.dispatch", exc)
            return desc
        hooks_step.note_graph_mode(step, lambda: desc.cg_mode)
        record_padding(lambda: desc.num_tokens)
        return desc
    return wrapper
