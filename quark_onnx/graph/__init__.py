"""Graph helpers on ``onnx_ir`` shared by the passes, the planner and the stages.

``ir`` (values, constants, consumers, node edits), ``channels`` (per-channel views of weights) and
``patterns`` (the subgraphs the planner recognises: constants, Erf-based Gelu, LayerNorm).
"""
