"""Activation offload with several micro-batches in flight (pipeline schedules), on one process.

Two pipeline stages of a 4-block `MoETransformer` (`StageModule`, blocks 0-1 and 2-3) run by hand
in the orders of pipeline schedules that hold several micro-batches at once (GPipe, and the
interleaved order of two virtual stages on one rank, where backwards of older micro-batches run
between forwards of newer ones). With ``OffloadHandle.start_microbatch_at`` on the stages,
every boundary name offloaded: the gradients equal the same schedule without offload; per
(micro-batch, stage) the warm-up rule keeps the last group of each name and offloads the other
one; nothing is reloaded on demand; and every reload (on demand or look-ahead) runs during the
backward of the (micro-batch, stage) whose forward produced the group. The same on CUDA (marked
``gpu``: side streams, pinned host memory).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from memory.test_offload import GRAD_TOL, OUT_TOL, tokens, transformer

from lightning_moe.memory import OFFLOAD_MODULES, apply_activation_offload
from lightning_moe.parallel.pipeline.split import StageModule, pipeline_parts_of

M, BLOCKS_PER_STAGE = 4, 2


def _interleaved() -> list[tuple[str, int, int]]:
    """One rank holding stages 0 and 1: warm-up forwards, then backwards of older micro-batches between newer forwards."""
    text = "F00 F01 F10 F11 B10 F02 B11 F03 B00 F12 B01 F13 B12 B13 B02 B03"
    return [(a[0], int(a[1]), int(a[2])) for a in text.split()]


SCHEDULES = {
    "GPipe": [("F", 0, m) for m in range(M)] + [("F", 1, m) for m in range(M)]
    + [("B", 1, m) for m in range(M)] + [("B", 0, m) for m in range(M)],
    "interleaved": _interleaved(),
}


def _stages(model) -> list[StageModule]:
    parts = pipeline_parts_of(model)
    return [StageModule(model, parts, [0, 1], True, False), StageModule(model, parts, [2, 3], False, True)]


def _run(model, schedule, offload: bool, device: str = "cpu"):
    """Run ``schedule`` (actions ``(F|B, stage, micro-batch)``); returns losses, gradients, the handle and reloads."""
    stages = _stages(model)
    handle = apply_activation_offload(model, OFFLOAD_MODULES, min_tensor_bytes=0) if offload else None
    reloads: list[tuple[tuple[int, int], tuple[int, int]]] = []  # (producer of the group, running backward)
    owner: dict[int, tuple[int, int]] = {}  # id of an offload micro-batch -> the (stage, micro-batch) forward
    running: list[tuple[int, int]] = []
    if offload:
        handle.start_microbatch_at(stages)
        offloader = handle.offloader
        reload = offloader._reload

        def logged_reload(group):
            reloads.append((owner[id(group.microbatch)], running[-1]))
            reload(group)

        offloader._reload = logged_reload
    batches = [tokens(10 + m, device) for m in range(M)]
    outputs, inputs, losses = {}, {}, {}
    for kind, stage, m in schedule:
        running.append((stage, m))
        if kind == "F":
            if stage == 0:
                outputs[0, m] = stages[0](batches[m][:, :-1])
            else:
                inputs[m] = outputs[0, m].detach().requires_grad_()
                logits = stages[1](inputs[m])
                losses[m] = F.cross_entropy(logits.flatten(0, 1), batches[m][:, 1:].flatten())
            if offload:
                owner[id(offloader._microbatch)] = (stage, m)  # the micro-batch this forward filled
        elif stage == 1:
            losses[m].backward()
        else:
            outputs[0, m].backward(inputs[m].grad)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return torch.stack([losses[m].detach() for m in range(M)]), grads, handle, reloads


def _check(schedule, device: str):
    base = transformer(num_layers=2 * BLOCKS_PER_STAGE, device=device)
    want_losses, want_grads, _, _ = _run(copy.deepcopy(base), schedule, False, device)
    losses, grads, handle, reloads = _run(copy.deepcopy(base), schedule, True, device)
    torch.testing.assert_close(losses, want_losses, **OUT_TOL)
    for param, grad in want_grads.items():
        torch.testing.assert_close(grads[param], grad, **GRAD_TOL, msg=param)
    stats = handle.offloader.stats
    names, forwards = len(OFFLOAD_MODULES), 2 * M  # every block is a MoE block with every boundary
    assert stats.reloads_on_demand == 0
    assert stats.kept_groups == forwards * names  # the last of each name per (micro-batch, stage)
    assert stats.offloaded_groups == forwards * names * (BLOCKS_PER_STAGE - 1)
    assert stats.reloaded_bytes == stats.offloaded_bytes > 0
    assert len(reloads) == stats.offloaded_groups
    assert all(producer == backward for producer, backward in reloads), reloads
    return handle


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_stage_forward_is_its_own_offload_microbatch(name):
    _check(SCHEDULES[name], "cpu")


@pytest.mark.gpu
def test_gpu_each_stage_forward_is_its_own_offload_microbatch():
    handle = _check(SCHEDULES["interleaved"], "cuda")
    d2h, h2d = handle.offloader.streams
    assert d2h is not None and h2d is not None
    assert d2h != torch.cuda.current_stream() and h2d != torch.cuda.current_stream()


def test_remove_drops_the_microbatch_starts():
    model = transformer(num_layers=2 * BLOCKS_PER_STAGE)
    stages = _stages(model)
    handle = apply_activation_offload(model, ["expert_fc1"], min_tensor_bytes=0)
    handle.start_microbatch_at(stages)
    assert all(len(stage._forward_pre_hooks) == 1 for stage in stages)
    handle.remove()
    assert all(not stage._forward_pre_hooks for stage in stages)
