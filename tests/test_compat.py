"""`lightning_moe.compat` holds the private torch and Lightning APIs that moved there; no product file
outside it uses them again, and each function says which versions it was written against.

Oracle: the package's own source, read (not imported) file by file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_moe import compat

PACKAGE_DIR = Path(compat.__file__).parent
# The private names routed through compat: none may reappear elsewhere in the package.
ROUTED = (
    "_get_fsdp_state", "_fsdp_param_groups", "_state_ctx", "_root_post_backward_final_callback", "_lazy_init",
    "_op_dispatcher", "torch.utils._pytree", "torch.utils._device", "distributed.fake_pg", "_skip_backward",
    "_get_default_process_group_backend_for_device", "_optimizers_to_device", "_sync_ddp_if_available",
    "_set_num_threads_if_needed", "_init_dist_connection", "_format_summary_table", "_set_pg_timeout",
    "_get_default_store", "pipelining.schedules", "_PipelineScheduleRuntime", "_add_send_recv",
    "_add_unshard_reshard", "_ComputationType", "_num_stages", "_n_microbatches", "_setup_forward_recv_info",
    "_setup_backward_recv_info", "_stage_forward_initialized", "_stage_backward_initialized", "_has_backward",
    "_rebuild_tensor_v2", "_get_storage_alignment",
    "_dtype_to_storage_type_map", "checkpoint._traverse", "_get_layout", "tensor._utils",
    "_compute_local_shape_and_global_offset", "_untyped_storage", "_pickle_storage_type",
    # The private kernels, as calls (an error message may still name torch._scaled_mm to the user).
    "torch._scaled_mm(", "torch._scaled_grouped_mm(", '"_scaled_grouped_mm"', "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_backward", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward", "_SubprocessScriptLauncher", "_call_children_scripts",
    "_is_local_file_protocol", "_StridedShard", "torch._subclasses", "distributed._tools", "tensor._sharding_prop",
    "utils._python_dispatch", "_resolve_process_group", "_cdata", "fsdp._fully_shard", "_open_zipfile_writer",
    # torch's C bindings and private ops, and private members the planner reads or patches.
    "torch._C.", "_linear_pointwise", "_current_graph_task_id", "_top_saved_tensors_default_hooks",
    "_propagate_tensor_meta", "_type()", "ProcessGroup.unbox", "_local_scalar_dense", "._version", "._base",
    "_local_tensor", "._results", "_logger_connector",
)

# A name, not the tail of a longer one (compat's own fsdp_lazy_init, set_skip_backward...); a
# name ending in punctuation (a call's "(", a closing quote) ends there.
_PATTERNS = {
    name: re.compile(rf"(?<![A-Za-z0-9]){re.escape(name)}" + (r"\b" if re.match(r"\w", name[-1]) else ""))
    for name in ROUTED
}


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines of ``path`` outside docstrings and comments (a mention in prose is not a use)."""
    text = re.sub(r'"""(?:.|\n)*?"""', lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
    return [(n, line.split("#", 1)[0]) for n, line in enumerate(text.splitlines(), 1)]


def test_no_product_file_uses_a_routed_private_api():
    uses = [
        f"{path.relative_to(PACKAGE_DIR)}:{n}: {name}"
        for path in sorted(PACKAGE_DIR.rglob("*.py")) if path != Path(compat.__file__)
        for n, line in _code_lines(path) for name in ROUTED if _PATTERNS[name].search(line)
    ]
    assert not uses, "private APIs used outside lightning_moe/compat.py (call the compat function):\n" + "\n".join(uses)


def test_every_function_names_the_versions_it_was_written_against():
    for name in compat.__all__:
        doc = getattr(compat, name).__doc__ or ""
        assert re.search(r"(torch|Lightning)\s+(>=\s*)?\d+\.\d+", doc), f"compat.{name} does not name its versions: {doc!r}"


def test_skip_backward_switches_the_fit_loop_flag():
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(_skip_backward=False))
    compat.set_skip_backward(trainer, True)
    assert trainer.fit_loop._skip_backward is True
    compat.set_skip_backward(trainer, False)
    assert trainer.fit_loop._skip_backward is False


def test_tree_helpers_flatten_and_map_nested_containers():
    tree = {"a": torch.ones(2), "b": [torch.zeros(1), 3]}
    leaves, _ = compat.tree_flatten(tree)
    assert len(leaves) == 3 and leaves[2] == 3
    doubled = compat.tree_map_only(torch.Tensor, lambda t: t * 2, tree)
    assert torch.equal(doubled["a"], torch.full((2,), 2.0)) and doubled["b"][1] == 3


def test_importing_compat_imports_no_distributed_module():
    # layers/ and memory/ call compat and must stay single-device code (docs/architecture.md §1).
    code = (
        "import sys, torch; before = {m for m in sys.modules if m.startswith('torch.distributed.')}; "
        "import lightning_moe.compat; "
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.') and m not in before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing lightning_moe.compat imported {out}"


def test_graph_task_id_tells_one_backward_from_another():
    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda grad: seen.append(compat.current_graph_task_id()))
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    assert compat.current_graph_task_id() == -1  # outside any backward
    assert len(seen) == 2 and min(seen) >= 0 and seen[0] != seen[1]


def test_top_saved_tensors_hooks_is_the_innermost_pair():
    def pack(t):
        return t

    def unpack(t):
        return t

    assert compat.top_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert compat.top_saved_tensors_hooks() == (pack, unpack)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_onednn_linear_is_a_times_w_transposed():
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(16, 24, generator=gen), torch.randn(8, 24, generator=gen)
    torch.testing.assert_close(compat.onednn_linear(a, w), a @ w.T, rtol=1e-5, atol=1e-5)


def test_script_object_kind_names_a_reduce_op_and_nothing_else():
    # The script object c10d's dispatched collectives receive for their reduction.
    assert "ReduceOp" in compat.script_object_kind(torch.classes.c10d.ReduceOp())
    assert compat.script_object_kind(torch.ones(1)) == "" and compat.script_object_kind("sum") == ""
