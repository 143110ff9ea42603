"""Quantization parameters: from a plan and calibration to scales and zero points.

``qparams`` (the :class:`QuantParams` record and its numpy arithmetic), ``pof2`` (the one
power-of-two arithmetic), ``pof2_params`` (XINT8 positions from calibration), ``solver`` and
``verify`` (positions moved until every NPU rule holds, and the rules recomputed) and
``strategy`` (the float-scale strategies: static, weight-only, dynamic).
"""
