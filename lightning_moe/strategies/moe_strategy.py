"""`MoEStrategy`: the Lightning strategy for folded MoE parallelism.

``Trainer(strategy=MoEStrategy(expert_parallel_size=4))`` takes a LightningModule written for one
device, builds the folded layout in ``setup_environment`` (``strategy.parallel_context`` and a dense
``strategy.device_mesh`` before ``configure_model``), applies :func:`~lightning_moe.parallel.parallelize`
and materialises each rank's shards, synchronises gradients (buckets overlapped with backward, or
FSDP2), feeds each data-parallel replica its own samples, and checkpoints with global keys that
reshard across layouts (:class:`~lightning_moe.strategies.checkpoint_methods.CheckpointMethods`).
Launch with ``devices=N`` (Lightning's subprocess launcher), torchrun / SLURM, or from processes
that initialised ``torch.distributed`` already.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe.compat import default_process_group_backend, optimizers_to_device
from lightning_moe.layers.cpu_gemm import ENV_VAR as CPU_GEMM_ENV_VAR
from lightning_moe.parallel import ParallelContext, ParallelDims, build_parallel_context, mixed_tensor_updates
from lightning_moe.parallel.context_parallel.apply import shard_batch
from lightning_moe.parallel.cpu_gemm_agreement import describe_cpu_gemm_choices
from lightning_moe.parallel.grad_norm import clip_grad_norm_
from lightning_moe.parallel.gradient_sync import GradientSync
from lightning_moe.parallel.layout.lightning_mesh import lightning_device_mesh
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.strategies.checkpoint_methods import CheckpointMethods
from lightning_moe.strategies.checkpointing import MoECheckpointing
from lightning_moe.strategies.collectives import WorldCollectives
from lightning_moe.strategies.empty_init import meta_weights
from lightning_moe.strategies.environment import ExistingProcessGroupEnvironment, connect
from lightning_moe.strategies.launcher import MoESubprocessLauncher
from lightning_moe.strategies.model_setup import materialize, prepare_model_once
from lightning_moe.strategies.optimizer_step import patch_gradient_clipping
from lightning_moe.strategies.options import check_strategy_options
from lightning_moe.strategies.pipeline_step import PipelineDriver
from lightning_moe.strategies.sharding import check_sharding_combination, make_grad_sync, sharding_mp_policy
from lightning_moe.strategies.step_safeguards import StepSafeguards
from lightning_moe.strategies.trainer_callbacks import add_expert_bias_updater, use_global_model_summary

__all__ = ["MoEStrategy"]


_STARTUP_TIMEOUT = timedelta(minutes=30)


class MoEStrategy(CheckpointMethods, WorldCollectives, ParallelStrategy):
    """Folded expert / tensor / data parallelism for MoE LightningModules (registered as ``"moe"``).

    Args:
        tensor_parallel_size: TP, attention and dense layers (Megatron ``tensor_model_parallel_size``).
        context_parallel_size: CP: each sequence sharded over CP ranks (chunks r and 2C-1-r) for the
            reference model's attention; the strategy cuts every ``[B, S, ...]`` batch tensor.
        cp_comm_type: the CP exchange of keys and values, ``"p2p"`` (ring) or ``"all_gather"``.
        pipeline_parallel_size: PP, layers split into stages; ``pipeline_schedule``, ``num_microbatches``,
            ``virtual_stages``, ``pipeline_layer_split``: see :class:`~lightning_moe.strategies.pipeline_step.PipelineDriver`.
        expert_parallel_size: EP, experts sharded over this many ranks (``expert_model_parallel_size``).
        expert_tensor_parallel_size: ETP, each expert's F dimension sharded; None = TP, as Megatron.
        dispatcher: token dispatcher, ``"alltoall"``, ``"allgather"`` or ``"flex"`` (README: choosing one).
        flex_backend: ``flex``'s implementation: ``"auto"`` (DeepEP on CUDA where it can run), ``"torch"``, ``"deepep"``.
        sharding_strategy: ``"NO_SHARD"`` (default: replicated), ``"SHARD_GRAD_OP"`` or ``"FULL_SHARD"``
            (PyTorch FSDP2, dense over DP x CP, experts over EDP: :mod:`lightning_moe.parallel.fully_shard`).
        defer_gradient_reduction: sharded strategies only. False (default): each micro-batch (gradient accumulation,
            pipeline schedule) reduce-scatters its gradients into the shards; True: one reduce-scatter per step, but
            DP times the gradient shard held unsharded between micro-batches (``ShardedGradSync``).
        order: rank order of the folded layout, ``"tp-cp-ep-dp-pp"`` or ``"tp-cp-ep-pp-dp"``.
        bucket_size_mb: gradient reduction bucket size.
        grad_reduce_in_fp32: under ``NO_SHARD``, sum bf16/fp16 parameters' gradients in fp32 (default, Megatron's
            flag; two buckets in fp32 at a time), or in their own dtype (False): ``GradSync``.
        save_distributed_checkpoint: sharded checkpoint directories (True) or one consolidated file
            (model weights only), which rank 0 writes as the tensors reach it, one at a time; every rank
            loads it memory-mapped, taking only its own slices.
        verify_checkpoints: check the SHA-256 of every file on load (``meta.pt``, ``.metadata``, the
            shards; recorded at save); False skips the checksums for very large checkpoints on
            trusted storage. Sizes, paths, links and ``.metadata`` coverage are checked either way.
        start_method: ``"popen"`` (re-run the script per rank). Spawn/fork launchers are refused:
            they send rank 0's local state back to the parent, which would keep one shard only.
        process_group_backend: ``"gloo"``/``"nccl"``; default from the device.
        timeout: timeout of every collective, on the default group and every subgroup: a rank that
            stops answering ends the job with an error after this long.
        startup_timeout: how long the ranks wait for each other to join the process group at start-up (each
            imports and loads at its own pace): a short ``timeout`` does not fail slow starts. None: ``timeout``.
        on_nonfinite_grads: ``"raise"`` (default): a step whose reduced gradients hold inf/NaN raises
            :class:`~lightning_moe.strategies.optimizer_step.NonFiniteGradientsError` before the
            optimizer step; ``"skip"``: the step is skipped and counted in ``moe/skipped_steps``.
            Under ``16-mixed`` the GradScaler handles overflows instead.
        pipeline_schedule: with ``pipeline_parallel_size > 1``, the ``torch.distributed.pipelining``
            schedule: ``"1F1B"`` (default), ``"GPipe"``, ``"Interleaved1F1B"`` (``virtual_stages >= 2``)
            or ``"ZBVZeroBubble"`` (zero bubble, exactly 2 stages per rank).
        num_microbatches: micro-batches each batch is split into under PP (the batch size must be a
            multiple; None: 1). More micro-batches shrink the pipeline bubble; use it instead of
            ``accumulate_grad_batches``.
        virtual_stages: stages per PP rank (None: what the schedule needs, 2 for the interleaved
            and V schedules).
        pipeline_layer_split: transformer blocks per stage, in stage order, summing to the number
            of blocks (None: as even as possible, earlier stages first; the embedding rides with the
            first stage, the final norm and the head with the last).
        accelerator: Lightning's accelerator (None: the Trainer's).
        parallel_devices: the devices of this node (None: set by the Trainer from ``devices``).
        cluster_environment: Lightning's cluster environment (None: detected; an existing
            process group is used as is).
        checkpoint_io: accepted for Lightning's signature; checkpoints are written and read by the strategy itself
            (sharded directories or one file), not through a CheckpointIO plugin.
        precision_plugin: Lightning's precision plugin (None: from the Trainer's ``precision``).
    """

    strategy_name = "moe"
    manages_moe_loss_scaling = True
    """Read by :class:`~lightning_moe.callbacks.MoELossScaling`: this strategy scales the aux losses itself."""

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        context_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        dispatcher: str = "alltoall",
        flex_backend: str = "auto",
        cp_comm_type: str = "p2p",
        sharding_strategy: str = "NO_SHARD",
        defer_gradient_reduction: bool = False,
        order: str = "tp-cp-ep-dp-pp",
        bucket_size_mb: float = 25.0,
        grad_reduce_in_fp32: bool = True,
        save_distributed_checkpoint: bool = True,
        verify_checkpoints: bool = True,
        start_method: str = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        startup_timeout: timedelta | None = _STARTUP_TIMEOUT,
        on_nonfinite_grads: str = "raise",
        pipeline_schedule: str = "1F1B", num_microbatches: int | None = None,
        virtual_stages: int | None = None, pipeline_layer_split: list[int] | None = None,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        if cluster_environment is None and ExistingProcessGroupEnvironment.detect():
            cluster_environment = ExistingProcessGroupEnvironment()
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )
        self.parallel_options = ParallelOptions(dispatcher, sharding_strategy, None, flex_backend, cp_comm_type)
        check_strategy_options(
            pipeline_parallel_size, context_parallel_size, start_method, self.parallel_options, defer_gradient_reduction
        )
        self.sizes = {
            "tp": tensor_parallel_size, "cp": context_parallel_size, "pp": pipeline_parallel_size,
            "ep": expert_parallel_size, "etp": expert_tensor_parallel_size,
        }
        self.order = order
        self.defer_gradient_reduction = defer_gradient_reduction
        self.bucket_size_mb = bucket_size_mb
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self._process_group_backend, self._timeout = process_group_backend, timeout
        self._startup_timeout = startup_timeout if startup_timeout is not None else timeout
        self._context: ParallelContext | None = None
        self._layout_announced = False
        self._device_mesh: DeviceMesh | None = None
        self._grad_sync: GradientSync | None = None
        self._safeguards = StepSafeguards(on_nonfinite_grads)
        self.checkpointing = MoECheckpointing(self, save_distributed_checkpoint, verify_checkpoints=verify_checkpoints)
        self.num_nodes = 1
        self._pipeline = PipelineDriver.create(pipeline_parallel_size, pipeline_schedule, num_microbatches,
                                               virtual_stages, pipeline_layer_split)

    # -- layout ---------------------------------------------------------------------------------

    def parallel_dims(self, world_size: int | None = None) -> ParallelDims:
        """The folded layout for ``world_size`` ranks (default: this Trainer's world)."""
        world = world_size if world_size is not None else self.world_size
        try:
            return ParallelDims(world, order=self.order, **self.sizes)
        except ValueError as err:
            raise ValueError(
                f"MoEStrategy cannot fold {world} processes (devices x num_nodes = {self.num_processes} x "
                f"{self.num_nodes}) into TP={self.sizes['tp']}, CP={self.sizes['cp']}, PP={self.sizes['pp']}, "
                f"EP={self.sizes['ep']}, ETP={self.sizes['etp'] or self.sizes['tp']}: {err}"
            ) from None

    dispatcher = property(lambda self: self.parallel_options.dispatcher, doc="The MoE layers' token dispatcher.")
    sharding_strategy = property(lambda self: self.parallel_options.sharding_strategy, doc="NO_SHARD or FSDP2's.")
    flex_backend = property(lambda self: self.parallel_options.flex_backend, doc="The flex dispatcher's backend.")
    cp_comm_type = property(lambda self: self.parallel_options.cp_comm_type, doc="The CP K/V exchange.")

    @property
    def parallel_context(self) -> ParallelContext:
        """Process groups and meshes of the folded layout (available from ``setup_environment`` on)."""
        if self._context is None:
            raise RuntimeError("The parallel context is built in setup_environment(); it is not available yet.")
        return self._context

    @property
    def pipeline_stages(self) -> list[nn.Module]:
        """This rank's pipeline stage modules in stage order (each runs once per micro-batch); empty without PP or before setup."""
        runner = None if self._pipeline is None else self._pipeline.runner
        return [] if runner is None else list(runner.modules)

    num_microbatches = property(lambda self: 1 if self._pipeline is None else self._pipeline.num_microbatches,
                                doc="Micro-batches each batch is split into by the pipeline schedule (1 without PP).")

    @property
    def device_mesh(self) -> DeviceMesh:
        """The dense mesh with Lightning's dim names (pipeline/data/context/tensor_parallel): a model applies its own
        tensor parallelism with ``self.device_mesh["tensor_parallel"]`` in ``configure_model``, as under Lightning's
        ``ModelParallelStrategy`` (:mod:`~lightning_moe.parallel.user_tensor_parallel`)."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh is built in setup_environment(); it is not available yet.")
        return self._device_mesh

    @property
    def root_device(self) -> torch.device:
        """The device of this process."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes (devices) per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to inject distributed samplers and honour ``sync_dist``."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Samples are split over the dense data-parallel replicas; TP/CP ranks share theirs."""
        ctx = self.parallel_context
        return {"num_replicas": ctx.size("dp"), "rank": ctx.rank_in("dp")}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the parallelized model and its optimizers."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The strategy restores optimizer states itself (sharded)."""
        return False

    # -- processes ------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if ExistingProcessGroupEnvironment.detect() and not isinstance(
            self.cluster_environment, ExistingProcessGroupEnvironment
        ):
            self.cluster_environment = ExistingProcessGroupEnvironment(self.num_processes or None)
        if isinstance(self.cluster_environment, ExistingProcessGroupEnvironment):
            self.cluster_environment.use_processes_per_node(self.num_processes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = MoESubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        """Ranks from the cluster environment; validates the folded layout against the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        if self.num_processes and self.cluster_environment is not None:
            # Lightning's launcher checks devices x nodes against the environment; with processes
            # started externally there is no launcher, so check here.
            if self.cluster_environment.creates_processes_externally:
                self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            self.parallel_dims(self.num_nodes * self.num_processes)  # fail at Trainer init, before training
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        """Initialise the process group (if needed) and build the parallel context once."""
        super().setup_environment()
        self.set_world_ranks()
        if self.global_rank != 0:
            # Deprecation notices are the same on every rank: rank 0 says them once. Other warnings
            # (which may concern one rank only) stay.
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category)
        backend = self._process_group_backend or default_process_group_backend(self.root_device)
        self._process_group_backend = backend
        connect(self.cluster_environment, backend, self.root_device, self._startup_timeout, self._timeout)
        if self._context is None:
            dims = self.parallel_dims(dist.get_world_size())
            self._context = build_parallel_context(dims, self.root_device.type, timeout=self._timeout)
            self._device_mesh = lightning_device_mesh(self._context)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # -- model ----------------------------------------------------------------------------------

    def setup(self, trainer) -> None:
        """Parallelize and materialise the model, set up gradient sync, optimizers and precision."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        callback = trainer.checkpoint_callback  # its dirpath is set in the callbacks' setup, before this
        if trainer.state.fn == TrainerFn.FITTING and callback is not None and callback.dirpath is not None:
            self.checkpointing.check_writable(callback.dirpath)  # before any step is spent
        check_sharding_combination(self.sharding_strategy, self.precision_plugin, trainer.callbacks)
        split = None if self._pipeline is None else self._pipeline.prepare(self, trainer)  # trims before sharding
        precision = str(getattr(self.precision_plugin, "precision", ""))  # completes the options with FSDP2's policy
        options = replace(self.parallel_options, mp_policy=sharding_mp_policy(precision))
        gemm_choices = prepare_model_once(self.model, self.parallel_context, self.root_device, options, split)
        if not self._layout_announced:  # once the model holds the layout: the banner never claims one not applied
            rank_zero_info(
                f"MoEStrategy: {self.parallel_context.dims.describe()}, dispatcher={self.dispatcher}, "
                f"sharding_strategy={self.sharding_strategy}"
            )
            self._layout_announced = True
        if gemm_choices:
            rank_zero_info(
                f"MoEStrategy: CPU expert GEMMs through {describe_cpu_gemm_choices(gemm_choices)} (measured on "
                f"rank 0, used by every rank; {CPU_GEMM_ENV_VAR}=aten or onednn forces one library)"
            )
        materialize(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._pipeline is not None:
            self._pipeline.setup(self, trainer)
        self._safeguards.setup(
            self.model, self.parallel_context, self.root_device, self._grad_scaler,
            detect_anomaly=getattr(trainer, "_detect_anomaly", False),
        )
        if trainer.state.fn == TrainerFn.FITTING:
            use_global_model_summary(trainer.callbacks, None if self._pipeline is None else self._pipeline.runner)
            add_expert_bias_updater(trainer.callbacks, self.model)
            if self._grad_sync is None:
                self._grad_sync = make_grad_sync(
                    self.sharding_strategy, self.model, self.parallel_context, self.bucket_size_mb,
                    trainer.lightning_module.automatic_optimization, self.grad_reduce_in_fp32,
                    self.defer_gradient_reduction,
                )
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            self._patch_gradient_clipping()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        self.barrier()

    @property
    def _grad_scaler(self):
        return getattr(self.precision_plugin, "scaler", None)  # 16-mixed

    def model_to_device(self) -> None:
        """Move every remaining parameter and buffer to this rank's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Modules built here go straight to this rank's device; with ``empty_init=True`` their weights to
        the meta device (:func:`meta_weights`), materialised in setup after sharding: no rank holds the model."""
        device = meta_weights(self.root_device) if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    # -- steps ----------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any):
        """Check that the tensor-parallel ranks got the same batch, cut it to this rank's sequence
        chunks under context parallelism, then run the module's step."""
        if self.lightning_module.automatic_optimization:
            # Compared on the device; read once per optimizer step, before it (see optimizer_step).
            self._safeguards.observe_batch(args, kwargs, self.parallel_context)
        else:  # manual optimization may never step: read at once
            StepSafeguards.check_batch(args, kwargs, self.parallel_context)
        args, kwargs = shard_batch((args, kwargs), self.parallel_context)
        if self._pipeline is not None:
            return self._pipeline.training_step(self, *args, **kwargs)
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        """As :meth:`training_step`: validation batches are split over TP and CP ranks too."""
        StepSafeguards.check_batch(args, kwargs, self.parallel_context)
        args, kwargs = shard_batch((args, kwargs), self.parallel_context)
        if self._pipeline is not None:
            return self._pipeline.validation_step(self, *args, **kwargs)
        return super().validation_step(*args, **kwargs)

    # -- gradients ------------------------------------------------------------------------------

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: replicated gradients reduced after the last micro-batch (sharded ones see ``no_sync``)."""
        if self._grad_sync is None:
            yield
            return
        with self._grad_sync.no_sync():
            yield

    def no_sync(self):
        """Context manager for manual optimization: accumulate gradients without reducing them."""
        return self.block_backward_sync()

    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's training backward, with the gradient-sync hooks armed for exactly its duration: a backward
        run elsewhere (a callback, a validation step) is neither reduced nor launched (see ``GradSync``)."""
        sync = self._grad_sync
        if sync is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        sync.begin_backward()
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            sync.end_backward()

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Before each training backward: the aux/z-loss gradient scale follows the main loss's."""
        module = self.lightning_module
        accumulation = module.trainer.accumulate_grad_batches if module.automatic_optimization else 1
        self._safeguards.before_backward(accumulation, self.parallel_context, self._grad_scaler)

    def post_backward(self, closure_loss: Tensor) -> None:
        """Finish the overlapped reduction after a backward that is not being accumulated."""
        sync = self._grad_sync
        if sync is not None and sync.sync_enabled and sync.overlap:
            sync.finish()

    def finish_grad_sync(self) -> None:
        """Reduce the gradients accumulated since the last reduction (idempotent). Manual optimization needs
        no call (the strategy reduces before ``optimizer.step()`` and clipping); call it to read them earlier."""
        if self._grad_sync is not None:
            self._grad_sync.finish()

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Step after the gradients of the closure's backward (or of manual backward passes) are reduced.

        The update runs under :func:`~lightning_moe.parallel.mixed_tensor_updates`, so torch's foreach
        and fused kernels (the default on CUDA) accept a group of DTensors and plain tensors; the
        closure (forward, backward, the hooks before the step, clipping) runs without it."""
        inner = closure

        def reduced_closure():
            result = inner()
            # The closure ran the step's last micro-batch: every batch of this step has been compared.
            self._safeguards.verify_batches()
            if self._grad_sync is None:
                return result
            self.finish_grad_sync()  # a no-op when post_backward already reduced
            self._safeguards.before_optimizer_step(
                optimizer, self.parallel_context, self.lightning_module.trainer.global_step, self._grad_scaler,
                log=self._log_step_metric,
            )
            return result

        with mixed_tensor_updates(optimizer):
            return super().optimizer_step(optimizer, reduced_closure, model, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip all gradients by their global norm over every shard; returns the norm before clipping."""
        assert self.model is not None
        return clip_grad_norm_(self.model.parameters(), max_norm, self.parallel_context)

    def _patch_gradient_clipping(self) -> None:
        patch_gradient_clipping(
            self.precision_plugin, lambda: self.parallel_context, self.finish_grad_sync, self._safeguards.guard
        )

    def _log_step_metric(self, name: str, value: float) -> None:
        self.lightning_module.log(name, value, on_step=True, on_epoch=False)

    def on_exception(self, exception: BaseException) -> None:
        """A run stopped by SIGTERM exits with 143 (128 + SIGTERM) instead of Lightning's 0."""
        if isinstance(exception, SIGTERMException) and not exception.code:
            exception.code = 128 + signal.SIGTERM

    def teardown(self) -> None:
        """Release the accelerator and the gradient hooks; sharded models stay where they are."""
        if self._grad_sync is not None:
            self._grad_sync.remove_hooks()
            self._grad_sync = None
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Register ``"moe"`` (all sizes 1; set them through the class in code or YAML)."""
        strategy_registry.register(cls.strategy_name, cls, description="Folded expert/tensor/data parallelism for MoE models")
