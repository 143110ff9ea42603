"""The onnxruntime side of calibration: :class:`CalibrationSession`.

The session runs a copy of the model (the user's model and its folder are never touched; only a
model above the 2 GB protobuf limit is written, to a temporary directory removed afterwards)
whose outputs are the tensors read, pruned to the nodes they need (:func:`keep_only_what_feeds`).

A graph of at most :data:`quark_onnx.runtime.sessions.SEGMENT_NODES` nodes gets one session, and
each run is one ``session.run``. A longer graph is run piece by piece
(:func:`quark_onnx.runtime.sessions. run_segments`): one piece's session at a time, on groups of up
to :data:`SEGMENT_RUNS` runs, so calibration's memory is bounded by a piece (a session costs ~6.5 KB
per node; a 50,000-node Add chain: ~600 MB as one session). The values are those of one session:
each piece has the session options of the whole graph, and is cut only where every computed value
crossing the cut is a tensor read (a graph output of the whole-graph copy, which onnxruntime never
fuses away), so no optimisation reaches across a cut in either form. The pieces are rebuilt for
every group: that costs one whole-graph build per group, against a held piece's values for every run
of the group.

Memory of one session: the copy is serialized and dropped before onnxruntime parses it, and the
bytes are dropped once the session holds the weights (``InferenceSession`` keeps them otherwise,
only to rebuild itself on ``set_providers``, which calibration never calls). The session has no
memory pattern (:func:`session_options`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from quark_onnx.errors import CalibrationError
from quark_onnx.model_files.external import fits_in_protobuf
from quark_onnx.model_files.files import private_temp_folder
from quark_onnx.model_files.save import save_model
from quark_onnx.runtime import sessions
from quark_onnx.runtime.memory import release_freed_memory

logger = logging.getLogger(__name__)

#: Above this many nodes the calibration session uses onnxruntime's basic optimizations only:
#: its extended and layout optimizers cost more than linear time in the node count, which the
#: faster kernels of a graph that large never pay back over a calibration run.
EXTENDED_OPTIMIZATION_MAX_NODES = 4000

#: Runs (batches) that go through the pieces of a graph too long for one session together: each
#: piece's session is built once per group, and a piece's values are held for every run of it.
SEGMENT_RUNS = 4


def session_options(nodes: int = 0) -> ort.SessionOptions:
    """Session options of the calibration session (and of any timing comparison against it).

    Full graph optimisation (basic only above :data:`EXTENDED_OPTIMIZATION_MAX_NODES` ``nodes``):
    onnxruntime never fuses away a graph output, so the tensors read are those of the float model
    (up to the float rounding of its optimised kernels).

    The intra-op threads do not spin between kernels: the observers run in Python beside the
    session (next batch in onnxruntime, previous batch in numpy), and spinning threads would take
    the cores numpy needs.

    No memory pattern: with one, onnxruntime plans every later run into a single block of its
    own, which its arena cannot carve from the chunks the first (unplanned) run left free, so the
    arena holds both. Without, each run allocates tensor by tensor from those chunks, in less
    memory and the same time (``benchmarks/results/measurements.md``).
    """
    return sessions.session_options(
        optimize="all" if nodes <= EXTENDED_OPTIMIZATION_MAX_NODES else "basic",
        spinning=False,
        mem_pattern=False,
    )


def keep_only_what_feeds(graph: onnx.GraphProto, wanted: set[str]) -> None:
    """Drop the nodes and outputs of the calibration copy that no calibrated tensor depends on.

    onnxruntime then neither runs them nor needs to know them: a custom op after the quantized part
    (or one it cannot run at all) no longer stops calibration, and nothing is computed for
    nothing. Graphs with subgraph attributes (If/Loop/Scan) are left whole: their bodies read
    outer values that the node's inputs do not list.
    """
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for node in graph.node
        for a in node.attribute
    ):
        return
    needed = set(wanted)
    keep = []
    for node in reversed(graph.node):  # ONNX nodes are in topological order
        if any(out in needed for out in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    if not keep:  # only graph inputs are wanted: onnxruntime refuses a graph without nodes
        return
    keep.reverse()
    outputs = [o for o in graph.output if o.name in wanted]
    del graph.node[:]
    graph.node.extend(keep)
    del graph.output[:]
    graph.output.extend(outputs)


@contextlib.contextmanager
def load_errors() -> Iterator[None]:
    """onnxruntime's refusal of the calibration copy as a :class:`CalibrationError`."""
    try:
        yield
    except CalibrationError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CalibrationError(
            f"onnxruntime cannot load the calibration copy of the model: {first}"
        ) from exc


def _run_error(exc: Exception, first: int) -> CalibrationError:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return CalibrationError(f"onnxruntime failed on calibration feed #{first}: {first_line}")


class CalibrationSession:
    """What runs the calibration copy of ``model``: one onnxruntime session, or the copy itself
    run piece by piece (``segmented``) when it has more than ``segment_nodes`` nodes.

    ``fetch``: the tensors read (in the order :meth:`run` returns them); ``types``: their element
    types where known.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        fetch: Sequence[str],
        types: dict[str, int],
        *,
        providers: Sequence[str],
        external_data_dir: str | Path | None = None,
        segment_nodes: int | None = None,
    ) -> None:
        self.fetch = list(fetch)
        self.providers = list(providers)
        self.external_data_dir = external_data_dir
        self.nodes = len(model.graph.node)  # of the whole model: its session options
        self.segment_nodes = sessions.SEGMENT_NODES if segment_nodes is None else segment_nodes
        self.session: ort.InferenceSession | None = None
        self.copy: onnx.ModelProto | None = None  # the segmented form runs the copy itself
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        #: seconds of the last run (timing the overlap of the next run with the fold)
        self.run_seconds = 0.0
        copy_ = self._calibration_copy(model, types)
        if len(copy_.graph.node) > self.segment_nodes and self.providers == list(sessions.CPU):
            self.copy = copy_
            return
        if not fits_in_protobuf(copy_):
            self.session = self._session_from_file(copy_)
            return
        data = copy_.SerializeToString()
        del copy_
        with load_errors():
            # weights stay in the model's data files (onnxruntime maps them read-only)
            self.session = sessions.create_session(
                data,
                session_options(self.nodes),
                external_data_dir=self.external_data_dir,
                providers=self.providers,
                purpose="calibration",
            )
        del data
        release_freed_memory()

    @property
    def segmented(self) -> bool:
        return self.copy is not None

    def _calibration_copy(self, model: onnx.ModelProto, types: dict[str, int]) -> onnx.ModelProto:
        """A copy of the model whose outputs are the tensors read, pruned to what they need."""
        copy_ = onnx.ModelProto()
        copy_.CopyFrom(model)
        g = copy_.graph
        existing_outputs = {o.name for o in g.output}
        for src in self.fetch:
            if src not in existing_outputs:
                elem = types.get(src, onnx.TensorProto.FLOAT)
                g.output.append(onnx.helper.make_tensor_value_info(src, elem, None))
        keep_only_what_feeds(g, set(self.fetch))
        return copy_

    def _session_from_file(self, proto: onnx.ModelProto) -> ort.InferenceSession:
        # Above 2 GB the model cannot be passed as bytes: stream it to a private temporary
        # folder with its weights as external data (never beside the user's model).
        with load_errors():
            if self._tmpdir is None:
                self._tmpdir = private_temp_folder("calib")
            path = Path(self._tmpdir.name) / f"calib_{id(proto)}.onnx"
            save_model(proto, path, external_data=True)
            return sessions.create_session(
                path,
                session_options(len(proto.graph.node)),
                providers=self.providers,
                purpose="calibration",
            )

    def run(self, feed: dict[str, np.ndarray], first: int) -> list[np.ndarray]:
        """The tensors read on one run (one session only); ``first``: the run's first feed."""
        assert self.session is not None
        try:
            tic = time.perf_counter()
            outputs = self.session.run(self.fetch, feed) if self.fetch else []
            self.run_seconds = time.perf_counter() - tic
            return outputs
        except Exception as exc:
            raise _run_error(exc, first) from exc

    def run_pieces(
        self, feeds: Sequence[dict[str, np.ndarray]], first: int
    ) -> Iterator[dict[str, list[np.ndarray]]]:
        """The segmented form: the tensors read on the runs ``feeds`` (from calibration feed
        ``first`` on), a piece at a time: ``values[name][j]`` is ``name`` on run ``j`` (every
        name once)."""
        assert self.copy is not None
        runs = sessions.run_segments(
            self.copy,
            feeds,
            self.fetch,
            max_nodes=self.segment_nodes,
            whole=False,
            options=session_options(self.nodes),
            external_data_dir=self.external_data_dir,
            purpose="calibration",
            cross=self.fetch,
        )
        while True:
            try:
                step = next(runs, None)
            except Exception as exc:
                # building a piece or running it: the group of runs is named, not one feed
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                raise CalibrationError(
                    f"onnxruntime failed on the {len(feeds)} run(s) from calibration feed "
                    f"#{first} on (the model run piece by piece): {first_line}"
                ) from exc
            if step is None:
                return
            yield step[1]

    def close(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
