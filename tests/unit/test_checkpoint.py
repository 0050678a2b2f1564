import json

import pytest
import torch

from hpcml.distributed.runtime import Runtime
from hpcml.errors import CheckpointError
from hpcml.models.zoo import build_model
from hpcml.train.checkpoint import store as ckpt

RT = Runtime(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend=None
)


def _model_opt():
    torch.manual_seed(0)
    model = build_model("mlp", {"hidden": 16, "input_shape": [8]})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _save(root, step, model, opt, keep=3):
    return ckpt.save(
        root,
        step,
        model,
        opt,
        {"scheduler": {}, "scaler": {}, "epoch": 0},
        {"rng": ckpt.rng_state(), "data": {"epoch": 0, "loader": None}},
        RT,
        keep,
    )


def test_round_trip_restores_model_and_optimizer(tmp_path):
    model, opt = _model_opt()
    path = _save(tmp_path, 5, model, opt)
    assert ckpt.verify(path) is None
    other, opt2 = _model_opt()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    loaded = ckpt.load(path, other, opt2, RT)
    assert loaded.step == 5
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    s1 = opt.state_dict()["state"][0]["exp_avg"]
    s2 = opt2.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(s1, s2)


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path):
    model, opt = _model_opt()
    _save(tmp_path, 1, model, opt)
    good = _save(tmp_path, 2, model, opt)
    # A writer killed mid-save leaves a .tmp folder; a folder without manifest is also partial.
    (tmp_path / ".step-3.tmp").mkdir()
    (tmp_path / "step-4").mkdir()
    assert ckpt.find_latest(tmp_path) == good
    # Flip bytes in the newest one: it is reported and the previous one is used.
    bad = _save(tmp_path, 5, model, opt)
    manifest = json.loads((bad / "manifest.json").read_text())
    victim = bad / next(iter(manifest["files"]))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    warnings = []
    assert ckpt.find_latest(tmp_path, warn=warnings.append) == good
    assert "sha256" in warnings[0]


def test_retention_keeps_last_k(tmp_path):
    model, opt = _model_opt()
    for s in range(1, 6):
        _save(tmp_path, s, model, opt, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5"]


def _corrupt(path):
    manifest = json.loads((path / "manifest.json").read_text())
    victim = path / next(iter(manifest["files"]))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 can tell
    victim.write_bytes(bytes(data))


def _tree(root):
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_resume_auto_refuses_when_no_checkpoint_is_complete_and_changes_nothing(tmp_path):
    model, opt = _model_opt()
    for s in (1, 2):
        _corrupt(_save(tmp_path, s, model, opt))
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match="none of the 2 checkpoint.* is complete") as err:
        ckpt.resume_target(tmp_path)
    assert "--allow-fresh-start" in err.value.message
    assert _tree(tmp_path) == before  # not moved, not deleted, byte for byte


def test_allow_fresh_start_moves_corrupt_checkpoints_aside_and_keeps_them(tmp_path):
    model, opt = _model_opt()
    for s in (1, 2):
        _corrupt(_save(tmp_path, s, model, opt))
    before = _tree(tmp_path)
    warnings = []
    assert ckpt.resume_target(tmp_path, warnings.append, allow_fresh_start=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt"]
    # The same bytes, under corrupt/.
    assert _tree(tmp_path) == {f"corrupt/{k}": v for k, v in before.items()}
    assert len(warnings) == 2 and all("starting from step 0" in w for w in warnings)
    assert f"moved it to {tmp_path / 'corrupt' / 'step-2'}" in warnings[0]


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_survives_retention(tmp_path):
    model, opt = _model_opt()
    good = _save(tmp_path, 1, model, opt)
    bad = _save(tmp_path, 2, model, opt)
    _corrupt(bad)
    corrupt_bytes = _tree(bad)
    assert ckpt.resume_target(tmp_path, lambda m: None) == good
    # Training goes on past step 2 again: neither a new step-2 save nor pruning touches it.
    for s in (2, 3, 4, 5):
        _save(tmp_path, s, model, opt, keep=1)
    assert _tree(tmp_path / "corrupt" / "step-2") == corrupt_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt", "step-5"]
    # dry_run (the launcher's check) reports but moves nothing.
    _corrupt(tmp_path / "step-5")
    assert ckpt.resume_target(tmp_path, allow_fresh_start=True, dry_run=True) is None
    assert (tmp_path / "step-5").exists()


def test_verify_modes_full_size_none_and_the_bytes_each_one_hashes(tmp_path):
    from hpcml.train import rundir
    from hpcml.train.checkpoint import manifest as ckpt_manifest

    model, opt = _model_opt()
    before = ckpt_manifest.bytes_hashed
    path = _save(tmp_path / "checkpoints", 5, model, opt)
    files = json.loads((path / "manifest.json").read_text())["files"]
    total = sum(f["bytes"] for f in files.values())
    assert ckpt_manifest.bytes_hashed - before == total  # each file once, at save
    # A resume (choice + load) with `full` hashes every file once more, not three times.
    for mode, hashed in (("full", total), ("size", 0), ("none", 0)):
        ckpt_manifest._verified.clear()
        before = ckpt_manifest.bytes_hashed
        found = rundir.resolve_shared(RT, tmp_path, "auto", False, mode=mode)
        cfg = type("C", (), {"fault": type("F", (), {"checkpoint_verify": mode})()})()
        ckpt.load(found, model, opt, RT, None if mode == "full" else cfg)
        assert found == path and ckpt_manifest.bytes_hashed - before == hashed, mode

    # A flipped byte: only `full` sees it. A truncated file: `size` sees it too.
    victim = path / "rank-0.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert "sha256" in ckpt.verify(path, "full")
    assert ckpt.verify(path, "size") is None and ckpt.verify(path, "none") is None
    victim.write_bytes(bytes(data[:-1]))
    assert "bytes" in ckpt.verify(path, "size") and ckpt.verify(path, "none") is None


def test_a_manifest_written_without_hashes_is_checked_by_size(tmp_path):
    from hpcml.train.checkpoint import manifest as ckpt_manifest

    model, opt = _model_opt()
    before = ckpt_manifest.bytes_hashed
    path = ckpt.save(
        tmp_path,
        1,
        model,
        opt,
        {"epoch": 0},
        {"rng": ckpt.rng_state(), "data": {}},
        RT,
        3,
        verify="none",
    )
    assert ckpt_manifest.bytes_hashed == before  # nothing hashed at save
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert all(f["sha256"] is None and f["bytes"] > 0 for f in files.values())
    assert ckpt.verify(path, "full") is None
    (path / "trainer.pt").write_bytes(b"x")
    assert "bytes" in ckpt.verify(path, "full")
