"""Hugging Face ``transformers`` models with `MoELayer` s: :func:`swap_moe_blocks` and its inverse.

``swap_moe_blocks(model)`` replaces every sparse-MoE block of a ``transformers`` model (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GLM-4.5) by a :class:`~lightning_moe.MoELayer` holding the same
weights with the same routing, so the model trains under ``MoEStrategy`` with expert parallelism
and the MoE callbacks; ``unswap_moe_blocks(model)`` puts the ``transformers`` blocks back with the
trained weights, for ``save_pretrained``::

    import lightning as L
    import torch
    import transformers
    from lightning_moe import swap_moe_blocks, unswap_moe_blocks
    from lightning_moe.callbacks import LoadBalanceMonitor
    from lightning_moe.strategies import MoEStrategy

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.AutoModelForCausalLM.from_pretrained("allenai/OLMoE-1B-7B-0924")
            swap_moe_blocks(self.model)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    trainer = L.Trainer(strategy=MoEStrategy(expert_parallel_size=8), devices=8,
                        callbacks=[LoadBalanceMonitor()])

* :mod:`.families`: the supported block classes and where each tensor lies (one entry per family);
* :mod:`.blocks`: the replacement both ways.

Nothing here imports ``transformers``: blocks are recognised by their class's module and name.
"""

from lightning_moe.models.hf.swap.blocks import SwappedBlock, swap_moe_blocks, unswap_moe_blocks
from lightning_moe.models.hf.swap.families import BLOCK_FAMILIES, BlockFamily

__all__ = ["BLOCK_FAMILIES", "BlockFamily", "SwappedBlock", "swap_moe_blocks", "unswap_moe_blocks"]
