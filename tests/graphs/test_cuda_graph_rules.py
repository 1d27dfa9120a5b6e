"""CUDA-graph logic on the CPU: scope rules, staged forwards, and the capture/replay plumbing (emulated).

What a CPU can verify (the real graphs run in ``test_cuda_graphs_gpu.py``):

* every refusal rule raises ``ValueError`` naming the scope and the reason;
* the staged forwards (scopes split out of ``TransformerBlock`` / ``MoELayer``) equal the modules'
  own forwards bit for bit, outputs and every gradient, so staging cannot drift from the model;
* the capture/replay plumbing (static buffers, replay autograd node, backward order, eager
  fallbacks, buffer restoration after warm-up and capture) run through the ``emulate`` backend
  gives the same training run as eager mode, with gradient accumulation, and parameter gradients
  that never alias graph memory (the ``make_graphed_callables`` accumulation bug);
* the callback's device policy and wiring in a real ``Trainer.fit``.
"""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
from graphs.tiny import DROP_AND_PAD, SCOPE_SETS, batches, stage_results, tiny_model, train
from helpers.lit import LossRecordingLM
from strategies.toy import quiet_trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture
from lightning_moe.callbacks.loss_scaling import MoELossScaling
from lightning_moe.graphs import CUDAGraphManager, find_targets, static_routed_rows, validate_scopes
from lightning_moe.layers.router import RouterReduction
from lightning_moe.memory import apply_selective_recompute
from lightning_moe.parallel.dispatchers import AllGatherDispatcher, AllToAllDispatcher

# The emulated replay re-runs the same ops, but the replayed backward sums the aux-loss gradient
# contributions through torch.autograd.grad instead of the engine's accumulation: a few fp32 ulps.
REPLAY_TOL = 1e-6


STAGED_METHODS = ("forward", "attention_residual", "ffn_residual")
"""The methods the manager replaces by instance attributes (a block's two residual parts, a bare MoE layer's forward)."""


def staged_methods(module: nn.Module) -> list[str]:
    """Which of :data:`STAGED_METHODS` ``module`` holds as instance attributes (none once released)."""
    return [name for name in STAGED_METHODS if name in module.__dict__]


def _router_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: buf.clone()
        for name, buf in model.named_buffers()
        if ".router." in f".{name}" and buf.dtype != torch.bool
    }


# ------------------------------------------------------------------------------------ scope lists


@pytest.mark.parametrize(
    ("scopes", "match"),
    [
        ([], "at least one"),
        (["attention"], r"Unknown CUDA-graph scope\(s\) \['attention'\]"),
        (["attn", "attn"], r"more than once"),
        (["moe", "moe_router"], "Scope 'moe' cannot be combined with scope 'moe_router'"),
        (["moe_preprocess"], "Scope 'moe_preprocess' extends the 'moe_router' graph.*add 'moe_router'"),
        (["moe", "moe_preprocess"], "Scope 'moe_preprocess' extends the 'moe_router' graph"),
    ],
)
def test_invalid_scope_lists_are_refused(scopes, match):
    with pytest.raises(ValueError, match=match):
        validate_scopes(scopes)


def test_scopes_come_back_in_layer_order():
    assert validate_scopes(["moe_preprocess", "moe_router", "attn"]) == ("attn", "moe_router", "moe_preprocess")
    assert validate_scopes("moe") == ("moe",)


def test_static_routed_rows():
    dropless = MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2)
    padded = MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, capacity_factor=1.5, pad_to_capacity=True)
    dropping = MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, capacity_factor=1.0)
    aligned = MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, router_padding_alignment=16)
    assert static_routed_rows(dropless, 10) == 20  # T * K
    assert static_routed_rows(padded, 10) == 4 * 8  # E * ceil(10 * 2 / 4 * 1.5)
    assert static_routed_rows(dropping, 10) is None
    assert static_routed_rows(aligned, 10) is None


# --------------------------------------------------------------------------------- refusal rules


def _with_dispatcher(model, cls):
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.dispatcher = cls.__new__(cls)  # only the type matters to the rules
    return model


@pytest.mark.parametrize(
    ("scopes", "moe", "dispatcher", "match"),
    [
        (["moe"], {}, None, r"Scope 'moe' on layers\.0: .*drop-and-pad.*dropless routing"),
        (["moe"], {"capacity_factor": 1.0}, None, r"Scope 'moe' on layers\.0: .*capacity dropping without padding"),
        (["moe"], DROP_AND_PAD, AllToAllDispatcher, r"Scope 'moe' on layers\.0: the AllToAllDispatcher dispatcher"),
        (["moe_router", "moe_preprocess"], {}, AllToAllDispatcher,
         r"Scope 'moe_preprocess' on layers\.0: the AllToAllDispatcher dispatcher synchronises with the host"),
        (["moe_router", "moe_preprocess"], {}, AllGatherDispatcher,
         r"Scope 'moe_preprocess' on layers\.0: the AllGatherDispatcher dispatcher synchronises with the host"),
        (["moe_router", "moe_preprocess"], {"router_padding_alignment": 16}, None,
         r"Scope 'moe_preprocess' on layers\.0: with router_padding_alignment=16 the number of routed rows"),
        (["moe_router", "moe_preprocess"], {"capacity_factor": 1.0}, None,
         r"Scope 'moe_preprocess' on layers\.0: capacity dropping without pad_to_capacity"),
    ],
)
def test_impossible_scopes_name_scope_and_reason(scopes, moe, dispatcher, match):
    model = tiny_model(moe)
    if dispatcher is not None:
        _with_dispatcher(model, dispatcher)
    with pytest.raises(ValueError, match=match):
        find_targets(model, scopes)
    with pytest.raises(ValueError, match=match):  # the manager applies the same rules, before changing anything
        CUDAGraphManager(model, scopes, backend="emulate")
    assert not any(staged_methods(m) for m in model.modules())


def test_router_scopes_refuse_captured_collectives():
    model = tiny_model()
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.router.reduction = RouterReduction(tp_cp_size=2, tp_dp_cp_size=2)
    with pytest.raises(ValueError, match=r"Scope 'moe_router' on layers\.0: the router sums its aux-loss counts over TP x CP"):
        find_targets(model, ["moe_router"])
    find_targets(model, ["attn"])  # the attention scope is unaffected

    model = tiny_model({"load_balancing": ["global_aux_loss"], "aux_loss_coeff": 0.01})
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.router.reduction = RouterReduction(tp_cp_size=1, tp_dp_cp_size=4)
    with pytest.raises(ValueError, match=r"Scope 'moe_router' on layers\.0: global_aux_loss sums its counts"):
        find_targets(model, ["moe_router"])


def test_scopes_refuse_tensor_parallel_parameters():
    model = tiny_model()
    weight = model.layers[1].attn.q_proj.weight
    weight.placements, weight.device_mesh = ("Shard(0)",), "mesh"  # what a DTensor looks like to the rule
    with pytest.raises(ValueError, match=r"Scope 'attn' on layers\.1: parameter 'q_proj.weight' is a DTensor"):
        find_targets(model, ["attn"])


def test_scopes_refuse_recompute_and_offload_inside_them():
    model = tiny_model()
    handle = apply_selective_recompute(model, ["attention", "moe_act"])
    with pytest.raises(ValueError, match=r"Scope 'attn' on layers\.0: selective recompute 'attention' is applied to layers\.0\.attn"):
        find_targets(model, ["attn"])
    find_targets(model, ["moe_router"])  # neither the attention nor moe_act is inside the router's graph
    handle.remove()
    manager = CUDAGraphManager(model, ["attn"], backend="emulate")
    apply_selective_recompute(model, ["layernorm"])  # applied after staging: caught at capture
    manager.start_recording()
    tokens = batches(1, 1, 2, 8)[0][0]
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    with pytest.raises(ValueError, match=r"selective recompute 'layernorm' is applied to layers\.0\.attn_norm"):
        manager.capture()


def test_release_under_a_later_wrapper_leaves_a_plain_eager_forward():
    model = tiny_model()
    reference = tiny_model()
    manager = CUDAGraphManager(model, ["moe_router"], backend="emulate")
    block = model.layers[0]
    staged = block.ffn_residual
    block.ffn_residual = lambda *args, **kwargs: staged(*args, **kwargs)  # someone wraps it afterwards
    manager.release()
    assert staged_methods(block) == ["ffn_residual"] and not staged_methods(model.layers[1])
    tokens = batches(1, 1, 2, 8)[0][0]
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)


def test_scopes_that_find_nothing_are_refused():
    bare = nn.Sequential(MoELayer(MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4)))
    with pytest.raises(ValueError, match=r"Scope 'attn' found no block in the model: .* parallel_plan\(\)\.graph_blocks"):
        find_targets(bare, ["attn"])
    dense = tiny_model(dense=True)
    with pytest.raises(ValueError, match=r"Scope\(s\) \['moe_router'\] found no MoELayer"):
        find_targets(dense, ["moe_router"])
    assert [t.scopes for t in find_targets(dense, ["attn"])] == [("attn",), ("attn",)]
    mixed = tiny_model(moe_layer_freq=[0, 1])
    assert [t.scopes for t in find_targets(mixed, ["attn", "moe_router"])] == [("attn",), ("attn", "moe_router")]


def test_backend_cuda_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        CUDAGraphManager(tiny_model(), ["attn"], backend="cuda")
    with pytest.raises(ValueError, match="Unknown CUDA-graph backend"):
        CUDAGraphManager(tiny_model(), ["attn"], backend="fake")


# ------------------------------------------------------------------------------- staged forwards


def _loss_and_grads(model, tokens, padding_mask=None):
    model.zero_grad()
    loss = model.loss(tokens[:, :-1], tokens[:, 1:], padding_mask=padding_mask)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("scopes", "moe"), [*SCOPE_SETS, (("moe_router",), {"router_padding_alignment": 4})])
def test_staged_forward_equals_the_model_bit_for_bit(scopes, moe):
    reference = tiny_model(moe)
    staged = copy.deepcopy(reference)
    CUDAGraphManager(staged, scopes, backend="emulate")  # staged, never recorded: runs eagerly
    tokens = batches(1, 1, 3, 10)[0][0]
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[1, 7:] = True
    for padding_mask in (None, mask):
        loss_ref, grads_ref = _loss_and_grads(reference, tokens, padding_mask)
        loss_staged, grads_staged = _loss_and_grads(staged, tokens, padding_mask)
        torch.testing.assert_close(loss_staged, loss_ref, rtol=0, atol=0)
        assert grads_staged.keys() == grads_ref.keys()
        for name in grads_ref:
            torch.testing.assert_close(grads_staged[name], grads_ref[name], rtol=0, atol=0, msg=name)
    for name, value in _router_buffers(reference).items():
        torch.testing.assert_close(_router_buffers(staged)[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("scopes", [("moe_router",), ("moe_router", "moe_preprocess"), ("moe",)])
def test_staged_bare_moe_layer_equals_the_layer(scopes):
    config = MoEConfig(
        hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2, load_balancing=["seq_aux_loss"],
        aux_loss_coeff=0.01, shared_expert_ffn_hidden_size=16, **DROP_AND_PAD,
    )
    torch.manual_seed(3)
    reference = nn.Sequential(MoELayer(config))
    staged = copy.deepcopy(reference)
    CUDAGraphManager(staged, scopes, backend="emulate")
    hidden = torch.randn(2, 6, 16)
    for shape in ((2, 6, 16), (12, 16)):
        outs = []
        for model in (reference, staged):
            x = hidden.reshape(shape).clone().requires_grad_()
            out = model(x)
            out.square().sum().backward()
            outs.append((out.detach(), x.grad))
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="MoELayer expects hidden of shape"):
        staged(torch.randn(2, 6, 8))  # the layer's own errors come through


# ------------------------------------------------------------------------ emulated capture/replay


@pytest.mark.parametrize(("scopes", "moe"), SCOPE_SETS)
def test_replayed_training_equals_eager(scopes, moe):
    eager = tiny_model(moe)
    graphed = copy.deepcopy(eager)
    data = batches(steps=5, micro=2, batch=2, seq=8)
    eager_losses, _, _ = train(eager, data)
    graphed_losses, manager, _ = train(graphed, data, scopes, warmup_steps=2)
    torch.testing.assert_close(graphed_losses, eager_losses, rtol=REPLAY_TOL, atol=REPLAY_TOL)
    for (name, p_eager), p_graphed in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(p_graphed, p_eager, rtol=REPLAY_TOL, atol=REPLAY_TOL, msg=name)
    # Warm-up and capture ran the router 1 + num_warmup_iters extra times; its statistics show none.
    graphed_buffers = _router_buffers(graphed)
    for name, value in _router_buffers(eager).items():
        torch.testing.assert_close(graphed_buffers[name], value, rtol=REPLAY_TOL, atol=REPLAY_TOL, msg=name)
    stats = manager.stats()
    assert stats and all(s["replays"] == 3 * 2 and s["eager_fallbacks"] == 0 for s in stats.values()), stats


def test_a_stage_replayed_alone_equals_its_eager_run():
    """The comparison the GPU test makes for each captured stage (``stage_results``), emulated."""
    _, manager, _ = train(tiny_model(), batches(steps=1, micro=1, batch=2, seq=8), ("attn", "moe_router"), 1)
    for stage in manager.stages[:2]:
        eager, replayed = stage_results(stage, replay=False), stage_results(stage, replay=True)
        assert len(eager) == len(replayed) > len(stage.params)
        for got, want in zip(replayed, eager):
            assert (got is None) == (want is None)
            if want is not None:
                torch.testing.assert_close(got, want, rtol=REPLAY_TOL, atol=REPLAY_TOL)


@pytest.mark.parametrize("scopes", [("moe_router", "moe_preprocess"), ("moe",)])
def test_replayed_bare_moe_layer_equals_eager(scopes):
    """An MoELayer outside a TransformerBlock (no norm in the graph; the tokens are a view of the input)."""
    config = MoEConfig(
        hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2, load_balancing=["aux_loss"],
        aux_loss_coeff=0.01, z_loss_coeff=1e-3, shared_expert_ffn_hidden_size=16, **DROP_AND_PAD,
    )
    torch.manual_seed(5)
    eager = nn.Sequential(nn.Linear(8, 16), MoELayer(config))
    graphed = copy.deepcopy(eager)
    manager = CUDAGraphManager(graphed, scopes, backend="emulate")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, graphed)]
    g = torch.Generator().manual_seed(6)
    for step in range(4):
        x = torch.randn(2, 6, 8, generator=g)
        if step == 1:
            manager.start_recording()
        losses = []
        for model, optimizer in zip((eager, graphed), optimizers):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        if manager.recording:
            manager.capture()
        torch.testing.assert_close(losses[1], losses[0], rtol=REPLAY_TOL, atol=REPLAY_TOL)
    for p_eager, p_graphed in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(p_graphed, p_eager, rtol=REPLAY_TOL, atol=REPLAY_TOL)
    assert all(s["replays"] == 2 for s in manager.stats().values())


def test_parameter_gradients_never_alias_graph_memory():
    model = tiny_model()
    data = batches(steps=2, micro=2, batch=2, seq=8)
    _, manager, _ = train(model, data[:1], ("attn", "moe_router"), warmup_steps=1)
    tokens = data[1][0]
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    static = {g.untyped_storage().data_ptr() for s in manager.stages for g in s._static_grads if g is not None}
    assert static and all(p.grad.untyped_storage().data_ptr() not in static for p in model.parameters())
    # A second micro-batch accumulates: g1 + g2, not 2 * g2 (make_graphed_callables' aliasing bug).
    tokens2 = data[1][1]
    model.loss(tokens2[:, :-1], tokens2[:, 1:]).backward()
    reference = tiny_model()
    reference.load_state_dict(model.state_dict())  # plain eager copy of the current weights
    reference.loss(tokens2[:, :-1], tokens2[:, 1:]).backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, first[name] + p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_eval_no_grad_and_new_shapes_run_eagerly():
    model = tiny_model()
    data = batches(steps=1, micro=1, batch=2, seq=8)
    _, manager, _ = train(model, data, ("attn", "moe_router"), warmup_steps=1)
    before = manager.stats()
    tokens = batches(1, 1, 2, 8, seed=5)[0][0][:, :-1]  # the recorded shape
    model.eval()
    model(tokens)
    model.train()
    with torch.no_grad():
        model(tokens)
    assert manager.stats() == {k: {**v, "eager_calls": v["eager_calls"] + 2} for k, v in before.items()}
    with pytest.warns(UserWarning, match="running eagerly"):
        model.loss(*(lambda t: (t[:, :-1], t[:, 1:]))(batches(1, 1, 3, 5, seed=6)[0][0])).backward()
    assert all(s["eager_fallbacks"] == 1 for s in manager.stats().values())
    model(tokens)
    assert all(s["replays"] == 1 for s in manager.stats().values())


def test_recording_and_release_contract():
    model = tiny_model(DROP_AND_PAD)
    manager = CUDAGraphManager(model, ["attn", "moe"], backend="emulate")
    with pytest.raises(RuntimeError, match="No stage was recorded"):
        manager.capture()
    tokens = batches(1, 1, 2, 8)[0][0]
    with manager.recording_step():
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    assert manager.captured
    with pytest.raises(RuntimeError, match="already captured"):
        manager.start_recording()
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.data = model.layers[0].attn.q_proj.weight.data.clone()
    with pytest.raises(RuntimeError, match="a parameter was reallocated after capture"):
        model.loss(tokens[:, :-1], tokens[:, 1:])
    manager.release()
    assert not manager.captured and not any(staged_methods(m) for m in model.modules())
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # plain eager again


# ------------------------------------------------------------------------------------ the callback


def _fit(model, callbacks, steps=5, accumulate=1):
    data = torch.cat([b[0] for b in batches(steps * accumulate, 1, 2, 8)])
    module = LossRecordingLM(model)
    # MoELossScaling: the aux-loss gradients follow the accumulation (as any user's run should).
    trainer = L.Trainer(
        **quiet_trainer_kwargs(max_steps=steps, accumulate_grad_batches=accumulate),
        callbacks=[*callbacks, MoELossScaling()],
    )
    trainer.fit(module, DataLoader(data, batch_size=2))
    return module


def test_callback_validates_its_arguments():
    with pytest.raises(ValueError, match="Scope 'moe' cannot be combined"):
        CUDAGraphCapture(scopes=["moe", "moe_router"])
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        CUDAGraphCapture(warmup_steps=0)


def test_callback_on_cpu_warns_and_stays_eager_or_raises_when_strict():
    eager = _fit(tiny_model(), [])
    callback = CUDAGraphCapture(scopes=["attn", "moe_router"], warmup_steps=2)
    with pytest.warns(UserWarning, match=r"needs a CUDA device but training runs on cpu; the model runs eagerly"):
        module = _fit(tiny_model(), [callback])
    assert module.losses == eager.losses and callback.stats() == {}
    with pytest.raises(RuntimeError, match=r"needs a CUDA device.*strict=False"):
        _fit(tiny_model(), [CUDAGraphCapture(scopes=["attn"], strict=True)])


def test_callback_checks_the_rules_on_cpu_too():
    with pytest.raises(ValueError, match=r"Scope 'moe' on model\.layers\.0: .*dropless"):
        _fit(tiny_model(), [CUDAGraphCapture(scopes=["moe"])])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_callback_replays_after_warmup(accumulate):
    eager = _fit(tiny_model(), [], accumulate=accumulate)
    callback = CUDAGraphCapture(scopes=["attn", "moe_router", "moe_preprocess"], warmup_steps=3, emulate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no eager fallback warning
        graphed = _fit(tiny_model(), [callback], accumulate=accumulate)
    torch.testing.assert_close(graphed.losses, eager.losses, rtol=REPLAY_TOL, atol=REPLAY_TOL)
    batches_run = 5 * accumulate
    stats = callback.stats()
    assert len(stats) == 4
    assert all(s["replays"] == batches_run - 3 and s["eager_fallbacks"] == 0 for s in stats.values()), stats
    assert not any(staged_methods(m) for m in graphed.modules())  # released at the end of fit
