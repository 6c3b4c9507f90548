"""Run a function on N spawned gloo ranks of this machine (a small private helper for measure())."""
from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import time
import traceback

import cloudpickle


def _child(rank: int, world: int, port: int, payload: bytes, timeout: float, conn, backend: str,
           env: dict = None) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {}))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        fn, args, stateful = cloudpickle.loads(payload)
        from ..core.neurons import restore_stateful

        restore_stateful(stateful)  # the parent's register_stateful calls
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=td)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td)
        conn.send(("ok", cloudpickle.dumps(fn(*args))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo") -> list:
    """``fn(*args)`` on ``world_size`` ranks (gloo, or NCCL with rank ``r`` on GPU ``r``); the return
    values in rank order.

    Raises RuntimeError with the first rank's traceback when a rank fails, dies or times out.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    from ..core.neurons import registered_stateful

    from .isolation import rank_scratch_env

    payload = cloudpickle.dumps((fn, args, registered_stateful()))
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    scratch = tempfile.mkdtemp(prefix="snn-ranks-")  # the ranks' temporary files; removed after
    try:
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(rank, world_size, store.port, payload, timeout, child, backend,
                                                    rank_scratch_env(scratch)), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        results, deadline = {}, time.monotonic() + timeout
        pending = dict(enumerate(conns))
        while pending:
            ready = multiprocessing.connection.wait(list(pending.values()) + [p.sentinel for p in procs],
                                                    timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"ranks {sorted(pending)} did not finish within {timeout:g}s")
            for rank, conn in list(pending.items()):
                if conn in ready or conn.poll():
                    try:
                        status, body = conn.recv()
                    except EOFError:
                        raise RuntimeError(f"rank {rank} exited without a result "
                                           f"(exit code {procs[rank].exitcode})") from None
                    if status == "error":
                        raise RuntimeError(body)
                    results[rank] = cloudpickle.loads(body)
                    del pending[rank]
            dead = [r for r in pending if not procs[r].is_alive() and not pending[r].poll()]
            if dead:
                raise RuntimeError(f"rank {dead[0]} exited without a result (exit code {procs[dead[0]].exitcode})")
        return [results[r] for r in range(world_size)]
    finally:
        for proc in procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in conns:
            conn.close()
        shutil.rmtree(scratch, ignore_errors=True)
        del store
