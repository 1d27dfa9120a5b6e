"""`MoETransformerConfig`: the shape of the reference decoder-only MoE language model.

One dataclass holds every setting of :class:`~lightning_moe.models.MoETransformer`; the MoE
feed-forward layers take the nested :class:`~lightning_moe.MoEConfig`. Attribute docstrings are
what jsonargparse and LightningCLI show in ``--help``, and presets under
``examples/configs/models/`` are YAML files with these fields as top-level keys.

The parameter count is computed analytically (:meth:`MoETransformerConfig.num_parameters`), so
the size of a 600B-parameter model is known without building it; the tests check the formula
against the real module built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_moe.layers.activations import is_gated
from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.field_docs import document_fields
from lightning_moe.models.attention import qk_norm_mode
from lightning_moe.models.rope import RopeScaling

__all__ = ["ATTENTION_TYPES", "LAYER_TYPES", "MLA_FIELDS", "MoETransformerConfig"]

ATTENTION_TYPES = ("mha", "mla")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The settings of multi-head latent attention; None unless ``attention='mla'``."""
LAYER_TYPES = ("full_attention", "sliding_attention")
"""The entries of ``layer_types`` (``transformers``' names)."""


@document_fields
@dataclass
class MoETransformerConfig:
    """Configuration of a GPT-style decoder-only language model with Mixture-of-Experts FFNs.

    Each block is ``x + attn(attn_norm(x))`` then ``x + ffn(ffn_norm(x))``, where ``ffn`` is an
    :class:`~lightning_moe.MoELayer` on MoE layers and a dense SwiGLU MLP elsewhere. Which layers
    are MoE: layer ``i`` is MoE iff ``moe`` is set, ``i >= first_dense_layers`` and
    ``moe_layer_freq`` selects it (see :meth:`is_moe_layer`).
    """

    vocab_size: int
    """Number of token ids V (rows of the embedding and of the output head)."""

    hidden_size: int
    """Model width H of the residual stream (HF ``hidden_size``, Megatron ``hidden_size``)."""

    num_layers: int
    """Number of transformer blocks (HF ``num_hidden_layers``, Megatron ``num_layers``)."""

    num_attention_heads: int
    """Query heads per attention layer (HF ``num_attention_heads``)."""

    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; must divide ``num_attention_heads``. None means
    multi-head attention, one kv head per query head (HF ``num_key_value_heads``, Megatron
    ``num_query_groups``)."""

    head_dim: int | None = None
    """Width of one attention head; None means ``hidden_size // num_attention_heads``. Must be
    even (rotary embeddings rotate pairs). Qwen3 uses 128 with hidden 2048 and 32 heads (HF
    ``head_dim``, Megatron ``kv_channels``)."""

    ffn_hidden_size: int | None = None
    """Hidden width of the dense SwiGLU MLP of the non-MoE layers (HF ``intermediate_size``,
    Megatron ``ffn_hidden_size``). Required when any layer is dense; the routed experts' width is
    ``moe.ffn_hidden_size``."""

    max_seq_len: int = 4096
    """Longest sequence ``forward`` accepts (HF ``max_position_embeddings``). Rotary tables are
    computed on the fly, so this costs no memory."""

    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies (HF ``rope_theta``, Megatron
    ``rotary_base``)."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (HF ``rms_norm_eps``, Megatron ``norm_epsilon``)."""

    qk_norm: bool | str = False
    """RMSNorm on the queries and keys before the rotary embedding (Megatron ``qk_layernorm``):
    True or ``head`` normalises each head (width ``head_dim``), as Qwen3; ``full`` normalises the
    whole projection (widths ``heads * head_dim`` and ``kv_heads * head_dim``), as OLMoE (not
    supported under tensor parallelism, which splits the heads)."""

    tie_embeddings: bool = False
    """Share one ``[V, H]`` tensor between the token embedding and the output head (HF
    ``tie_word_embeddings``; Megatron ``share_embeddings_and_output_weights``)."""

    moe: MoEConfig | None = None
    """Settings of the MoE feed-forward layers (router, experts, shared expert, losses); None
    builds a dense model. ``moe.hidden_size`` must equal ``hidden_size``."""

    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE, as Megatron's ``moe_layer_freq``: an int N makes layer ``i`` MoE iff
    ``i % N == 0`` (1 = every layer); a list of ``num_layers`` 0/1 entries marks each layer
    (1 = MoE). Combined with ``first_dense_layers`` by AND."""

    first_dense_layers: int = 0
    """Force the first k layers dense whatever ``moe_layer_freq`` says (DeepSeek-V3's
    ``first_k_dense_replace``; Megatron expresses it with a ``moe_layer_freq`` list). With an int
    frequency N, layer ``i`` is MoE iff ``i >= k and i % N == 0``, as in DeepSeek's code."""

    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the embedding, attention, dense MLP and
    output weights (Megatron ``init_method_std``); the MoE layers use ``moe.init_std``."""

    rope_interleaved: bool = False
    """Rotate interleaved feature pairs ``(2j, 2j+1)`` instead of ``(j, j + D/2)`` (HF DeepSeek-V3
    ``rope_interleave``, Megatron ``rotary_interleaved``)."""

    rope_scaling: RopeScaling | None = None
    """Context extension of the rotary embedding (YaRN; HF ``rope_parameters`` / ``rope_scaling``);
    None for plain rotary embeddings."""

    attention: str = "mha"
    """Attention type: ``mha`` (multi-head / grouped-query attention, :class:`~lightning_moe.models.Attention`)
    or ``mla`` (DeepSeek's multi-head latent attention, :class:`~lightning_moe.models.MultiLatentAttention`,
    shaped by the five fields below; Megatron ``multi_latent_attention``)."""

    q_lora_rank: int | None = None
    """MLA: rank of the query latent (HF and Megatron ``q_lora_rank``); None projects the queries
    directly (``q_proj``), as DeepSeek-V2-Lite."""

    kv_lora_rank: int | None = None
    """MLA: rank of the compressed key/value latent (HF and Megatron ``kv_lora_rank``)."""

    qk_nope_head_dim: int | None = None
    """MLA: per-head query/key width without position embedding (HF ``qk_nope_head_dim``,
    Megatron ``qk_head_dim``)."""

    qk_rope_head_dim: int | None = None
    """MLA: per-head query width with rotary embedding, and width of the rotary key shared by
    all heads (HF ``qk_rope_head_dim``, Megatron ``qk_pos_emb_head_dim``). Even."""

    v_head_dim: int | None = None
    """MLA: per-head value width (HF and Megatron ``v_head_dim``)."""

    attention_bias: bool = False
    """Learned biases on ``q_proj``, ``k_proj`` and ``v_proj`` (not ``o_proj``), as Qwen2-MoE
    (HF ``qkv_bias``) and GLM-4.5 (HF ``attention_bias``); Megatron ``add_qkv_bias``. Multi-head
    attention only."""

    partial_rotary_factor: float = 1.0
    """Fraction of each head the rotary embedding covers: the first ``int(head_dim * factor)``
    features are rotated (pairs ``(j, j + R/2)`` within them), the rest pass through unchanged, as
    GLM-4.5 (HF ``partial_rotary_factor``, 0.5; Megatron ``rotary_percent``). In ``(0, 1]``;
    multi-head attention only (MLA sets its rotary width with ``qk_rope_head_dim``)."""

    attention_out_bias: bool = False
    """A bias ``[H]`` on the attention output projection ``o_proj`` (GPT-OSS; HF ``attention_bias``
    covers q/k/v/o there). Standard attention only."""

    attention_sinks: bool = False
    """GPT-OSS's attention sinks: one learned logit per query head (parameter ``layers.{i}.attn.sinks``
    ``[num_attention_heads]``) that joins every softmax denominator of its head and is dropped
    after, as a key with a zero value. Standard attention only."""

    sliding_window: int | None = None
    """Window length W of the ``sliding_attention`` layers of ``layer_types``: the query at position
    ``i`` sees the keys ``j`` with ``i - W < j <= i`` (HF ``sliding_window``, as ``transformers``
    masks it; GPT-OSS 128). None: no sliding layers."""

    layer_types: list[str] | None = None
    """Per layer ``full_attention`` or ``sliding_attention`` (HF ``layer_types``; GPT-OSS alternates,
    sliding first); ``sliding_attention`` needs ``sliding_window``. None: every layer full."""

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, tuple):
            self.layer_types = list(self.layer_types)
        if isinstance(self.moe_layer_freq, (list, tuple)):
            self.moe_layer_freq = [int(flag) for flag in self.moe_layer_freq]
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        self._validate()

    # ----------------------------------------------------------------------------- derived shapes

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``num_kv_heads``, or ``num_attention_heads`` for MHA)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        """Width of one head (``head_dim``, or ``hidden_size // num_attention_heads``); with MLA the
        query/key width ``qk_nope_head_dim + qk_rope_head_dim``."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Width the rotary tables cover: ``int(head_dim * partial_rotary_factor)`` (the head width
        by default), or ``qk_rope_head_dim`` with MLA."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.attention_head_dim * self.partial_rotary_factor)

    @property
    def qk_norm_mode(self) -> str | None:
        """``qk_norm`` normalised: None (off), ``"head"`` or ``"full"``."""
        return qk_norm_mode(self.qk_norm)

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE feed-forward layer (else a dense MLP)."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer index {index} is out of range for num_layers={self.num_layers}.")
        if self.moe is None or index < self.first_dense_layers:
            return False
        if isinstance(self.moe_layer_freq, int):
            return index % self.moe_layer_freq == 0
        return self.moe_layer_freq[index] == 1

    def layer_window(self, index: int) -> int | None:
        """The sliding window of block ``index``: ``sliding_window`` on a ``sliding_attention`` layer, else None."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer index {index} is out of range for num_layers={self.num_layers}.")
        if self.layer_types is None or self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    # ----------------------------------------------------------------------------- parameter count

    def num_parameters(self, active: bool = False) -> int:
        """Number of parameters of the model, computed from the shapes (no module is built).

        With ``active=True``, the parameters one token uses: the router, ``top_k`` routed experts
        and the shared expert of every MoE layer instead of all experts, everything else in full
        (the embedding counted once, the output head again when untied). Buffers such as the
        expert bias are not parameters. Equals ``sum(p.numel() for p in model.parameters())`` of
        the built model for ``active=False``.
        """
        hidden, vocab = self.hidden_size, self.vocab_size
        embedding = vocab * hidden
        head = 0 if self.tie_embeddings else vocab * hidden
        total = embedding + head + hidden  # + final norm
        for index in range(self.num_layers):
            total += 2 * hidden + self._attention_parameters()  # attn_norm, ffn_norm, attention
            if self.is_moe_layer(index):
                total += self._moe_parameters(active)
            else:
                total += 3 * hidden * self.ffn_hidden_size  # gate_proj, up_proj, down_proj
        return total

    def _attention_parameters(self) -> int:
        if self.attention == "mla":
            return self._mla_parameters()
        q_width = self.num_attention_heads * self.attention_head_dim
        kv_width = self.kv_heads * self.attention_head_dim
        mode = self.qk_norm_mode
        norms = {None: 0, "head": 2 * self.attention_head_dim, "full": q_width + kv_width}[mode]
        biases = q_width + 2 * kv_width if self.attention_bias else 0  # on q_proj, k_proj, v_proj
        biases += self.hidden_size if self.attention_out_bias else 0  # o_proj bias [H]
        sinks = self.num_attention_heads if self.attention_sinks else 0  # sinks [heads]
        # q_proj [q, H], k_proj and v_proj [kv, H], o_proj [H, q].
        return 2 * q_width * self.hidden_size + 2 * kv_width * self.hidden_size + norms + biases + sinks

    def _mla_parameters(self) -> int:
        hidden, heads = self.hidden_size, self.num_attention_heads
        qk, rank = self.attention_head_dim, self.q_lora_rank
        # q_proj [heads*qk, H], or q_down_proj [r, H] + q_latent_norm [r] + q_up_proj [heads*qk, r].
        q = heads * qk * hidden if rank is None else rank * hidden + rank + heads * qk * rank
        kv_rank = self.kv_lora_rank
        # kv_down_proj [kv_r + rope, H], kv_latent_norm [kv_r], kv_up_proj [heads*(nope + v), kv_r].
        kv = (kv_rank + self.qk_rope_head_dim) * hidden + kv_rank
        kv += heads * (self.qk_nope_head_dim + self.v_head_dim) * kv_rank
        return q + kv + hidden * heads * self.v_head_dim  # + o_proj [H, heads*v]

    def _moe_parameters(self, active: bool) -> int:
        moe, hidden = self.moe, self.hidden_size
        fc1_factor = 2 if is_gated(moe.activation) else 1
        per_expert = (fc1_factor + 1) * moe.ffn_hidden_size * hidden + (hidden if moe.fc2_bias else 0)
        per_expert += fc1_factor * moe.ffn_hidden_size if moe.fc1_bias else 0
        experts = moe.top_k if active else moe.num_experts
        shared = 0
        if moe.shared_expert_ffn_hidden_size:
            shared = (fc1_factor + 1) * moe.shared_expert_ffn_hidden_size * hidden
            shared += hidden if moe.shared_expert_gate else 0
        router = moe.num_experts * (hidden + (1 if moe.router_bias else 0))
        return router + experts * per_expert + shared  # router + experts + shared

    # ----------------------------------------------------------------------------- validation

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoETransformerConfig.{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MoETransformerConfig.{name} must be > 0, got {getattr(self, name)}.")
        self._validate_attention()
        self._validate_layer_types()
        self._validate_layer_pattern()
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise ValueError(
                f"moe.hidden_size={self.moe.hidden_size} differs from hidden_size={self.hidden_size}: "
                f"the MoE layers read and write the residual stream. Set moe.hidden_size: {self.hidden_size}."
            )
        dense = [i for i in range(self.num_layers) if not self.is_moe_layer(i)]
        if dense and (self.ffn_hidden_size is None or self.ffn_hidden_size < 1):
            raise ValueError(
                f"layers {_short_list(dense)} are dense but ffn_hidden_size={self.ffn_hidden_size}; set "
                "ffn_hidden_size (the dense SwiGLU width, >= 1) or make every layer MoE."
            )

    def _validate_attention(self) -> None:
        if self.attention not in ATTENTION_TYPES:
            raise ValueError(
                f"Unknown attention {self.attention!r}; choose 'mha' (multi-head / grouped-query) or "
                "'mla' (multi-head latent attention)."
            )
        qk_norm_mode(self.qk_norm)  # raises on an unknown value
        if self.attention == "mla":
            self._validate_mla()
            return
        set_mla = [f"{name}={getattr(self, name)}" for name in MLA_FIELDS if getattr(self, name) is not None]
        if set_mla:
            raise ValueError(
                f"{', '.join(set_mla)} only applies to attention='mla'; set attention: mla or leave "
                f"{', '.join(s.split('=')[0] for s in set_mla)} unset."
            )
        heads = self.num_attention_heads
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or heads % self.num_kv_heads):
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must be >= 1 and divide num_attention_heads={heads} "
                "(each kv head serves a group of query heads); use a divisor, or None for MHA."
            )
        if self.head_dim is None and self.hidden_size % heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={heads}; set "
                "head_dim explicitly or choose a head count that divides hidden_size."
            )
        if self.attention_head_dim < 2 or self.attention_head_dim % 2:
            raise ValueError(
                f"head_dim={self.attention_head_dim} must be even and >= 2: rotary embeddings rotate "
                "pairs of features."
            )
        self._validate_rotary_width()

    def _validate_layer_types(self) -> None:
        window, types = self.sliding_window, self.layer_types
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window={window!r} must be an integer >= 1 (GPT-OSS: 128), or None.")
        if types is None:
            if window is not None:
                raise ValueError(
                    f"sliding_window={window} is set but layer_types is None (every layer full attention), so "
                    "no layer would use it; set layer_types (e.g. alternating 'sliding_attention' and "
                    "'full_attention') or sliding_window: null."
                )
            return
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(
                f"layer_types needs num_layers={self.num_layers} entries, each one of {list(LAYER_TYPES)}; got "
                f"{len(types)} entries: {_short_list(types)}."
            )
        if "sliding_attention" in types and window is None:
            raise ValueError(
                "layer_types has 'sliding_attention' layers but sliding_window is None; set sliding_window "
                "(the window length, GPT-OSS 128) or make those layers 'full_attention'."
            )

    def _validate_mla(self) -> None:
        required = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        missing = [name for name in required if getattr(self, name) is None]
        if missing:
            raise ValueError(f"attention='mla' needs {', '.join(missing)} (DeepSeek-V3: 512, 128, 64, 128).")
        for name in (*required, "q_lora_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"MoETransformerConfig.{name} must be >= 1, got {value}.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even: rotary embeddings rotate pairs of "
                "features."
            )
        if self.num_kv_heads is not None and self.num_kv_heads != self.num_attention_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} does not apply to attention='mla' (every head has its own "
                "key and value, expanded from the shared latent); set num_kv_heads: null."
            )
        if self.head_dim is not None:
            raise ValueError(
                f"head_dim={self.head_dim} does not apply to attention='mla': qk_nope_head_dim + "
                "qk_rope_head_dim and v_head_dim set the head widths; set head_dim: null."
            )
        if self.qk_norm_mode is not None:
            raise ValueError(
                f"qk_norm does not apply to attention='mla' (got qk_norm={self.qk_norm!r}): its latents have "
                "their own RMSNorms. Set qk_norm: false."
            )
        unsupported = [name for name in ("attention_out_bias", "attention_sinks") if getattr(self, name)]
        if self.layer_types is not None and "sliding_attention" in self.layer_types:
            unsupported.append("layer_types with 'sliding_attention'")
        if unsupported:
            raise ValueError(
                f"{', '.join(unsupported)} are not supported with attention='mla' (no MLA model uses them); "
                "use attention='mha' or turn them off."
            )
        if self.attention_bias or self.partial_rotary_factor != 1.0:
            raise ValueError(
                f"attention_bias={self.attention_bias} and partial_rotary_factor={self.partial_rotary_factor} "
                "apply to attention='mha' only (MLA's rotary width is qk_rope_head_dim); set "
                "attention_bias: false and partial_rotary_factor: 1.0."
            )

    def _validate_rotary_width(self) -> None:
        factor = self.partial_rotary_factor
        if not 0 < factor <= 1:
            raise ValueError(
                f"partial_rotary_factor={factor} must be in (0, 1]: the fraction of each head the rotary "
                "embedding covers (GLM-4.5: 0.5; 1.0 rotates the whole head)."
            )
        rotary = self.rotary_dim
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"partial_rotary_factor={factor} with head_dim={self.attention_head_dim} rotates "
                f"int({self.attention_head_dim} * {factor}) = {rotary} features, which must be even and >= 2 "
                "(rotary embeddings rotate pairs); choose a factor giving an even width."
            )

    def _validate_layer_pattern(self) -> None:
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ValueError(
                f"first_dense_layers={self.first_dense_layers} must be between 0 and "
                f"num_layers={self.num_layers}."
            )
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                raise ValueError(
                    f"moe_layer_freq={freq} must be >= 1 (1 = every layer MoE, N = every N-th), "
                    "or a list of 0/1 per layer."
                )
        elif len(freq) != self.num_layers or any(flag not in (0, 1) for flag in freq):
            raise ValueError(
                f"moe_layer_freq as a list needs num_layers={self.num_layers} entries of 0 or 1 "
                f"(1 = MoE), got {len(freq)} entries: {_short_list(freq)}."
            )
        if self.moe is not None and not self.moe_layers:
            raise ValueError(
                f"moe is set but no layer is MoE (first_dense_layers={self.first_dense_layers}, "
                f"moe_layer_freq={_short_list(freq) if isinstance(freq, list) else freq}, "
                f"num_layers={self.num_layers}); lower first_dense_layers or set moe: null for a "
                "dense model."
            )


def _short_list(values: list[int], limit: int = 8) -> str:
    """``values`` for an error message, elided past ``limit`` entries."""
    if len(values) <= limit:
        return str(list(values))
    return "[" + ", ".join(str(v) for v in values[:limit]) + f", ... ({len(values)} in all)]"
