"""The worker pool: one persistent process per device, hosting that device's engines for the whole run.

The driver (the flow's process: gyms, tools, rewards, the loss) starts the pool once per run (`pool_for`) and
every step reuses it; each worker keeps its engines (trainer replica with the adapter, sampler, prefix cache) in its
own `engine.runtime` registry across tasks and steps. Collectives between workers go through `torch.distributed`
(gloo on CPU, NCCL on GPU; a process group of the workers only, rendezvous on a port the OS gave). The driver talks
to each worker over its own socket (`multiprocessing.connection`, authenticated): a request is (function path,
kwargs), the reply the function's return value or its error with traceback.

What the seeds paid for, built in:
* clean environment: a worker starts without the driver's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT and
  CUDA_VISIBLE_DEVICES (on a GPU it gets its own device only); a fault-injection setting is given to the first start
  of the worker it names only (`LGRPO_WORKER_KILL_AT=<rank>:<stage>:<step>`), so a restart is clean;
* a dead worker fails the call at once -- its socket closes with the process -- with `WorkerDied` naming the worker,
  its exit cause (code or signal) and the last lines of its stderr (`<run>/logs/worker-<rank>.log`); never a hang.
  The next call restarts it (cold caches; results do not depend on them), so Prefect's retry of the task completes;
* one Triton cache for all workers (`TRITON_CACHE_DIR`, shared): kernels are tuned once;
* SIGUSR1 dumps every thread's stack: each worker registers faulthandler for it, and `install_stack_dumps()` makes
  the driver dump its own stacks and forward the signal to every live worker.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

CLEAN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RUN_ID", "LGRPO_KILL_AT", "LGRPO_WORKER_KILL_AT")
START_TIMEOUT_S = 120.0
GROUP_TIMEOUT_S = 120.0  # a rendezvous or collective that waits longer fails (a peer died): never a silent hang


class WorkerDied(RuntimeError):
    """A worker process ended while the driver waited on it."""

    def __init__(self, rank: int, cause: str, stderr_tail: str):
        self.rank, self.cause, self.stderr_tail = rank, cause, stderr_tail
        super().__init__(f"worker {rank} died ({cause}); last lines of its stderr:\n{stderr_tail or '(empty)'}")


class WorkerError(RuntimeError):
    """A call raised inside a worker; the message carries the worker's traceback."""


def free_port() -> int:
    """A TCP port the OS has free now on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_cause(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    conn: Connection
    log: Path
    lock: threading.Lock = field(default_factory=threading.Lock)


class WorkerPool:
    """`n` worker processes for `run_dir` on `device` ("cpu": n CPU processes; "cuda": one per GPU)."""

    def __init__(self, run_dir: str | Path, n: int, device: str = "cpu", threads: int | None = None):
        if n < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {n}")
        self.run_dir, self.n, self.device, self.threads = str(run_dir), int(n), device, threads
        self.logs = Path(run_dir) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._key)
        self._accept_lock = threading.Lock()
        self.dist_port = free_port()
        self.workers: dict[int, _Worker] = {}
        self._kill_spec = os.environ.get("LGRPO_WORKER_KILL_AT")
        self._closed = False
        for rank in range(self.n):
            self._start(rank)
        self.call_all("engine.pool.init_group", lambda r: {"port": self.dist_port})

    # -- processes ------------------------------------------------------------------------------------------------

    def _env(self, rank: int, first: bool) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
        env.update(LGRPO_WORKER_RANK=str(rank), LGRPO_WORKER_WORLD=str(self.n), LGRPO_WORKER_KEY=self._key.hex(),
                   PYTHONUNBUFFERED="1")
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("TRITON_CACHE_DIR", str(Path(self.run_dir).resolve() / "cache" / "triton"))  # one, shared
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads), LGRPO_WORKER_THREADS=str(self.threads))
        if first and self._kill_spec and self._kill_spec.split(":", 1)[0] == str(rank):
            env["LGRPO_KILL_AT"] = self._kill_spec.split(":", 1)[1]  # a drill: this start only
        return env

    def _start(self, rank: int) -> None:
        old = self.workers.get(rank)
        log = self.logs / f"worker-{rank}.log"
        f = open(log, "ab")
        host, port = self._listener.address
        proc = subprocess.Popen([sys.executable, "-m", "engine.pool", f"{host}:{port}"], env=self._env(rank, old is None),
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=os.getcwd(),
                                start_new_session=False)
        f.close()
        with self._accept_lock:  # workers say who they are when they connect
            conn = self._accept(proc, rank, log)
        self.workers[rank] = _Worker(rank, proc, conn, log)

    def _accept(self, proc, rank: int, log: Path) -> Connection:
        result: dict = {}

        def accept():
            try:
                result["conn"] = self._listener.accept()
            except Exception as e:  # the listener was closed while waiting
                result["error"] = e

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while t.is_alive() and proc.poll() is None and time.monotonic() < deadline:
            t.join(0.2)
        conn = result.get("conn")
        if conn is None:  # died while starting (an import error, say) or never connected: say so now
            if proc.poll() is None:
                proc.kill()
            cause = _exit_cause(proc.wait())
            # a fresh listener: the old one's accept may still be pending and must not take a later worker's call
            self._listener.close()
            self._listener = Listener(("127.0.0.1", 0), authkey=self._key)
            why = f"; the listener: {result['error']}" if "error" in result else ""
            raise WorkerDied(rank, f"did not connect at start ({cause}){why}", _tail(log))
        hello = pickle.loads(conn.recv_bytes())
        if hello != ("hello", rank):
            raise RuntimeError(f"worker {rank}: unexpected greeting {hello!r}")
        return conn

    def alive(self, rank: int) -> bool:
        return self.workers[rank].proc.poll() is None

    def restart(self, rank: int) -> None:
        """Start worker `rank` again (after it died) and rebuild the process group with it. Waits for the other
        workers' calls in flight (their locks), so no reply is mixed up with the group's rebuild."""
        locks = [self.workers[r].lock for r in range(self.n)]
        for lock in locks:
            lock.acquire()
        try:
            w = self.workers[rank]
            if w.proc.poll() is None:  # another thread restarted it meanwhile, or it is alive after all
                return
            w.proc.wait()
            try:
                w.conn.close()
            except OSError:
                pass
            self._start(rank)
            self._event("restarted", rank, pid=self.workers[rank].proc.pid)
            self.workers[rank].lock = locks[rank]  # the new worker object keeps the lock held here
            self.dist_port = free_port()
            for r in range(self.n):  # every worker leaves the old group; all join the new one
                self._call(r, "engine.pool.init_group", {"port": self.dist_port},
                           wait=False)
            for r in range(self.n):
                self._reply(r)
        finally:
            for lock in locks:
                lock.release()

    # -- calls ----------------------------------------------------------------------------------------------------

    def call(self, rank: int, fn: str, **kwargs):
        """Run `fn` (a dotted path to a function) with kwargs in worker `rank`; a dead worker is restarted first."""
        if not self.alive(rank):
            self.restart(rank)
        with self.workers[rank].lock:
            self._call(rank, fn, kwargs, wait=False)
            return self._reply(rank)

    def call_all(self, fn: str, kwargs_of) -> list:
        """`fn` in every worker at once (collectives need all ranks inside the call): kwargs_of(rank) -> kwargs."""
        for r in range(self.n):
            if not self.alive(r):
                self.restart(r)
        for r in range(self.n):
            self.workers[r].lock.acquire()
        try:
            for r in range(self.n):
                self._call(r, fn, kwargs_of(r), wait=False)
            return [self._reply(r) for r in range(self.n)]
        finally:
            for r in range(self.n):
                self.workers[r].lock.release()

    def _call(self, rank: int, fn: str, kwargs: dict, wait: bool = True):
        w = self.workers[rank]
        try:
            w.conn.send_bytes(pickle.dumps((fn, kwargs)))  # plain pickle: tensors travel by value
        except (OSError, EOFError):
            raise self._died(rank) from None
        return self._reply(rank) if wait else None

    def _reply(self, rank: int):
        w = self.workers[rank]
        try:
            ok, value = pickle.loads(w.conn.recv_bytes())
        except (OSError, EOFError):
            raise self._died(rank) from None
        if not ok:
            if isinstance(value, dict) and "gate" in value:
                from engine.gates import GateFailed

                raise GateFailed(value["gate"], f"{value['message']} (in worker {rank})", value["report"])
            raise WorkerError(f"worker {rank}: {value}")
        return value

    def _died(self, rank: int) -> WorkerDied:
        w = self.workers[rank]
        try:
            code = w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        self._event("died", rank, cause=_exit_cause(code), pid=w.proc.pid)
        return WorkerDied(rank, _exit_cause(code), _tail(w.log))

    def _event(self, what: str, rank: int, **fields) -> None:
        """One line in <run>/logs/pool-events.jsonl: what happened to which worker, when (deaths, restarts)."""
        import json

        with open(self.logs / "pool-events.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "event": what, "rank": rank, **fields}) + "\n")

    def pids(self) -> list[int]:
        return [self.workers[r].proc.pid for r in range(self.n)]

    def dump_stacks(self) -> None:
        """Every thread's stack of the driver (stderr) and of each live worker (its log)."""
        faulthandler.dump_traceback(all_threads=True)
        for w in self.workers.values():
            if w.proc.poll() is None:
                os.kill(w.proc.pid, signal.SIGUSR1)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self.workers.values():
            try:
                w.conn.send_bytes(pickle.dumps(None))  # stop
            except (OSError, EOFError):
                pass
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            try:
                w.conn.close()
            except OSError:
                pass
        self._listener.close()
        _POOLS.pop(self.run_dir, None)


_POOLS: dict[str, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(run_dir: str | Path, n: int, device: str = "cpu", threads: int | None = None) -> WorkerPool:
    """The run's pool, started on first use and reused by every later task and step of this process."""
    key = str(run_dir)
    with _POOLS_LOCK:
        p = _POOLS.get(key)
        if p is None or p.n != n:
            if p is not None:
                p.close()
            p = _POOLS[key] = WorkerPool(run_dir, n, device, threads)
        return p


def close_all() -> None:
    for p in list(_POOLS.values()):
        p.close()


def install_stack_dumps() -> None:
    """SIGUSR1 on the driver dumps its threads' stacks and forwards the signal to every pool's workers (main thread
    only: Python installs signal handlers there)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_usr1(signum, frame):
        for p in list(_POOLS.values()):
            p.dump_stacks()
        if not _POOLS:
            faulthandler.dump_traceback(all_threads=True)

    signal.signal(signal.SIGUSR1, on_usr1)


# -- the worker side ------------------------------------------------------------------------------------------------

def init_group(port: int) -> dict:
    """Join the workers' process group (gloo on CPU, NCCL on GPU) at 127.0.0.1:port; leave an older one first."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    rank, world = int(os.environ["LGRPO_WORKER_RANK"]), int(os.environ["LGRPO_WORKER_WORLD"])
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return {"rank": rank, "world": world, "backend": backend, "pid": os.getpid()}


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum of a vector over the workers (FP32 all-reduce): the group's smoke test."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float32)
    dist.all_reduce(t)
    return t.tolist()


def info() -> dict:
    return {"pid": os.getpid(), "rank": int(os.environ["LGRPO_WORKER_RANK"]),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                  "CUDA_VISIBLE_DEVICES", "TRITON_CACHE_DIR")}}


def _serve(address: str) -> None:
    rank = int(os.environ["LGRPO_WORKER_RANK"])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # SIGUSR1: every thread's stack to the worker log
    if os.environ.get("LGRPO_WORKER_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["LGRPO_WORKER_THREADS"]))
    parent = os.getppid()

    def orphan_watch():  # the driver died (SIGKILL included): this worker must not outlive it
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=orphan_watch, daemon=True, name="orphan-watch").start()
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["LGRPO_WORKER_KEY"]))
    conn.send_bytes(pickle.dumps(("hello", rank)))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the driver is gone: so is this worker
            break
        try:
            msg = pickle.loads(data)
            if msg is None:
                break
            fn, kwargs = msg
            mod, _, name = fn.rpartition(".")
            reply = (True, getattr(importlib.import_module(mod), name)(**kwargs))
        except BaseException as e:  # reported to the driver with the traceback; the worker goes on serving
            gate = getattr(e, "gate", None)
            if gate is not None:  # a failed gate stays a GateFailed on the driver: never retried, its report kept
                prefix = f"gate `{gate}` failed: "
                text = str(e)
                reply = (False, {"gate": gate, "message": text[len(prefix):] if text.startswith(prefix) else text,
                                 "report": getattr(e, "report", {}), "traceback": traceback.format_exc()})
            else:
                reply = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        try:
            conn.send_bytes(pickle.dumps(reply))
        except Exception as e:  # a result that does not pickle: say so instead of dying
            conn.send_bytes(pickle.dumps((False, f"the result of {msg[0] if isinstance(msg, tuple) else msg} could "
                                                 f"not be sent: {type(e).__name__}: {e}")))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _serve(sys.argv[1])
