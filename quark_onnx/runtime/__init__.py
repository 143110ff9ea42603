"""Running models: the one onnxruntime session factory and what a run costs.

``sessions`` (every session the package builds), ``arena`` (session options and the shared
memory arena), ``counters``, ``memory``, ``progress`` and ``ray_cluster`` (Ray, when wanted).
"""
