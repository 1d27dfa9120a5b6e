"""One line per GPU-path check, read from the junit report of ``gpu_check.sh``'s pytest step.

    python benchmarks/gpu_path_report.py RESULTS_DIR/pytest.xml

Each check is one or more ``gpu``-marked tests (by test id prefix); the line says how many of them
passed, failed or were skipped, or that none was collected.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

CHECKS = {
    "1-GPU NCCL fit, bf16-mixed": "tests/strategies/test_device_setup.py::test_one_gpu_fit_over_nccl",
    "router fp32 under bf16 autocast": "tests/layers/test_router_gpu.py::",
    "expert GEMMs bf16 under autocast": "tests/layers/test_experts_gpu.py::",
    "16-mixed aux grads vs fp32": "tests/callbacks/test_loss_scaling.py::test_16_mixed_aux_gradients",
    "sync-free grouped path": "tests/layers/test_sync_free.py::",
    "CP ring on CUDA flash attention": "tests/parallel/test_context_parallel_gpu.py::",
    "setup peak <= shard + one tensor": "tests/parallel/test_scale_gpu.py::test_setup_peak",
    "FSDP2 all-gather prefetch overlap": "tests/parallel/test_scale_gpu.py::test_fsdp2_prepares",
    "foreach/fused AdamW, mixed TP groups": "tests/parallel/test_mixed_step_gpu.py::",
    "consolidated save in host memory": "tests/parallel/test_consolidated_gpu.py::",
}
"""What is checked -> the id prefix (``path::name``) of its tests."""


def outcomes(report: str) -> dict[str, str]:
    """``{test id: passed | failed | skipped}`` of every test case in a junit XML report."""
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        if case.find("failure") is not None or case.find("error") is not None:
            results[test_id] = "failed"
        else:
            results[test_id] = "skipped" if case.find("skipped") is not None else "passed"
    return results


def main(report: str) -> int:
    """Print the table; non-zero when a check failed or was not collected."""
    try:
        results = outcomes(report)
    except (OSError, ET.ParseError) as err:
        print(f"no junit report ({err})")
        return 1
    status = 0
    for check, prefix in CHECKS.items():
        found = [outcome for test_id, outcome in results.items() if test_id.startswith(prefix)]
        counts = ", ".join(f"{found.count(o)} {o}" for o in ("passed", "failed", "skipped") if o in found)
        print(f"{check:34s} {counts or 'not collected'}")
        status |= not found or "failed" in found
    return int(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
