"""The quantization pipeline: from a float model and data to the written quantized model.

``quantizer`` (:class:`ModelQuantizer`, the entry point), ``sequencer`` (the stage order, written
once), ``preflight``, ``prepare`` (the float graph rewrites), ``guard`` (the fidelity verdict on
the first calibration samples), ``repair`` (quantize again when the guard finds an output not
faithful) and ``report`` (the record of one quantization).
"""
