"""A YOLOv8-style detector from ``onnx.helper`` and numpy: issue 34's acceptance model.

The architecture follows Ultralytics YOLOv8n, scaled by ``width`` (16 = YOLOv8n's channels):

* backbone: Conv(3x3, s2)-BN-SiLU stem, Conv s2, C2f blocks (1x1 Conv -> Split in two ->
  bottlenecks of two 3x3 Conv-BN-SiLU with a residual Add -> Concat -> 1x1 Conv) and an SPPF
  (three 5x5 MaxPools, Concat);
* neck: a PAN/FPN of nearest x2 Resize upsamples, Concats, C2f blocks and stride-2 Convs;
* head per stride (8, 16, 32): a box branch ending in 4 * 16 DFL logits and a class branch
  ending in ``num_classes`` logits (two 3x3 Conv-BN-SiLU then a 1x1 Conv with bias each);
* decode, as the Ultralytics export writes it: the three scales reshaped and joined to
  ``[1, 64 + nc, A]``, Split into box and class logits; DFL (Reshape ``[1, 4, 16, A]``,
  Transpose, Softmax over the 16 bins, a 1x1 Conv with the fixed weights 0..15); dist2bbox
  (``anchor -/+ distance``, centre and size) times the stride tensor, so boxes are
  ``cx, cy, w, h`` in input pixels; Sigmoid class scores; ``output0 = Concat([boxes, scores], 1)``
  of shape ``[1, 4 + nc, A]`` with ``A = (s/8)^2 + (s/16)^2 + (s/32)^2``.

SiLU is written ``x * Sigmoid(x)`` and BatchNormalization stays unfused, as exports write them
(the quantizer folds BN itself). ``unsimplified=True`` writes what a torch export without
onnxsim keeps: every Reshape's shape computed by ``Shape -> Gather -> Unsqueeze -> Concat`` on
int64, the upsample sizes by ``Shape -> Slice -> Cast(float) -> Mul -> Cast(int64)`` (float
tensors that only feed shapes), the anchors and strides by ``Range``/``Expand``/
``ConstantOfShape`` on the feature maps' shapes, and shape constants as ``Constant`` nodes. Both
builds compute the same outputs.

Weights (why they look trained): a seeded numpy He-normal initialisation gives random features
whose ranges drift layer by layer; a trained network's BN instead leaves every channel near a
fixed mean and scale. So the BN statistics are set from data: the network is first built with
every BatchNormalization replaced by a *batch* normalization (ReduceMean over N, H, W) that
exposes its batch mean and variance, and run once (onnxruntime) on 16 synthetic images (seed
``10_000 + seed``); those means and variances become the BN running statistics, so on those
images every BN output channel has mean ``beta`` and standard deviation ``gamma``, with ``gamma``
log-uniform in [0.2, 1] (a 5x channel-to-channel scale variation, as trained BN shows) and
``beta ~ N(1, 0.5)``. SiLU outputs then reach about 5 (median layer) to 13 (widest) at most, 7
standard deviations. Why not wider: a random deep network with BN gammas up to 3 is chaotic
(measured: rounding only the weights to int8 per channel, activations float, kept under half of
its detections) where a trained one is not, and with gammas up to 1 and a positive ``beta`` mean
(most SiLUs near their linear part) the same rounding keeps about 90 %. The stem's filters have
zero mean per input channel (edge detectors, as trained first layers are), so whole images do not
scale every deep activation up or down together.

The head's last Convs are set the same way: their weights lose the components a trained head
ignores (the top principal directions of the per-image mean features, background and brightness,
and of the per-position mean features, the zero padding at the borders); their outputs on the
initialisation images are normalised per channel to ``z`` (mean 0, std 1). The class logits are
``2 z + prior_c + b``: class priors falling linearly by 12 from class 0 to class 79 (a few classes
dominate, as on any real data set, and the best class of a detection stands clear of the
second) and one strongly negative ``b`` per scale (a trained detector's negative prior) that
lets 2 % of the anchors score >= 0.25 on the initialisation images. The DFL logits are ``1.5 z``
plus a bump over the bins (peak 3, 2 and 1.3 for strides 8, 16, 32) so box sizes vary around a
third of the image. The result on held-out synthetic images: 3-40 detections per 160 x 160 image
after NMS (about 15 on average, 25 classes seen), boxes of 35-100 pixels, scores 0.25-0.95.

``synthetic_images`` draws the structured images used here and by the tests: rectangles and
ellipses of random colours on noisy gradient backgrounds; calibration and held-out sets come from
the same distribution with different seeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

REG_MAX = 16
STRIDES = (8, 16, 32)
OPSET = 17
BN_EPS = 1e-3  # Ultralytics' BatchNorm2d eps
INIT_IMAGES = 16
INIT_SEED_OFFSET = 10_000
GAMMA_RANGE = (0.2, 1.0)
BETA_MEAN, BETA_STD = 1.0, 0.5
CLS_SCALE = 2.0
CLASS_PRIOR_SPREAD = 12.0  # class c's logit prior is -spread * c / (nc - 1)
DETECTION_RATE = 0.02  # share of anchors scoring >= 0.25 on the initialisation images
BOX_SCALE = 1.5
BOX_PEAK = {8: 3.0, 16: 2.0, 32: 1.3}  # DFL bin where each scale's distances centre
BOX_PEAK_WIDTH = 2.5
ZERO_DC_STEM = True  # stem filters see edges, not the mean colour
GLOBAL_DIRECTIONS = 8  # per-image directions removed from the heads' last Convs
POSITION_DIRECTIONS = 4  # per-position directions (border padding) removed from them


class _Graph:
    """Collects nodes and initializers; ``stats`` mode builds the BN-statistics network.

    In ``stats`` mode each BN is a batch normalization that exposes its mean and variance and the
    head's last Convs expose their input features; in ``infer`` mode the numbers measured in
    ``stats`` mode (``measured``) set the BN running statistics and the head's last Convs. The
    random weights are drawn in the same order in both modes, so both see the same network.
    """

    def __init__(
        self,
        seed: int,
        stats_mode: bool,
        measured: dict[str, tuple[np.ndarray, ...]] | None = None,
        unsimplified: bool = False,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.stats_mode = stats_mode
        self.measured = measured or {}
        self.unsimplified = unsimplified
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.probes: dict[str, list[str]] = {}  # stats mode: key -> tensors to read
        self._names: dict[str, int] = {}

    def _unique(self, name: str) -> str:
        count = self._names.get(name, 0)
        self._names[name] = count + 1
        return name if count == 0 else f"{name}_{count}"

    def node_n(
        self, op: str, inputs: Sequence[str], scope: str, outputs: int, **attrs
    ) -> list[str]:
        """Add one node named like a torch export's (``/scope/Op``); its output names."""
        name = self._unique(f"{scope}/{op}")
        outs = [f"{name}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=name, **attrs))
        return outs

    def node(self, op: str, inputs: Sequence[str], scope: str, **attrs) -> str:
        """A one-output node (see ``node_n``); its output name."""
        return self.node_n(op, inputs, scope, 1, **attrs)[0]

    def weight(self, name: str, value: np.ndarray) -> str:
        """A float initializer (weights, BN parameters)."""
        self.initializers.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def const(self, value: np.ndarray, scope: str) -> str:
        """A shape or decode constant: an initializer, or a Constant node when unsimplified."""
        value = np.asarray(value)
        if self.unsimplified:
            return self.node("Constant", [], scope, value=numpy_helper.from_array(value))
        name = self._unique(f"{scope}/const")
        self.initializers.append(numpy_helper.from_array(value, name))
        return name


# -- blocks ----------------------------------------------------------------------------------


def conv_bn_silu(g: _Graph, x: str, cin: int, cout: int, k: int, s: int, scope: str) -> str:
    """Conv (no bias) -> BatchNormalization -> SiLU as ``x * Sigmoid(x)``, YOLOv8's ``Conv``."""
    fan_in = cin * k * k
    w = g.rng.standard_normal((cout, cin, k, k)) * math.sqrt(2.0 / fan_in)
    if ZERO_DC_STEM and cin == 3:
        w -= w.mean(axis=(2, 3), keepdims=True)
    gamma = np.exp(g.rng.uniform(math.log(GAMMA_RANGE[0]), math.log(GAMMA_RANGE[1]), cout))
    beta = g.rng.normal(BETA_MEAN, BETA_STD, cout)
    y = g.node(
        "Conv",
        [x, g.weight(f"{scope}.conv.weight", w)],
        f"{scope}/conv",
        kernel_shape=[k, k],
        strides=[s, s],
        pads=[k // 2] * 4,
    )
    if g.stats_mode:
        y = _batch_norm(g, y, gamma, beta, scope)
    else:
        mean, var = g.measured[scope]
        y = g.node(
            "BatchNormalization",
            [
                y,
                g.weight(f"{scope}.bn.weight", gamma),
                g.weight(f"{scope}.bn.bias", beta),
                g.weight(f"{scope}.bn.running_mean", mean),
                g.weight(f"{scope}.bn.running_var", var),
            ],
            f"{scope}/bn",
            epsilon=BN_EPS,
        )
    return g.node("Mul", [y, g.node("Sigmoid", [y], f"{scope}/act")], f"{scope}/act")


def _batch_norm(g: _Graph, x: str, gamma: np.ndarray, beta: np.ndarray, scope: str) -> str:
    """Training-mode BN over (N, H, W) that exposes its batch mean and variance (stats mode)."""
    mean = g.node("ReduceMean", [x], f"{scope}/bn", axes=[0, 2, 3], keepdims=1)
    centred = g.node("Sub", [x, mean], f"{scope}/bn")
    var = g.node(
        "ReduceMean", [g.node("Mul", [centred, centred], f"{scope}/bn")], f"{scope}/bn",
        axes=[0, 2, 3], keepdims=1,
    )  # fmt: skip
    std = g.node("Sqrt", [g.node("Add", [var, g.weight(f"{scope}.eps", BN_EPS)], scope)], scope)
    shape = (1, -1, 1, 1)
    y = g.node("Div", [centred, std], f"{scope}/bn")
    y = g.node("Mul", [y, g.weight(f"{scope}.gamma", gamma.reshape(shape))], f"{scope}/bn")
    y = g.node("Add", [y, g.weight(f"{scope}.beta", beta.reshape(shape))], f"{scope}/bn")
    g.probes[scope] = [mean, var]
    return y


def bottleneck(g: _Graph, x: str, c: int, shortcut: bool, scope: str) -> str:
    """Two 3x3 Conv-BN-SiLU, plus the input when ``shortcut`` (YOLOv8's ``Bottleneck``, e=1)."""
    y = conv_bn_silu(g, x, c, c, 3, 1, f"{scope}/cv1")
    y = conv_bn_silu(g, y, c, c, 3, 1, f"{scope}/cv2")
    return g.node("Add", [x, y], scope) if shortcut else y


def c2f(g: _Graph, x: str, cin: int, cout: int, n: int, shortcut: bool, scope: str) -> str:
    """1x1 Conv -> Split in two halves -> n bottlenecks on the last half -> Concat -> 1x1 Conv."""
    c = cout // 2
    y = conv_bn_silu(g, x, cin, 2 * c, 1, 1, f"{scope}/cv1")
    parts = g.node_n("Split", [y, g.const(np.array([c, c], np.int64), scope)], scope, 2, axis=1)
    for i in range(n):
        parts.append(bottleneck(g, parts[-1], c, shortcut, f"{scope}/m.{i}"))
    y = g.node("Concat", parts, scope, axis=1)
    return conv_bn_silu(g, y, (2 + n) * c, cout, 1, 1, f"{scope}/cv2")


def sppf(g: _Graph, x: str, cin: int, cout: int, scope: str) -> str:
    """1x1 Conv -> three chained 5x5 stride-1 MaxPools -> Concat of all four -> 1x1 Conv."""
    c = cin // 2
    y = conv_bn_silu(g, x, cin, c, 1, 1, f"{scope}/cv1")
    parts = [y]
    for _ in range(3):
        parts.append(
            g.node("MaxPool", [parts[-1]], f"{scope}/m", kernel_shape=[5, 5], pads=[2] * 4)
        )
    return conv_bn_silu(
        g, g.node("Concat", parts, scope, axis=1), 4 * c, cout, 1, 1, f"{scope}/cv2"
    )


def upsample(g: _Graph, x: str, scope: str) -> str:
    """Nearest x2 Resize; unsimplified, its sizes come from the input's shape through float."""
    attrs = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
             "nearest_mode": "floor"}  # fmt: skip
    if not g.unsimplified:
        scales = g.const(np.array([1, 1, 2, 2], np.float32), scope)
        return g.node("Resize", [x, "", scales], scope, **attrs)
    shape = g.node("Shape", [x], scope)
    hw = g.node(
        "Slice",
        [shape, g.const(np.array([2], np.int64), scope), g.const(np.array([4], np.int64), scope)],
        scope,
    )
    hw = g.node("Cast", [hw], scope, to=TensorProto.FLOAT)
    hw = g.node("Mul", [hw, g.const(np.array([2, 2], np.float32), scope)], scope)
    hw = g.node("Cast", [g.node("Floor", [hw], scope)], scope, to=TensorProto.INT64)
    nc = g.node(
        "Slice",
        [shape, g.const(np.array([0], np.int64), scope), g.const(np.array([2], np.int64), scope)],
        scope,
    )
    sizes = g.node("Concat", [nc, hw], scope, axis=0)
    return g.node("Resize", [x, "", "", sizes], scope, **attrs)


def _nuisance_projector(features: np.ndarray) -> np.ndarray:
    """Projector ``[cin, cin]`` onto the feature directions a trained head ignores.

    Those are the top principal directions of the per-image mean features (whole images
    differing: background colour, brightness) and of the per-position mean features (where the
    anchor sits rather than what it sees: zero padding at the borders).
    """
    image_means = features.mean(axis=(2, 3))  # [N, cin]
    position_means = features.mean(axis=0).reshape(features.shape[1], -1).T  # [HW, cin]
    directions = []
    for means, k in ((image_means, GLOBAL_DIRECTIONS), (position_means, POSITION_DIRECTIONS)):
        _, _, vt = np.linalg.svd(means - means.mean(axis=0), full_matrices=False)
        directions.append(vt[:k])
    q, _ = np.linalg.qr(np.concatenate(directions).T)  # orthonormal basis [cin, k]
    return q @ q.T


def head_conv(
    g: _Graph, x: str, cin: int, cout: int, scale: float, bias: np.ndarray | None, scope: str
) -> str:
    """The head's last 1x1 Conv with bias: logits ``scale * z + bias``, z its normalised output.

    In stats mode the Conv's input features are probed; in infer mode the He-initialised weights
    lose their components along the directions in which whole images differ (the top principal
    directions of the per-image mean features: background colour, brightness), so the logits
    follow local content rather than moving whole images, and are rescaled per channel to
    ``scale * z + bias`` on the initialisation images. ``bias=None`` (the class head) sets one
    bias for all classes so that ``DETECTION_RATE`` of the anchors reach a score of 0.25 there.
    """
    w = g.rng.standard_normal((cout, cin)) * math.sqrt(1.0 / cin)
    if g.stats_mode:
        g.probes[scope] = [x]
        return g.node("Conv", [x, g.weight(f"{scope}.weight", w[:, :, None, None])], scope,
                      kernel_shape=[1, 1])  # fmt: skip
    (features,) = g.measured[scope]  # [N, cin, H, W]
    w = w - w @ _nuisance_projector(features)
    raw = np.einsum("oc,nchw->nohw", w, features)
    mean, std = raw.mean(axis=(0, 2, 3)), raw.std(axis=(0, 2, 3)) + 1e-6
    if bias is None:  # class priors; the best class at the wanted quantile sits at logit(0.25)
        prior = -CLASS_PRIOR_SPREAD * np.arange(cout) / max(cout - 1, 1)
        z = (raw - mean[None, :, None, None]) / std[None, :, None, None]
        best = (scale * z + prior[None, :, None, None]).max(axis=1)
        threshold = float(np.quantile(best, 1.0 - DETECTION_RATE))
        bias = math.log(0.25 / 0.75) - threshold + prior
    w = w * (scale / std)[:, None]
    b = bias - scale * mean / std
    return g.node(
        "Conv",
        [x, g.weight(f"{scope}.weight", w[:, :, None, None]), g.weight(f"{scope}.bias", b)],
        scope,
        kernel_shape=[1, 1],
    )


def head(
    g: _Graph, x: str, cin: int, num_classes: int, stride: int, scope: str, c2: int, c3: int
) -> tuple[str, str]:
    """One scale's box branch (-> 4 * REG_MAX DFL logits) and class branch (-> class logits)."""
    box = conv_bn_silu(g, x, cin, c2, 3, 1, f"{scope}/cv2.0")
    box = conv_bn_silu(g, box, c2, c2, 3, 1, f"{scope}/cv2.1")
    bins = np.arange(REG_MAX, dtype=np.float64)
    bump = -2.0 * ((bins - BOX_PEAK[stride]) / BOX_PEAK_WIDTH) ** 2  # a peaked prior over bins
    box = head_conv(g, box, c2, 4 * REG_MAX, BOX_SCALE, np.tile(bump, 4), f"{scope}/cv2.2")
    cls = conv_bn_silu(g, x, cin, c3, 3, 1, f"{scope}/cv3.0")
    cls = conv_bn_silu(g, cls, c3, c3, 3, 1, f"{scope}/cv3.1")
    cls = head_conv(g, cls, c3, num_classes, CLS_SCALE, None, f"{scope}/cv3.2")
    return box, cls


def network(g: _Graph, x: str, num_classes: int, width: int) -> list[tuple[str, str]]:
    """Backbone, PAN/FPN neck and the three heads; per stride the (box, class) logit maps."""
    c1, c2, c3, c4, c5 = width, 2 * width, 4 * width, 8 * width, 16 * width
    y = conv_bn_silu(g, x, 3, c1, 3, 2, "/model.0")  # stride 2
    y = conv_bn_silu(g, y, c1, c2, 3, 2, "/model.1")  # 4
    y = c2f(g, y, c2, c2, 1, True, "/model.2")
    y = conv_bn_silu(g, y, c2, c3, 3, 2, "/model.3")  # 8
    p3 = c2f(g, y, c3, c3, 2, True, "/model.4")
    y = conv_bn_silu(g, p3, c3, c4, 3, 2, "/model.5")  # 16
    p4 = c2f(g, y, c4, c4, 2, True, "/model.6")
    y = conv_bn_silu(g, p4, c4, c5, 3, 2, "/model.7")  # 32
    y = c2f(g, y, c5, c5, 1, True, "/model.8")
    p5 = sppf(g, y, c5, c5, "/model.9")
    # neck: top-down then bottom-up
    y = g.node("Concat", [upsample(g, p5, "/model.10"), p4], "/model.11", axis=1)
    n4 = c2f(g, y, c5 + c4, c4, 1, False, "/model.12")
    y = g.node("Concat", [upsample(g, n4, "/model.13"), p3], "/model.14", axis=1)
    o3 = c2f(g, y, c4 + c3, c3, 1, False, "/model.15")
    y = conv_bn_silu(g, o3, c3, c3, 3, 2, "/model.16")
    y = g.node("Concat", [y, n4], "/model.17", axis=1)
    o4 = c2f(g, y, c3 + c4, c4, 1, False, "/model.18")
    y = conv_bn_silu(g, o4, c4, c4, 3, 2, "/model.19")
    y = g.node("Concat", [y, p5], "/model.20", axis=1)
    o5 = c2f(g, y, c4 + c5, c5, 1, False, "/model.21")
    box_c = max(16, c3 // 4, 4 * REG_MAX)
    cls_c = max(c3, min(num_classes, 100))
    return [
        head(g, feat, ch, num_classes, stride, f"/model.22/{i}", box_c, cls_c)
        for i, (feat, ch, stride) in enumerate(
            zip((o3, o4, o5), (c3, c4, c5), STRIDES, strict=True)
        )
    ]


# -- decode ------------------------------------------------------------------------------------


def _dim(g: _Graph, x: str, axis: int, scope: str) -> str:
    """``x.shape[axis]`` as a torch export writes it: Shape -> Gather (an int64 scalar)."""
    shape = g.node("Shape", [x], scope)
    return g.node("Gather", [shape, g.const(np.array(axis, np.int64), scope)], scope, axis=0)


def _unsqueeze(g: _Graph, x: str, axis: int, scope: str) -> str:
    return g.node("Unsqueeze", [x, g.const(np.array([axis], np.int64), scope)], scope)


def _shape_of(g: _Graph, parts: Sequence[str | int], scope: str) -> str:
    """A Reshape target: ints are constants, strings int64 scalars (unsimplified only)."""
    if not g.unsimplified:
        return g.const(np.array(parts, np.int64), scope)
    pieces = [
        g.const(np.array([p], np.int64), scope)
        if isinstance(p, int)
        else _unsqueeze(g, p, 0, scope)
        for p in parts
    ]
    return g.node("Concat", pieces, scope, axis=0)


def dfl(g: _Graph, box: str, anchors: int, scope: str) -> str:
    """``[1, 64, A]`` logits -> ``[1, 4, A]`` distances: Softmax over 16 bins, expectation Conv."""
    b = _dim(g, box, 0, scope) if g.unsimplified else 1
    a = _dim(g, box, 2, scope) if g.unsimplified else anchors
    y = g.node("Reshape", [box, _shape_of(g, [b, 4, REG_MAX, a], scope)], scope)
    y = g.node("Transpose", [y], scope, perm=[0, 2, 1, 3])
    y = g.node("Softmax", [y], scope, axis=1)
    weight = np.arange(REG_MAX, dtype=np.float32).reshape(1, REG_MAX, 1, 1)
    y = g.node("Conv", [y, g.weight(f"{scope}.conv.weight", weight)], f"{scope}/conv",
               kernel_shape=[1, 1])  # fmt: skip
    return g.node("Reshape", [y, _shape_of(g, [b, 4, a], scope)], scope)


def _anchor_constants(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Anchor centres ``[1, 2, A]`` (x, y in grid cells, offset 0.5) and strides ``[1, A]``."""
    points, strides = [], []
    for stride in STRIDES:
        n = size // stride
        sy, sx = np.meshgrid(np.arange(n) + 0.5, np.arange(n) + 0.5, indexing="ij")
        points.append(np.stack([sx, sy], -1).reshape(-1, 2))
        strides.append(np.full(n * n, stride))
    anchors = np.concatenate(points).T[None].astype(np.float32)
    return anchors, np.concatenate(strides)[None].astype(np.float32)


def _anchors_from_shapes(g: _Graph, feats: Sequence[str], scope: str) -> tuple[str, str]:
    """Ultralytics ``make_anchors`` traced: Range over each map's H and W, meshgrid, stack."""
    points, strides = [], []
    for feat, stride in zip(feats, STRIDES, strict=True):
        h, w = _dim(g, feat, 2, scope), _dim(g, feat, 3, scope)
        axes = []
        for n in (w, h):
            limit = g.node("Cast", [n], scope, to=TensorProto.FLOAT)
            r = g.node("Range", [g.const(np.array(0, np.float32), scope), limit,
                                 g.const(np.array(1, np.float32), scope)], scope)  # fmt: skip
            axes.append(g.node("Add", [r, g.const(np.array(0.5, np.float32), scope)], scope))
        sx, sy = axes
        grid = _shape_of(g, [h, w], scope)
        sy = g.node("Expand", [g.node("Reshape", [sy, _shape_of(g, [-1, 1], scope)], scope),
                               grid], scope)  # fmt: skip
        sx = g.node("Expand", [g.node("Reshape", [sx, _shape_of(g, [1, -1], scope)], scope),
                               grid], scope)  # fmt: skip
        xy = g.node("Concat", [_unsqueeze(g, sx, -1, scope), _unsqueeze(g, sy, -1, scope)], scope,
                    axis=-1)  # fmt: skip
        points.append(g.node("Reshape", [xy, _shape_of(g, [-1, 2], scope)], scope))
        hw = g.node("Mul", [h, w], scope)
        strides.append(
            g.node("ConstantOfShape", [_shape_of(g, [hw, 1], scope)], scope,
                   value=numpy_helper.from_array(np.array([stride], np.float32)))
        )  # fmt: skip
    anchors = g.node("Transpose", [g.node("Concat", points, scope, axis=0)], scope, perm=[1, 0])
    anchors = _unsqueeze(g, anchors, 0, scope)
    stride_row = g.node("Transpose", [g.node("Concat", strides, scope, axis=0)], scope, perm=[1, 0])
    return anchors, stride_row


def decode(
    g: _Graph, heads: Sequence[tuple[str, str]], num_classes: int, size: int, scope: str
) -> str:
    """Join the scales, DFL and dist2bbox to pixel ``cx, cy, w, h``, Sigmoid scores, Concat."""
    no = 4 * REG_MAX + num_classes
    anchors_n = sum((size // s) ** 2 for s in STRIDES)
    feats = [g.node("Concat", [box, cls], scope, axis=1) for box, cls in heads]
    b = _dim(g, feats[0], 0, scope) if g.unsimplified else 1
    flat = [g.node("Reshape", [f, _shape_of(g, [b, no, -1], scope)], scope) for f in feats]
    joined = g.node("Concat", flat, scope, axis=2)
    split = g.const(np.array([4 * REG_MAX, num_classes], np.int64), scope)
    box, cls = g.node_n("Split", [joined, split], scope, 2, axis=1)
    dist = dfl(g, box, anchors_n, f"{scope}/dfl")
    if g.unsimplified:
        anchors, strides = _anchors_from_shapes(g, feats, scope)
    else:
        a, s = _anchor_constants(size)
        anchors, strides = g.weight(f"{scope}.anchors", a), g.weight(f"{scope}.strides", s)
    lt, rb = g.node_n("Split", [dist, g.const(np.array([2, 2], np.int64), scope)], scope, 2, axis=1)
    x1y1 = g.node("Sub", [anchors, lt], scope)
    x2y2 = g.node("Add", [anchors, rb], scope)
    half = g.const(np.array(2, np.float32), scope)
    centre = g.node("Div", [g.node("Add", [x1y1, x2y2], scope), half], scope)
    wh = g.node("Sub", [x2y2, x1y1], scope)
    boxes = g.node("Mul", [g.node("Concat", [centre, wh], scope, axis=1), strides], scope)
    scores = g.node("Sigmoid", [cls], scope)
    return g.node("Concat", [boxes, scores], scope, axis=1)


# -- building -----------------------------------------------------------------------------------


def _model(g: _Graph, inputs: list, outputs: list) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, "yolov8_like", inputs, outputs, g.initializers)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="quark_onnx tests"
    )
    model.ir_version = 8
    return model


def _measure(
    seed: int, size: int, num_classes: int, width: int
) -> dict[str, tuple[np.ndarray, ...]]:
    """Run the batch-normalized network on the initialisation images; per-scope statistics."""
    g = _Graph(seed, stats_mode=True)
    network(g, "images", num_classes, width)
    names = [t for probe in g.probes.values() for t in probe]
    image = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, size, size])
    outputs = [helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in names]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        _model(g, [image], outputs).SerializeToString(), options, ["CPUExecutionProvider"]
    )
    images = synthetic_images(INIT_IMAGES, size, INIT_SEED_OFFSET + seed)
    values = dict(zip(names, session.run(names, {"images": images}), strict=True))
    measured: dict[str, tuple[np.ndarray, ...]] = {}
    for scope, probe in g.probes.items():
        if len(probe) == 2:  # BN: batch mean and variance
            measured[scope] = tuple(values[t].reshape(-1).astype(np.float64) for t in probe)
        else:  # head Conv: its input features
            measured[scope] = (values[probe[0]].astype(np.float64),)
    return measured


def build_yolov8_like(
    seed: int = 0,
    size: int = 160,
    num_classes: int = 80,
    width: int = 16,
    unsimplified: bool = False,
) -> onnx.ModelProto:
    """The detector (see the module docstring); input ``images`` ``[1, 3, size, size]`` in [0, 1],
    output ``output0`` ``[1, 4 + num_classes, A]``: pixel ``cx, cy, w, h`` then class scores.
    """
    if size % 32:
        raise ValueError(f"size must be a multiple of 32, got {size}")
    measured = _measure(seed, size, num_classes, width)
    g = _Graph(seed, stats_mode=False, measured=measured, unsimplified=unsimplified)
    heads = network(g, "images", num_classes, width)
    decode(g, heads, num_classes, size, "/model.22")
    g.nodes[-1].output[0] = "output0"  # the final Concat writes the graph output, as exported
    anchors = sum((size // s) ** 2 for s in STRIDES)
    image = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, size, size])
    output = helper.make_tensor_value_info(
        "output0", TensorProto.FLOAT, [1, 4 + num_classes, anchors]
    )
    model = _model(g, [image], [output])
    onnx.checker.check_model(model)
    return model


def synthetic_images(n: int, size: int, seed: int) -> np.ndarray:
    """``[n, 3, size, size]`` float32 in [0, 1]: 2-6 rectangles and ellipses of random colours
    and sizes (10-60 % of the side) on a noisy colour-gradient background. The same distribution
    for every seed, so calibration and held-out sets differ only in their seed.
    """
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    images = np.empty((n, 3, size, size), np.float32)
    for i in range(n):
        c0, c1 = rng.uniform(0, 1, (2, 3, 1, 1)).astype(np.float32)
        angle = rng.uniform(0, 2 * math.pi)
        t = (math.cos(angle) * xx + math.sin(angle) * yy + 1.0) / 2.0  # in [0, 1]
        img = c0 * (1 - t) + c1 * t
        for _ in range(int(rng.integers(2, 7))):
            w, h = rng.uniform(0.1, 0.6, 2) * size
            cx, cy = rng.uniform(0, size, 2) / size
            colour = rng.uniform(0, 1, (3, 1)).astype(np.float32)
            if rng.random() < 0.5:
                mask = (np.abs(xx - cx) <= w / size / 2) & (np.abs(yy - cy) <= h / size / 2)
            else:
                mask = ((xx - cx) / (w / size / 2)) ** 2 + ((yy - cy) / (h / size / 2)) ** 2 <= 1
            img[:, mask] = colour
        img += rng.normal(0, 0.04, img.shape).astype(np.float32)
        images[i] = np.clip(img, 0.0, 1.0)
    return images
