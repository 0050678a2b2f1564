"""Inference backends behind one small protocol: `load()`, then `infer(batch) -> batch`.

Torch eager, torch.compile and ONNX Runtime (fp32 or dynamically quantized INT8) take and give
numpy arrays with the batch axis first, so the batcher and the server never see a framework.
`infer` is called from the batcher's threads. ONNX Runtime releases the GIL for a whole run;
torch eager takes it back between every two kernels, so next to a busy event loop each forward
pass queues for the GIL many times (the convoy effect). `ProcessBackend` therefore runs a
backend in a child process and exchanges only the batch and its answer over a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import signal
import struct
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpcml.errors import ModelError
from hpcml.models.export import check_architecture, check_weights_key, read_export_meta
from hpcml.serve.codec.oip import DATATYPES, TensorSpec, datatype_of

ONNX_FILE = "model.onnx"
ONNX_INT8_FILE = "model.int8.onnx"


class WorkerDied(RuntimeError):
    """The child process computing batches is gone (killed, crashed); it can be restarted."""


class Backend(Protocol):
    name: str
    platform: str
    input: TensorSpec
    output: TensorSpec

    def load(self) -> None: ...

    def infer(self, batch: np.ndarray) -> np.ndarray: ...

    def close(self) -> None: ...


def export_dir_of(path: Path) -> Path:
    """An export folder, given it or the run folder holding it in `export/`."""
    path = Path(path)
    if not path.is_dir():
        state = "is a file" if path.exists() else "does not exist"
        raise ModelError(
            f"{path} {state}; pass a run folder or its export/ folder (model.json and weights)."
        )
    if (path / "export" / "model.json").exists():
        return path / "export"
    return path


def signature(meta: dict[str, Any]) -> tuple[TensorSpec, TensorSpec]:
    inp, out = meta["input"], meta["output"]
    return (
        TensorSpec(
            inp.get("name", "input"), datatype_of(inp.get("dtype", "float32")), tuple(inp["shape"])
        ),
        TensorSpec(
            out.get("name", "logits"), datatype_of(out.get("dtype", "float32")), tuple(out["shape"])
        ),
    )


class TorchBackend:
    """The exported nn.Module in eval mode under `torch.inference_mode`; optionally compiled."""

    def __init__(
        self,
        export_dir: Path,
        compile: bool = False,
        threads: int | None = None,
        device: str = "auto",
        trust_code: bool = False,
    ) -> None:
        self.export_dir = export_dir_of(export_dir)
        self.device = device
        self.meta = read_export_meta(self.export_dir)
        # Refused here, in the server, before any process is started or anything imported.
        check_architecture(self.meta, self.export_dir, trust_code)
        check_weights_key(self.export_dir)
        self.trust_code = trust_code
        self.input, self.output = signature(self.meta)
        self.compile = compile
        self.threads = threads
        self.name = "compile" if compile else "torch"
        self.platform = "pytorch_torch"
        self._model: Any = None

    def load(self) -> None:
        import torch

        from hpcml.models.export import load_export

        if self.threads:
            torch.set_num_threads(self.threads)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        model, _ = load_export(self.export_dir, device=self.device, trust_code=self.trust_code)
        # dynamic=True: one graph for every batch size, instead of a recompile per size.
        self._model = torch.compile(model, dynamic=True) if self.compile else model
        if self.compile:
            # Compile now, not on the first request: that one would otherwise wait seconds.
            dtype = DATATYPES[self.input.datatype]
            for batch in (1, 2):
                self.infer(np.zeros((batch, *self.input.shape), dtype=dtype))

    def infer(self, batch: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self._model(torch.from_numpy(batch).to(self.device))
        return out.cpu().numpy()

    def close(self) -> None:
        self._model = None


class OnnxBackend:
    """ONNX Runtime on CPU (or CUDA where its provider is installed) over `model[.int8].onnx`."""

    def __init__(self, export_dir: Path, int8: bool = False, threads: int | None = None) -> None:
        self.export_dir = export_dir_of(export_dir)
        self.meta = read_export_meta(self.export_dir)
        self.input, self.output = signature(self.meta)
        self.file = self.export_dir / (ONNX_INT8_FILE if int8 else ONNX_FILE)
        self.threads = threads
        self.name = "onnx-int8" if int8 else "onnx"
        self.platform = "onnxruntime_onnx"
        self._session: Any = None

    def load(self) -> None:
        import onnxruntime as ort

        if not self.file.exists():
            flag = " --int8" if self.name == "onnx-int8" else ""
            raise ModelError(
                f"{self.file} does not exist; create it with `hpcml export onnx {self.export_dir}{flag}`."
            )
        opts = ort.SessionOptions()
        # Spinning idle threads would take the CPU the event loop needs to parse requests.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if self.threads:
            opts.intra_op_num_threads = self.threads
        providers = [
            p
            for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
            if p in ort.get_available_providers()
        ]
        self._session = ort.InferenceSession(str(self.file), opts, providers=providers)
        self._input_name = self._session.get_inputs()[0].name

    def infer(self, batch: np.ndarray) -> np.ndarray:
        out: np.ndarray = self._session.run(None, {self._input_name: batch})[0]
        return out

    def close(self) -> None:
        self._session = None


def frame(data: bytes) -> bytes:
    """`data` with its length in front: what `read_frame` and `FrameProtocol` take apart."""
    return struct.pack("!Q", len(data)) + data


def write_frame(fd: int, data: bytes) -> None:
    view = memoryview(frame(data))
    while view:
        view = view[os.write(fd, view) :]


def read_frame(fd: int) -> bytes:
    """One frame written by `write_frame`, read blocking; EOFError if the pipe closed."""
    (n,) = struct.unpack("!Q", read_exact(fd, 8))
    return read_exact(fd, n)


def read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _serve_in_child(
    requests: Connection,
    answers: Connection,
    kind: str,
    export_dir: str,
    threads: int | None,
    device: str,
    trust_code: bool = False,
) -> None:
    """Body of a ProcessBackend child: load, then answer batches until told to stop.

    Batches come in and answers go out as length-prefixed pickles (`write_frame`) on raw pipes,
    which the parent writes and reads from its event loop without ever blocking it.
    """
    # The parent decides when to stop (it drains first); Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = answers.fileno()

    def answer(obj: object) -> None:
        write_frame(out, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        backend = make_backend(kind, Path(export_dir), threads, device, trust_code=trust_code)
        backend.load()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        answer(("error", (isinstance(exc, ModelError), str(getattr(exc, "message", exc)))))
        return
    answer(("ready", None))
    inp = requests.fileno()
    while True:
        try:
            batch = pickle.loads(read_frame(inp))  # from our own parent: trusted
        except EOFError:  # the server is gone
            return
        if batch is None:
            return
        try:
            answer(("ok", backend.infer(batch)))
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            answer(("error", f"{type(exc).__name__}: {exc}"))


class FrameProtocol(asyncio.Protocol):
    """Reassembles length-prefixed frames (`write_frame`) from a child's pipe as they arrive
    on the event loop, handing each whole one to `frame_received`."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= 8:
            (n,) = struct.unpack("!Q", self.buffer[:8])
            if len(self.buffer) < 8 + n:
                return
            payload = bytes(self.buffer[8 : 8 + n])
            del self.buffer[: 8 + n]
            self.frame_received(payload)

    def frame_received(self, frame: bytes) -> None:
        raise NotImplementedError


class _Frames(FrameProtocol):
    """The child's answers, in request order: each complete frame goes to the oldest waiting
    caller; a caller that gave up (cancelled) still owns its frame, which is then dropped.
    """

    def __init__(self, on_lost: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.pending: deque[asyncio.Future[bytes]] = deque()
        self.closed = False
        self.on_lost = on_lost
        """Called once when the child's end of the pipe closes: it exited or was killed."""

    def frame_received(self, frame: bytes) -> None:
        if self.pending:
            waiter = self.pending.popleft()
            if not waiter.done():
                waiter.set_result(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        while self.pending:
            waiter = self.pending.popleft()
            if not waiter.done():
                waiter.set_exception(EOFError())
        if self.on_lost is not None:
            self.on_lost()


class ProcessBackend:
    """Another backend, run in a child process (spawned: safe next to threads and CUDA).

    The batcher awaits `infer_async`, which writes the batch and is woken by the event loop
    when the answer is in: no thread sits between them (on a busy CPU every thread hop is a
    scheduler wake-up, worth milliseconds). The batch goes out through a non-blocking write
    transport, so a child that stopped reading (SIGSTOP, a wedged forward pass) cannot block
    the loop, and `kill` ends it whatever state it is in. `infer` is the blocking form for use
    without a loop; once `infer_async` has run, both pipes belong to the loop.
    """

    def __init__(
        self,
        kind: str,
        export_dir: Path,
        threads: int | None = None,
        device: str = "auto",
        trust_code: bool = False,
    ) -> None:
        # Signature only, nothing loaded (an untrusted architecture is refused here already).
        inner = make_backend(kind, export_dir, threads, device, trust_code=trust_code)
        self.name, self.platform = inner.name, inner.platform
        self.input, self.output = inner.input, inner.output
        self._args = (kind, str(export_dir), threads, device, trust_code)
        self._requests: Connection | None = None
        self._answers: Connection | None = None
        self._frames: _Frames | None = None
        self._transport: asyncio.BaseTransport | None = None
        self._writer: asyncio.WriteTransport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._on_lost: Callable[[], None] | None = None

    def _died(self) -> WorkerDied:
        return WorkerDied(f"the inference process died (exit code {self._proc.exitcode})")

    async def watch(self, on_lost: Callable[[], None]) -> None:
        """Read answers on this event loop from now on, and call `on_lost` the moment the
        child's pipe closes, whether or not a batch is in flight (the supervisor's signal)."""
        self._on_lost = on_lost
        if self._frames is None:
            await self._attach()

    async def _attach(self) -> None:
        assert self._answers is not None
        loop = asyncio.get_running_loop()
        frames = _Frames(self._on_lost)
        # A duplicate descriptor: the transport closes its own, the Connection its own.
        pipe = os.fdopen(os.dup(self._answers.fileno()), "rb", buffering=0)
        self._transport, _ = await loop.connect_read_pipe(lambda: frames, pipe)
        assert self._requests is not None
        out = os.fdopen(os.dup(self._requests.fileno()), "wb", buffering=0)
        self._writer, _ = await loop.connect_write_pipe(asyncio.Protocol, out)
        self._frames, self._loop = frames, loop

    def restart(self) -> None:
        """A fresh child after this one died (blocking: it loads the model); `watch` again."""
        self.close()
        self.load()

    def load(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        requests_in, requests_out = ctx.Pipe(duplex=False)
        answers_in, answers_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_serve_in_child,
            args=(requests_in, answers_out, *self._args),
            daemon=True,
            name=f"hpcml-{self.name}",
        )
        self._proc.start()
        requests_in.close()
        answers_out.close()
        self._requests, self._answers = requests_out, answers_in
        try:
            status, detail = self._read_blocking()
        except EOFError:
            self.close()
            raise ModelError(
                f"the inference process for {self._args[1]} exited with code "
                f"{self._proc.exitcode} while loading the model."
            ) from None
        if status == "error":
            self.close()
            user_error, message = detail
            if user_error:
                raise ModelError(message)
            raise ModelError(f"loading {self._args[1]} with backend {self.name} failed: {message}")

    def _read_blocking(self) -> Any:
        assert self._answers is not None
        return pickle.loads(read_frame(self._answers.fileno()))

    def _result(self, status: str, value: Any) -> np.ndarray:
        if status != "ok":
            raise RuntimeError(value)
        out: np.ndarray = value
        return out

    def infer(self, batch: np.ndarray) -> np.ndarray:
        if self._requests is None or self._frames is not None:
            raise RuntimeError("the backend is not loaded (or is driven by infer_async)")
        try:
            write_frame(self._requests.fileno(), pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))
            return self._result(*self._read_blocking())
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise self._died() from None

    async def infer_async(self, batch: np.ndarray) -> np.ndarray:
        if self._requests is None or self._answers is None:
            raise RuntimeError("the backend is not loaded")
        loop = asyncio.get_running_loop()
        if self._frames is None:
            await self._attach()
        assert self._frames is not None
        if self._frames.closed:
            raise self._died()
        answer: asyncio.Future[bytes] = loop.create_future()
        assert self._writer is not None
        if self._writer.is_closing():
            raise self._died()
        # Buffered by the transport when the pipe is full: never blocks the loop.
        self._writer.write(frame(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)))
        self._frames.pending.append(answer)
        try:
            payload = await answer
        except EOFError:
            raise self._died() from None
        return self._result(*pickle.loads(payload))

    def kill(self) -> None:
        """SIGKILL the child: the one signal a stopped or wedged process cannot delay."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    def close(self) -> None:
        if self._frames is not None:
            self._frames.on_lost = None  # closing on purpose is not a death
            self._frames = None
        if self._writer is not None and self._writer.get_write_buffer_size():
            self.kill()  # it stopped reading mid-batch: a stop frame could not get through
        if self._requests is not None:
            # Best effort: a small frame goes in whole or not at all (the loop's transport
            # made the pipe non-blocking), and a child that reads no more is killed below.
            with contextlib.suppress(OSError):  # the child may be gone already
                os.write(self._requests.fileno(), frame(pickle.dumps(None)))
            self._requests.close()
            self._requests = None
        if self._proc is not None:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
            if self._proc.is_alive():  # stopped: SIGTERM waits for a SIGCONT that never comes
                self._proc.kill()
                self._proc.join(5)
        for transport in (self._transport, self._writer):
            if transport is None:
                continue
            # Transports belong to their loop's thread; close() may run in another.
            if self._loop is not None and self._loop.is_running():
                self._loop.call_soon_threadsafe(transport.close)
            else:
                transport.close()
        self._transport = self._writer = None
        if self._answers is not None:
            self._answers.close()
            self._answers = None


def make_backend(
    kind: str,
    export_dir: Path,
    threads: int | None = None,
    device: str = "auto",
    isolation: str = "thread",
    trust_code: bool = False,
) -> Backend:
    """A backend of `kind`; `isolation="process"` runs it in a child process.

    `trust_code` lets a torch export whose model.json names an import path run that code;
    ONNX files hold a graph, not Python, and need no trust."""
    if isolation == "process":
        return ProcessBackend(kind, export_dir, threads, device, trust_code)
    if kind == "torch":
        return TorchBackend(export_dir, threads=threads, device=device, trust_code=trust_code)
    if kind == "compile":
        return TorchBackend(
            export_dir, compile=True, threads=threads, device=device, trust_code=trust_code
        )
    if kind == "onnx":
        return OnnxBackend(export_dir, threads=threads)
    if kind == "onnx-int8":
        return OnnxBackend(export_dir, int8=True, threads=threads)
    raise ModelError(f"backend '{kind}' is not known; use torch, compile, onnx or onnx-int8.")
