"""`MoELanguageModel`: the LightningModule that trains the reference MoE language model.

Written for one device like any LightningModule; ``Trainer(strategy=MoEStrategy(...))`` makes it
parallel. It logs what people look at while training a language model: ``train_loss`` (progress
bar), ``val_loss`` and ``val_ppl`` (per target token, torchmetrics metrics computed from the loss,
the same values in every layout), the learning rate and ``tokens_per_sec`` (global tokens per second
of host wall time spent in the training step: :meth:`MoELanguageModel.on_train_batch_end`). Under
tensor parallelism the logits stay sharded over the vocabulary and the loss is the
vocabulary-parallel cross-entropy (:meth:`MoETransformer.loss_sum
<lightning_moe.models.MoETransformer.loss_sum>`); only ``forward`` and ``Trainer.predict`` gather
the whole logits. ``Trainer.test`` logs the validation metrics as ``test_loss`` and ``test_ppl``;
``Trainer.predict`` returns next-token log-probabilities (:meth:`MoELanguageModel.predict_step`).
A micro-batch whose targets are all ``IGNORE_INDEX`` has loss 0 (no NaN, no gradient); an empty
batch is refused.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_moe.checkpoint.export_hf import MODEL_CONFIG_KEY, model_record
from lightning_moe.data.token_check import check_token_ids, vocab_problem
from lightning_moe.lit.optimization import adamw_kernel_options, optimizer_param_groups, warmup_cosine
from lightning_moe.lit.token_metrics import TokenMeanLoss, TokenPerplexity
from lightning_moe.lora import LoRAConfig, apply_lora, is_adapter_key
from lightning_moe.lora.checkpoint import LORA_RECORD_KEY, adapter_state, base_fingerprint, base_mismatches
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.models.transformer import EMPTY_BATCH_HINT
from lightning_moe.parallel.config_error import ConfigError
from lightning_moe.parallel.context_parallel.apply import cp_token_mean

__all__ = ["MoELanguageModel", "OverrideValue", "check_batch"]

IGNORE_INDEX = -100

_Scalar = bool | int | float | str | None
OverrideValue = _Scalar | list[_Scalar] | dict[str, _Scalar | list[_Scalar]]
"""A value of ``model_overrides``: plain data (a field, or a mapping of :class:`~lightning_moe.MoEConfig`
fields for ``moe``), so a configuration parser never builds an object from it (no class is among
its types) and it comes back from a checkpoint's hyperparameters as the same plain data."""


def check_batch(inputs: Tensor, targets: Tensor, stage: str, batch_idx: int) -> None:
    """Refuse a batch that is not two non-empty ``[B, S]`` tensors of one shape, saying why."""
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise ValueError(
            f"{stage} batch {batch_idx}: inputs and targets must both be [B, S], got inputs of shape "
            f"{tuple(inputs.shape)} and targets of shape {tuple(targets.shape)}; targets are the inputs "
            "shifted by one position (see lightning_moe.data.PackedTokenDataset)."
        )
    if inputs.numel() == 0:
        raise ValueError(
            f"{stage} batch {batch_idx} is empty: inputs of shape {tuple(inputs.shape)}, targets of shape "
            f"{tuple(targets.shape)} ({inputs.shape[0]} samples of {inputs.shape[1]} tokens). {EMPTY_BATCH_HINT}"
        )


def _resolve_config(
    model: MoETransformerConfig | None, init_from: str | None, overrides: dict[str, Any] | None
) -> tuple[MoETransformerConfig, str | None, dict[str, Any]]:
    """``(config, family, token ids)``: the configuration given, or the one of ``init_from``'s
    ``config.json`` with ``overrides``, its Hugging Face family and the ``config.json`` keys kept."""
    if init_from is None:
        if model is None:
            raise ValueError(
                "MoELanguageModel needs model (a MoETransformerConfig) or init_from (a Hugging Face model directory)."
            )
        if overrides:
            raise ValueError("model_overrides applies to init_from's config.json; without init_from edit model instead.")
        return model, None, {}
    if model is not None:
        raise ValueError(
            f"MoELanguageModel got both model and init_from={init_from!r}: the configuration of init_from is its "
            "config.json. Leave model out and put the fields to change in model_overrides."
        )
    from lightning_moe.models.hf import PASSTHROUGH_KEYS, pretrained_config
    from lightning_moe.models.hf.io import read_config

    config, family = pretrained_config(init_from, **(overrides or {}))
    raw = read_config(init_from)
    return config, family, {key: raw[key] for key in PASSTHROUGH_KEYS if key in raw}


def _materialises_meta_models(trainer) -> bool:
    """Whether ``trainer``'s strategy parallelises and materialises a meta-device model in its setup."""
    if trainer is None:
        return False
    from lightning_moe.strategies import MoEStrategy  # the strategies import lightning_moe.lit's neighbours

    return isinstance(trainer.strategy, MoEStrategy)


class MoELanguageModel(L.LightningModule):
    """Next-token prediction with a :class:`~lightning_moe.models.MoETransformer`.

    Args:
        model: the transformer's configuration (a YAML mapping in the CLI); leave it out with ``init_from``.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay of the matrices.
        betas: AdamW betas.
        warmup_steps: linear warm-up steps.
        min_lr_ratio: the cosine schedule ends at ``learning_rate * min_lr_ratio``.
        init_from: a Hugging Face model directory (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
            DeepSeek-V3 / Kimi K2, GLM-4.5, GPT-OSS: ``config.json`` + safetensors) to start from: the configuration is its ``config.json``
            and training starts from its weights (see :meth:`load_pretrained_weights`).
        model_overrides: with ``init_from``, fields of the configuration read from ``config.json``
            to replace (training settings such as ``max_seq_len``; ``moe`` takes a mapping of
            :class:`~lightning_moe.MoEConfig` fields, e.g. ``{"aux_loss_coeff": 0.01}``).
        check_every_batch: check the token ids of every batch against ``vocab_size`` (a debugging
            switch: one host read per step). By default only the first batch of each stage (fit,
            validate, test, predict) is checked, so training pays no per-step host read.
        lora: fine-tune with LoRA adapters (:class:`~lightning_moe.lora.LoRAConfig`; a mapping of its
            fields in YAML, ``model.lora``): applied to the transformer when it is built, before the
            strategy parallelises it, and only the adapters are trained (the rest is frozen).
            Checkpoints then hold the adapters and their optimizer state only, with the base's
            identity (``init_from`` and a fingerprint of its weights); on resume the base is read
            from ``init_from`` again (or drawn from the seed) and checked against that fingerprint.

    Under :class:`~lightning_moe.strategies.MoEStrategy` the transformer is built on the meta
    device, parallelised and materialised by the strategy (each rank draws only its shard), and with
    ``init_from`` each rank then reads only its own slices of the weights
    (:func:`~lightning_moe.checkpoint.hf_load.load_hf_weights`), so no rank ever holds the whole
    model. The weights are read when the first loop starts (fit, validate, test or predict), after
    Lightning restored a checkpoint: resuming with ``ckpt_path`` keeps the checkpoint's weights and
    reads nothing from ``init_from``. Checkpoints record the directory's ``config.json`` and which
    tokenizer files it holds: ``lightning-moe export --format hf`` writes that ``config.json`` back
    (training overrides such as ``max_seq_len`` do not change it) and copies the tokenizer and
    ``generation_config.json``.
    """

    def __init__(
        self,
        model: MoETransformerConfig = None,  # None with init_from; not Optional[...], so --help inlines the fields
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        init_from: str | None = None,
        model_overrides: dict[str, OverrideValue] | None = None,
        check_every_batch: bool = False,
        lora: LoRAConfig = None,  # None: full fine-tuning; not Optional[...], so --help inlines the fields
    ) -> None:
        super().__init__()
        if isinstance(lora, dict):  # from a checkpoint's hyperparameters
            lora = LoRAConfig(**lora)
        self.lora = lora
        self.config, family, extra = _resolve_config(model, init_from, model_overrides)
        self._hf_record = model_record(self.config, family, extra, init_from)
        # Plain containers only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters({
            "model": None if model is None else asdict(model), "learning_rate": learning_rate,
            "weight_decay": weight_decay, "betas": list(betas), "warmup_steps": warmup_steps,
            "min_lr_ratio": min_lr_ratio, "init_from": None if init_from is None else str(init_from),
            "model_overrides": model_overrides, "check_every_batch": check_every_batch,
            "lora": None if lora is None else asdict(lora),
        })
        self.init_from = init_from
        # Whether init_from's weights still have to be read (a restored checkpoint clears it).
        self._init_pending = False
        # LoRA: the base's fingerprint (computed once: the base is frozen), and the one a restored
        # adapter checkpoint recorded, checked once the base is in place.
        self._base_print: dict | None = None
        self._expected_base: dict | None = None
        self.model: MoETransformer | None = None
        # The metric states get storage even under Trainer.init_module(empty_init=True): the strategy
        # materialises only parameters and buffers it can re-draw, never a metric's running sums.
        with torch.device("cpu"):
            self.val_loss = TokenMeanLoss()
            self.val_perplexity = TokenPerplexity()
            self.test_loss = TokenMeanLoss()
            self.test_perplexity = TokenPerplexity()
        self._step_started: float | None = None
        # The stages (training, validation, ...) whose first batch's token ids were checked.
        self._checked_stages: set[str] = set()
        self.check_every_batch = check_every_batch

    def configure_model(self) -> None:
        """Build the transformer (once). Under a strategy that materialises meta-device models
        (:class:`~lightning_moe.strategies.MoEStrategy`) it is built on the meta device: the strategy
        shards it and gives only this rank's part storage, drawn with the values of a one-device
        build, so no rank holds the whole model. Elsewhere it is built with its weights."""
        if self.model is not None:
            return
        if _materialises_meta_models(self._trainer):
            with torch.device("meta"):
                self.model = MoETransformer(self.config)
        else:
            self.model = MoETransformer(self.config)
        if self.lora is not None:
            apply_lora(self.model, self.lora)
        self._init_pending = self.init_from is not None

    def load_pretrained_weights(self) -> None:
        """Read ``init_from``'s weights into the transformer now: each rank its own slices of every
        parameter, in place (the optimizer keeps its references). Called by the first loop's start
        hook unless a checkpoint was restored; call it yourself to use the weights outside a
        Trainer (after :meth:`configure_model`)."""
        if self.init_from is None:
            raise ValueError("load_pretrained_weights needs init_from (a Hugging Face model directory).")
        if self.model is None:
            self.configure_model()
        from lightning_moe.checkpoint.hf_load import load_hf_weights  # safetensors: the hf extra

        read = load_hf_weights(self.model, self.init_from)
        self._init_pending = False
        self._base_print = None  # a new base
        rank_zero_info(f"MoELanguageModel: weights read from {self.init_from} ({read / 2**20:.1f} MiB on rank 0)")

    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        """The module's state; with ``lora`` only the adapters' (the frozen base is not checkpointed)."""
        state = super().state_dict(*args, **kwargs)
        return state if self.lora is None else adapter_state(state)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        """Load ``state_dict``; with ``lora`` it needs the adapters only (base entries, if any, load too)."""
        if self.lora is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [key for key in result.missing_keys if is_adapter_key(key)]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Loading a LoRA state dict into {type(self).__name__}: missing adapters {missing[:8]}, unexpected "
                f"keys {result.unexpected_keys[:8]}. Load a checkpoint of a run with the same LoRAConfig (rank "
                f"{self.lora.rank}, targets {self.lora.targets})."
            )
        return result

    def base_fingerprint(self) -> dict[str, list[float]]:
        """The frozen base's fingerprint (:func:`~lightning_moe.lora.checkpoint.base_fingerprint`; collective)."""
        if self._base_print is None:
            self._base_print = base_fingerprint(self.model)
        return self._base_print

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the transformer's configuration (and ``init_from``'s family) for ``lightning-moe export --format hf``;
        with ``lora`` also the base's identity (``init_from`` and its fingerprint)."""
        checkpoint[MODEL_CONFIG_KEY] = self._hf_record
        if self.lora is not None:
            checkpoint[LORA_RECORD_KEY] = {
                "config": asdict(self.lora), "init_from": None if self.init_from is None else str(self.init_from),
                "base_fingerprint": self.base_fingerprint(),
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A restored checkpoint's weights win over ``init_from``'s; a LoRA checkpoint holds no base, so
        ``init_from``'s weights are still read, and the base is checked against the recorded fingerprint."""
        record = checkpoint.get(LORA_RECORD_KEY)
        if self.lora is None or record is None:
            self._init_pending = False
            return
        self._expected_base = record  # the base is still to be read (if it is pending), then checked

    def _load_pending_weights(self) -> None:
        if self._init_pending:
            self.load_pretrained_weights()
        if self._expected_base is not None:
            record, self._expected_base = self._expected_base, None
            problems = base_mismatches(record["base_fingerprint"], self.base_fingerprint())
            if problems:
                raise ValueError(
                    f"The LoRA checkpoint's adapters were trained on another base: {len(problems)} base tensors "
                    f"differ, e.g. {problems[:3]}. The checkpoint's base was init_from={record['init_from']!r}, this "
                    f"run's is init_from={None if self.init_from is None else str(self.init_from)!r}: resume with "
                    "the same init_from (or model config and seed) as the run that wrote it."
                )

    def on_train_start(self) -> None:
        """Read ``init_from``'s weights unless a checkpoint was restored (or they were read already)."""
        self._load_pending_weights()

    def on_validation_start(self) -> None:
        """As :meth:`on_train_start` (the sanity check and ``Trainer.validate`` start here)."""
        self._load_pending_weights()

    def on_test_start(self) -> None:
        """As :meth:`on_train_start`."""
        self._load_pending_weights()

    def on_predict_start(self) -> None:
        """As :meth:`on_train_start`."""
        self._load_pending_weights()

    def setup(self, stage: str) -> None:
        """Check that the data's vocabulary fits the model's (and check each loop's first batch again)."""
        self._checked_stages.clear()
        datamodule = getattr(self._trainer, "datamodule", None)  # None outside a Trainer
        data_vocab = getattr(datamodule, "vocab_size", None)
        if data_vocab is not None and data_vocab > self.config.vocab_size:
            raise ConfigError(vocab_problem(data_vocab, self.config.vocab_size))

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[B, S, V]`` of ``tokens`` ``[B, S]`` (under tensor parallelism gathered over the
        vocabulary on every rank: the training and evaluation steps keep them sharded)."""
        return self.model.full_logits(self.model(tokens))

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        total, count = self.model.loss_sum(logits, targets, IGNORE_INDEX)
        # 0, still connected to the graph, for a micro-batch whose targets are all IGNORE_INDEX.
        return total / count.clamp(min=1)

    def pipeline_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """One micro-batch's loss under pipeline parallelism: the last stage's logits against its targets.

        The pipeline protocol of `MoEStrategy` (:mod:`lightning_moe.strategies.pipeline_step`): the
        strategy then runs the schedule instead of :meth:`training_step` and logs ``train_loss``
        itself, and instead of :meth:`validation_step` it calls :meth:`pipeline_validation_step`.
        Under context parallelism this CP rank's share of the mean over the whole sequences, as in
        :meth:`training_step` (:meth:`_training_loss`); the pipeline averages the shares over ``cp``.
        """
        return self._training_loss(logits, targets)

    def pipeline_num_targets(self, targets: Tensor) -> Tensor:
        """The targets a micro-batch keeps (not ``IGNORE_INDEX``), on the device: under pipeline
        parallelism each micro-batch's :meth:`pipeline_loss` weighs by its share of the batch's, so
        ``train_loss`` and the gradients are the mean per target of the whole batch, as at PP=1."""
        return (targets != IGNORE_INDEX).sum()

    def pipeline_validation_step(self, losses: Tensor, targets: Tensor, batch_idx: int) -> None:
        """:meth:`validation_step` under pipeline parallelism: the same ``val_loss`` and ``val_ppl``.

        ``losses`` are the ``M`` micro-batch losses of the batch (:meth:`pipeline_loss`, the same on
        every rank), micro-batch ``m`` holding the ``m``-th of ``M`` equal slices of ``targets``
        along dimension 0. Each weighs as many targets as it keeps (a micro-batch without targets,
        loss 0, adds nothing), so ``val_loss`` is the mean per target token over every batch and
        rank, as at PP=1, and ``val_ppl`` its ``exp`` (:class:`TokenPerplexity`). Counted on the
        device: no host read. Under context parallelism ``targets`` are this CP rank's chunks and
        ``losses`` the whole sequences' means: each CP rank weighs them by its own targets, so the
        sums over all ranks count every target of the sequences once per pipeline rank, which keeps
        the ratio.
        """
        kept = (targets != IGNORE_INDEX).reshape(losses.shape[0], -1).sum(1)
        self.val_loss.update(losses, kept)
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.val_perplexity.update(losses, kept)
        self.log("val_ppl", self.val_perplexity)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Mean next-token cross-entropy of this rank's micro-batch (0 if every target is ignored)."""
        inputs, targets = batch
        check_batch(inputs, targets, "training", batch_idx)
        loss = self._training_loss(self.model(inputs), targets)  # logits sharded under tensor parallelism
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def _training_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """:meth:`_loss`; under context parallelism this rank's share of the mean over every target of
        the whole sequences (:func:`~lightning_moe.parallel.context_parallel.apply.cp_token_mean`):
        the CP ranks hold different numbers of kept targets."""
        strategy = self.trainer.strategy
        ctx = strategy.parallel_context if hasattr(type(strategy), "parallel_context") else None
        if ctx is None or ctx.size("cp") == 1:
            return self._loss(logits, targets)
        return cp_token_mean(*self.model.loss_sum(logits, targets, IGNORE_INDEX), ctx)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Validation loss and perplexity per target token, over every batch and rank."""
        self._evaluate(batch, batch_idx, "validation", "val", self.val_loss, self.val_perplexity)

    def _evaluate(self, batch: tuple[Tensor, Tensor], batch_idx: int, stage: str, prefix: str,
                  loss: TokenMeanLoss, perplexity: TokenPerplexity) -> None:
        """Update and log ``<prefix>_loss`` and ``<prefix>_ppl`` with one batch."""
        inputs, targets = batch
        check_batch(inputs, targets, stage, batch_idx)
        mean_loss, kept = self._loss(self.model(inputs), targets), self.pipeline_num_targets(targets)
        # Token-weighted (TokenMeanLoss): a batch without targets adds nothing instead of a 0.
        loss(mean_loss, kept)
        self.log(f"{prefix}_loss", loss, prog_bar=prefix == "val")
        perplexity(mean_loss, kept)
        self.log(f"{prefix}_ppl", perplexity)

    def check_token_ids(self, batch: Any, stage: str, batch_idx: int) -> None:
        """Refuse a batch holding a token id outside ``[0, vocab_size)``, naming it, its position and the fix.

        Without this, an id past the vocabulary trains silently under tensor parallelism (the
        vocabulary-parallel embedding gives it a zero row) and fails with torch's bare ``index out
        of range`` otherwise. Runs on the first batch of each stage, or on every batch with
        ``check_every_batch`` (each check is one host read). ``batch`` is ``(inputs, targets)`` or
        the inputs alone; targets equal to ``IGNORE_INDEX`` are allowed.
        """
        if stage in self._checked_stages and not self.check_every_batch:
            return
        self._checked_stages.add(stage)
        if isinstance(batch, (tuple, list)):
            inputs, targets = batch[0], (batch[1] if len(batch) > 1 else None)
        else:
            inputs, targets = batch, None
        vocab = self.config.vocab_size
        if isinstance(inputs, Tensor):
            check_token_ids(inputs, vocab, f"{stage} batch {batch_idx} inputs")
        if isinstance(targets, Tensor):
            check_token_ids(targets, vocab, f"{stage} batch {batch_idx} targets", ignore_index=IGNORE_INDEX)

    def on_validation_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        """:meth:`check_token_ids` (the first batch, or every batch with ``check_every_batch``)."""
        self.check_token_ids(batch, "validation", batch_idx)

    def on_test_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        """:meth:`check_token_ids` (the first batch, or every batch with ``check_every_batch``)."""
        self.check_token_ids(batch, "test", batch_idx)

    def on_predict_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        """:meth:`check_token_ids` (the first batch, or every batch with ``check_every_batch``)."""
        self.check_token_ids(batch, "predict", batch_idx)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """``test_loss`` and ``test_ppl``: :meth:`validation_step`'s metrics on the test data (with
        :class:`~lightning_moe.lit.TextDataModule`, its held-out documents)."""
        self._evaluate(batch, batch_idx, "test", "test", self.test_loss, self.test_perplexity)

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Next-token log-probabilities ``[B, S, V]`` (fp32) of the inputs ``[B, S]``: entry ``[b, s, v]``
        is ``log p(token s + 1 = v | tokens 0..s of sample b)``, so ``exp`` sums to 1 over ``v``.

        ``batch`` is the inputs or a tuple whose first entry they are (``(inputs, targets)``, as
        :class:`~lightning_moe.lit.TextDataModule` gives; the targets are not used). The log-probability
        of the actual next tokens is ``out.gather(-1, targets.unsqueeze(-1))``. ``Trainer.predict``
        returns one such tensor per batch (``B * S * V * 4`` bytes each: mind large vocabularies; under
        tensor parallelism every rank gathers the whole vocabulary's logits for it).
        """
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        if inputs.dim() != 2 or inputs.numel() == 0:
            raise ValueError(
                f"predict batch {batch_idx}: inputs must be a non-empty [B, S] tensor of token ids, got shape "
                f"{tuple(inputs.shape)}."
            )
        return torch.log_softmax(self(inputs).float(), dim=-1)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """:meth:`check_token_ids` (the first batch, or every batch with ``check_every_batch``); starts the step timer."""
        self.check_token_ids(batch, "training", batch_idx)
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        """Log ``tokens_per_sec``: the batch's tokens on all data-parallel replicas over the host wall
        time since :meth:`on_train_batch_start` (forward, backward, gradient reduction and optimizer
        step as the host issues them; data loading and logging are outside).

        It adds no device synchronisation: on CUDA the host runs ahead of the device until something
        reads a device value, so one step's figure may include part of a neighbouring step's device
        time. Averaged over steps, as loggers plot it, it is the training step's throughput; time
        single steps with CUDA events or a profiler instead.
        """
        if self._step_started is None:
            return
        elapsed = time.perf_counter() - self._step_started
        inputs = batch[0]
        replicas = self._data_parallel_replicas()
        self.log("tokens_per_sec", inputs.numel() * replicas / max(elapsed, 1e-9), prog_bar=True)

    def _data_parallel_replicas(self) -> int:
        strategy = self.trainer.strategy
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if self.trainer.world_size > 1 else None
        return kwargs["num_replicas"] if kwargs else 1

    def configure_optimizers(self):
        """AdamW over every parameter (see :func:`optimizer_param_groups`; fused on CUDA, see
        :func:`adamw_kernel_options`) with warm-up + cosine."""
        hp = self.hparams
        groups = optimizer_param_groups(self, hp.weight_decay)
        kernel = adamw_kernel_options({p.device.type for g in groups for p in g["params"]})
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), **kernel)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
