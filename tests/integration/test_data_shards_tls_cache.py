"""Shard sets in a bucket served over TLS, the local disk cache, and read-ahead.

One real `moto_server` (its own process) serves https with a certificate signed by a CA this
module makes (`s3_server.py`); moto's request recorder tells which shard objects the server
actually sent. The checks:

- with the CA given (`tls_ca_file_path=` in the URL, or AWS_CA_BUNDLE) hpcml reads and verifies
  the set; without it the read is refused in one sentence naming the certificate, and
  `hpcml train` exits 2 without a traceback;
- with `cache_dir`, a second pass (a new reader, as a new run would make) GETs no shard; a
  truncated and a same-size corrupted cache file are each fetched again; the cache's bytes stay
  within the limit after a pass over a set larger than it;
- read-ahead fetches a batch's next shards on its own thread before they are used, keeps within
  `shard_cache`, and reads the same samples in the same order as without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT, hpcml_env, run_hpcml, step_losses
from tests.integration.s3_server import CREDENTIALS, MotoServer, make_ca_and_server_cert
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.data.shards import ShardSet, read_manifest, version_id
from hpcml.data.shards.cache import SUBFOLDER, DiskCache
from hpcml.data.shards.convert import shard

SEED = 5


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """A small synthetic shard set (28 train shards of 9 samples of 3x32x32 float32) in
    s3://hpcml/syn on a TLS moto server; the URL carries no CA."""
    folder = tmp_path_factory.mktemp("tls")
    ca, cert, key = make_ca_and_server_cert(folder / "pki")
    local = folder / "syn"
    shard("synthetic", local, shard_size="120KB", synthetic_samples=310, val_fraction=0.2)
    saved = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_CA_BUNDLE"]}
    os.environ.update(CREDENTIALS)
    os.environ.pop("AWS_CA_BUNDLE", None)
    server = MotoServer(folder, tls=(cert, key, ca))
    try:
        url = server.upload(local, "hpcml", "syn")
        yield {"local": local, "url": url, "ca": ca, "server": server}
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def with_ca(t: dict[str, object]) -> str:
    return f"{t['url']}&tls_ca_file_path={t['ca']}"


def read_all(ds: ShardSet, batch: int = 16, shuffle: bool = True) -> list[tuple[int, bytes]]:
    """(id, x bytes) of every sample, through a DataLoader (its __getitems__ path)."""
    g = torch.Generator().manual_seed(SEED)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=shuffle, generator=g)
    out = []
    for x, _, ids in loader:
        out += [(int(i), x[j].numpy().tobytes()) for j, i in enumerate(ids)]
    return out


def one_by_one(ds: ShardSet, batch: int = 16) -> list[tuple[int, bytes]]:
    """read_all's samples in read_all's order, read through __getitem__ one at a time: the
    indices come from the same loader over range(len(ds)) with the same seeded generator."""
    g = torch.Generator().manual_seed(SEED)
    indices = torch.utils.data.DataLoader(
        range(len(ds)), batch_size=batch, shuffle=True, generator=g
    )
    out = []
    for batch_indices in indices:
        for i in batch_indices.tolist():
            x, _, sid = ds[i]
            out.append((int(sid), x.numpy().tobytes()))
    return out


def test_reads_over_tls_with_the_ca_in_the_url_or_the_environment(
    tls: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    version = version_id(read_manifest(tls["local"]))  # type: ignore[arg-type]
    res = CliRunner().invoke(app, ["data", "info", with_ca(tls), "--verify", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["version"] == version
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tls["ca"]))
    res = CliRunner().invoke(app, ["data", "info", str(tls["url"]), "--verify", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verified"] is True


def test_an_untrusted_certificate_is_refused_in_one_sentence(
    tls: dict[str, object], tmp_path: Path
) -> None:
    res = CliRunner().invoke(app, ["data", "info", str(tls["url"])])
    assert res.exit_code == 2
    assert "TLS certificate is not trusted" in res.stderr and "AWS_CA_BUNDLE" in res.stderr
    env = {**hpcml_env(), **CREDENTIALS}
    env.pop("AWS_CA_BUNDLE", None)
    proc = run_hpcml(
        "train", "examples/digits_cnn.yaml", "model.name=mlp", "train.max_steps=1",
        "data.source=shards", f"data.path={tls['url']}", "--quiet",
        "--run-dir", str(tmp_path / "run"), env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "TLS certificate is not trusted" in proc.stderr and "Traceback" not in proc.stderr
    missing = CliRunner().invoke(app, ["data", "info", f"{tls['url']}&tls_ca_file_path=/no/ca"])
    assert missing.exit_code == 2 and "not a readable file" in missing.stderr


def test_the_disk_cache_serves_a_second_pass_without_a_get(
    tls: dict[str, object], tmp_path: Path
) -> None:
    server: MotoServer = tls["server"]  # type: ignore[assignment]
    cache = tmp_path / "cache"
    local = ShardSet(tls["local"], "train", with_ids=True)  # type: ignore[arg-type]
    expected = one_by_one(local)
    mark = len(server.requests())
    first = ShardSet(with_ca(tls), "train", with_ids=True, cache_dir=cache, cache_shards=2)
    assert read_all(first) == expected
    gets = server.shard_gets(mark)
    assert sorted(set(gets)) == sorted(f"/hpcml/syn/{f}" for f in first.files)
    assert len(gets) == len(first.files)  # once each: later misses of shard_cache hit the disk
    mark = len(server.requests())
    second = ShardSet(with_ca(tls), "train", with_ids=True, cache_dir=cache, cache_shards=2)
    assert read_all(second) == expected
    assert server.shard_gets(mark) == []
    # A truncated file (size check) and a same-size corrupted one (sha256, in a new process
    # that has not hashed it yet) are fetched again, and the cache holds good copies after.
    bad = sorted(DiskCache(cache, 10**9).files())
    short, flipped = bad[0], bad[1]
    short.write_bytes(short.read_bytes()[:-100])
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    mark = len(server.requests())
    code = (
        "import sys; from hpcml.data.shards import ShardSet; "
        "ds = ShardSet(sys.argv[1], 'train', with_ids=True, cache_dir=sys.argv[2]); "
        "[ds[i] for i in range(len(ds))]"
    )
    subprocess.run(
        [sys.executable, "-c", code, with_ca(tls), str(cache)],
        env=hpcml_env(), cwd=ROOT, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    refetched = {p.rsplit("/", 1)[1] for p in server.shard_gets(mark)}
    assert refetched == {short.name.split("-", 1)[1], flipped.name.split("-", 1)[1]}
    for p in (short, flipped):
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name.split("-", 1)[0]


def test_the_cache_stays_within_its_limit(tls: dict[str, object], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ds = ShardSet(with_ca(tls), "train", with_ids=True, cache_dir=cache)
    limit = sum(ds.sizes) // 4  # a quarter of the set: most shards must be evicted
    ds = ShardSet(with_ca(tls), "train", with_ids=True, cache_dir=cache, cache_limit_bytes=limit)
    assert len(read_all(ds, shuffle=False)) == len(ds)
    files = list((cache / SUBFOLDER).iterdir())
    shards = [p for p in files if p.suffix == ".arrow"]
    assert 0 < sum(p.stat().st_size for p in shards) <= limit
    assert not [p for p in files if p.name.startswith(".")]  # no temporary file left behind


def test_readahead_fetches_the_next_shards_before_use_in_the_same_order(
    tls: dict[str, object],
) -> None:
    plain = ShardSet(with_ca(tls), "train", with_ids=True, cache_shards=3, readahead=0)
    expected = one_by_one(ShardSet(tls["local"], "train", with_ids=True))  # type: ignore[arg-type]
    assert read_all(plain) == expected
    ahead = ShardSet(with_ca(tls), "train", with_ids=True, cache_shards=3, readahead=2)
    ahead.slots.events = events = []
    g = torch.Generator().manual_seed(SEED)
    loader = torch.utils.data.DataLoader(ahead, batch_size=16, shuffle=True, generator=g)
    got, batches = [], 0
    for x, _, ids in loader:
        got += [(int(i), x[j].numpy().tobytes()) for j, i in enumerate(ids)]
        batches += 1
        assert len(ahead.slots) <= 3  # open + in flight, within shard_cache
    assert got == expected  # same samples, same order
    main = [k for what, k, thread in events if what == "fetch" and thread == "MainThread"]
    behind = [k for what, k, thread in events if what == "fetch" and thread != "MainThread"]
    # Each batch touches about 12 of the 28 shards; only its first can be fetched in the
    # foreground (without read-ahead every one is).
    assert len(main) <= batches < len(behind)
    for k in set(behind):  # every shard fetched ahead was fetched before its use
        first_fetch = events.index(next(e for e in events if e[:2] == ("fetch", k)))
        uses = [n for n, e in enumerate(events) if e[:2] == ("use", k)]
        assert not uses or first_fetch < uses[0]
    # One sample at a time, in file order: every shard after the first arrives ahead.
    seq = ShardSet(with_ca(tls), "train", with_ids=True, cache_shards=2, readahead=1)
    seq.slots.events = events = []
    assert [int(seq[i][2]) for i in range(len(seq))] == [int(plain[i][2]) for i in range(len(seq))]
    fetched = {k: thread for what, k, thread in events if what == "fetch"}
    assert fetched[0] == "MainThread"
    assert all(t.startswith("hpcml-readahead") for k, t in fetched.items() if k > 0)


def test_a_second_training_run_reads_every_shard_from_the_cache(
    tls: dict[str, object], tmp_path: Path
) -> None:
    """`hpcml train` with data.cache_dir and 2 loader workers (each its own client, cache and
    read-ahead thread): the second run GETs no shard and has the first run's losses."""
    server: MotoServer = tls["server"]  # type: ignore[assignment]
    env = {**hpcml_env(), **CREDENTIALS, "AWS_CA_BUNDLE": str(tls["ca"])}
    args = [
        "train", "examples/digits_cnn.yaml", "model.name=mlp", "model.args={hidden: 16}",
        "data.source=shards", f"data.path={tls['url']}", f"data.cache_dir={tmp_path / 'c'}",
        "data.num_workers=2", "data.batch_size=16", "train.max_steps=6", "train.eval_every=0",
        "train.log_every=1", "train.checkpoint_every=0", "train.deterministic=true", "--quiet",
    ]  # fmt: skip
    mark = len(server.requests())
    run_hpcml(*args, "--run-dir", str(tmp_path / "one"), env=env)
    assert server.shard_gets(mark)
    mark = len(server.requests())
    run_hpcml(*args, "--run-dir", str(tmp_path / "two"), env=env)
    assert server.shard_gets(mark) == []
    assert step_losses(tmp_path / "two") == step_losses(tmp_path / "one")


def test_a_changed_shard_set_never_reads_a_stale_cached_file(
    tls: dict[str, object], tmp_path: Path
) -> None:
    """Another version of the set, same file names and sizes, other bytes, through one cache."""
    server: MotoServer = tls["server"]  # type: ignore[assignment]
    other = tmp_path / "syn-v2"
    shard("synthetic", other, shard_size="120KB", synthetic_samples=320, val_fraction=0.2)
    url2 = f"{server.upload(other, 'hpcml', 'syn-v2')}&tls_ca_file_path={tls['ca']}"
    cache = tmp_path / "cache"
    first = ShardSet(with_ca(tls), "train", with_ids=True, cache_dir=cache)
    second = ShardSet(url2, "train", with_ids=True, cache_dir=cache)
    assert first.files[0] == second.files[0] and first.sizes[0] == second.sizes[0]
    assert first.sha256[0] != second.sha256[0]
    x1, x2 = first[0][0], second[0][0]
    assert not torch.equal(x1, x2)
    assert torch.equal(x2, ShardSet(other, "train")[0][0])
