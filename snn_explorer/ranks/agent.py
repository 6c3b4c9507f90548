"""The agent process: runs torch elastic on its own main thread, in its own session.

Started by :func:`snn_explorer.ranks.run` as ``python agent.py RUN_DIR``. It imports torch and
the package once, then elastic *forks* the ranks from it (so no rank imports torch again), each
entering :func:`snn_explorer.ranks.rank.run_rank`. Every port it opens listens on 127.0.0.1.
It ends every descendant before it exits, and removes the run directory if its parent dies.
"""
import os
import shutil
import sys


def _import_package(spec: dict) -> None:
    """The caller's ``sys.path`` (and this package's root, if the caller found it elsewhere)."""
    sys.path[:] = spec["sys_path"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.append(root)


def _record_exits(run_dir: str, exitcodes: dict) -> None:
    """Emit an ``exit`` event for every worker as soon as it exits and keep its code (elastic
    reports one failed worker only, and a worker's clean exit not at all)."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    from snn_explorer import compat
    from snn_explorer.ranks import channel

    poll = compat.ELASTIC_POLL

    def recording_poll(self):
        for local_rank, proc in enumerate(getattr(getattr(self, "_pc", None), "processes", ())):
            code = proc.exitcode
            if code is not None and local_rank not in exitcodes:
                exitcodes[local_rank] = code
                channel.emit(run_dir, local_rank, "exit", code=code)
        return poll(self)
    MultiprocessContext._poll = recording_poll


def _loopback_store(timeout_s: int = 60):
    """A ``TCPStore`` server whose socket listens on 127.0.0.1 only (TCPStore alone binds every
    interface, so the socket is bound first and handed over)."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, master_listen_fd=sock.detach(),
                    timeout=timedelta(seconds=timeout_s))


def _register_loopback_rendezvous() -> None:
    """Register ``c10d-loopback``: elastic's c10d rendezvous whose stores listen on 127.0.0.1 only.

    Both stores are loopback-bound: the rendezvous store, and the store elastic shares with the
    workers (MASTER_ADDR / MASTER_PORT), which it would otherwise open on every interface.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from snn_explorer import compat

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return "c10d-loopback"

    def creator(params):
        store = _loopback_store()
        handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
        name = compat.ELASTIC_STORE_SERVER.__name__
        setattr(handler, name, lambda master_addr, master_port: _loopback_store())
        return handler
    rendezvous_handler_registry.register("c10d-loopback", creator)


def _loopback_interface() -> str:
    import socket

    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else ""


def _start_method() -> str:
    """``fork`` (the ranks inherit the imported torch) unless this process touched CUDA."""
    import torch

    return "spawn" if torch.cuda.is_initialized() else "fork"


def _elastic(run_dir: str, spec: dict, channel, rank) -> dict:
    """Run the ranks under elastic; the outcome as ``status.json`` holds it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if spec["backend"] == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and _loopback_interface():
        os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    exitcodes: dict = {}
    _record_exits(run_dir, exitcodes)
    _register_loopback_rendezvous()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=spec["nprocs"], run_id=spec["run_id"],
        rdzv_backend="c10d-loopback", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
        start_method=_start_method(), monitor_interval=0.05, shutdown_timeout=spec["shutdown_timeout"],
        logs_specs=DefaultLogsSpecs(log_dir=channel.path(run_dir, "logs"), redirects=Std.ALL),
    )
    status = {"ok": False, "failures": {}, "agent_error": None}
    try:
        elastic_launch(config, rank.run_rank)(run_dir, spec["backend"], spec.get("pg_timeout"))
        status["ok"] = True
    except ChildFailedError as exc:
        status["failures"] = {int(r): {"exitcode": c} for r, c in exitcodes.items() if c}
        status["failures"].update({int(r): {"exitcode": f.exitcode} for r, f in exc.failures.items()})
    except BaseException as exc:  # SignalException, rendezvous errors, ...
        import traceback

        status["agent_error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return status


def main(run_dir: str) -> int:
    import json

    with open(os.path.join(run_dir, "spec.json")) as fh:
        spec = json.load(fh)
    _import_package(spec)
    from snn_explorer.ranks import channel, process, rank

    def orphaned():  # the caller died (SIGTERM, SIGHUP, SIGKILL): nobody else will clean up
        shutil.rmtree(run_dir, ignore_errors=True)
        process.kill_tree(os.getpid())
        os.killpg(0, 9)

    rank.exit_with_parent(spec["parent_pid"], orphaned)
    process.become_subreaper()
    import cloudpickle  # noqa: F401  (imported once here, inherited by the forked ranks)
    import snn_explorer.core  # noqa: F401

    try:
        status = _elastic(run_dir, spec, channel, rank)
        channel.write_json(channel.path(run_dir, "status.json"), status)
    finally:
        process.kill_tree(os.getpid())  # adopted orphans: a rank's grandchildren in their own session
    return 0 if status["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
