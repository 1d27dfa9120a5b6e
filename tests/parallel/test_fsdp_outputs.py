"""`return_no_views`: a module's view outputs become aliases that keep a tensor hook through an in-place op.

Oracle: the same computation without the hook (values and gradients), and autograd's own behaviour
on a view, where an in-place op drops a hook registered on it (what FSDP2 warns about).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.parallel.fsdp_outputs import return_no_views


class _ViewOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        return y.view(2, 3, 6), y.detach()  # a view that needs grad, and a plain tensor


def _run(unview: bool) -> tuple[torch.Tensor, list[torch.Tensor], bool, torch.Tensor | None]:
    torch.manual_seed(0)
    module = _ViewOut()
    if unview:
        return_no_views(module)
    out, _plain = module(torch.randn(6, 4))
    fired = []
    out.register_hook(lambda grad: fired.append(True))  # as FSDP2's pre-backward hook
    out *= 2  # the in-place op of the warning
    out.sum().backward()
    return out.detach(), [p.grad for p in module.parameters()], bool(fired), out._base


def test_view_outputs_become_aliases_that_keep_hooks():
    want_out, want_grads, view_kept_hook, base = _run(unview=False)
    assert base is not None and not view_kept_hook  # the hazard: the hook is gone
    got_out, got_grads, alias_kept_hook, alias_base = _run(unview=True)
    assert alias_base is None and alias_kept_hook
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
