"""Reference values of docs/numerics.md §15, computed with the upstream code.

Shared by the router, routing, loss and permutation tests (import as
``from layers.reference_values import ...``): one copy of the upstream inputs and outputs.
"""

from __future__ import annotations

import torch

# Logits of T=6 tokens over E=4 experts; every example of docs/numerics.md §15 routes them with K=2.
REFERENCE_LOGITS = torch.tensor(
    [
        [2, 1, 0.5, -1],
        [0.1, 0.3, 0.2, 0],
        [-1, 3, 0, 1],
        [0.5, 0.5, 2.5, 0.4],
        [1.5, -0.5, 1.4, 1.3],
        [0, 0, 0, 2],
    ]
)

# Softmax-post routing of REFERENCE_LOGITS with K=2: token -> {expert: probability}.
SOFTMAX_POST_PROBS = {
    0: {0: 0.7311, 1: 0.2689},
    1: {1: 0.5250, 2: 0.4750},
    2: {1: 0.8808, 3: 0.1192},
    3: {1: 0.1192, 2: 0.8808},
    4: {0: 0.5250, 2: 0.4750},
    5: {2: 0.1192, 3: 0.8808},
}
