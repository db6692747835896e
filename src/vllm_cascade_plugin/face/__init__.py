"""What the user runs: the ``vllm-cascade`` command (:mod:`.cli`), its environment report
(:mod:`.check`) and demo (:mod:`.demo`, :mod:`.demo_engine`), and the plugin-on vs. plugin-off
agreement rule that the demo, the engine tests and the soak share (:mod:`.agreement`).
"""
