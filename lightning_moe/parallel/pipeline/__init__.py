"""Pipeline parallelism: a model cut into stages and run by torch's pipeline schedules.

* :mod:`~lightning_moe.parallel.pipeline.split`: the stages of a model, from the pipeline parts
  its plan declares (and the record of which blocks each stage keeps).
* :mod:`~lightning_moe.parallel.pipeline.runner`: ``PipelineRunner``, one training or evaluation
  step over the schedule (``PIPELINE_SCHEDULES``), with FSDP2 and gradient sync per stage.
* :mod:`~lightning_moe.parallel.pipeline.loss`: the last stage's loss, weighted by each
  micro-batch's share of the targets.
* :mod:`~lightning_moe.parallel.pipeline.stage_failure`: one stage's error reported to its peers,
  so no rank waits forever on a stage that died.

Nothing is imported here, so importing one of them does not import the runner.
"""
