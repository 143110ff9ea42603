"""Running models: the one onnxruntime session factory and what a run costs.

``sessions`` (every session the package builds, :func:`create_session`), ``arena`` (session
options and the shared memory arena), ``memory``, ``progress`` and ``ray_cluster`` (Ray, when
wanted). The counters of sessions and serialisations are :mod:`quark_onnx.counters`.
"""
