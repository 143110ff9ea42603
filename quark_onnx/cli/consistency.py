"""Does one calibration source fit every model of a batch?

A batch quantized without a manifest calibrates every model on the same data with the same
pre-processing. A model that needs another normalisation is then calibrated, and judged, on
inputs it was not trained for, and nothing fails: the verdict compares float and quantized on the
same wrong inputs. Two signs of it, each named per model after the batch
(:func:`batch_warnings`):

* what the models declare about their input differs: the layout of the image input (channels
  first or last) or ONNX's image metadata (``Image.BitmapPixelFormat``,
  ``Image.NominalPixelRange``, ``Image.ColorSpaceGamma``);
* the float model's outputs are out of distribution on the calibration data: a classifier whose
  float top-1 confidence collapses where the batch's other classifiers stay confident
  (:func:`float_confidence`, measured on the verdict's held-out samples).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: ONNX's image metadata (``metadata_props``) that says how the input was normalised.
IMAGE_METADATA = ("Image.BitmapPixelFormat", "Image.NominalPixelRange", "Image.ColorSpaceGamma")

#: A classifier is out of distribution when its float confidence above chance is below this
#: share of the median of the batch's other classifiers (the issue's SqueezeNet on
#: wrongly-normalised images: near chance, where its peers stay near 1).
CONFIDENCE_COLLAPSE = 0.5


def declared_input(model: str | Path) -> dict[str, str]:
    """What ``model`` declares about its input: ``layout`` (``NCHW``/``NHWC`` for a 4-D input
    with 1 or 3 channels on one side only) and the :data:`IMAGE_METADATA` it holds."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    declared = {p.key: p.value for p in proto.metadata_props if p.key in IMAGE_METADATA}
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in initializers]
    if len(inputs) == 1:
        dims = [d.dim_value if d.HasField("dim_value") else None for d in _dims(inputs[0])]
        if len(dims) == 4:
            first, last = dims[1] in (1, 3), dims[3] in (1, 3)
            if first != last:
                declared["layout"] = "NCHW" if first else "NHWC"
    return declared


def _dims(value: Any) -> Iterable[Any]:
    return value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else ()


def float_confidence(model: str | Path, feeds: Sequence[dict[str, np.ndarray]]) -> float | None:
    """The float model's mean top-1 confidence above chance on ``feeds``, of its first output
    when that is a score vector ``[N, C]`` (C >= 2): 0 is chance (``1 / C``), 1 certainty.
    Scores that are not probabilities are read through a softmax. None for other outputs."""
    from quark_onnx.runtime.sessions import create_session

    if not feeds:
        return None
    session = create_session(str(model), purpose="float confidence")
    first = session.get_outputs()[0].name
    rows = []
    for feed in feeds:
        (scores,) = session.run([first], feed)
        scores = np.asarray(scores, dtype=np.float64)
        if scores.ndim != 2 or scores.shape[1] < 2:
            return None
        rows.append(scores)
    scores = np.concatenate(rows)
    probabilities = (scores >= 0).all() and np.allclose(scores.sum(axis=1), 1.0, atol=1e-3)
    if not probabilities:
        shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
        scores = shifted / shifted.sum(axis=1, keepdims=True)
    chance = 1.0 / scores.shape[1]
    return float((scores.max(axis=1).mean() - chance) / (1.0 - chance))


def batch_warnings(outcomes: Sequence[Any]) -> list[str]:
    """One sentence per model that seems to need other pre-processing than the batch's others
    (outcomes of models quantized on one calibration source; see the module docstring)."""
    done = [o for o in outcomes if o.ok]
    warnings = []
    declared = [o for o in done if o.declared_input]
    for key in ("layout", *IMAGE_METADATA):
        values = [(o, o.declared_input[key]) for o in declared if key in o.declared_input]
        if len({v for _, v in values}) < 2:
            continue
        common = statistics.mode([v for _, v in values])
        for o, value in values:
            if value != common:
                warnings.append(
                    f"{o.name}: its input declares {key} {value} where the batch's other models "
                    f"declare {common}, and every model was calibrated with the same "
                    "pre-processing; give each model its own in a --manifest"
                )
    scored = [o for o in done if o.float_confidence is not None]
    for o in scored if len(scored) > 1 else []:
        others = statistics.median(p.float_confidence for p in scored if p is not o)
        if o.float_confidence < CONFIDENCE_COLLAPSE * others:
            warnings.append(
                f"{o.name}: the float model is out of distribution on the calibration data: its "
                f"top-1 confidence above chance is {o.float_confidence:.2f} where the batch's "
                f"other classifiers reach {others:.2f}; it probably needs another normalisation "
                "than the batch's --preprocess: give each model its own in a --manifest"
            )
    return warnings
