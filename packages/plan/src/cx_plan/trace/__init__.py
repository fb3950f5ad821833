"""The model as the planner sees it: its shape and parameter counts, and FakeTensor traces of its steps."""
