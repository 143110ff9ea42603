"""The quantization plan: what gets quantized, how, and which positions are tied together.

``build`` (:func:`build_plan` walks the graph), ``types`` (the plan's data) and ``masks``
(saturating, mask-like tensors whose range a constant sets).
"""
