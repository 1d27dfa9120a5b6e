"""`MoETransformer`: the reference GPT-style decoder-only Mixture-of-Experts language model.

Written for one device (docs/architecture.md §2): parallelism is applied afterwards by
``lightning_moe.parallel`` (expert parallelism on the :class:`~lightning_moe.MoELayer` s, the rest
through the plan :meth:`MoETransformer.parallel_plan` hands over, :mod:`lightning_moe.models.parallel_plan`,
over the module names below). Module names are a stable public API::

    embed                      nn.Embedding [V, H]
    layers.{i}.attn_norm       RMSNorm [H]
    layers.{i}.attn            Attention: q_proj, k_proj, v_proj, o_proj (nn.Linear), q_norm, k_norm,
                               sinks (attention_sinks, [heads]), core_attn (CoreAttention, no
                               parameters; its sliding_window from layer_types); with attention='mla'
                               MultiLatentAttention: q_proj or q_down_proj, q_latent_norm, q_up_proj;
                               kv_down_proj, kv_latent_norm, kv_up_proj, o_proj, rope_key, core_attn
    layers.{i}.ffn_norm        RMSNorm [H]
    layers.{i}.ffn             MoELayer (MoE layers) or DenseMLP: gate_proj, up_proj, down_proj
    norm                       RMSNorm [H]
    lm_head                    nn.Linear [V, H] (weight is embed.weight when tied)

Initialisation is deterministic and independent of device and parallel layout: the model draws
one seed from the global RNG when it is built; every weight outside the MoE layers is drawn from
a generator seeded by (that seed, the module's qualified name), and every MoE layer is built with
the global RNG forked and seeded the same way, so its own seed (from which its experts are drawn
by global expert index) depends only on the model seed and its name. A model built on the meta
device, materialised with ``to_empty`` and re-initialised with :meth:`MoETransformer.reset_parameters`
holds the same weights as one built directly after the same ``torch.manual_seed``, and either
build advances the global RNG by exactly one draw.

Published weights: :meth:`MoETransformer.from_pretrained` reads a Hugging Face model directory
and :meth:`MoETransformer.save_pretrained` writes one (:mod:`lightning_moe.models.hf`).
"""

from __future__ import annotations

import os
import zlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.weight_init import reset_adapters, write_full
from lightning_moe.models.attention import Attention, RMSNorm
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.mla import MultiLatentAttention
from lightning_moe.models.rope import rotary_cos_sin

if TYPE_CHECKING:
    from lightning_moe.parallel.model_plan import ModelPlan

__all__ = [
    "EMPTY_BATCH_HINT", "DenseMLP", "MoETransformer", "TransformerBlock", "init_generator", "module_seed",
    "next_token_loss",
    "next_token_loss_sum",
]

EMPTY_BATCH_HINT = (
    "A data loader yielded an empty batch: check that the dataset (and each data-parallel rank's "
    "shard of it) has samples, that no collate_fn or batch sampler filters out every sample of a "
    "batch and that no step cuts the sequences to length 0; a batch sampler should drop an "
    "incomplete last batch (drop_last=True) rather than yield an empty one."
)
"""The likely causes of an empty batch; the errors that refuse one end with it."""


def module_seed(model_seed: int, name: str) -> int:
    """The seed of the module called ``name`` (qualified, e.g. ``layers.3.attn.q_proj``).

    Mixes the model seed with ``zlib.crc32`` of the name (stable across processes, unlike Python's
    salted ``hash``), so every module gets its own stream whatever the build order.
    """
    return (model_seed * 1_000_003 + zlib.crc32(name.encode("utf-8")) * 7_919 + 1) % (2**63 - 1)


def init_generator(model_seed: int, name: str) -> torch.Generator:
    """The CPU generator that initialises the module called ``name`` (see :func:`module_seed`)."""
    return torch.Generator(device="cpu").manual_seed(module_seed(model_seed, name))


def next_token_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean fp32 cross-entropy of ``logits`` ``[B, S, V]`` over the ``targets`` ``[B, S]`` kept.

    Targets equal to ``ignore_index`` are left out of the mean. A batch whose targets are all
    ignored gives 0 where ``F.cross_entropy`` gives 0/0 = NaN: the sum over no target is a 0 that
    still depends on the logits, so backward gives every parameter a (zero) gradient and
    gradient reductions across ranks (DDP) see them all, and the logged value is 0.
    """
    total, count = next_token_loss_sum(logits, targets, ignore_index)
    # The count stays on the device: no host read per step.
    return total / count.clamp(min=1)


def next_token_loss_sum(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """``(sum of the fp32 cross-entropies, number of targets kept)`` of :func:`next_token_loss`, for
    means over several ranks' tokens (context parallelism)."""
    flat_targets = targets.flatten()
    total = F.cross_entropy(
        logits.float().flatten(0, 1), flat_targets, ignore_index=ignore_index, reduction="sum"
    )
    return total, (flat_targets != ignore_index).sum()


class DenseMLP(nn.Module):
    """SwiGLU feed-forward ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases.

    ``gate_proj`` and ``up_proj`` are ``[F, H]``, ``down_proj`` ``[H, F]`` (``nn.Linear`` weights).
    ``forward`` accepts (and ignores) a ``padding_mask`` so blocks call dense and MoE FFNs alike.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x`` ``[B, S, H]`` -> ``[B, S, H]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _build_attention(config: MoETransformerConfig, index: int = 0) -> nn.Module:
    if config.attention == "mla":
        return MultiLatentAttention(
            config.hidden_size,
            config.num_attention_heads,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=config.q_lora_rank,
            softmax_scale=MultiLatentAttention.default_softmax_scale(
                config.attention_head_dim, config.rope_scaling
            ),
            rope_interleaved=config.rope_interleaved,
        )
    return Attention(
        config.hidden_size,
        config.num_attention_heads,
        config.kv_heads,
        config.attention_head_dim,
        qk_norm=config.qk_norm,
        norm_eps=config.norm_eps,
        rope_interleaved=config.rope_interleaved,
        attention_bias=config.attention_bias,
        out_bias=config.attention_out_bias,
        sinks=config.attention_sinks,
        sliding_window=config.layer_window(index),
    )


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))``, then ``+ ffn(ffn_norm(x))`` (MoE or dense).

    ``layer_index`` selects the block's attention type in ``config.layer_types`` (its sliding window).
    """

    def __init__(self, config: MoETransformerConfig, ffn: nn.Module, layer_index: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = _build_attention(config, layer_index)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn = ffn

    def attention_residual(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x + attn(attn_norm(x))`` (the CUDA-graph scope ``attn`` captures this method)."""
        return x + self.attn(self.attn_norm(x), cos, sin)

    def ffn_residual(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x + ffn(ffn_norm(x), padding_mask)`` (the MoE CUDA-graph scopes split this method)."""
        return x + self.ffn(self.ffn_norm(x), padding_mask)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x`` ``[B, S, H]``, rotary tables ``[S, D]``, ``padding_mask`` ``[B, S]`` -> ``[B, S, H]``."""
        return self.ffn_residual(self.attention_residual(x, cos, sin), padding_mask)


class MoETransformer(nn.Module):
    """Decoder-only language model with Mixture-of-Experts feed-forward layers.

    ``forward(tokens [B, S] int64, padding_mask [B, S] bool | None) -> logits [B, S, V]``.
    ``padding_mask`` (True = padding) keeps padded tokens out of the MoE load-balancing losses and
    expert-bias counts; attention is causal only, so pad on the right (or pack sequences) and give
    padded targets ``ignore_index`` in :meth:`loss`. Aux and z losses of the MoE layers reach the
    gradients by themselves (see :class:`~lightning_moe.MoELayer`); the training loss needs no term.

    Under tensor parallelism the output head is sharded over the vocabulary and ``forward`` returns
    this rank's slice of the logits, ``[B, S, V / TP]``, so that no rank holds ``B x S x V`` of them:
    compute the loss with :meth:`loss` or :meth:`loss_sum` (vocabulary-parallel cross-entropy) and
    get the whole logits, for inference, with :meth:`full_logits`. On one device these are plain
    cross-entropy and the identity.

    Example::

        config = MoETransformerConfig(vocab_size=256, hidden_size=64, num_layers=2,
                                      num_attention_heads=4, ffn_hidden_size=128,
                                      moe=MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=4))
        model = MoETransformer(config)
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])

    Large models: build under ``with torch.device("meta"):``, parallelise, then ``to_empty`` and
    :meth:`reset_parameters`.
    """

    def __init__(self, config: MoETransformerConfig) -> None:
        super().__init__()
        self.config = config
        # Explicitly on the CPU generator so that building under a device context works.
        self.init_seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        """The model seed every weight is drawn from (see :func:`init_generator`)."""
        # Everything below leaves the global CPU RNG untouched: default initialisers consume it on
        # real devices but not on meta, and each MoE layer's seed must not depend on that.
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                TransformerBlock(config, self._build_ffn(index), index) for index in range(config.num_layers)
            )
            self.norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie_weights()
        self.vocab_parallel = None
        """None on one device; set by tensor parallelism, whose head leaves the logits sharded over the
        vocabulary: an object with ``loss_sum(logits, targets, ignore_index)`` and ``gather(logits)``
        (:class:`~lightning_moe.parallel.vocab_parallel_loss.VocabParallelLogits`)."""
        if not self.embed.weight.is_meta:
            self.reset_parameters()

    def _build_ffn(self, index: int) -> nn.Module:
        config = self.config
        if not config.is_moe_layer(index):
            return DenseMLP(config.hidden_size, config.ffn_hidden_size)
        # MoELayer draws its seed from the global CPU RNG (forked in __init__): seed that from
        # (model seed, name). The CPU generator only: torch.manual_seed would reseed CUDA too.
        torch.random.default_generator.manual_seed(module_seed(self.init_seed, f"layers.{index}.ffn"))
        return MoELayer(config.moe)

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _apply(self, fn, recurse=True):
        # Conversions that create new parameters (to_empty from meta, .to() across devices) replace
        # embed.weight and lm_head.weight separately; tie them again.
        super()._apply(fn, recurse)
        self._tie_weights()
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every weight from the model seed (norms to ones, biases outside the MoE layers to zeros,
        attention sinks from their own streams, MoE layers from their seeds).

        Call after ``to_empty`` on a model built on the meta device. Normal(0, ``init_std``) values
        are drawn in fp32 on the CPU from :func:`init_generator` of each module's qualified name
        and copied in, so they do not depend on the parameters' device or dtype.
        """
        # A pipeline stage's trimmed model may have no embedding: any parameter tells.
        if next(self.parameters()).is_meta:
            raise RuntimeError(
                "reset_parameters() on a meta-device model has nothing to write to; call "
                "model.to_empty(device=...) first."
            )
        self._tie_weights()
        moe_prefixes: list[str] = []
        for name, module in self.named_modules():
            if any(name.startswith(prefix) for prefix in moe_prefixes):
                continue  # inside an MoE layer: it initialises its own submodules
            if isinstance(module, MoELayer):
                module.reset_parameters()
                moe_prefixes.append(name + ".")
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, Attention) and module.sinks is not None:
                self._draw(module.sinks, f"{name}.sinks")  # its projections come by as nn.Linear below
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.config.tie_embeddings:
                    continue  # the embedding's tensor, already drawn
                self._draw(module.weight, name)
                if getattr(module, "bias", None) is not None:  # q/k/v and o_proj biases start at zero, as transformers
                    write_full(module.bias, torch.zeros(module.bias.shape, dtype=torch.float32, device="cpu"))
        reset_adapters(self)  # LoRA adapters of the linear layers drawn above (the MoE layers did theirs)

    def _draw(self, tensor: Tensor, name: str) -> None:
        """Write Normal(0, ``init_std``) values drawn in fp32 on the CPU from the stream of ``name``."""
        # Explicitly on the CPU, like the generator: Lightning may run this under a device context.
        values = torch.empty(tensor.shape, dtype=torch.float32, device="cpu")
        values.normal_(0.0, self.config.init_std, generator=init_generator(self.init_seed, name))
        write_full(tensor, values)
        del values  # one drawn tensor alive at a time

    def forward(
        self, tokens: Tensor, padding_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Next-token logits: ``tokens`` ``[B, S]`` int64 -> ``[B, S, V]`` (``[B, S, V / TP]``, this rank's
        vocabulary slice, under tensor parallelism: see the class docstring).

        ``position_ids`` (``[S]`` integers, default ``0 .. S-1``) are the tokens' positions for the
        rotary embedding; context parallelism passes each rank's chunks of the longer sequence.
        """
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"tokens must be an integer tensor [B, S], got {tokens.dtype} {tuple(tokens.shape)}."
            )
        if tokens.numel() == 0:
            raise ValueError(
                f"MoETransformer got an empty batch: tokens of shape {tuple(tokens.shape)} "
                f"({tokens.shape[0]} samples of {tokens.shape[1]} tokens); every batch needs at least one "
                f"sample of at least one token. {EMPTY_BATCH_HINT}"
            )
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}; shorten the "
                "sequences or raise max_seq_len."
            )
        if padding_mask is not None and padding_mask.shape != tokens.shape:
            raise ValueError(
                f"padding_mask must have the shape of tokens {tuple(tokens.shape)}, "
                f"got {tuple(padding_mask.shape)}."
            )
        config = self.config
        if position_ids is not None and position_ids.shape != (seq,):
            raise ValueError(f"position_ids must have shape [S] = [{seq}], got {tuple(position_ids.shape)}.")
        cos, sin = rotary_cos_sin(
            seq, config.rotary_dim, config.rope_theta, tokens.device, config.rope_scaling, positions=position_ids
        )
        x = self.embed(tokens)  # [B, S, H]
        for layer in self.layers:
            x = layer(x, cos, sin, padding_mask)
        return self.lm_head(self.norm(x))  # [B, S, V] ([B, S, V / TP] under tensor parallelism)

    def loss(
        self, tokens: Tensor, targets: Tensor, ignore_index: int = -100, padding_mask: Tensor | None = None
    ) -> Tensor:
        """Mean next-token cross-entropy (fp32) of ``forward(tokens)`` against ``targets`` ``[B, S]``.

        Targets equal to ``ignore_index`` are left out of the mean (all of them: 0, see
        :func:`next_token_loss`); ``padding_mask`` goes to :meth:`forward` (it keeps padded tokens
        out of the MoE statistics). Under tensor parallelism the logits stay sharded (:meth:`loss_sum`).
        """
        total, count = self.loss_sum(self(tokens, padding_mask), targets, ignore_index)
        return total / count.clamp(min=1)  # as next_token_loss: 0 without targets, no host read

    def loss_sum(self, logits: Tensor, targets: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
        """``(fp32 sum of the cross-entropies, number of targets kept)`` of this model's ``logits`` against
        ``targets`` ``[B, S]`` (:func:`next_token_loss_sum`), for means over several micro-batches or ranks.

        ``logits`` are :meth:`forward`'s output: under tensor parallelism this rank's vocabulary slice,
        whose loss is the vocabulary-parallel cross-entropy of :attr:`vocab_parallel` (the same value
        on every rank of the tensor-parallel group, the full logits never gathered).
        """
        if self.vocab_parallel is None:
            return next_token_loss_sum(logits, targets, ignore_index)
        return self.vocab_parallel.loss_sum(logits, targets, ignore_index)

    def full_logits(self, logits: Tensor) -> Tensor:
        """The logits ``[..., V]`` over the whole vocabulary from :meth:`forward`'s output: ``logits`` itself
        on one device, all-gathered over the tensor-parallel group otherwise (inference: ``B x S x V`` on
        every rank)."""
        return logits if self.vocab_parallel is None else self.vocab_parallel.gather(logits)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype | None = None, **overrides
    ) -> MoETransformer:
        """Build the model of a Hugging Face model directory and load its weights (Hugging Face's name).

        Reads ``config.json`` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 / Kimi K2, GLM-4.5 or GPT-OSS; anything this model cannot
        reproduce exactly is refused with an error naming the field) and the safetensors files
        (one file or shards with ``model.safetensors.index.json``). Weights keep the dtypes of the
        files unless ``dtype`` is given; ``overrides`` replace fields of the mapped
        :class:`MoETransformerConfig` (training settings; ``moe`` may be a dict of
        :class:`~lightning_moe.MoEConfig` fields). Needs the ``hf`` extra (safetensors). See
        :func:`lightning_moe.models.hf.load_pretrained`.
        """
        from lightning_moe.models.hf import load_pretrained  # hf builds this class: import at call time

        return load_pretrained(path, dtype=dtype, model_class=cls, **overrides)

    def save_pretrained(
        self, path: str | os.PathLike, family: str | None = None, max_shard_size: int | str = "5GB"
    ) -> None:
        """Write a Hugging Face model directory that ``transformers`` loads (Hugging Face's name).

        ``config.json`` and safetensors weights in the on-disk format ``transformers`` uses for
        ``family`` (per-expert keys; None infers it from the config), sharded with an index past
        ``max_shard_size`` (bytes, or a string such as ``"5GB"``). The whole model must be on this
        process (not parallelised). See :func:`lightning_moe.models.hf.save_pretrained`.
        """
        from lightning_moe.models.hf import save_pretrained  # hf builds this class: import at call time

        save_pretrained(self, path, family=family, max_shard_size=max_shard_size)

    def parallel_plan(self) -> ModelPlan:
        """What parallelism, recompute and CUDA graphs need to know of this model
        (:func:`lightning_moe.models.parallel_plan.transformer_plan`)."""
        # At call time: the plan imports torch.distributed, which this module never needs.
        from lightning_moe.models.parallel_plan import transformer_plan

        return transformer_plan(self)

    def extra_repr(self) -> str:
        config = self.config
        moe = "dense" if config.moe is None else f"moe layers {len(config.moe_layers)}/{config.num_layers}"
        return f"params={config.num_parameters():,}, active={config.num_parameters(active=True):,}, {moe}"
