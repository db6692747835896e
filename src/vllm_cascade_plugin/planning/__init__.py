"""Planning: one engine step's block tables in, a cascade plan and its cost out.

numpy and the standard library, numba for the runner hooks' pre-checks (:mod:`.compiled`, numpy
where numba is missing); no torch, vLLM or FlashInfer (``tests/planning`` holds it to that): the
prefix trie (:mod:`.trie`), the plan (:mod:`.plan`) and how the planner finds it (:mod:`.planner`,
:mod:`.layout`, :mod:`.memory`), the plan's contract check (:mod:`.invariants`), the cost model
that picks cascade or flat (:mod:`.cost`) and the bucketed layout a graphed decode step is keyed
by (:mod:`.graph_layout`).
"""
