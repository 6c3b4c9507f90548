"""launch() from a real Jupyter kernel: a cell-defined function, live widgets, a clean kernel after."""
from __future__ import annotations

import textwrap

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

CELL = textwrap.dedent("""
    import signal
    import torch, torch.distributed as dist
    from snn_explorer.launcher import launch, report
    handlers = lambda: (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    before = handlers()
    torch.cuda.is_available()  # touching CUDA in the kernel first must not matter
    def cell_fn(x):
        report(step=1, total=1, loss=0.5)
        print("noise from a rank")
        return dist.get_rank() * x
    result = launch(cell_fn, 5, nprocs=2)
    print("VALUES", result.values, "CLEAN", handlers() == before)
""")


@pytest.mark.timeout(150)
def test_launch_from_a_kernel_cell():
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        msg_id = kc.execute(CELL)
        stdout, widgets, errors = [], 0, []
        while True:
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                stdout.append(content["text"])
            elif kind == "display_data" and "application/vnd.jupyter.widget-view+json" in content["data"]:
                widgets += 1
            elif kind == "error":
                errors.append("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        text = "".join(stdout)
        assert not errors, errors
        assert "VALUES [0, 5] CLEAN True" in text, text
        assert "noise from a rank" not in text  # rank output goes to the logs, not the cell
        assert widgets == 1, text  # the live per-rank progress display
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
