"""Per-channel views of convolution weights and of activations (axis 1).

Shared by the passes that rescale or fold channels (CrossLayerEqualization,
EqualizeGatedActivations, FoldConstantChannels): the range of each output or input channel of a
(grouped) conv weight, the grouped weight layout, the channel count of a value, and per-channel
statistics of activations measured on sample inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import constant_array


@dataclasses.dataclass(frozen=True)
class ChannelStats:
    """Per-channel (axis 1) statistics of one tensor over sample inputs."""

    max_abs: np.ndarray
    mean_square: np.ndarray
    #: share of the values that are not 0 (a Relu's zeros carry no rounding error)
    nonzero: np.ndarray


def channel_statistics(
    model: ir.Model,
    feeds: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
    names: Sequence[str],
) -> dict[str, ChannelStats]:
    """:class:`ChannelStats` of the named values of ``model`` over ``feeds`` (one feed or
    several, one onnxruntime session, CPU, graph optimisations off); values of rank < 2 or empty
    are left out."""
    from quark_onnx.runtime import sessions

    names = list(names)
    session = sessions.create_session(
        model, purpose="channel_statistics", edit=lambda p: sessions.add_outputs(p, names)
    )
    batches = [feeds] if isinstance(feeds, Mapping) else list(feeds)
    max_abs: dict[str, np.ndarray] = {}
    square: dict[str, np.ndarray] = {}
    nonzero: dict[str, np.ndarray] = {}
    count: dict[str, int] = {}
    for feed in batches:
        for name, array in zip(names, session.run(names, dict(feed)), strict=True):
            if array.ndim < 2 or not array.size:
                continue
            flat = np.moveaxis(array.astype(np.float64), 1, 0).reshape(array.shape[1], -1)
            peak = np.abs(flat).max(axis=1)
            if name in max_abs:
                max_abs[name] = np.maximum(max_abs[name], peak)
                square[name] += np.square(flat).sum(axis=1)
                nonzero[name] += (flat != 0).sum(axis=1)
                count[name] += flat.shape[1]
            else:
                max_abs[name] = peak
                square[name] = np.square(flat).sum(axis=1)
                nonzero[name] = (flat != 0).sum(axis=1).astype(np.float64)
                count[name] = flat.shape[1]
    return {
        name: ChannelStats(max_abs[name], square[name] / count[name], nonzero[name] / count[name])
        for name in max_abs
    }


def output_channel_ranges(weight: np.ndarray) -> np.ndarray:
    """``r_c = max |W[c, ...]|`` for each output channel ``c`` (axis 0) of a conv weight."""
    return np.abs(weight.reshape(weight.shape[0], -1)).max(axis=1)


def input_channel_ranges(weight: np.ndarray, group: int) -> np.ndarray:
    """``r_i`` = largest ``|w|`` of a (grouped) conv weight ``C_out x C_in/g x k...`` reading input
    channel ``i``; length ``C_in = g * (C_in / g)``."""
    return np.abs(_grouped_view(weight, group)).max(axis=(1, 3)).reshape(-1)


def channel_range_spread(weight: np.ndarray) -> float:
    """``max_c r_c / min_c r_c`` over the non-zero output-channel ranges (1.0 if none)."""
    ranges = output_channel_ranges(weight)
    ranges = ranges[ranges > 0]
    if ranges.size == 0:
        return 1.0
    return float(ranges.max() / ranges.min())


def _grouped_view(weight: np.ndarray, group: int) -> np.ndarray:
    """``W`` viewed as ``(g, C_out/g, cpg, K)``, ``cpg = C_in/g``.

    Input channel ``i`` is the slice ``[i // cpg, :, i % cpg, :]``.
    """
    c_out, cpg = weight.shape[0], weight.shape[1]
    return weight.reshape(group, c_out // group, cpg, -1)


#: Ops whose output has the channels of their input 0 (what :func:`value_channels` walks back
#: through when a value carries no shape, e.g. a model not run through shape inference).
_SAME_CHANNELS = frozenset(
    {
        "Relu", "LeakyRelu", "PRelu", "Clip", "Identity", "Dropout", "MaxPool", "AveragePool",
        "GlobalAveragePool", "GlobalMaxPool", "Pad", "BatchNormalization", "Sigmoid",
        "HardSigmoid", "HardSwish",
    }
)  # fmt: skip


def value_channels(value: ir.Value, depth: int = 0) -> int | None:
    """Channels (axis 1) of ``value``: its recorded shape, else found from its producer (a Conv's
    constant weight, a channel Concat's inputs, or input 0 of a per-channel op); None if
    unknown."""
    shape = value.shape
    if shape is not None and len(shape) >= 2 and isinstance(shape[1], int):
        return shape[1]
    producer = value.producer()
    if producer is None or depth > 64 or producer.domain not in ("", "ai.onnx"):
        return None
    op = producer.op_type
    if op in ("Conv", "ConvTranspose") and len(producer.inputs) > 1 and producer.inputs[1]:
        weight = constant_array(producer.inputs[1])
        if weight is None or weight.ndim < 3:
            return None
        if op == "Conv":
            return int(weight.shape[0])
        return int(weight.shape[1]) * producer.attributes.get_int("group", 1)
    if op == "Concat" and producer.attributes.get_int("axis", 0) == 1:
        counts = [value_channels(v, depth + 1) if v is not None else None for v in producer.inputs]
        return None if any(c is None for c in counts) else sum(counts)  # type: ignore[misc]
    if op in _SAME_CHANNELS and producer.inputs and producer.inputs[0] is not None:
        return value_channels(producer.inputs[0], depth + 1)
    return None
