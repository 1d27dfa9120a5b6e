"""The parallel layout and its process groups, before anything is sharded.

* :mod:`~lightning_moe.parallel.layout.dims`: ``ParallelDims``, the folded layout as pure rank
  arithmetic (testable without a process).
* :mod:`~lightning_moe.parallel.layout.groups`: ``ParallelContext`` and ``build_parallel_context``,
  the process groups and device meshes of a layout.
* :mod:`~lightning_moe.parallel.layout.lightning_mesh`: the dense mesh under Lightning's dim names,
  as a model's ``configure_model`` reads it.
* :mod:`~lightning_moe.parallel.layout.check`: a model checked against a layout before any process
  exists.

Nothing is imported here, so importing one of them does not import the others.
"""
