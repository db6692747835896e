"""The kernel benchmark's grid and page layouts (``kernels/bench.py``): the shape, the rows, the
bandwidth/compute floor and each row's KV pages. numpy only, no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAGE = 16
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE_BYTES = 2  # bf16
NUM_LAYERS = 32  # Llama-3-8B: the plugin's per-step cost is spread over them
HBM_BYTES_PER_S = 4.3e12  # H200 HBM3e, achievable
PEAK_FLOPS = 790e12  # H200 dense bf16 tensor cores, achievable
TOLERANCE = 2e-2
WORKSPACE_BYTES = 394 * 1024 * 1024  # vLLM 0.26's VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE
METHODS = ("plugin", "fi_decode", "fi_cascade", "fa3_decode", "fa3_cascade")
TIMED = ("fi_decode", "plugin_cascade", "plugin_cascade_fa3", "fi_cascade", "fa3_decode",
         "fa3_cascade")
# The plugin's two executors (CASCADE_KERNEL): their timing columns.
EXECUTOR_COLUMNS = {"flashinfer": "plugin_cascade", "fa3": "plugin_cascade_fa3"}

GRID_B = (8, 32, 64, 128, 256)
GRID_P = (512, 2048, 8192, 32768)
GRID_S = 128
GROUP_ROWS = ((256, 8192, 4), (256, 8192, 16))  # (B, P, groups)


# ----------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Case:
    B: int  # requests (= query tokens)
    P: int  # shared prefix tokens per group
    S: int = GRID_S  # own tokens per request
    groups: int = 1

    def __post_init__(self) -> None:
        if self.B < 1 or self.P < PAGE or self.S < 1 or self.groups < 1:
            raise ValueError(f"{self}: need B >= 1, P >= {PAGE}, S >= 1, groups >= 1")
        if self.P % PAGE:
            raise ValueError(f"{self}: P must be whole pages of {PAGE} (FA3's cascade asserts it)")
        if self.B % self.groups or self.B // self.groups < 2:
            raise ValueError(f"{self}: groups must divide B into groups of >= 2 requests")

    @property
    def label(self) -> str:
        return f"B={self.B} P={self.P} S={self.S} G={self.groups}"


def grid() -> list[Case]:
    """The issue's grid: B x P at S = 128, one group; plus 4 and 16 groups at P = 8192, B = 256."""
    return [Case(b, p) for p in GRID_P for b in GRID_B] + [
        Case(b, p, GRID_S, g) for b, p, g in GROUP_ROWS]


QUICK = (Case(8, 512), Case(256, 8192), Case(256, 8192, GRID_S, 4))


def parse_rows(text: str) -> list[Case]:
    """``"256x8192,256x8192x4,8x512x1x64"``: B x P [x groups [x S]] per row, S default 128."""
    cases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            numbers = [int(n) for n in item.lower().split("x")]
        except ValueError:
            raise ValueError(f"row {item!r}: expected BxP[xGROUPS[xS]]") from None
        if not 2 <= len(numbers) <= 4:
            raise ValueError(f"row {item!r}: expected BxP[xGROUPS[xS]]")
        b, p, *rest = numbers
        groups = rest[0] if rest else 1
        s = rest[1] if len(rest) > 1 else GRID_S
        cases.append(Case(b, p, s, groups))
    if not cases:
        raise ValueError("no rows given")
    return cases


def unique_kv_bytes(case: Case) -> int:
    """KV bytes a step must read at least: each group's prefix once, each request's own tokens."""
    tokens = case.groups * case.P + case.B * case.S
    return tokens * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE_BYTES  # K and V


def attention_flops(case: Case) -> int:
    """QK^T and PV: 2 * 2 * head_dim FLOPs per query head and key token."""
    return 4 * case.B * NUM_QO_HEADS * HEAD_DIM * (case.P + case.S)


def floor_ms(case: Case) -> float:
    """max(unique KV bytes / 4.3 TB/s, attention FLOPs / 790 TFLOP/s), in ms."""
    return 1e3 * max(unique_kv_bytes(case) / HBM_BYTES_PER_S, attention_flops(case) / PEAK_FLOPS)


# ---------------------------------------------------------------------------- page layout


@dataclass(frozen=True)
class PagedLevel:
    """One level in FlashInfer's paged format (int32 numpy arrays)."""

    qo_indptr: np.ndarray  # [G + 1]
    kv_page_indptr: np.ndarray  # [G + 1]
    kv_page_indices: np.ndarray  # [nnz]
    kv_last_page_len: np.ndarray  # [G]


@dataclass(frozen=True)
class Layout:
    """A case's pages: ``block_table[r]`` = its group's prefix pages, then its own pages."""

    case: Case
    block_table: np.ndarray  # int32 [B, P/PAGE + ceil(S/PAGE)]
    seq_lens: np.ndarray  # int32 [B], all P + S
    prefix_pages: np.ndarray  # int32 [groups, P/PAGE]
    own_pages: np.ndarray  # int32 [B, ceil(S/PAGE)]
    num_blocks: int  # pages in the cache; ids are in 1..num_blocks-1

    @property
    def group_size(self) -> int:
        return self.case.B // self.case.groups

    def group_rows(self, g: int) -> slice:
        return slice(g * self.group_size, (g + 1) * self.group_size)

    def _last_page_len(self, tokens: int, n: int) -> np.ndarray:
        return np.full(n, tokens - PAGE * (-(-tokens // PAGE) - 1), np.int32)

    def flat(self) -> PagedLevel:
        """Every request over its full page list (one query each): the decode kernels' input."""
        b, width = self.block_table.shape
        return PagedLevel(
            qo_indptr=np.arange(b + 1, dtype=np.int32),
            kv_page_indptr=(np.arange(b + 1) * width).astype(np.int32),
            kv_page_indices=self.block_table.reshape(-1).copy(),
            kv_last_page_len=self._last_page_len(self.case.P + self.case.S, b),
        )

    def cascade(self) -> tuple[PagedLevel, PagedLevel]:
        """The two cascade levels: each group's prefix (non-causal), each request's own pages."""
        c = self.case
        prefix_width, own_width = self.prefix_pages.shape[1], self.own_pages.shape[1]
        shared = PagedLevel(
            qo_indptr=(np.arange(c.groups + 1) * self.group_size).astype(np.int32),
            kv_page_indptr=(np.arange(c.groups + 1) * prefix_width).astype(np.int32),
            kv_page_indices=self.prefix_pages.reshape(-1).copy(),
            kv_last_page_len=np.full(c.groups, PAGE, np.int32),
        )
        own = PagedLevel(
            qo_indptr=np.arange(c.B + 1, dtype=np.int32),
            kv_page_indptr=(np.arange(c.B + 1) * own_width).astype(np.int32),
            kv_page_indices=self.own_pages.reshape(-1).copy(),
            kv_last_page_len=self._last_page_len(c.S, c.B),
        )
        return shared, own


def build_layout(case: Case, rng: np.random.Generator, pool_pages: int = 0) -> Layout:
    """Distinct random page ids (never block 0, vLLM's null block) over a pool of
    ``max(pool_pages, pages needed + 1)`` pages, groups contiguous in batch order."""
    prefix_width, own_width = case.P // PAGE, -(-case.S // PAGE)
    needed = case.groups * prefix_width + case.B * own_width
    num_blocks = max(pool_pages, needed + 1)
    ids = (rng.permutation(num_blocks - 1)[:needed] + 1).astype(np.int32)
    prefix = ids[: case.groups * prefix_width].reshape(case.groups, prefix_width)
    own = ids[case.groups * prefix_width :].reshape(case.B, own_width)
    group_of = np.arange(case.B) // (case.B // case.groups)
    return Layout(
        case=case,
        block_table=np.ascontiguousarray(np.concatenate([prefix[group_of], own], axis=1)),
        seq_lens=np.full(case.B, case.P + case.S, np.int32),
        prefix_pages=prefix,
        own_pages=own,
        num_blocks=num_blocks,
    )
