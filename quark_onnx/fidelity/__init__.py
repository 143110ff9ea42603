"""Fidelity: does the quantized model still compute what the float model computes?

``compare`` (float vs quantized on data, per output and per layer), ``paired_run`` (a model
before and after a pass in one session) and ``verdict`` (the measures and the faithful / not
faithful verdict). The pipeline's guard and repair (:mod:`quark_onnx.pipeline`) use them.
"""
