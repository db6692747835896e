"""Mixed prefill+decode steps in the FA3 executor: the decode rows as cascade, the rest flat.

Under serving a new request's prefill joins the running decodes every few steps. Such a step's
decode rows are planned alone (the planner's plan of the step with every row of several query
tokens as padding: :meth:`~vllm_cascade_plugin.step.StepSession.plan_step`), and the executor
runs the step in three parts, each layer:

1. one flat FlashAttention 3 call over all the step's queries with vLLM's own metadata, except
   that every decode row's KV length is 0: the rows of several query tokens attend as vLLM's
   flat path would, and a decode row reads nothing (FA3 writes it zeros, as for the rows vLLM
   pads its FULL graphs with);
2. the decode rows' queries gathered into a buffer of the executor's, which the decode rows'
   cascade runs on exactly as it runs a decode step: from its per-layer CUDA graph of their
   layout where the step is graphed (the buffer is static, so one graph serves every mixed
   step of that layout whatever the step's other rows), or launched eagerly;
3. their output scattered over the decode rows' zeros.

Torch only: the executor (:mod:`.fa3`) holds the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .common import upload


@dataclass(frozen=True)
class FlatRows:
    """What the flat call of a mixed step reads: vLLM's metadata of the step, with the decode
    rows' KV lengths 0, and where the decode rows' queries are."""

    query_start_loc: torch.Tensor  # int32 [rows + 1]: vLLM's, every row's queries
    seq_lens: torch.Tensor  # int32 [rows]: the KV lengths, 0 for every decode row
    block_table: torch.Tensor  # int32 [rows, pages]: vLLM's
    max_query_len: int
    max_seq_len: int
    decode_tokens: torch.Tensor  # int64 [decode rows]: their query positions, in batch order
    num_tokens: int  # the step's query tokens (rows of q and out the executor's run takes)

    @property
    def num_decode(self) -> int:
        return int(self.decode_tokens.shape[0])


def flat_rows(query_start_loc: torch.Tensor, block_table: torch.Tensor, max_query_len: int,
              max_seq_len: int, host_query_start_loc: np.ndarray, host_seq_lens: np.ndarray,
              decode: np.ndarray, device: torch.device) -> FlatRows:
    """A mixed step's :class:`FlatRows`: ``query_start_loc`` and ``block_table`` are vLLM's
    tensors of the step (rows past the batch's are padding without queries);
    ``host_query_start_loc`` and ``host_seq_lens`` the batch's rows on the host, ``decode``
    which of them are decode rows (one query token). Two small uploads that never wait."""
    rows = int(query_start_loc.shape[0]) - 1
    lens = np.zeros(rows, np.int32)
    n = len(host_seq_lens)
    lens[:n] = np.where(decode, 0, host_seq_lens)
    tokens = np.asarray(host_query_start_loc[:-1], np.int64)[decode]
    return FlatRows(query_start_loc=query_start_loc, seq_lens=upload(lens, np.int32, device),
                    block_table=block_table, max_query_len=int(max_query_len),
                    max_seq_len=int(max_seq_len),
                    decode_tokens=upload(tokens, np.int64, device),
                    num_tokens=int(host_query_start_loc[n]))


def run_flat(attention: Any, rows: FlatRows, q: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, out: torch.Tensor, sm_scale: float, softcap: float,
             sinks: torch.Tensor | None = None) -> None:
    """Part 1: every row flat into ``out``, decode rows reading no KV (zeros); ``sinks``: the
    layer's attention sinks, as vLLM passes them (``s_aux``)."""
    attention(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=rows.query_start_loc,
              max_seqlen_q=rows.max_query_len, seqused_k=rows.seq_lens,
              max_seqlen_k=rows.max_seq_len, softmax_scale=sm_scale, causal=True,
              window_size=[-1, -1], block_table=rows.block_table, softcap=softcap,
              return_softmax_lse=True, fa_version=3,
              **({} if sinks is None else {"s_aux": sinks}))


def gather(rows: FlatRows, q: torch.Tensor, into: torch.Tensor) -> None:
    """Part 2: the decode rows' queries into the first rows of ``into``."""
    torch.index_select(q, 0, rows.decode_tokens, out=into[:rows.num_decode])


def scatter(rows: FlatRows, decoded: torch.Tensor, out: torch.Tensor) -> None:
    """Part 3: the decode rows' output (the first rows of ``decoded``) into their rows of
    ``out``."""
    out.index_copy_(0, rows.decode_tokens, decoded[:rows.num_decode])
