"""Loss-parallel tensor parallelism with a padded vocabulary, on 2 gloo processes.

gpt with a 50-token vocabulary padded to 64 head columns (`vocab_multiple`), split over tp=2
(rank 1's columns 32..63 hold the 14 padding ones): the logits stay vocabulary-sharded (no
rank gathers them), the padded columns get no probability, and the loss and every gradient
equal those of the unpadded model (vocab_multiple 1, the same weights) in one process.
Evaluation scores the sharded logits without gathering them either (`vocab_parallel_scores`)
and equals the one-process validation loss and accuracy.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
from tests import forked

pytestmark = pytest.mark.slow

VOCAB, PADDED, BATCH, SEQ = 50, 64, 4, 8
# fp32 on 2 ranks: the sharded matmuls and the loss-parallel softmax add in another order
# than one process (measured gaps ~1e-7); 1e-5 is far below what a padded column given
# probability changes (the loss moves by ~log(64/50) = 0.25).
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _models() -> tuple[Any, Any]:
    """The padded model and the unpadded one with the same weights (its vocabulary rows)."""
    from hpcml.models.gpt import GPT, GPTConfig

    shape = dict(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=1, n_head=2, d_model=16)
    torch.manual_seed(0)
    padded = GPT(GPTConfig(**shape, vocab_multiple=64))
    plain = GPT(GPTConfig(**shape, vocab_multiple=1))
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(padded.get_parameter(name)[: p.shape[0]])
    return padded, plain


class _CommSizes(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any collective (c10d or functional) carried."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN204
        if func.namespace in ("c10d", "_c10d_functional"):
            flat = torch.utils._pytree.tree_leaves((args, kwargs))
            sizes = [t.numel() for t in flat if isinstance(t, torch.Tensor)]
            self.largest = max([self.largest, *sizes])
        return func(*args, **(kwargs or {}))


def _worker(rank: int, world: int, port: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from hpcml.config import ParallelConfig
    from hpcml.distributed.parallel import local_value, loss_context, parallelize
    from hpcml.distributed.precision import setup_precision
    from hpcml.distributed.runtime import init_runtime, shutdown
    from hpcml.train.evaluation import evaluate_model
    from hpcml.train.losses import cross_entropy

    rt = init_runtime("cpu", "gloo", 60, tp=2)
    padded, plain = _models()
    model = parallelize(
        padded, rt, ParallelConfig(tp=2, sequence_parallel=True), loss_parallel=True
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    out: dict[str, Any] = {}
    with loss_context(model):
        with _CommSizes() as comm:
            logits = model(x)
        out["sharded"] = isinstance(logits, DTensor) and logits.to_local().shape[-1] == 32
        out["forward_largest"] = comm.largest
        loss = cross_entropy(logits, y)
        loss.backward()
    out["loss"] = float(local_value(loss.detach()))
    grads = {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in model.named_parameters()
    }
    ref_loss = cross_entropy(plain(x), y)
    ref_loss.backward()
    out["ref_loss"] = float(ref_loss)
    out["grad_gap"] = max(
        (grads[n][: p.shape[0]] - p.grad).abs().max().item() for n, p in plain.named_parameters()
    )
    # Tied: the head is the token table; its padded rows are never looked up either.
    out["pad_grad"] = grads["emb.tok.weight"][VOCAB:].abs().max().item()
    # Evaluation: two batches, the second half masked out (a padded share).
    valid = torch.tensor([True, True, True, False])
    loader = [(x, y, torch.ones(BATCH, dtype=torch.bool)), (y, x, valid)]
    precision = setup_precision("fp32", rt.device)
    with _CommSizes() as comm:
        out["eval"] = evaluate_model(model, loader, rt, precision, False)
    out["eval_largest"] = comm.largest
    out["ref_eval"] = evaluate_model(plain, loader, rt, precision, False)
    queue.put((rank, out))
    shutdown(rt, clean=True)


def test_loss_parallel_with_a_padded_vocabulary_equals_the_unpadded_model() -> None:
    # Forked from tests/forked.py's server, which imported torch and the trainer once.
    queue = forked.server_context().SimpleQueue()
    forked.start_ranks(_worker, (2, _free_port(), queue))
    results = dict(queue.get() for _ in range(2))
    positions = BATCH * SEQ
    for rank, got in results.items():
        assert got["sharded"], rank  # loss-parallel kept (main: off once the vocab is padded)
        # No collective carried a whole (batch, seq, vocab) logits tensor, nor half of one:
        # the largest are the (batch, seq, d_model) activations of sequence parallelism.
        assert got["forward_largest"] < positions * PADDED // 2, got
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=TOL, abs=TOL)
        assert got["grad_gap"] < TOL, got
        assert got["pad_grad"] == 0.0  # the -inf columns take no gradient
        ev, ref = got["eval"], got["ref_eval"]
        assert ev["val_samples"] == ref["val_samples"] == 7
        assert ev["val_loss"] == pytest.approx(ref["val_loss"], rel=TOL)
        assert ev["val_accuracy"] == ref["val_accuracy"]
        # Scores reduced per position, activations as in training: never the logits.
        assert got["eval_largest"] < positions * PADDED // 2, got
