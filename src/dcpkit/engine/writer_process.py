"""The persistent writer process of ``async_with_pinned_mem``: one per rank, its own process
group, the staging buffers shared with it once; it writes and publishes each save and dies with
its training process."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint.planner import WriteItem

from dcpkit import dist
from dcpkit.engine.planning import global_plans
from dcpkit.engine.publish import write_and_publish
from dcpkit.engine.staged import StagedPlanner, StagedStep


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WriterProcess:
    """One writer process per rank; the writers of all ranks form their own process group."""

    def __init__(self) -> None:
        import torch.multiprocessing as mp

        rank, world = dist.rank(), dist.world_size()
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = dist.broadcast_object(_free_port() if rank == 0 else None)
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_writer_main,
            args=(child_conn, addr, port, rank, world, os.getpid(), _log_level()),
            daemon=True,
            name=f"dcpkit-writer-{rank}",
        )
        with _main_module_hidden():
            self.process.start()
        child_conn.close()
        self._ready = False
        self._sent_plan: tuple[list[WriteItem], dict[str, Any]] | None = None
        self.plans = 0
        """DCP global plannings the writer ran, as of its last save."""

    def _died(self) -> RuntimeError:
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        elif code is not None:
            how = f"exited with code {code}"
        else:
            how = "stopped answering"
        when = " before it was ready" if not self._ready else ""
        return RuntimeError(f"the checkpoint writer process {how}{when}")

    def _expect(self, kind: str) -> Any:
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise self._died()
        try:
            reply = self.conn.recv()
        except EOFError:
            raise self._died() from None
        if reply[0] == "error":
            raise RuntimeError(reply[1])
        if reply[0] != kind:
            raise RuntimeError(f"unexpected reply from the writer process: {reply[0]}")
        return reply[1:]

    def send_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        if not self._ready:
            self._expect("ready")
            self._ready = True
        self.conn.send(("buffers", buffers))
        self._expect("ok")

    def write(self, staged: StagedStep) -> list[int]:
        """Write and publish ``staged``; returns the steps retention chose to delete (left to the
        caller, so that the next save need not wait for the deletion)."""
        # The plan (write items, key mappings) is the same save after save: send it only when it
        # changed, so that pickling it does not hold the GIL while training resumes.
        same = (
            self._sent_plan is not None
            and len(self._sent_plan[0]) == len(staged.items)
            and all(a is b for a, b in zip(self._sent_plan[0], staged.items))
            and self._sent_plan[1] == staged.mappings
        )
        if same:
            staged = dataclasses.replace(staged, items=[], mappings={})
        else:
            self._sent_plan = (list(staged.items), dict(staged.mappings))
        try:
            self.conn.send(("save", staged, same))
        except (BrokenPipeError, OSError):
            raise self._died() from None
        _, doomed, self.plans = self._expect("saved")
        return list(doomed)

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self.conn.send(("stop",))
            self.process.join(timeout=30)
        except (BrokenPipeError, EOFError, OSError):
            pass
        if self.process.is_alive():
            self.process.kill()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A spawned process runs the launching script again (as ``__mp_main__``) unless its code
    stands under ``if __name__ == "__main__":``; the writer needs nothing of it, so it is not
    told where the script is. A script without the guard would otherwise start its training
    again inside the writer (under torchrun: join the job's rendezvous as a rank it is not,
    and hang)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _die_with_parent(parent: int) -> None:
    """The writer must not outlive the training process (nor publish after it was killed)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:
        os._exit(1)


def _log_level() -> tuple[int, str, str]:
    """How dcpkit's messages are shown here: level, format, stream (none configured: Python's
    default, warnings and worse on stderr)."""
    logger = logging.getLogger("dcpkit")
    if not logger.hasHandlers():
        return logging.WARNING, "%(message)s", "stderr"
    handler = next((h for lg in (logger, logging.getLogger()) for h in lg.handlers), None)
    fmt = getattr(getattr(handler, "formatter", None), "_fmt", None) or logging.BASIC_FORMAT
    stream = "stdout" if getattr(handler, "stream", None) is sys.stdout else "stderr"
    return logger.getEffectiveLevel(), fmt, stream


def _show_logs(level: int, fmt: str, stream: str) -> None:
    """The writer's messages shown as the trainer's are."""
    handler = logging.StreamHandler(sys.stdout if stream == "stdout" else sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    logger = logging.getLogger("dcpkit")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def _writer_main(
    conn: Any, addr: str, port: int, rank: int, world: int, parent: int, log: tuple[int, str, str]
) -> None:
    _die_with_parent(parent)
    _show_logs(*log)
    torch.set_num_threads(1)
    group = None
    if world > 1:
        store = torch_dist.TCPStore(
            addr,
            port,
            world,
            is_master=rank == 0,
            timeout=__import__("datetime").timedelta(minutes=10),
        )
        torch_dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    conn.send(("ready",))
    buffers: dict[str, torch.Tensor] = {}
    plan: tuple[list[WriteItem], dict[str, Any]] = ([], {})
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        kind = msg[0]
        if kind == "stop":
            break
        try:
            if kind == "buffers":
                buffers = msg[1]
                conn.send(("ok",))
            elif kind == "save":
                staged: StagedStep = msg[1]
                if msg[2]:  # the plan of the previous save
                    staged = dataclasses.replace(staged, items=plan[0], mappings=plan[1])
                plan = (staged.items, staged.mappings)
                start = time.perf_counter()
                published = write_and_publish(
                    staged.info,
                    {},
                    planner=StagedPlanner(staged, buffers, group),
                    group=group,
                    kill_pid=parent,
                    delete_now=False,
                )
                plans = global_plans(staged.plan_key)
                conn.send(("saved", time.perf_counter() - start, published.doomed, plans))
        except BaseException as e:  # reported to the training process, never swallowed
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    # Nothing is left to do; skip interpreter finalization, where gloo's threads can abort.
    os._exit(0)
