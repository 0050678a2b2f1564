"""Process-group setup, device choice and the few collectives the rest of hpcml needs.

The only place that calls `dist.init_process_group`. Works in three situations: a plain single
process (no process group), a worker started by torchrun (RANK/WORLD_SIZE/LOCAL_RANK set), and
any launcher that sets the same variables (SLURM's srun starting torchrun, Kubernetes).
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None
    tp: int = 1
    """Tensor-parallel degree: ranks r and r+1 .. r+tp-1 share one model replica and one batch."""
    pp: int = 1
    """Pipeline-parallel degree: the mesh is (pp, dp, tp), pp outermost; the ranks of one
    pipeline (one per stage) share one batch."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data-parallel replica (the mesh is (pp, dp, tp), tp innermost)."""
        return (self.rank // self.tp) % self.dp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline (its stage, or its first stage)."""
        return self.rank // (self.world_size // self.pp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


WORKER_ERRORS_ENV = "HPCML_WORKER_ERRORS"
"""Set by `hpcml train --nproc N` to a folder: each worker that stops on a user error leaves
rank-R.json there (its sentence and exit code) for the parent to report."""


AGENT_ENV = "HPCML_AGENT"
"""Set by hpcml's torchrun agent (`hpcml.launch.agent`) for its workers."""

STOCK_TORCHRUN_NOTE = (
    "(torchrun's own report of the failed worker follows: `python -m hpcml.launch.agent` takes "
    "the same arguments and ends with the line above alone, exit code {code})"
)
"""Said under torchrun's own agent, which cannot be told to end with a worker's sentence: it
raises ChildFailedError (a traceback, exit 1) for any worker that exits non-zero."""


def report_worker_error(message: str, exit_code: int) -> bool:
    """In a torchrun worker that stops on a user error: leave the sentence for our launcher and
    print it on rank 0 now, while set-up's signal handlers still hold off torchrun's SIGTERM
    (sent as soon as a peer exits). True when this process printed it."""
    import json
    import sys
    from pathlib import Path

    rank = int(os.environ.get("RANK", "0"))
    folder = os.environ.get(WORKER_ERRORS_ENV)
    if folder and Path(folder).is_dir():
        tmp = Path(folder) / f".rank-{rank}.json.tmp"
        tmp.write_text(json.dumps({"rank": rank, "exit_code": exit_code, "message": message}))
        tmp.replace(Path(folder) / f"rank-{rank}.json")
    if rank != 0:
        return False
    print(f"error: {message}", file=sys.stderr, flush=True)
    note = stock_torchrun_note(exit_code)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    return True


def stock_torchrun_note(exit_code: int) -> str | None:
    """What rank 0 adds to its error under torchrun's own agent (`STOCK_TORCHRUN_NOTE`)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or AGENT_ENV in os.environ:
        return None
    if os.environ.get(WORKER_ERRORS_ENV):  # hpcml train --nproc: its agent and parent report
        return None
    return STOCK_TORCHRUN_NOTE.format(code=exit_code)


def peer_failed_first() -> bool:
    """In a worker under our launcher: True when another rank already left its sentence (then
    this rank's broken collective is a consequence, not news)."""
    from pathlib import Path

    folder = os.environ.get(WORKER_ERRORS_ENV)
    if not folder:
        return False
    mine = f"rank-{os.environ.get('RANK', '0')}.json"
    return any(p.name != mine for p in Path(folder).glob("rank-*.json"))


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def choose_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if preference == "cuda":
        from hpcml.errors import LaunchError

        raise LaunchError(
            "train.device is 'cuda' but no CUDA device is visible; use train.device=auto or cpu."
        )
    return torch.device("cpu")


def _elastic_attempt_store(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """Under torchrun's agent store, keys of one attempt under their own prefix.

    torchrun (2.13, --standalone) hands every restarted group the same store, and the workers'
    keys are no longer prefixed per attempt: a restarted rank can read a dead peer's address
    and the group fails to form. Without an agent store, env:// is used as usual.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return {
        "store": dist.PrefixStore(f"/hpcml/attempt_{attempt}", store),
        "rank": rank,
        "world_size": world,
    }


FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives NCCL's flight recorder keeps per rank (torch's default is 0: off)."""


FLIGHT_RECORDER_ENV = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
"""What turns NCCL's flight recorder on: each rank keeps its last collectives and, on a
collective timeout, writes them to `flight_recorder_file` (read them with `torchfrtrace`)."""


def flight_recorder_file(rank: int) -> str:
    """Where NCCL's flight recorder writes this rank's dump (torch's variable and default)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get(
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_"
    )
    return f"{prefix}{rank}"


def dump_flight_recorder(rt: Runtime) -> str | None:
    """Write NCCL's flight recorder of this rank now (a hang our watchdog ends before NCCL's
    own timeout would dump it); the file, or None where there is none (gloo, an older torch)."""
    if rt.backend != "nccl" or "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        return None
    try:
        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace")  # noqa: B009 - private
        trace = dump()  # bytes (pickle), torch >= 2.4
        path = flight_recorder_file(rt.rank)
        with open(path, "wb") as f:
            f.write(trace)
        return path
    except Exception:  # noqa: BLE001 - a diagnosis aid, never a second failure
        return None


def init_runtime(
    device: str = "auto",
    backend: str = "auto",
    timeout_s: float = 600.0,
    tp: int = 1,
    pp: int = 1,
) -> Runtime:
    """Devices and the process group. Under NCCL the flight recorder is on
    (`FLIGHT_RECORDER_ENV`; values the user set win)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world % tp:
        from hpcml.errors import ConfigError

        raise ConfigError(
            f"parallel.tp {tp} does not divide the {world} processes; start a multiple of "
            f"{tp} processes (--nproc) or lower parallel.tp."
        )
    if world % (tp * pp):
        from hpcml.errors import ConfigError

        raise ConfigError(
            f"parallel.pp {pp} x parallel.tp {tp} does not divide the {world} processes; start "
            f"a multiple of {tp * pp} processes (--nproc) or lower parallel.pp."
        )
    dev = choose_device(device, local_rank)
    chosen: str | None = None
    if world > 1:
        chosen = backend if backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if chosen == "nccl":
            for key, value in FLIGHT_RECORDER_ENV.items():
                os.environ.setdefault(key, value)
        if not dist.is_initialized():
            dist.init_process_group(
                backend=chosen,
                timeout=timedelta(seconds=timeout_s),
                device_id=dev if dev.type == "cuda" else None,
                **_elastic_attempt_store(rank, world, timeout_s),
            )
    if dev.type == "cpu" and local_world > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Several ranks on one CPU: split the cores instead of letting each grab all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return Runtime(rank, local_rank, world, local_world, dev, chosen, tp, pp)


def shutdown(rt: Runtime, clean: bool = True) -> None:
    """Leave the process group. After a clean run all ranks meet first: a rank that tears down
    gloo while a peer still writes its export can leave that peer waiting forever at exit."""
    if rt.distributed and dist.is_initialized():
        if clean:
            dist.barrier()
        # A gloo worker thread frees a finished collective (and its tensors, which needs the
        # GIL) just after the caller's wait returns. If the group is destroyed meanwhile from
        # the DDP reducer's destructor, which joins those threads holding the GIL, both wait
        # forever (seen at exit of 2-process runs). Let the threads finish first.
        time.sleep(0.25)
        dist.destroy_process_group()


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def all_reduce_sum(rt: Runtime, t: torch.Tensor) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(rt: Runtime, t: torch.Tensor) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= rt.world_size
    return t


def all_reduce_max(rt: Runtime, t: torch.Tensor) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def broadcast_object(rt: Runtime, obj: Any, src: int = 0) -> Any:
    """Send one picklable object from `src` to every rank (the value on other ranks is ignored)."""
    if not rt.distributed:
        return obj
    box = [obj if rt.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(rt: Runtime, obj: Any) -> list[Any]:
    if not rt.distributed:
        return [obj]
    out: list[Any] = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


def all_gather_rows(rt: Runtime, t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` stacked, (world_size, *t.shape): one collective, no host read."""
    if not rt.distributed:
        return t.unsqueeze(0)
    out = t.new_empty(rt.world_size * t.numel())  # gloo wants a flat output
    dist.all_gather_single(out, t.reshape(-1))
    return out.view(rt.world_size, *t.shape)


def split_work(items: list[Any], fn: Any) -> list[Any]:
    """`fn(item)` for every item, each computed on one rank of the default process group (rank
    r takes items r, r + W, ...), the results on every rank in item order; in one process (no
    group), all of them here. For work every rank would otherwise repeat (hashing a data set),
    called by every rank at the same point."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [fn(item) for item in items]
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {i: fn(items[i]) for i in range(rank, len(items), world)}
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, mine)
    merged = {i: v for share in shares for i, v in share.items()}
    return [merged[i] for i in range(len(items))]


def device_info(rt: Runtime) -> dict[str, Any]:
    if rt.device.type == "cuda":
        props = torch.cuda.get_device_properties(rt.device)
        return {
            "type": "cuda",
            "name": props.name,
            "count": torch.cuda.device_count(),
            "memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
        }
    import platform

    return {
        "type": "cpu",
        "name": platform.processor() or platform.machine(),
        "count": os.cpu_count() or 1,
        # What this rank computes with (the planner scales a CPU's peak by it).
        "threads": torch.get_num_threads(),
        "ranks_per_host": rt.local_world_size,
    }


_ = pickle  # broadcast_object pickles through torch; kept for readers looking for the dependency
