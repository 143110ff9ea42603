"""Layer-by-layer replay of a float and a quantized model on calibration samples.

The accuracy stages (bias correction, AdaRound, error analysis) compare, layer by layer, what the
quantized model computes with what the float model computes. Running the whole quantized model
once per layer would cost O(depth^2); instead :class:`Replay` runs a model *segment by segment*:
it keeps, per sample, only the *live* tensors (computed and still read by a later node) at a
checkpoint and, when asked for a tensor, runs just the nodes between the checkpoint and that
tensor's producer as small onnxruntime models, one sample at a time. Without a memory budget the
checkpoint follows every request, so a full walk runs every node once; with one, it stays where
the live tensors of all samples fit and later requests run the segments after it again. A weight
changed before a segment is built is used by that segment (the quantized prefix is the current
one); a value added to a tensor (:meth:`Replay.add_to`) is added again whenever it is recomputed.

Memory: live ``DequantizeLinear`` outputs with a power-of-two scale are kept as their integer
codes (exact, 4x smaller for int8); under a budget, new segments are also split after their last
``QuantizeLinear`` so a checkpoint can hold int8 codes instead of a float convolution output.
All segments' sessions allocate from one onnxruntime arena (:mod:`quark_onnx.runtime.arena`).
After a request, once the process holds more than :data:`TRIM_SLACK_MB` over the replay's start,
the arena's unused regions are freed (:func:`~quark_onnx.runtime.arena.release_arena`) and
glibc's free pages returned (:func:`quark_onnx.runtime.memory.release_freed_memory`);
:meth:`Replay.close` does both for good. The first sample of a request measures the live state at
every boundary but keeps only the (at most two) states the checkpoint can move to. Values are
bit-identical whatever the budget: a rerun uses the first run's session, dequantizing power-of-two
codes is exact, and the extra split lies between a ``QuantizeLinear`` and its ``DequantizeLinear``,
which no optimization fuses while Q/DQ fusions are off (checked: the XINT8 models of digits_cnn,
SqueezeNet and MobileNetV2 are byte-identical).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.accuracy.replay_graph import (
    IRNode,
    ReplayGraph,
    Tensor,
    node_proto,
    tensor_array,
    tensor_proto,
)
from quark_onnx.errors import QuantizationError
from quark_onnx.npu.rules import position_of_scale
from quark_onnx.runtime import memory
from quark_onnx.runtime.arena import release_arena, session_options
from quark_onnx.runtime.sessions import create_session, subgraph_reads

logger = logging.getLogger(__name__)

#: Growth of the resident set (MiB) over a replay's start that is tolerated before freed heap
#: pages are handed back (:func:`quark_onnx.runtime.memory.release_freed_memory_above`).
TRIM_SLACK_MB = 32.0


@dataclass(frozen=True)
class _Codes:
    """A ``DequantizeLinear`` output kept as its integer codes: ``T = (C - zp) * 2^-p``.

    With a power-of-two scale the product is exact in float32 (``|C - zp| < 2^17``), so
    :meth:`dequantize` gives the bits onnxruntime's DequantizeLinear gives, on any kernel.
    """

    codes: str
    scale: np.float32
    zero_point: np.float32

    def dequantize(self, codes: np.ndarray) -> np.ndarray:
        x = codes.astype(np.float32)
        if self.zero_point:
            x -= self.zero_point
        x *= self.scale
        return x


@dataclass
class _Segment:
    """Nodes ``[start, end)`` run as one onnxruntime model (built on its first run)."""

    start: int
    end: int
    inputs: list[str]
    outputs: list[str]
    session: Any = None


_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _reads(node: onnx.NodeProto | IRNode) -> list[str]:
    """The names ``node`` reads: its inputs and, for If/Loop/Scan, what its subgraphs read from
    the outer graph by name (a value only a branch reads must stay alive until the node runs,
    and reach its segment as an input)."""
    attributes = node.node.attributes.values() if isinstance(node, IRNode) else node.attribute
    if not any(a.type in _GRAPH_ATTRIBUTES for a in attributes):  # ir's types are onnx's ints
        return list(node.input)
    return [*node.input, *sorted(subgraph_reads(node_proto(node)))]


class Replay:
    """Run ``proto`` on ``samples`` segment by segment, keeping only live tensors (module doc).

    The replay keeps, for every sample, the live tensors at one *checkpoint* (a segment
    boundary) and answers a request by running, sample by sample, the segments from the
    checkpoint to the tensors asked for. Without ``memory_budget`` the checkpoint always moves to
    the furthest boundary reached, so every node runs once. With one, it moves to the furthest
    boundary whose live tensors (all samples) fit in ``memory_budget`` bytes; the segments after it
    are run again by later requests (their sessions are kept), trading time for memory. The trade
    is bounded: once the nodes run so far exceed ``1 + rerun_allowance`` times the distinct nodes
    reached (a model whose live tensors never fit, e.g. ResNet-50 at 224x224, would otherwise rerun
    its whole prefix for every request: quadratic), a request that finds no boundary within budget
    moves the checkpoint anyway, to the boundary of the second half of its run with the smallest
    live state. New
    segments are then also split after their last ``QuantizeLinear`` so a boundary exists where
    the live state is integer codes.

    Storage: a live output of ``DequantizeLinear(C, 2^-p, zp)`` whose codes ``C`` are computed by
    the replay is kept as ``C`` (int8: 4x smaller) and dequantized exactly when read
    (:class:`_Codes`). Every segment is an onnxruntime model with the same nodes and (a superset
    of) the same outputs whatever the budget, so the values are bit-identical to one walk.

    Args:
        proto: the model (its top-level graph is replayed in node order, which ONNX requires to
            be topological). An ``ir.Model`` is read as it is when each segment is first built
            (its nodes and the initializers they read are serialized then, a segment at a
            time): the replay never holds a second, serialized copy of the whole model; change
            its initializers through :meth:`set_initializer` as for a proto.
        samples: feeds, one dict per run (each run is independent; shapes as the model takes).
        label: used in error messages.
        memory_budget: bytes the checkpoint's live tensors may take over all samples (the
            samples themselves are the caller's and not counted); None: no limit, no recompute.
        rerun_allowance: node runs beyond one pass allowed, as a fraction of one pass, before
            the checkpoint moves past the budget; None: never past it.
        threads: onnxruntime intra-op threads of the segments' sessions (None: its default).
    """

    def __init__(
        self,
        proto: onnx.ModelProto | ir.Model,
        samples: Sequence[dict[str, np.ndarray]],
        label: str,
        memory_budget: int | None = None,
        rerun_allowance: float | None = 1.0,
        threads: int | None = None,
    ) -> None:
        if not samples:
            raise QuantizationError(f"{label}: no samples to replay the model on")
        self.label = label
        self.memory_budget = memory_budget
        self.rerun_allowance = rerun_allowance
        self.threads = threads
        self._nodes_run = 0  # node executions per sample, reruns included
        # freed pages go back to the OS once the process holds this much more than at the start
        now = memory.resident_mb()
        self._trim_above = None if now is None else now + TRIM_SLACK_MB
        graph = ReplayGraph.of(proto)
        self.nodes = graph.nodes
        self.initializers: dict[str, Tensor] = graph.initializers
        self.types = graph.types
        self._opsets, self._ir_version = graph.opsets, graph.ir_version
        self.producer: dict[str, int] = {}
        self.last_use: dict[str, int] = {}
        end = len(self.nodes)
        constant = set(self.initializers)
        self.constant: set[str] = set()  # computed from initializers alone (e.g. weight DQ)
        self.reads = [_reads(node) for node in self.nodes]  # a subgraph's reads once
        for i, (node, reads) in enumerate(zip(self.nodes, self.reads, strict=True)):
            for o in node.output:
                if o:
                    self.producer[o] = i
            for x in reads:
                if x:
                    self.last_use[x] = i
            if all(not x or x in constant for x in reads):
                constant.update(o for o in node.output if o)
                self.constant.update(o for o in node.output if o)
        for o in graph.outputs:
            self.last_use[o] = end
        # per boundary, how many initializer-only tensors cross it (:meth:`_clean`)
        crossings = [0] * (end + 2)
        for t in self.constant:
            if self.last_use.get(t, -1) > self.producer[t]:
                crossings[self.producer[t] + 1] += 1
                crossings[self.last_use[t] + 1] -= 1
        self._constant_crossings = list(itertools.accumulate(crossings))
        self.num_samples = len(samples)
        self.graph_inputs: set[str] = set()
        self.env: dict[str, list[np.ndarray]] = {}
        for name in graph.inputs:
            if name in self.initializers:
                continue
            if any(name not in s for s in samples):
                raise QuantizationError(f"{label}: a sample has no value for input {name!r}")
            self.graph_inputs.add(name)
            self.env[name] = [np.asarray(s[name]) for s in samples]
        self.coded = self._find_coded()
        # codes stay as long as the dequantized tensor they stand for is read
        self.keep_until = dict(self.last_use)
        for t, c in self.coded.items():
            # a dequantized tensor nothing reads (a mutated or pruned graph) keeps no codes alive
            last = self.last_use.get(t, -1)
            self.keep_until[c.codes] = max(self.keep_until.get(c.codes, -1), last)
        self.patches: dict[str, np.ndarray] = {}
        self._live_at: dict[int, list[str]] = {}
        self._sweep: tuple[int, dict[str, None]] = (0, {t: None for t in self.graph_inputs})
        self.segments: list[_Segment] = []  # from the checkpoint to the cursor
        self.checkpoint = 0
        self.cursor = 0
        self.runs = 0

    def _find_coded(self) -> dict[str, _Codes]:
        coded: dict[str, _Codes] = {}
        for node in self.nodes:
            if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
                continue
            if len(node.input) < 2 or not node.output or not node.output[0]:
                continue
            x, scale = node.input[0], node.input[1]
            zp = node.input[2] if len(node.input) > 2 else ""
            if x in self.initializers or x in self.constant or scale not in self.initializers:
                continue
            s = tensor_array(self.initializers[scale])
            if s.dtype != np.float32 or s.size != 1 or position_of_scale(float(s)) is None:
                continue
            z = np.zeros(1)
            if zp:
                if zp not in self.initializers:
                    continue
                z = tensor_array(self.initializers[zp])
                if z.size != 1 or z.dtype not in (np.int8, np.uint8, np.int16, np.uint16):
                    continue
                # x and x_zero_point have one type: the codes' segment output is declared with it
                self.types.setdefault(x, self.types[zp])
            elif x not in self.types:
                continue
            coded[node.output[0]] = _Codes(
                x, np.float32(s.reshape(-1)[0]), np.float32(z.reshape(-1)[0])
            )
        return coded

    def set_initializer(self, name: str, array: np.ndarray) -> None:
        """Replace initializer ``name`` in the segments built from now on (a segment already
        built, and run again under a memory budget, keeps what it was built with)."""
        if name not in self.initializers:
            raise QuantizationError(f"{self.label}: no initializer {name!r}")
        self.initializers[name] = onnx.numpy_helper.from_array(np.asarray(array), name)

    def get(self, names: Sequence[str]) -> list[list[np.ndarray]]:
        """Per name, its value on every sample; runs the nodes up to the last producer needed."""
        out: list[list[np.ndarray]] = [[] for _ in names]
        for _, values in self.stream(names):
            for acc, v in zip(out, values, strict=True):
                acc.append(v)
        return out

    def stream(self, names: Sequence[str]) -> Iterator[tuple[int, list[np.ndarray]]]:
        """``(sample index, values of names)`` one sample at a time, in sample order.

        Only one sample's tensors between the checkpoint and ``names`` exist at a time. The
        checkpoint moves (class doc) once the last sample has been yielded.
        """
        missing = [n for n in names if n not in self.producer and n not in self.graph_inputs]
        if missing:
            raise QuantizationError(f"{self.label}: no tensor {missing[0]!r} in the model")
        ahead = [n for n in names if not self._stored(n)]
        gone = [n for n in ahead if self.producer.get(n, -1) < self.checkpoint]
        if gone:
            raise QuantizationError(
                f"{self.label}: tensor {gone[0]!r} was computed earlier and is no longer kept; "
                "ask for tensors in graph order"
            )
        end = max((self.producer[n] + 1 for n in ahead), default=self.checkpoint)
        if end > self.cursor:
            self._extend(end, set(names))
        chain = []
        for seg in self.segments:
            if seg.start >= end:
                break
            chain.append(seg)
        offered = {o for seg in chain for o in seg.outputs}
        lost = [n for n in ahead if n not in offered]
        if lost:
            raise QuantizationError(
                f"{self.label}: tensor {lost[0]!r} is no longer kept; ask for tensors in graph "
                "order"
            )
        if chain:
            self._nodes_run += chain[-1].end - chain[0].start
        wanted = set(names)  # and the codes a wanted tensor may be kept as
        wanted.update(self.coded[n].codes for n in names if n in self.coded)
        old = self.env
        new: dict[str, list[np.ndarray]] = {}
        if not chain:
            move_to: int | None = self.checkpoint
        else:
            move_to = chain[-1].end if self.memory_budget is None else None
        sizes: dict[int, int] = {}  # per boundary of the chain: its live bytes per sample
        for i in range(self.num_samples):
            state = {k: v[i] for k, v in old.items()}
            stored: dict[int, dict[str, np.ndarray]] = {}
            for seg in chain:
                self._run_segment(seg, state)
                for name in [n for n in state if self.keep_until.get(n, -1) < seg.end]:
                    if name not in wanted:
                        del state[name]
                if move_to is None:
                    # the first sample measures every boundary but keeps only the states the
                    # choice can still fall on (at most two), not one per boundary
                    stored[seg.end] = self._store(seg.end, state)
                    sizes[seg.end] = sum(
                        a.nbytes for k, a in stored[seg.end].items() if k not in self.graph_inputs
                    )
                    candidates = self._candidates(sizes, chain[-1].end)
                    for boundary in [b for b in stored if b not in candidates]:
                        del stored[boundary]
                elif seg.end == move_to:
                    stored[seg.end] = self._store(seg.end, state)
            yield i, [self._value(n, state) for n in names]
            if i == 0 and move_to is None:
                move_to = self._choose_checkpoint(sizes, chain[-1].end)
            if move_to is not None and move_to != self.checkpoint:
                for k, arr in stored[move_to].items():
                    new.setdefault(k, []).append(arr)
                for v in old.values():  # private lists: the caller got fresh ones
                    v[i] = None  # type: ignore[call-overload]
            del state, stored
        if move_to is not None and move_to != self.checkpoint:
            self.env = new
            self.checkpoint = move_to
            self.segments = [s for s in self.segments if s.start >= move_to]
            self.patches = {k: v for k, v in self.patches.items() if self.producer[k] + 1 > move_to}
        if chain:
            self._release_above()

    def add_to(self, name: str, step: np.ndarray) -> None:
        """Add ``step`` (broadcast, float32 in place) to tensor ``name`` on every sample, now and
        whenever its segment runs again (e.g. after changing the bias of its producer)."""
        if name not in self.producer or self.producer[name] + 1 > self.cursor:
            raise QuantizationError(f"{self.label}: tensor {name!r} has not been computed")
        if self.producer[name] < self.checkpoint:
            if name not in self.env:
                raise QuantizationError(f"{self.label}: tensor {name!r} is not live")
            for y in self.env[name]:
                y += step
            return
        if not any(seg.end == self.producer[name] + 1 for seg in self.segments):
            raise QuantizationError(f"{self.label}: tensor {name!r} does not end a segment")
        self.patches[name] = step

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the sessions and the kept tensors, and hand the memory they used back (the shared
        arena's free regions, then glibc's free pages). The replay cannot be used afterwards
        (``with Replay(...) as replay:`` closes it at the end of the block)."""
        self.segments = []
        self.env = {}
        self.patches = {}
        self.cursor = self.checkpoint = len(self.nodes)
        release_arena()
        memory.release_freed_memory()

    # -- internals ------------------------------------------------------------------------------

    def _release_above(self) -> None:
        """Once the process holds more than :data:`TRIM_SLACK_MB` over the replay's start, free
        the shared arena's unused regions and return glibc's free pages to the system."""
        if self._trim_above is not None:
            now = memory.resident_mb()
            if now is not None and now <= self._trim_above:
                return
        release_arena()
        memory.release_freed_memory()

    def _stored(self, name: str) -> bool:
        if name in self.env:
            return True
        c = self.coded.get(name)
        return c is not None and c.codes in self.env

    def _value(self, name: str, state: dict[str, np.ndarray]) -> np.ndarray:
        if name in state:
            return state[name]
        c = self.coded.get(name)
        if c is None or c.codes not in state:
            raise QuantizationError(f"{self.label}: tensor {name!r} is not available")
        return c.dequantize(state[c.codes])

    def _live(self, boundary: int) -> list[str]:
        """The tensors computed before ``boundary`` (or fed) and read at or after it.

        Boundaries are asked for in increasing order (the replay moves forward): the live set
        is carried from the last boundary asked for (what was produced since joins, what was
        last read before leaves), so a whole walk costs O(nodes), not O(nodes x tensors)."""
        live = self._live_at.get(boundary)
        if live is not None:
            return live
        last_b, last_set = self._sweep
        if boundary < last_b:  # backwards (not done by the replay): start again
            last_b, last_set = 0, {t: None for t in self.graph_inputs}
        current = dict(last_set)
        for node in self.nodes[last_b:boundary]:
            current.update((o, None) for o in node.output if o)
        current = {t: None for t in current if self.last_use.get(t, -1) >= boundary}
        self._sweep = (boundary, current)
        live = self._live_at[boundary] = list(current)
        return live

    def _store(self, boundary: int, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The live tensors at ``boundary``, coded ones as their codes."""
        out: dict[str, np.ndarray] = {}
        for t in self._live(boundary):
            c = self.coded.get(t)
            if c is not None and c.codes in state:
                out[c.codes] = state[c.codes]
            elif t in state:
                out[t] = state[t]
            else:
                raise QuantizationError(f"{self.label}: live tensor {t!r} was not kept")
        return out

    def _furthest_fitting(self, sizes: dict[int, int]) -> int | None:
        """The furthest boundary whose live tensors (``sizes``: bytes per sample), times the
        samples, fit the budget; None if none does."""
        assert self.memory_budget is not None
        fits = [b for b, size in sizes.items() if size * self.num_samples <= self.memory_budget]
        return max(fits) if fits else None

    def _smallest_late(self, sizes: dict[int, int], end: int) -> int | None:
        """The boundary with the smallest state in the second half of the run ending at ``end``
        (the later one on ties); None if none was measured there yet."""
        half = (self.checkpoint + end) / 2
        late = [b for b in sizes if b >= half]
        return min(late, key=lambda b: (sizes[b], -b)) if late else None

    def _candidates(self, sizes: dict[int, int], end: int) -> set[int]:
        """The boundaries :meth:`_choose_checkpoint` may pick among those measured so far."""
        picks = (self._furthest_fitting(sizes), self._smallest_late(sizes, end))
        return {b for b in picks if b is not None}

    def _choose_checkpoint(self, sizes: dict[int, int], end: int) -> int:
        """The furthest boundary that fits the budget; past the rerun allowance (class doc), the
        smallest state in the second half of the run (which ends at ``end``)."""
        fitting = self._furthest_fitting(sizes)
        if fitting is not None or not sizes or self.rerun_allowance is None:
            return self.checkpoint if fitting is None else fitting
        if self._nodes_run <= (1.0 + self.rerun_allowance) * self.cursor:
            return self.checkpoint
        late = self._smallest_late(sizes, end)
        return self.checkpoint if late is None else late

    def _extend(self, end: int, wanted: set[str]) -> None:
        """New segments over nodes ``[cursor, end)``."""
        cuts = [self.cursor, end]
        if self.memory_budget is not None:
            for k in range(end - 2, self.cursor - 1, -1):
                if self.nodes[k].op_type == "QuantizeLinear" and self._clean(k + 1):
                    cuts = [self.cursor, k + 1, end]
                    break
        for start, stop in itertools.pairwise(cuts):
            self.segments.append(self._segment(start, stop, wanted))
        self.cursor = end

    def _clean(self, boundary: int) -> bool:
        """No initializer-only tensor (a dequantized weight) crosses ``boundary``: it would
        reach the next segment as an input, not a constant, and change its kernels."""
        return not self._constant_crossings[boundary]

    def _segment(self, start: int, end: int, wanted: set[str]) -> _Segment:
        produced: set[str] = set()
        inputs: list[str] = []
        for node, reads in zip(self.nodes[start:end], self.reads[start:end], strict=True):
            for x in reads:
                if not x or x in produced or x in inputs or x in self.initializers:
                    continue
                known = x in self.graph_inputs or self.producer.get(x, end) < start
                if not known:
                    raise QuantizationError(
                        f"{self.label}: node {node.name or node.op_type} reads {x!r}, which is "
                        "neither computed nor an initializer"
                    )
                inputs.append(x)
            produced.update(o for o in node.output if o)
        outputs = [o for o in produced if o in wanted or self.last_use.get(o, -1) >= end]
        for o in list(outputs):  # the codes of a live dequantized tensor: what is kept
            c = self.coded.get(o)
            if c is not None and c.codes in produced and c.codes not in outputs:
                outputs.append(c.codes)
        outputs.sort(key=lambda o: self.producer[o])
        return _Segment(start, end, inputs, outputs)

    def _run_segment(self, seg: _Segment, state: dict[str, np.ndarray]) -> None:
        if not seg.outputs:
            return
        feeds = {x: self._value(x, state) for x in seg.inputs}
        if seg.session is None:
            seg.session = self._session(seg, feeds)
        for o, arr in zip(seg.outputs, seg.session.run(seg.outputs, feeds), strict=True):
            step = self.patches.get(o)
            if step is not None:
                arr += step
            state[o] = arr
        self.runs += 1

    def _session(self, seg: _Segment, feeds: dict[str, np.ndarray]) -> Any:

        nodes = self.nodes[seg.start : seg.end]
        used = dict.fromkeys(x for node in nodes for x in node.input if x in self.initializers)
        graph = onnx.helper.make_graph(
            [node_proto(n) for n in nodes],
            f"segment_{seg.start}_{seg.end}",
            [
                onnx.helper.make_tensor_value_info(
                    x, onnx.helper.np_dtype_to_tensor_dtype(feeds[x].dtype), None
                )
                for x in seg.inputs
            ],
            [
                # a type shape inference left unknown (an unsimplified export's shape
                # arithmetic) stays unset: onnxruntime infers it, a guessed float is rejected
                onnx.helper.make_tensor_value_info(o, self.types[o], None)
                if o in self.types
                else onnx.helper.make_empty_tensor_value_info(o)
                for o in seg.outputs
            ],
            [tensor_proto(x, self.initializers[x]) for x in used],
        )
        model = onnx.helper.make_model(
            graph, opset_imports=self._opsets, ir_version=self._ir_version
        )
        data = model.SerializeToString()
        # the proto holds a copy of the segment's weights: gone before onnxruntime makes its own
        del model, graph
        try:
            return create_session(data, session_options(self.threads), purpose="replay segment")
        except Exception as exc:  # onnxruntime raises its own exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise QuantizationError(
                f"{self.label}: onnxruntime cannot load the segment ending at "
                f"{seg.outputs[-1] if seg.outputs else '?'}: {first[:300]}"
            ) from exc
