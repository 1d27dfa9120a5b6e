"""CUDA-graph capture of parts of every layer (no Lightning; ``callbacks.CUDAGraphCapture`` wraps it).

* :mod:`~lightning_moe.graphs.scopes`: the scopes ``attn``, ``moe_router``, ``moe_preprocess``,
  ``moe``, which modules each finds (``missing_scopes``), when each is legal (``ValueError``
  naming scope and reason otherwise), and the staged
  forwards of the MoE parts split at the scope boundaries; blocks are what a model declares
  (``parallel_plan().graph_blocks``, :mod:`lightning_moe.parallel.model_plan`).
* :mod:`~lightning_moe.graphs.cuda_graph`: ``GraphedStage``, one captured part of one layer
  (static buffers, capture, replay under autograd, eager fallback), and why it is built on
  ``torch.cuda.CUDAGraph`` rather than ``make_graphed_callables``.
* :mod:`~lightning_moe.graphs.manager`: ``CUDAGraphManager``, which stages a model, records one
  training step and captures every stage into one shared memory pool.
"""

from lightning_moe.graphs.cuda_graph import BACKENDS, GraphedStage
from lightning_moe.graphs.manager import CUDAGraphManager
from lightning_moe.graphs.scopes import (
    SCOPES,
    check_moe_layer,
    find_targets,
    missing_scopes,
    static_routed_rows,
    validate_scopes,
)

__all__ = [
    "BACKENDS",
    "SCOPES",
    "CUDAGraphManager",
    "GraphedStage",
    "check_moe_layer",
    "find_targets",
    "missing_scopes",
    "static_routed_rows",
    "validate_scopes",
]
