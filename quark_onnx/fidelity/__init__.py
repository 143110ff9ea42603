"""Fidelity: does the quantized model still compute what the float model computes?

``compare`` (float vs quantized on data), ``paired_run`` (a model before and after a pass in one
session), ``verdict`` (the measures and the faithful / not faithful verdict) and ``guard`` (the
check on the first calibration samples during a quantization).
"""
