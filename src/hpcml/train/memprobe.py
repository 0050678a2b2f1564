"""Measure, in every run, what the planner predicts: the bytes autograd keeps for backward
(saved activations) on one sampled micro-batch, and on CUDA the allocator's peaks; then put
the planner's prediction for the run's own config and hardware next to them.

Saved activations are counted with `torch.autograd.graph.saved_tensors_hooks`, which sees
every tensor an autograd node keeps, whatever the device. Each storage is counted once (views
and tensors saved by several nodes share one; the whole storage stays alive, so its full
size counts), at its size when saved. Storages are told apart by identity, never by data
address: FSDP2 frees a gathered weight's memory after its layer's forward even though
autograd saved it, and the allocator hands that address to the next tensor of the size, so
an address can name a parameter and then an activation within one forward (keyed by address,
rank 0 of a ZeRO-3 run once counted a 64 KiB activation as a weight). The probe holds each
storage it saw until the sample ends, so no identity is reused while it counts. Parameters saved for backward (a Linear keeps its weight) are model states, not
activations: a storage that belongs to a module's parameters when that module runs (after
FSDP2 has gathered them, so gathered ZeRO-3 layers count as parameters too) is reported
apart as `saved_param_bytes`. Tensors saved inside an activation-checkpointed unit are
recomputed, not kept; torch's checkpoint installs its own hooks there, so they are not seen.
Hand-written because torch offers no per-step "saved bytes" counter; the hook is its API.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    return _local(t).untyped_storage()


class SavedActivationProbe:
    """Counts what one forward pass saves for backward; `sample()` wraps that forward."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.done = False
        self._activations: dict[int, int] = {}  # storage identity -> bytes when saved
        self._params: dict[int, int] = {}
        self._param_ids: set[int] = set()
        self._held: list[torch.UntypedStorage] = []  # keeps identities unique while counting

    def _note_params(self, module: nn.Module, _args: Any) -> None:
        for p in module.parameters(recurse=False):
            st = _storage_of(p)
            if st.nbytes():
                self._held.append(st)
                self._param_ids.add(st._cdata)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = _storage_of(t)
        if st.nbytes():
            self._held.append(st)
            key = st._cdata
            if isinstance(t, nn.Parameter) or key in self._param_ids:
                self._params[key] = st.nbytes()
            else:
                self._activations[key] = st.nbytes()
        return t

    @contextmanager
    def sample(self, active: bool = True) -> Iterator[None]:
        """Count the saved tensors of the forward run inside (once per probe)."""
        if not active or self.done:
            yield
            return
        handles = [m.register_forward_pre_hook(self._note_params) for m in self.model.modules()]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()
            # A storage first seen as an activation may turn out to be a parameter's view.
            for key in list(self._activations):
                if key in self._param_ids:
                    self._params[key] = self._activations.pop(key)
            self._held.clear()
            self.done = True

    def result(self, device: torch.device) -> dict[str, Any]:
        out: dict[str, Any] = {
            "saved_activation_bytes": sum(self._activations.values()) if self.done else None,
            "saved_param_bytes": sum(self._params.values()) if self.done else None,
            "peak_reserved_bytes": None,
        }
        if device.type == "cuda":
            out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        return out


def step_peak(model: nn.Module, optimizer: Any, cfg: Any, device: torch.device) -> Any:
    """The CPU run's traced step peak (hpcml.train.peaktrace); off on CUDA, whose allocator
    counts its own peak, under torch.compile and pipeline stages (their schedule), and with
    train.plan_trace `never`."""
    from hpcml.train.peaktrace import StepPeak

    enabled = (
        device.type == "cpu"
        and cfg.train.plan_trace != "never"
        and not cfg.train.compile
        and cfg.parallel.pp == 1
    )
    return StepPeak(model, optimizer, cfg.train.max_steps, enabled)


class _Held:
    """A saved tensor while autograd keeps it (see `InFlightActivations`)."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, owner: InFlightActivations, key: int, tensor: torch.Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner._release(self.key)


class InFlightActivations:
    """The saved activations alive at once during one sampled pipeline step (`parallel.pp`):
    each micro-batch's forward saves tensors that autograd frees in its backward, so the peak
    is what the schedule's in-flight micro-batches hold (GPipe: all of them; 1F1B on stage s:
    at most p - s). Each storage counts once while any saved tensor holds it (by identity, as
    `SavedActivationProbe`); parameters do not count. `bytes_per_microbatch`: what the step
    saved in all, over its micro-batches. Freed tensors are seen when autograd drops what the
    pack hook returned (`_Held`), the only signal `saved_tensors_hooks` gives."""

    def __init__(self, model: nn.Module, microbatches: int) -> None:
        self.model, self.microbatches = model, microbatches
        self.peak_bytes: int | None = None
        self.saved_bytes = 0
        self._now = 0
        self._live: dict[int, list[int]] = {}  # storage identity -> [bytes, saved tensors]
        self._params: list[torch.UntypedStorage] = []  # held: identities stay unique
        self._param_ids: set[int] = set()

    def _note_params(self, module: nn.Module, _args: Any) -> None:
        for p in module.parameters(recurse=False):
            self._params.append(_storage_of(p))
            self._param_ids.add(self._params[-1]._cdata)

    def _pack(self, t: torch.Tensor) -> Any:
        st = _storage_of(t)
        key = st._cdata
        if not st.nbytes() or isinstance(t, nn.Parameter) or key in self._param_ids:
            return t
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [st.nbytes(), 0]
            self._now += entry[0]
            self.saved_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes or 0, self._now)
        entry[1] += 1
        return _Held(self, key, t)

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self._now -= entry[0]
            del self._live[key]

    @contextmanager
    def sample(self, active: bool) -> Iterator[None]:
        """Count the saved tensors of the schedule step run inside (when `active`)."""
        if not active:
            yield
            return
        self.peak_bytes, self.saved_bytes = 0, 0
        handles = [m.register_forward_pre_hook(self._note_params) for m in self.model.modules()]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            for h in handles:
                h.remove()
            self._params.clear()
            self._param_ids.clear()

    def result(self) -> dict[str, Any]:
        per = self.saved_bytes / self.microbatches if self.peak_bytes is not None else None
        return {"peak_bytes": self.peak_bytes, "bytes_per_microbatch": per}


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Held) else packed  # type: ignore[no-any-return]


def prediction_block(summary: dict[str, Any]) -> dict[str, Any]:
    """The planner's prediction for this run next to what it measured (plan imports no torch,
    so the run's summary is all it gets)."""
    from hpcml.plan.hardware import load_catalog
    from hpcml.plan.predict import predict_summary

    pipeline = summary.get("pipeline")
    if pipeline is not None:  # parallel.pp
        keys = (
            "schedule",
            "microbatches",
            "predicted_bubble",
            "measured_bubble",
            "replayed_bubble",
        )
        from hpcml.plan.stages import predict_stages

        try:
            stages: Any = predict_stages(summary, load_catalog())
        except Exception as exc:  # a prediction must never fail a finished run
            stages = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return {
            "note": "the planner's run check does not read parallel.pp yet (it would take the "
            "pipeline's stages for data-parallel replicas): the bubble and each stage's saved "
            "activations are compared",
            "pipeline": {k: pipeline[k] for k in keys},
            "stages": stages,
        }
    try:
        return predict_summary(summary, load_catalog())
    except Exception as exc:  # a prediction must never fail a finished run
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


class DevicePeaks:
    """The CUDA allocator's peak over training steps, apart from evaluation's: the planner
    predicts a training step's peak, and one evaluation of a language model (full-vocabulary
    logits, fp32 for the loss) can exceed it by gigabytes, so a peak over the whole run would
    be compared with the wrong prediction (seen on an H100: gpt2-small's final evaluation took
    3.1 GB on its own; with activation checkpointing the whole run's peak was 10.6 GB against
    6.0 GB predicted for its training steps). Evaluation runs between
    resets of the allocator's peak counter; training's peak is the max of the stretches
    between them. Nothing on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.train_bytes = 0
        self.eval_bytes = 0

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        self.train_bytes = max(self.train_bytes, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            self.eval_bytes = max(self.eval_bytes, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    def result(self) -> dict[str, int | None]:
        if not self.cuda:
            return {"peak_allocated_bytes": None, "eval_peak_allocated_bytes": None}
        train = max(self.train_bytes, torch.cuda.max_memory_allocated(self.device))
        return {
            "peak_allocated_bytes": int(train),
            "eval_peak_allocated_bytes": self.eval_bytes or None,
        }


_PROCESS: psutil.Process | None = None


def step_memory(device: torch.device) -> dict[str, int]:
    """The memory fields of a step record: this process's resident set now (`rss_bytes`) and,
    on CUDA, the allocator's bytes now and its peak since the last reset (evaluation resets it,
    see `DevicePeaks`). Cheap enough for every step: one read of /proc/self/statm, and the CUDA
    counters are host-side (no synchronisation)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = psutil.Process()
    out = {"rss_bytes": int(_PROCESS.memory_info().rss)}
    if device.type == "cuda":
        out["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated(device))
        out["cuda_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out
