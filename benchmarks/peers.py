"""Peer MoE layers for side-by-side benchmarks against ``lightning_moe.layers.moe.MoELayer``.

Each ``build_<name>(tokens, hidden, ffn, experts, top_k, dtype, seed)`` returns a :class:`Peer`
whose ``forward`` maps ``[T, H]`` tokens to ``[T, H]``. The peer libraries are imported lazily,
inside the builders; a missing library, or one that fails to build on this machine, raises
:class:`PeerUnavailable` with the install hint. ``build_all`` never raises for those.

Every peer gets the same layer: SwiGLU experts, a softmax top-k router whose top-k
probabilities are renormalised (HF ``norm_topk_prob=True`` = Megatron softmax after top-k),
no auxiliary loss, no shared expert, no bias, parameters in ``dtype`` and all re-initialised
N(0, 0.02) from ``seed`` (the HF Qwen3 router starts at zero otherwise).

Versions verified on CPU (torch 2.13): transformers 5.24.0, megatron-core 0.16.1 (the ``bench``
extra), DeepSpeed 0.19.8 and torchtitan 0.3.0. The last two are NOT in the ``bench`` extra: installed
with their dependencies they change the environment (torchtitan's ``datasets<4.8`` pin downgrades
huggingface-hub; DeepSpeed is an sdist that must build against the installed torch), so install
them into a separate directory and put it on ``PYTHONPATH`` only for the benchmark run::

    DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 pip install --no-build-isolation --no-deps --target /tmp/peers_ds \
        deepspeed==0.19.8 hjson py-cpuinfo ninja msgpack psutil nvidia-ml-py einops
    pip install --no-deps --target /tmp/peers_titan torchtitan==0.3.0 spmd_types==0.2.3 \
        torch_checkpointing tyro einops triton==3.9.0   # triton: imported at module level, even on CPU
    PYTHONPATH=/tmp/peers_ds:/tmp/peers_titan python benchmarks/moe_layer.py

(or a throwaway virtual environment with ``pip install deepspeed torchtitan triton``).
Every note states the peer's routing: all peers route for real (softmax top-k, same config);
none is forced to a balanced assignment.

``python benchmarks/peers.py`` runs :func:`cross_check_small`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "PEERS",
    "Peer",
    "PeerUnavailable",
    "available_peers",
    "build_all",
    "build_deepspeed",
    "build_deepspeed_routing_overhead",
    "build_hf_mixtral_grouped_mm",
    "build_hf_qwen3_grouped_mm",
    "build_megatron_core",
    "build_megatron_routing_overhead",
    "build_torchtitan",
    "build_torchtitan_routing_overhead",
    "cross_check_small",
]

INSTALL_HINT = "pip install -e '.[bench]' in a clone of lightning_moe"
SEPARATE_INSTALL_HINT = "a separate directory on PYTHONPATH (see the docstring of benchmarks/peers.py)"
INIT_STD = 0.02


class PeerUnavailable(Exception):
    """A peer's library is not installed, or the peer cannot be built on this machine."""


@dataclass
class Peer:
    """A built peer layer: ``forward`` maps ``[T, H]`` tokens to ``[T, H]``."""

    name: str
    module: nn.Module
    forward: Callable[[Tensor], Tensor]
    notes: str


def _generator(seed: int | torch.Generator) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    return torch.Generator(device="cpu").manual_seed(int(seed))


@torch.no_grad()
def _reinit_normal(module: nn.Module, seed: int | torch.Generator, std: float = INIT_STD) -> None:
    """Redraw every parameter of ``module`` from N(0, std), in ``named_parameters`` order."""
    gen = _generator(seed)
    for _, param in module.named_parameters():
        draw = torch.empty(param.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen)
        param.copy_(draw)


def _unavailable(name: str, package: str, err: BaseException, hint: str = INSTALL_HINT) -> PeerUnavailable:
    return PeerUnavailable(f"{name}: {package} unavailable ({type(err).__name__}: {err}). Install with: {hint}")


class _SwiGLUExpert(nn.Module):
    """One SwiGLU expert for the libraries that take an expert module (DeepSpeed):
    ``fc1`` ``[2F, H]`` (gate rows, then up rows), ``fc2`` ``[H, F]``, no bias."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


def _single_rank_group() -> None:
    """A single-rank gloo default process group, if none exists yet (Megatron and DeepSpeed need one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store_dir = tempfile.mkdtemp(prefix="peers_gloo_")
        store = dist.FileStore(os.path.join(store_dir, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"peers run in one process, found a process group of world size {dist.get_world_size()}")


# --------------------------------------------------------------------------------------------
# Hugging Face transformers (Qwen3-MoE, Mixtral): experts_implementation="grouped_mm"
# --------------------------------------------------------------------------------------------


def _hf_block(name: str, block_path: str, config_cls: str, block_cls: str, config_kwargs: dict,
              dtype: torch.dtype, seed: int | torch.Generator, notes: str) -> Peer:
    try:
        mod = importlib.import_module(block_path)
        config_type = getattr(mod, config_cls)
        block_type = getattr(mod, block_cls)
    except Exception as err:
        raise _unavailable(name, "transformers", err) from err
    try:
        # The experts implementation is a config kwarg (PreTrainedConfig pops "experts_implementation"
        # into config._experts_implementation); the @use_experts_implementation experts dispatch on it
        # at every forward. A bare block from a config without it would run the python "eager" loop.
        config = config_type(
            num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=config_kwargs["hidden_size"],
            vocab_size=16, hidden_act="silu", experts_implementation="grouped_mm", **config_kwargs,
        )
        if config._experts_implementation != "grouped_mm":
            raise RuntimeError(f"config._experts_implementation is {config._experts_implementation!r}")
        block = block_type(config)
        block.to(dtype=dtype)
        _reinit_normal(block, seed)
    except PeerUnavailable:
        raise
    except Exception as err:
        raise _unavailable(name, "transformers", err) from err

    def forward(tokens: Tensor) -> Tensor:
        # HF blocks take [B, S, H] and return a single tensor.
        return block(tokens.unsqueeze(0)).squeeze(0)

    return Peer(name=name, module=block, forward=forward, notes=notes)


def build_hf_qwen3_grouped_mm(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                              dtype: torch.dtype = torch.float32, seed: int | torch.Generator = 0) -> Peer:
    """transformers ``Qwen3MoeSparseMoeBlock`` with ``experts_implementation="grouped_mm"``."""
    del tokens
    return _hf_block(
        "hf_qwen3_grouped_mm", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeConfig",
        "Qwen3MoeSparseMoeBlock",
        dict(hidden_size=hidden, intermediate_size=ffn, moe_intermediate_size=ffn, num_experts=experts,
             num_experts_per_tok=top_k, norm_topk_prob=True, router_aux_loss_coef=0.0),
        dtype, seed,
        f"routing: real softmax top-{top_k} (norm_topk_prob), same config; "
        "sort + F.grouped_mm (transformers.integrations.moe, experts_implementation='grouped_mm'); "
        "fused gate_up_proj [E, 2F, H]; router logits in the input dtype",
    )


def build_hf_mixtral_grouped_mm(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                                dtype: torch.dtype = torch.float32, seed: int | torch.Generator = 0) -> Peer:
    """transformers ``MixtralSparseMoeBlock`` with ``experts_implementation="grouped_mm"``."""
    del tokens
    return _hf_block(
        "hf_mixtral_grouped_mm", "transformers.models.mixtral.modeling_mixtral", "MixtralConfig",
        "MixtralSparseMoeBlock",
        dict(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=top_k,
             router_aux_loss_coef=0.0, router_jitter_noise=0.0),
        dtype, seed,
        f"routing: real softmax top-{top_k} (always renormalised), same config; "
        "sort + F.grouped_mm (same experts code as Qwen3); "
        "fused gate_up_proj [E, 2F, H]",
    )


# --------------------------------------------------------------------------------------------
# Megatron Core MoELayer, one process (single-rank gloo group), allgather dispatcher
# --------------------------------------------------------------------------------------------


def _megatron_init_parallel() -> None:
    """A single-rank gloo process group and Megatron's model-parallel state, if not set up yet."""
    from megatron.core import parallel_state

    _single_rank_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _megatron_layer(name: str, hidden: int, ffn: int, experts: int, top_k: int, dtype: torch.dtype,
                    seed: int | torch.Generator, identity_experts: bool) -> nn.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # apex / Transformer Engine "not found" warnings
            from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
            from megatron.core.transformer.moe.moe_layer import MoELayer
            from megatron.core.transformer.moe.router import TopKRouter
            from megatron.core.transformer.spec_utils import ModuleSpec
            from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as err:
        raise _unavailable(name, "megatron-core", err) from err

    class CPUTopKRouter(TopKRouter):
        """TopKRouter whose gating() is a plain F.linear.

        Megatron's gating() moves a CPU weight to ``torch.cuda.current_device()`` and its
        ``router_gating_linear`` needs Transformer Engine on 0.16.1 (``te_general_gemm`` unbound);
        routing() (softmax after top-k) and everything else stay Megatron's.
        """

        def gating(self, input: Tensor) -> Tensor:
            router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
            return F.linear(input.to(router_dtype), self.weight.to(router_dtype))

    class IdentityExperts(nn.Module):
        """Experts that return their input times its routing probability (routing-overhead runs)."""

        def __init__(self, num_local_experts, config, pg_collection=None):
            super().__init__()

        def forward(self, hidden_states, tokens_per_expert, permuted_probs):
            return hidden_states * permuted_probs.unsqueeze(-1).to(hidden_states.dtype), None

    try:
        _megatron_init_parallel()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "full scope is deprecated" (cuda_graph_scope default)
            config = TransformerConfig(
                num_layers=1, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=ffn,
                moe_ffn_hidden_size=ffn, num_moe_experts=experts, moe_router_topk=top_k,
                moe_router_score_function="softmax", moe_router_pre_softmax=False,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                moe_permute_fusion=False, moe_router_fusion=False, moe_router_dtype="fp32",
                gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
                add_bias_linear=False, transformer_impl="local", use_cpu_initialization=True,
                perform_initialization=False,  # re-initialised below
                params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                pipeline_dtype=dtype, init_method_std=INIT_STD,
            )
        spec = get_moe_module_spec(use_te=False, num_experts=experts, moe_grouped_gemm=False)
        spec.submodules.router = CPUTopKRouter
        if identity_experts:
            spec.submodules.experts = ModuleSpec(module=IdentityExperts)
        layer = MoELayer(config, submodules=spec.submodules)  # parameters already in params_dtype
        _reinit_normal(layer, seed)
    except PeerUnavailable:
        raise
    except Exception as err:
        raise _unavailable(name, "megatron-core", err) from err
    return layer


def _megatron_forward(layer: nn.Module) -> Callable[[Tensor], Tensor]:
    def forward(tokens: Tensor) -> Tensor:
        # Megatron takes [S, B, H] and returns (output, mlp_bias).
        out, _ = layer(tokens.unsqueeze(1))
        return out.squeeze(1)

    return forward


def build_megatron_core(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                        dtype: torch.dtype = torch.float32, seed: int | torch.Generator = 0) -> Peer:
    """megatron-core ``MoELayer`` (local spec, allgather dispatcher, ``SequentialMLP``)."""
    del tokens
    name = "megatron_core"
    layer = _megatron_layer(name, hidden, ffn, experts, top_k, dtype, seed, identity_experts=False)
    return Peer(
        name=name, module=layer, forward=_megatron_forward(layer),
        notes=f"routing: real softmax top-{top_k} (softmax after top-k), same config; "
              "allgather dispatcher, SequentialMLP loop (F.linear per expert); gating() via F.linear, "
              "fp32 router; probs applied before fc2",
    )


def build_megatron_routing_overhead(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                                    dtype: torch.dtype = torch.float32,
                                    seed: int | torch.Generator = 0) -> Peer:
    """megatron-core ``MoELayer`` with identity experts: router + dispatch + combine only."""
    del tokens, ffn
    name = "megatron_routing_overhead"
    layer = _megatron_layer(name, hidden, hidden, experts, top_k, dtype, seed, identity_experts=True)
    return Peer(
        name=name, module=layer, forward=_megatron_forward(layer),
        notes=f"routing: real softmax top-{top_k}; identity experts (x * prob): router + allgather "
              "permute/unpermute only; gating() via F.linear",
    )


# --------------------------------------------------------------------------------------------
# DeepSpeed MoE, one process (not in the bench extra: see the module docstring)
# --------------------------------------------------------------------------------------------


class _IdentityDeepSpeedExperts(nn.Module):
    """DeepSpeed experts that return their dispatched ``[E, C, H]`` input (routing-overhead runs);
    the combine einsum still multiplies by the gate probabilities."""

    def forward(self, dispatched: Tensor) -> Tensor:
        return dispatched


def _deepspeed_layer(name: str, hidden: int, ffn: int, experts: int, top_k: int, dtype: torch.dtype,
                     seed: int | torch.Generator, identity_experts: bool) -> nn.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from deepspeed.moe.layer import MoE
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # "Creating MoE layer with ..."
    except Exception as err:
        raise _unavailable(name, "deepspeed", err, SEPARATE_INSTALL_HINT) from err
    try:
        _single_rank_group()
        # drop_tokens=False: dropless, capacity = the largest expert load (every expert is padded to
        # it); top-k > 2 goes through topkgating (softmax, top-k, renormalised); no noise, no RTS.
        layer = MoE(
            hidden_size=hidden, expert=_SwiGLUExpert(hidden, ffn), num_experts=experts, ep_size=1, k=top_k,
            capacity_factor=1.0, min_capacity=0, drop_tokens=False, use_rts=False, noisy_gate_policy=None,
            top2_2nd_expert_sampling=False,
        )
        if identity_experts:
            layer.deepspeed_moe.experts = _IdentityDeepSpeedExperts()
        layer.to(dtype=dtype)
        _reinit_normal(layer, seed)
    except Exception as err:
        raise _unavailable(name, "deepspeed", err, SEPARATE_INSTALL_HINT) from err
    return layer


def _deepspeed_forward(layer: nn.Module) -> Callable[[Tensor], Tensor]:
    def forward(tokens: Tensor) -> Tensor:
        # DeepSpeed takes [B, S, H] and returns (output, l_aux, expert_counts).
        out, _, _ = layer(tokens.unsqueeze(0))
        return out.squeeze(0)

    return forward


def build_deepspeed(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                    dtype: torch.dtype = torch.float32, seed: int | torch.Generator = 0) -> Peer:
    """DeepSpeed ``deepspeed.moe.layer.MoE`` (ep_size=1, dropless) with SwiGLU experts."""
    del tokens
    name = "deepspeed"
    layer = _deepspeed_layer(name, hidden, ffn, experts, top_k, dtype, seed, identity_experts=False)
    return Peer(
        name=name, module=layer, forward=_deepspeed_forward(layer),
        notes=f"routing: real softmax top-{top_k} (renormalised), same config; drop_tokens=False: every "
              "expert padded to the largest load, dense einsum dispatch/combine, python loop over E expert copies",
    )


def build_deepspeed_routing_overhead(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                                     dtype: torch.dtype = torch.float32,
                                     seed: int | torch.Generator = 0) -> Peer:
    """DeepSpeed MoE with identity experts: gate + dispatch + combine only."""
    del tokens, ffn
    name = "deepspeed_routing_overhead"
    layer = _deepspeed_layer(name, hidden, hidden, experts, top_k, dtype, seed, identity_experts=True)
    return Peer(
        name=name, module=layer, forward=_deepspeed_forward(layer),
        notes=f"routing: real softmax top-{top_k}; identity experts: gate + einsum dispatch/combine "
              "(capacity = largest load) only",
    )


# --------------------------------------------------------------------------------------------
# torchtitan MoE (LocalTokenDispatcher + GroupedExperts; not in the bench extra)
# --------------------------------------------------------------------------------------------


class _IdentityTitanExperts(nn.Module):
    """torchtitan inner experts that return their routed rows (routing-overhead runs); the
    dispatcher's combine still multiplies by the routing scores."""

    def forward(self, routed: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        return routed


def _torchtitan_layer(name: str, hidden: int, ffn: int, experts: int, top_k: int, dtype: torch.dtype,
                      seed: int | torch.Generator, identity_experts: bool) -> nn.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchtitan.models.common.linear import Linear
            from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
            from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    except Exception as err:
        raise _unavailable(name, "torchtitan", err, SEPARATE_INSTALL_HINT) from err
    try:
        config = MoE.Config(
            num_experts=experts,
            routed_experts=RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=hidden, hidden_dim=ffn, num_experts=experts),
                token_dispatcher=LocalTokenDispatcher.Config(num_experts=experts, top_k=top_k),
            ),
            router=TokenChoiceTopKRouter.Config(
                num_experts=experts, gate=Linear.Config(in_features=hidden, out_features=experts), top_k=top_k,
                score_func="softmax", route_norm=True,
            ),
            load_balance_coeff=None,
        )
        layer = config.build()
        if identity_experts:
            layer.routed_experts.inner_experts = _IdentityTitanExperts()
        layer.to(dtype=dtype)
        _reinit_normal(layer, seed)  # expert weights are torch.empty
    except Exception as err:
        raise _unavailable(name, "torchtitan", err, SEPARATE_INSTALL_HINT) from err
    return layer


def _torchtitan_forward(layer: nn.Module) -> Callable[[Tensor], Tensor]:
    def forward(tokens: Tensor) -> Tensor:
        # torchtitan takes [B, L, D]; its router's autocast(float32) is refused on CPU (a warning).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return layer(tokens.unsqueeze(0)).squeeze(0)

    return forward


def build_torchtitan(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                     dtype: torch.dtype = torch.float32, seed: int | torch.Generator = 0) -> Peer:
    """torchtitan ``MoE`` (``LocalTokenDispatcher``, ``GroupedExperts``, softmax router)."""
    del tokens
    name = "torchtitan"
    layer = _torchtitan_layer(name, hidden, ffn, experts, top_k, dtype, seed, identity_experts=False)
    return Peer(
        name=name, module=layer, forward=_torchtitan_forward(layer),
        notes=f"routing: real softmax top-{top_k} (route_norm), same config; argsort + torch._grouped_mm; "
              "GroupedExperts always casts tokens and weights to bf16 (very slow on CPUs without bf16 GEMMs)",
    )


def build_torchtitan_routing_overhead(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                                      dtype: torch.dtype = torch.float32,
                                      seed: int | torch.Generator = 0) -> Peer:
    """torchtitan MoE with identity experts: router + argsort permute + scatter-add combine only."""
    del tokens, ffn
    name = "torchtitan_routing_overhead"
    layer = _torchtitan_layer(name, hidden, hidden, experts, top_k, dtype, seed, identity_experts=True)
    return Peer(
        name=name, module=layer, forward=_torchtitan_forward(layer),
        notes=f"routing: real softmax top-{top_k}; identity experts: router + argsort gather + scatter-add only",
    )


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

Builder = Callable[..., Peer]

PEERS: dict[str, tuple[str, Builder]] = {
    "hf_qwen3_grouped_mm": ("transformers", build_hf_qwen3_grouped_mm),
    "hf_mixtral_grouped_mm": ("transformers", build_hf_mixtral_grouped_mm),
    "megatron_core": ("megatron.core", build_megatron_core),
    "megatron_routing_overhead": ("megatron.core", build_megatron_routing_overhead),
    "deepspeed": ("deepspeed", build_deepspeed),
    "deepspeed_routing_overhead": ("deepspeed", build_deepspeed_routing_overhead),
    "torchtitan": ("torchtitan", build_torchtitan),
    "torchtitan_routing_overhead": ("torchtitan", build_torchtitan_routing_overhead),
}
"""Every known peer: name -> (top-level module it needs, builder)."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_peers() -> dict[str, Builder]:
    """The peers whose library is installed (found without importing it); building may still fail."""
    return {name: builder for name, (module, builder) in PEERS.items() if _importable(module)}


def build_all(names: list[str] | tuple[str, ...] | None = None,
              **kw) -> tuple[list[Peer], dict[str, str]]:
    """Build the named peers (default: all of :data:`PEERS`) with the builder keywords ``kw``
    (``tokens, hidden, ffn, experts, top_k, dtype, seed``).

    Returns ``(peers, skipped)``; ``skipped`` maps each peer that could not be built to the reason.
    Raises ``ValueError`` only for names that are not peers at all.
    """
    names = list(PEERS) if names is None else list(names)
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {sorted(PEERS)}")
    peers: list[Peer] = []
    skipped: dict[str, str] = {}
    for name in names:
        try:
            peers.append(PEERS[name][1](**kw))
        except PeerUnavailable as err:
            skipped[name] = str(err)
    return peers, skipped


# --------------------------------------------------------------------------------------------
# Numerical cross-check
# --------------------------------------------------------------------------------------------


def _reference_params(peer: Peer) -> dict[str, Callable[[], Tensor]]:
    """Getters of the peer's router ``[E, H]``, fc1 ``[E, 2F, H]`` (gate rows, then up rows) and
    fc2 ``[E, H, F]`` parameters in that common layout, as ``name -> lambda: tensor``; each
    tensor is returned as a view or a stack of the peer's own parameters (``attr`` picks the
    parameter itself or its ``.grad``)."""
    m = peer.module
    if peer.name.startswith("hf_"):
        # HF: gate.weight [E, H]; experts.gate_up_proj [E, 2F, H] (not transposed, concatenated:
        # chunk(2, -1) -> gate, up); experts.down_proj [E, H, F].
        return {"router": lambda: m.gate.weight, "fc1": lambda: m.experts.gate_up_proj,
                "fc2": lambda: m.experts.down_proj}
    if peer.name == "megatron_core":
        # Megatron SequentialMLP: local_experts[e].linear_fc1.weight [2F, H] (glu: chunk(2, -1) ->
        # gate, up), local_experts[e].linear_fc2.weight [H, F]; router.weight [E, H].
        experts = m.experts.local_experts
        return {"router": lambda: m.router.weight,
                "fc1": lambda: [ex.linear_fc1.weight for ex in experts],
                "fc2": lambda: [ex.linear_fc2.weight for ex in experts]}
    if peer.name == "deepspeed":
        # DeepSpeed: deepspeed_moe.gate.wg.weight [E, H]; deepspeed_experts[e].fc1.weight [2F, H]
        # (our _SwiGLUExpert: gate rows, then up rows), fc2.weight [H, F].
        moe = m.deepspeed_moe
        experts = moe.experts.deepspeed_experts
        return {"router": lambda: moe.gate.wg.weight,
                "fc1": lambda: [ex.fc1.weight for ex in experts],
                "fc2": lambda: [ex.fc2.weight for ex in experts]}
    if peer.name == "lightning_moe":
        return {"router": lambda: m.router.weight, "fc1": lambda: m.experts.fc1_weight,
                "fc2": lambda: m.experts.fc2_weight}
    raise ValueError(f"no reference layout for {peer.name}")


@torch.no_grad()
def _load_reference_weights(peer: Peer, weights: dict[str, Tensor]) -> None:
    for key, get in _reference_params(peer).items():
        params = get()
        if isinstance(params, list):
            for e, p in enumerate(params):
                p.copy_(weights[key][e])
        else:
            params.copy_(weights[key])


def _reference_grads(peer: Peer) -> dict[str, Tensor]:
    grads = {}
    for key, get in _reference_params(peer).items():
        params = get()
        if isinstance(params, list):
            grads[key] = torch.stack([torch.zeros_like(p) if p.grad is None else p.grad for p in params])
        else:
            grads[key] = params.grad
    return grads


def _lightning_peer(hidden: int, ffn: int, experts: int, top_k: int) -> Peer | None:
    if not _importable("lightning_moe.layers.moe"):
        return None
    from lightning_moe.layers.config import MoEConfig
    from lightning_moe.layers.moe import MoELayer

    layer = MoELayer(MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k))
    return Peer(name="lightning_moe", module=layer, forward=layer, notes="lightning_moe MoELayer (local path)")


def _check_runs(peer: Peer, x: Tensor) -> list[str]:
    """Forward + backward; returns the problems found (empty = fine)."""
    problems = []
    peer.module.zero_grad(set_to_none=True)
    xin = x.clone().requires_grad_(True)
    out = peer.forward(xin)
    if out.shape != x.shape:
        problems.append(f"output shape {tuple(out.shape)} != {tuple(x.shape)}")
    if out.dtype != x.dtype:
        problems.append(f"output dtype {out.dtype} != {x.dtype}")
    out.float().square().sum().backward()
    if xin.grad is None or not torch.isfinite(xin.grad).all():
        problems.append("no finite input gradient")
    for pname, p in peer.module.named_parameters():
        if p.grad is None:
            problems.append(f"no grad for {pname}")
        elif not torch.isfinite(p.grad).all() or p.grad.abs().sum() == 0:
            problems.append(f"zero or non-finite grad for {pname}")
    peer.module.zero_grad(set_to_none=True)
    return problems


def _uses_grouped_mm(peer: Peer, x: Tensor) -> bool:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        peer.forward(x)
    return any(evt.key == "aten::_grouped_mm" for evt in prof.key_averages())


def cross_check_small(tokens: int = 64, hidden: int = 32, ffn: int = 16, experts: int = 8, top_k: int = 2,
                      seed: int = 0, atol: float = 1e-5, dtype: torch.dtype = torch.float32,
                      verbose: bool = True) -> dict[str, object]:
    """Check the peers on a small config, then cross-check their numerics.

    1. Build every peer (``build_all``); run forward + backward on ``[T, H]`` N(0, 1) tokens:
       output shape and dtype, a finite input gradient, a nonzero gradient on every parameter.
       For the HF peers, profile a forward and require ``aten::_grouped_mm``.
    2. Load the SAME weights into ``hf_qwen3_grouped_mm``, ``hf_mixtral_grouped_mm``,
       ``megatron_core``, ``deepspeed`` (when installed) and, if ``lightning_moe.layers.moe`` exists, lightning_moe's
       ``MoELayer``; compare output, input gradient and router / fc1 / fc2 gradients with the
       Qwen3 block (max abs difference <= ``atol``). The weights are N(0, 1/fan_in) so that the
       output is O(1) and ``atol`` is meaningful (at std 0.02 the output is ~1e-3).

    Returns ``{"skipped", "problems", "grouped_mm", "reference", "max_abs_diff", "ok"}`` where
    ``max_abs_diff[name]`` maps ``out``, ``dx``, ``d_router``, ``d_fc1``, ``d_fc2`` to floats.
    """
    kw = dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, dtype=dtype, seed=seed)
    peers, skipped = build_all(**kw)
    gen = _generator(seed + 1)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)

    result: dict[str, object] = {"skipped": skipped, "problems": {}, "grouped_mm": {}, "max_abs_diff": {}}
    for peer in peers:
        result["problems"][peer.name] = _check_runs(peer, x)
        if peer.name.startswith("hf_"):
            result["grouped_mm"][peer.name] = _uses_grouped_mm(peer, x)

    # torchtitan is left out: its experts compute in bf16 whatever the weights' dtype.
    comparable = [p for p in peers
                  if p.name in ("hf_qwen3_grouped_mm", "hf_mixtral_grouped_mm", "megatron_core", "deepspeed")]
    lightning = _lightning_peer(hidden, ffn, experts, top_k)
    if lightning is not None:
        lightning.module.to(dtype)
        comparable.append(lightning)
    weights = {
        "router": torch.randn(experts, hidden, generator=gen) / hidden**0.5,
        "fc1": torch.randn(experts, 2 * ffn, hidden, generator=gen) / hidden**0.5,
        "fc2": torch.randn(experts, hidden, ffn, generator=gen) / ffn**0.5,
    }
    dy = torch.randn(tokens, hidden, generator=gen).to(dtype)
    runs = {}
    for peer in comparable:
        _load_reference_weights(peer, weights)
        peer.module.zero_grad(set_to_none=True)
        xin = x.clone().requires_grad_(True)
        out = peer.forward(xin)
        out.backward(dy)
        runs[peer.name] = {"out": out.detach(), "dx": xin.grad,
                           **{f"d_{k}": g for k, g in _reference_grads(peer).items()}}
    if runs:
        ref_name = "hf_qwen3_grouped_mm" if "hf_qwen3_grouped_mm" in runs else next(iter(runs))
        result["reference"] = ref_name
        for name, run in runs.items():
            result["max_abs_diff"][name] = {
                k: (v.float() - runs[ref_name][k].float()).abs().max().item() for k, v in run.items()
            }
        result["output_scale"] = runs[ref_name]["out"].abs().max().item()
    result["ok"] = (
        all(not p for p in result["problems"].values())
        and all(result["grouped_mm"].values())
        and all(d <= atol for diffs in result["max_abs_diff"].values() for d in diffs.values())
    )
    if verbose:
        for peer in peers:
            print(f"{peer.name:26s} problems: {result['problems'][peer.name] or 'none'}; notes: {peer.notes}")
        for name, reason in skipped.items():
            print(f"{name:26s} SKIPPED: {reason}")
        for name, used in result["grouped_mm"].items():
            print(f"{name:26s} aten::_grouped_mm in the profile: {used}")
        if runs:
            print(f"same weights, max |diff| vs {result['reference']} (max |out| = {result['output_scale']:.3g}):")
        for name, diffs in result["max_abs_diff"].items():
            print(f"  {name:24s} " + "  ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
        print("cross-check", "OK" if result["ok"] else "FAILED")
    return result


if __name__ == "__main__":
    import sys

    sys.exit(0 if cross_check_small()["ok"] else 1)
