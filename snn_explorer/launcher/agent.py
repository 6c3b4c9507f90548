"""The agent process: runs torch elastic on its own main thread, in its own session.

Started by :func:`snn_explorer.launcher.launch` as ``python agent.py RUN_DIR`` (a script, so the
ranks that elastic spawns re-import only this light file, not the whole package). The entry
point of every rank is :func:`run_rank`, a trampoline that ``cloudpickle.loads`` the payload.
"""
import importlib.util
import os
import sys
import threading
import time


def _load_channel():
    name = "_snn_explorer_launch_channel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "channel.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


channel = _load_channel()


def _exit_with_parent(parent: int, on_orphan) -> None:
    """A daemon thread that calls ``on_orphan`` once the process ``parent`` is gone."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        on_orphan()
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _init_process_group(backend: str):
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    return dist


def _write_error(run_dir: str, rank: int, exc: BaseException, phase: str) -> None:
    import traceback

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    channel.write_json(channel.path(run_dir, "errors", f"{rank}.json"),
                       {"type": type(exc).__name__, "message": str(exc), "traceback": tb, "phase": phase})
    channel.emit(run_dir, rank, "error", type=type(exc).__name__, message=str(exc))
    sys.stderr.write(tb)


def _load_payload(path: str):
    """``(fn, args, kwargs)``; in-memory sources (notebook cells) go to linecache for tracebacks and
    the parent's ``register_stateful`` registrations are made here too."""
    import cloudpickle
    import linecache

    with open(path, "rb") as fh:
        data, sources = cloudpickle.loads(fh.read())
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    fn, args, kwargs, stateful = cloudpickle.loads(data)
    from snn_explorer.core.neurons import restore_stateful  # this file also runs as a script

    restore_stateful(stateful)
    return fn, args, kwargs


def run_rank(run_dir: str, backend: str) -> None:
    """One rank: heartbeat, load the payload, init the process group, run, store the value."""
    import faulthandler
    import signal

    rank = int(os.environ["RANK"])
    os.environ[channel.DIR_ENV] = run_dir
    _exit_with_parent(os.getppid(), lambda: os._exit(70))
    stacks = open(channel.path(run_dir, "stacks", f"{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    channel.emit(run_dir, rank, "start", pid=os.getpid())
    phase = "load"  # then "init" (joining the process group), then "run" (the function)
    try:
        import cloudpickle

        fn, args, kwargs = _load_payload(channel.path(run_dir, "payload.pkl"))
        phase = "init"
        dist = _init_process_group(backend)
        phase = "run"
        started = time.time()
        value = fn(*args, **kwargs)
        data = cloudpickle.dumps(value)
    except SystemExit as exc:  # exit now: interpreter teardown can block on a live process group
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        channel.emit(run_dir, rank, "exit", code=code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except BaseException as exc:  # the peers may be blocked in a collective: leave at once
        _write_error(run_dir, rank, exc, phase)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    channel.write_atomic(channel.path(run_dir, "results", f"{rank}.pkl"), data)
    channel.emit(run_dir, rank, "end", seconds=time.time() - started)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the value is stored; a torch interpreter teardown only delays the launcher


def _failures(exc, exitcodes: dict) -> dict:
    """rank -> exit code / pid / message; elastic names one failed rank, ``exitcodes`` has all."""
    out = {int(r): {"exitcode": c, "pid": None, "message": ""} for r, c in exitcodes.items() if c}
    out.update({int(rank): {"exitcode": f.exitcode, "pid": f.pid, "message": f.message}
                for rank, f in exc.failures.items()})
    return out


def _record_exitcodes(exitcodes: dict) -> None:
    """Keep every worker's exit code when elastic stops a failed group (it reports only one)."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    poll = MultiprocessContext._poll

    def recording_poll(self):
        result = poll(self)
        if result is not None and result.failures:
            for local_rank, proc in enumerate(getattr(getattr(self, "_pc", None), "processes", ())):
                exitcodes[local_rank] = proc.exitcode
        return result
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

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return "c10d-loopback"

    def creator(params):
        store = _loopback_store()
        handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
        handler._create_tcp_store_server = lambda addr, port: _loopback_store()
        return handler
    rendezvous_handler_registry.register("c10d-loopback", creator)


def _loopback_interface() -> str:
    import socket

    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else ""


def main(run_dir: str) -> int:
    spec = channel.read_json(channel.path(run_dir, "spec.json"))
    sys.path[:] = spec["sys_path"]
    _exit_with_parent(spec["parent_pid"], lambda: os.killpg(0, 9))

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if spec["backend"] == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and _loopback_interface():
        os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    exitcodes: dict = {}
    _record_exitcodes(exitcodes)
    _register_loopback_rendezvous()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=spec["nprocs"], run_id=spec["run_id"],
        rdzv_backend="c10d-loopback", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
        start_method="spawn",
        monitor_interval=0.05, shutdown_timeout=spec["shutdown_timeout"],
        logs_specs=DefaultLogsSpecs(log_dir=channel.path(run_dir, "logs"), redirects=Std.ALL),
    )
    status = {"ok": False, "failures": {}, "agent_error": None}
    try:
        elastic_launch(config, run_rank)(run_dir, spec["backend"])
        status["ok"] = True
    except ChildFailedError as exc:
        status["failures"] = _failures(exc, exitcodes)
    except BaseException as exc:  # SignalException, rendezvous errors, ...
        import traceback

        status["agent_error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    channel.write_json(channel.path(run_dir, "status.json"), status)
    return 0 if status["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
