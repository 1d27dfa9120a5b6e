"""`MoEConfig`: every setting of one MoE layer, validated when it is built.

Each field's docstring names the Megatron Core flag it matches, so configurations move between
the two. Attribute docstrings are what jsonargparse and LightningCLI show in ``--help``; they are
copied into the class docstring for ``help(MoEConfig)`` (:func:`~lightning_moe.layers.field_docs.document_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_moe.layers.activations import ACTIVATION_PARAMS, ACTIVATIONS
from lightning_moe.layers.field_docs import document_fields

__all__ = ["LOAD_BALANCING_TYPES", "SCORE_FUNCTIONS", "MoEConfig"]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = (None, "fp32", "fp64")


@document_fields
@dataclass
class MoEConfig:
    """Configuration of one Mixture-of-Experts layer (router, experts, shared expert, losses)."""

    hidden_size: int
    """Model width H of the tokens entering and leaving the layer (Megatron ``hidden_size``)."""

    ffn_hidden_size: int
    """Hidden width F of each routed expert (Megatron ``moe_ffn_hidden_size``). With a gated
    activation fc1 produces ``2F`` features."""

    num_experts: int
    """Number of routed experts E (Megatron ``num_moe_experts``, CLI ``--num-experts``)."""

    top_k: int = 2
    """Experts per token K (Megatron ``moe_router_topk``)."""

    score_func: str = "softmax"
    """Router score function: ``softmax``, ``sigmoid`` or ``sqrtsoftplus``
    (Megatron ``moe_router_score_function``)."""

    pre_softmax: bool = False
    """Softmax over all experts before top-k, without renormalising (DeepSeek-V2 style;
    Megatron ``moe_router_pre_softmax``). Required for softmax with ``top_k=1``."""

    num_groups: int | None = None
    """Expert groups for group-limited routing (Megatron ``moe_router_num_groups``)."""

    group_top_k: int | None = None
    """Groups each token may select from (Megatron ``moe_router_group_topk``)."""

    topk_scaling_factor: float | None = None
    """Multiplier applied to the routing probabilities (Megatron ``moe_router_topk_scaling_factor``)."""

    router_dtype: str | None = "fp32"
    """Dtype of logits, scores and probabilities: ``fp32``, ``fp64`` or None for the input dtype
    (Megatron ``moe_router_dtype``; its default is None, ours fp32 as Megatron recommends). The
    router runs outside autocast: under ``bf16-mixed`` it routes in this dtype, and None means the
    dtype of the router's input (fp32 activations route in fp32), never the autocast dtype."""

    expert_bias: bool = False
    """Aux-loss-free load balancing: a per-expert bias added to the scores for selection only,
    updated once per global batch by the sign rule (Megatron ``moe_router_enable_expert_bias``).
    Needs ``sigmoid`` or ``sqrtsoftplus`` scores."""

    bias_update_rate: float = 1e-3
    """Step of the expert-bias sign update (Megatron ``moe_router_bias_update_rate``)."""

    load_balancing: list[str] = field(default_factory=list)
    """Auxiliary load-balancing losses, any of ``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``
    (Megatron ``moe_router_load_balancing_type``; an empty list is its ``none``). Unlike Megatron,
    whose default type is ``aux_loss``, the default is none: list the types you want."""

    aux_loss_coeff: float | list[float] = 0.0
    """Coefficient of each load-balancing loss: one number for all, or one per entry of
    ``load_balancing`` (Megatron ``moe_aux_loss_coeff``). A coefficient of 0 turns that type off
    (not applied, not logged); a non-zero one with an empty ``load_balancing`` is an error."""

    z_loss_coeff: float | None = None
    """Router z-loss coefficient, 1e-3 is typical (Megatron ``moe_z_loss_coeff``)."""

    capacity_factor: float | None = None
    """Per-expert capacity as a multiple of the balanced load, ``ceil(T*K/E * factor)`` per rank;
    None is dropless (Megatron ``moe_expert_capacity_factor``)."""

    drop_policy: str = "probs"
    """Which assignments survive capacity: ``probs`` keeps the highest probabilities, ``position``
    the earliest tokens (Megatron ``moe_token_drop_policy``)."""

    pad_to_capacity: bool = False
    """Give every expert exactly ``capacity`` rows, padding with zero-probability rows, so shapes
    are static (Megatron ``moe_pad_expert_input_to_capacity``)."""

    router_padding_alignment: int | None = None
    """Pad each expert's token count to a multiple of this with zero-probability assignments, for
    FP8/FP4 grouped GEMMs (16, 32 or 128; Megatron ``moe_router_padding_for_quantization``)."""

    activation: str = "swiglu"
    """Expert activation: ``swiglu`` (gated), ``clamped_swiglu`` (gated, GPT-OSS's: see
    ``activation_alpha`` and ``activation_limit``), ``gelu``, ``relu`` or ``squared_relu``
    (Megatron ``gated_linear_unit`` + ``activation_func``)."""

    fc2_bias: bool = False
    """Bias on each expert's fc2, scaled by the routing probability (Megatron ``add_bias_linear``)."""

    shared_expert_ffn_hidden_size: int | None = None
    """Hidden width of the shared expert applied to every token; None for none
    (Megatron ``moe_shared_expert_intermediate_size``)."""

    shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x @ w)`` (Megatron ``moe_shared_expert_gate``)."""

    input_jitter_eps: float | None = None
    """Multiply the router input by ``Uniform(1-eps, 1+eps)`` noise in training
    (Megatron ``moe_input_jitter_eps``)."""

    force_load_balancing: bool = False
    """Benchmarks only: route with random logits (straight-through gradient) so the load is
    balanced (Megatron ``moe_router_force_load_balancing``)."""

    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight (Megatron ``init_method_std``)."""

    fc1_bias: bool = False
    """Bias on each expert's fc1 (GPT-OSS ``gate_up_proj_bias``), added before the activation; for a
    gated activation one ``[gate ; up]`` bias, ``experts.fc1_bias`` ``[E, 2, F]``. Initialised to zero."""

    router_bias: bool = False
    """Bias on the router's linear, ``router.bias`` ``[E]``, added to the logits before the top-k and
    the score function (GPT-OSS's router). Initialised to zero."""

    activation_alpha: float = 1.702
    """``clamped_swiglu`` only: ``out = gate * sigmoid(alpha * gate) * (up + 1)`` (GPT-OSS ``swiglu_alpha``)."""

    activation_limit: float = 7.0
    """``clamped_swiglu`` only: the gate is clamped to ``<= limit`` and the up projection to
    ``[-limit, limit]`` before the product (GPT-OSS ``swiglu_limit``)."""

    def __post_init__(self) -> None:
        if isinstance(self.load_balancing, str):
            self.load_balancing = [self.load_balancing]
        self.load_balancing = list(self.load_balancing)
        self._validate()

    @property
    def aux_loss_coeffs(self) -> dict[str, float]:
        """Coefficient of each configured load-balancing loss, by type."""
        coeffs = self.aux_loss_coeff
        if isinstance(coeffs, (int, float)):
            coeffs = [float(coeffs)] * len(self.load_balancing)
        return dict(zip(self.load_balancing, (float(c) for c in coeffs)))

    @property
    def activation_params(self) -> dict[str, float]:
        """The keyword parameters of ``activation`` (:data:`~lightning_moe.layers.activations.ACTIVATION_PARAMS`):
        ``alpha`` and ``limit`` for ``clamped_swiglu``, none for the others."""
        values = {"alpha": float(self.activation_alpha), "limit": float(self.activation_limit)}
        return {name: values[name] for name in ACTIVATION_PARAMS.get(self.activation, {})}

    def _validate(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}: a token cannot pick more "
                f"experts than exist. Use top_k <= {self.num_experts}."
            )
        if self.score_func not in SCORE_FUNCTIONS:
            raise ValueError(f"Unknown score_func {self.score_func!r}; choose one of {list(SCORE_FUNCTIONS)}.")
        if self.score_func == "softmax" and self.top_k == 1 and not self.pre_softmax:
            raise ValueError(
                "score_func='softmax' with top_k=1 gives every token probability 1 and the router no "
                "gradient. Set pre_softmax=True (or use sigmoid scores)."
            )
        if self.pre_softmax and self.score_func != "softmax":
            raise ValueError(f"pre_softmax=True only applies to score_func='softmax', not {self.score_func!r}.")
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"Unknown router_dtype {self.router_dtype!r}; choose one of {list(ROUTER_DTYPES)}.")
        self._validate_groups()
        if self.expert_bias and self.score_func == "softmax":
            raise ValueError(
                "expert_bias=True needs score_func 'sigmoid' or 'sqrtsoftplus' (the bias is added to "
                "non-negative scores, as in DeepSeek-V3); got score_func='softmax'."
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Unknown activation {self.activation!r}; choose one of {sorted(ACTIVATIONS)}.")
        if not self.activation_limit > 0:
            raise ValueError(
                f"activation_limit={self.activation_limit} must be > 0 (GPT-OSS uses 7.0): the up projection "
                "is clamped to [-limit, limit]."
            )
        self._validate_losses()
        self._validate_capacity()

    def _validate_groups(self) -> None:
        if (self.num_groups is None) != (self.group_top_k is None):
            raise ValueError(
                f"Group-limited routing needs both num_groups and group_top_k (got num_groups="
                f"{self.num_groups}, group_top_k={self.group_top_k}); set both or neither."
            )
        if self.num_groups is None:
            return
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by num_groups={self.num_groups}; "
                f"choose num_groups among the divisors of {self.num_experts}."
            )
        if not 1 <= self.group_top_k <= self.num_groups:
            raise ValueError(
                f"group_top_k={self.group_top_k} must be between 1 and num_groups={self.num_groups}."
            )
        if self.group_top_k > self.top_k:
            raise ValueError(
                f"group_top_k={self.group_top_k} exceeds top_k={self.top_k}: each selected group is scored "
                f"by its top top_k // group_top_k = 0 experts. Use group_top_k <= top_k."
            )
        reachable = self.group_top_k * (self.num_experts // self.num_groups)
        if self.top_k > reachable:
            raise ValueError(
                f"top_k={self.top_k} exceeds the {reachable} experts in group_top_k={self.group_top_k} "
                f"groups of {self.num_experts // self.num_groups}; raise group_top_k or lower top_k."
            )

    def _validate_losses(self) -> None:
        unknown = [t for t in self.load_balancing if t not in LOAD_BALANCING_TYPES]
        if unknown:
            raise ValueError(
                f"Unknown load_balancing type(s) {unknown}; choose from {list(LOAD_BALANCING_TYPES)} "
                "(an empty list means no auxiliary loss)."
            )
        if len(set(self.load_balancing)) != len(self.load_balancing):
            raise ValueError(f"load_balancing lists a type twice: {self.load_balancing}.")
        scalar_coeff = isinstance(self.aux_loss_coeff, (int, float))
        coeffs = [self.aux_loss_coeff] if scalar_coeff else self.aux_loss_coeff
        if not self.load_balancing and any(c != 0 for c in coeffs):
            # Megatron's default type is aux_loss, so a ported config may set only the coefficient;
            # here it would silently train without any load-balancing loss.
            raise ValueError(
                f"aux_loss_coeff={self.aux_loss_coeff} is set but load_balancing=[] enables no auxiliary "
                "loss, so it would be ignored. Name the losses it weights, e.g. load_balancing=['aux_loss'] "
                "(Megatron's default type), or set aux_loss_coeff=0.0 for no auxiliary loss."
            )
        if not scalar_coeff and len(self.aux_loss_coeff) != len(self.load_balancing):
            raise ValueError(
                f"aux_loss_coeff has {len(self.aux_loss_coeff)} entries but load_balancing has "
                f"{len(self.load_balancing)} ({self.load_balancing}); give one coefficient per type."
            )
        if any(c < 0 for c in self.aux_loss_coeffs.values()) or (self.z_loss_coeff or 0) < 0:
            raise ValueError("Loss coefficients must be >= 0.")

    def _validate_capacity(self) -> None:
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"Unknown drop_policy {self.drop_policy!r}; choose one of {list(DROP_POLICIES)}.")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} must be > 0; use None for dropless routing."
            )
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError(
                "pad_to_capacity=True needs a capacity_factor (the padded size); set capacity_factor, "
                "e.g. 1.0, or turn pad_to_capacity off."
            )
        if self.pad_to_capacity and self.capacity_factor > self.num_experts / self.top_k:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} > num_experts/top_k="
                f"{self.num_experts / self.top_k:g} with pad_to_capacity would route every token to "
                "every expert; lower the capacity factor."
            )
        if self.router_padding_alignment is not None:
            if self.router_padding_alignment < 1:
                raise ValueError(f"router_padding_alignment must be >= 1, got {self.router_padding_alignment}.")
            if self.pad_to_capacity:
                raise ValueError(
                    "router_padding_alignment and pad_to_capacity both pad the expert inputs; "
                    "pad_to_capacity already gives static sizes, so turn router_padding_alignment off."
                )
