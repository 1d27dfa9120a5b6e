"""Persistence, without Lightning: sharded save and load with global keys, integrity, safe loading, export.

* :mod:`~lightning_moe.checkpoint.sharded`: DCP model and optimizer state with global, layout-free keys.
* :mod:`~lightning_moe.checkpoint.security`: loading that never runs code from the files.
* :mod:`~lightning_moe.checkpoint.integrity`, :mod:`~lightning_moe.checkpoint.entries`: sizes and
  digests of every file of a save, checked before loading.
* :mod:`~lightning_moe.checkpoint.files`: atomic replacement and errors that name the path.
* :mod:`~lightning_moe.checkpoint.reader`, :mod:`~lightning_moe.checkpoint.legacy`: one reader for
  every checkpoint form, including older expert layouts.
* :mod:`~lightning_moe.checkpoint.export`, :mod:`~lightning_moe.checkpoint.consolidated`: one
  ``torch.save`` file of global weights; :mod:`~lightning_moe.checkpoint.export_hf`: a Hugging Face
  directory from a training checkpoint.
* :mod:`~lightning_moe.checkpoint.hf_load`: Hugging Face safetensors into a parallelized model.

The package sits above ``parallel/`` (it reads expert shards and pipeline records) and, for the
Hugging Face formats, above ``models/``; ``parallel/`` never imports it. Nothing is imported here,
so ``import lightning_moe.checkpoint`` stays cheap and loads no model.
"""
