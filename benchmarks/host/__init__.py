"""The plugin's host work per step, on the CPU. Entry points: ``planner`` (the planner's time
per step), ``step`` (the runner hooks' whole host work per step), ``step_compare`` (``step``
from two versions' source, side by side), ``step_toggle`` (steady decode continued, off and
on), ``row_identity`` (the check a builder makes before it takes a plan)."""
