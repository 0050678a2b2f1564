"""Pipeline parallelism's pieces that need no process group: the layout checks the launcher
runs before any worker starts (one sentence each), the stages a gpt splits into, and where
each rank sits in the (pp, dp) mesh."""

from __future__ import annotations

import pytest
import torch

from hpcml.config import ParallelConfig, RunConfig
from hpcml.distributed.parallel import check_parallel
from hpcml.distributed.pipeline import GPTStage, check_pipeline, stage_layers
from hpcml.distributed.runtime import Runtime
from hpcml.errors import ConfigError
from hpcml.models.zoo import build_model
from hpcml.train.pipeline import check_run

GPT = {"vocab_size": 100, "max_seq_len": 16, "n_layer": 4, "n_head": 2, "d_model": 16}


def meta_gpt(**args: object) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model("gpt-tiny", {**GPT, "tie_embeddings": False, **args})


@pytest.mark.parametrize(
    ("world", "parallel", "model_args", "batch", "said"),
    [
        (3, {"pp": 2}, {}, 8, "does not divide the 3 processes"),
        (2, {"pp": 2}, {"n_layer": 3}, 8, "do not divide the model's 3 blocks"),
        (2, {"pp": 2, "virtual_stages": 2}, {"n_layer": 6}, 8, "do not divide the model's 6"),
        (2, {"pp": 2, "microbatches": 1}, {}, 8, "microbatches 1 is fewer than parallel.pp 2"),
        (2, {"pp": 2, "microbatches": 4}, {}, 6, "batch_size 6 does not split into"),
        (2, {"pp": 2}, {"tie_embeddings": True}, 8, "set model.args.tie_embeddings=false"),
        (2, {"pp": 2, "pp_schedule": "zero_bubble", "microbatches": 3}, {}, 9, "multiple of"),
        (2, {"pp": 2, "virtual_stages": 2}, {}, 8, "virtual_stages 2 needs an interleaved"),
        (4, {"pp": 2, "tp": 2, "sequence_parallel": True}, {}, 8, "sequence_parallel would"),
        (4, {"pp": 2, "strategy": "zero1"}, {}, 8, "zero1 shards the optimizer over every"),
        (4, {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}, {}, 8, "neither"),
        (4, {"pp": 2, "tp": 2, "pp_schedule": "zero_bubble", "virtual_stages": 2}, {}, 8, "nor"),
        (1, {"microbatches": 2}, {}, 8, "apply to pipeline parallelism only"),
        (4, {"pp": 2}, {}, 8, "fails in DDP's reducer"),  # pp2 x ddp2 at 2 micro-batches
    ],
)
def test_layout_refused_in_one_sentence(
    world: int, parallel: dict, model_args: dict, batch: int, said: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_pipeline(meta_gpt(**model_args), world, ParallelConfig(**parallel), batch)
    assert said in err.value.message and "\n" not in err.value.message


def test_model_without_stages_refused() -> None:
    with torch.device("meta"):
        mlp = build_model("mlp")
    with pytest.raises(ConfigError, match="sequence of blocks"):
        check_pipeline(mlp, 2, ParallelConfig(pp=2), 8)


def test_accepted_layouts_pass() -> None:
    check_pipeline(meta_gpt(), 2, ParallelConfig(pp=2), 8)  # microbatches default: pp
    check_pipeline(meta_gpt(), 4, ParallelConfig(pp=4, microbatches=8, pp_schedule="gpipe"), 8)
    check_pipeline(meta_gpt(), 4, ParallelConfig(pp=2, microbatches=4), 8)  # pp2 x dp2, ddp
    for strategy in ("zero2", "zero3", "fsdp"):  # under FSDP2 per stage
        check_pipeline(meta_gpt(), 4, ParallelConfig(pp=2, strategy=strategy), 8)
    check_pipeline(meta_gpt(), 4, ParallelConfig(pp=2, tp=2, pp_schedule="gpipe"), 8)
    check_pipeline(meta_gpt(), 8, ParallelConfig(pp=2, tp=2, strategy="fsdp"), 8)
    # pp2 x tp2 on 4 processes has one replica per stage: ddp (the default) has nothing to
    # replicate, so tensor parallelism's refusal of ddp replicas does not apply.
    check_parallel(meta_gpt(), 4, 2, ParallelConfig(pp=2, tp=2), "fp32")
    interleaved = ParallelConfig(pp=2, virtual_stages=2, pp_schedule="interleaved_1f1b")
    check_pipeline(meta_gpt(), 2, interleaved, 8)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ({"train": {"activation_checkpointing": "full"}}, "train.activation_checkpointing"),
        ({"precision": "fp16"}, "precision fp16"),
        ({"train": {"compile": True}}, "train.compile"),
    ],
)
def test_unsupported_companions_refused(override: dict, said: str) -> None:
    cfg = RunConfig.model_validate({"parallel": {"pp": 2}, **override})
    with pytest.raises(ConfigError, match=said):
        check_run(cfg)
    check_run(RunConfig.model_validate(override))  # without pp: nothing to refuse


def test_stages_chain_to_the_whole_model() -> None:
    """Stage views over the model's own blocks: run one after the other they give the whole
    model's logits, and together they hold each parameter once, under its own name."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", {**GPT, "tie_embeddings": False, "vocab_multiple": 64}).eval()
    ids = torch.randint(0, GPT["vocab_size"], (2, 16))
    stages = [GPTStage(model, stage_layers(4, 2, s), first=s == 0, last=s == 1) for s in range(2)]
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](ids)), model(ids))  # padded vocab cut as there
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert [list(st.blocks) for st in stages] == [["0", "1"], ["2", "3"]]


def test_mesh_places_pipelines_outermost() -> None:
    """pp x dp on 4 ranks: ranks 0, 1 are stage 0 of replicas 0, 1; ranks 2, 3 stage 1."""
    cpu = torch.device("cpu")
    places = [
        (rt.pp_rank, rt.dp_rank, rt.dp_size)
        for rt in (Runtime(r, r, 4, 4, cpu, "gloo", 1, 2) for r in range(4))
    ]
    assert places == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    tp = [Runtime(r, r, 4, 4, cpu, "gloo", 2, 1) for r in range(4)]  # tp unchanged by pp
    assert [(rt.dp_rank, rt.dp_size, rt.pp_rank) for rt in tp] == [
        (0, 2, 0),
        (0, 2, 0),
        (1, 2, 0),
        (1, 2, 0),
    ]
