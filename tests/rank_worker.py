"""One rank of the test suite's pool of rank processes (see ``ranks.py``).

Started once per session with torch and dcpkit imported, it runs job after job as torchrun's
worker would: the environment torchrun gives a rank (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of a store made for that job), the job's ``sys.argv``, its
standard output and error written to files of the job's own. A job is the reference trainer's
``main``, a script of ``tests/scripts`` run as ``__main__``, or a module run as ``-m`` does. The
process group a job makes is destroyed when it ends, so the next job starts as a new process
would: nothing of a job's is left but the modules it imported.

    rank_worker.py FD      (FD: this worker's end of a socket pair; one JSON line a job)
"""

from __future__ import annotations

import gc
import json
import logging
import os
import runpy
import socket
import sys
import time
import traceback
import types

import torch  # noqa: F401  (imported once here, the cost the pool exists to pay once)
import torch.distributed as torch_dist

import dcpkit.train.trainer  # noqa: F401
from ranks import exit_status


class _ProcessExit(BaseException):
    """A job's ``os._exit(code)``: the end of the job, not of this process."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _os_exit(code: int = 0) -> None:
    raise _ProcessExit(code)


def _forget_singletons() -> None:
    """Object-store clients, in-memory file systems and Accelerate's process state a job left:
    a new process has none of them."""
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()
    memory = sys.modules.get("fsspec.implementations.memory")
    if memory is not None:
        memory.MemoryFileSystem.store.clear()
        memory.MemoryFileSystem.pseudo_dirs[:] = [""]
        memory.MemoryFileSystem.clear_instance_cache()


def _snapshot() -> dict[int, tuple[object, dict]]:
    """The namespace of every dcpkit module and of the classes they define: what a job's
    script may patch (a store method made to fail, a parse forbidden) is put back after it."""
    saved = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "dcpkit" or name.startswith("dcpkit.")):
            continue
        space = vars(module)
        saved[id(module)] = (module, dict(space))
        for value in list(space.values()):
            if isinstance(value, type) and value.__module__ == name:
                saved[id(value)] = (value, dict(vars(value)))
    return saved


def _restore(saved: dict[int, tuple[object, dict]]) -> None:
    for obj, before in saved.values():
        now = vars(obj)
        changed = [k for k, v in now.items() if k not in before or before[k] is not v]
        missing = [k for k in before if k not in now]
        for key in changed:
            if isinstance(now[key], types.ModuleType):
                continue  # a submodule imported by the job stays, as sys.modules keeps it
            if key in before:
                setattr(obj, key, before[key])
            elif not key.startswith("__"):
                delattr(obj, key)
        for key in missing:
            setattr(obj, key, before[key])


def _logging_state() -> dict[str, tuple]:
    """Each logger's handlers, level, propagation and whether it is disabled."""
    loggers = {"": logging.getLogger()}
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger):
            loggers[name] = logger
    return {
        name: (logger, list(logger.handlers), logger.level, logger.propagate, logger.disabled)
        for name, logger in loggers.items()
    }


def _restore_logging(before: dict[str, tuple]) -> None:
    """Loggers as they were before the job; those it made, as a new process makes them (a
    trainer's handler on ``dcpkit`` must not send a later script's messages elsewhere)."""
    for name, (logger, *_) in _logging_state().items():
        handlers, level, propagate, disabled = before.get(name, (None, [], 0, True, False))[1:]
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
        logger.disabled = disabled


def _run(job: dict) -> int:
    kind, target, args = job["kind"], job["target"], job["args"]
    if kind == "train":
        from dcpkit.train.trainer import main

        sys.argv = ["dcpkit.train", *args]
        return int(main(args) or 0)
    if kind == "script":
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(target))
        try:
            runpy.run_path(target, run_name="__main__")
        finally:
            sys.path.remove(os.path.dirname(target))
        return 0
    if kind == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    raise ValueError(f"unknown job kind {kind!r}")


def run_job(job: dict) -> dict:
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), list(sys.argv)
    saved_fds = os.dup(1), os.dup(2)
    started = time.perf_counter()
    code = 0
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    _forget_singletons()
    sys.stdout.flush()
    sys.stderr.flush()
    with open(job["stdout"], "wb") as out, open(job["stderr"], "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    saved_names, saved_logging = _snapshot(), _logging_state()
    os._exit, real_exit = _os_exit, os._exit
    try:
        code = _run(job)
    except _ProcessExit as e:
        code = e.code
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit = real_exit
        try:
            if torch_dist.is_initialized():
                torch_dist.destroy_process_group()
            _restore(saved_names)
            _restore_logging(saved_logging)
        except Exception:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        gc.collect()
    return {"code": code, "seconds": time.perf_counter() - started}


def main() -> None:
    conn = socket.socket(fileno=int(sys.argv[1]))
    reader, writer = conn.makefile("r"), conn.makefile("w")
    writer.write(json.dumps({"ready": os.getpid()}) + "\n")
    writer.flush()
    for line in reader:
        result = run_job(json.loads(line))
        writer.write(json.dumps(result) + "\n")
        writer.flush()


if __name__ == "__main__":
    main()
