"""Lightning strategies. Importing this module registers ``Trainer(strategy="moe")``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_moe.strategies import last_checkpoint
from lightning_moe.strategies.environment import ExistingProcessGroupEnvironment
from lightning_moe.strategies.moe_strategy import MoEStrategy
from lightning_moe.strategies.optimizer_step import NonFiniteGradientsError

__all__ = ["ExistingProcessGroupEnvironment", "MoEStrategy", "NonFiniteGradientsError"]

last_checkpoint.install()  # ckpt_path="last" falls back to the newest complete checkpoint

if MoEStrategy.strategy_name not in StrategyRegistry:
    MoEStrategy.register_strategies(StrategyRegistry)
