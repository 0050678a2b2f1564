"""`hpcml data prepare | shard | info | diff`: token corpora, shard sets and their versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from hpcml.cli.common import console, print_json

app = typer.Typer(help="Prepare data sets for training.", no_args_is_help=True)

CORPORA = ("pystdlib",)


@app.command("prepare")
def prepare(
    corpus: str = typer.Argument(
        ..., help="pystdlib: the Python standard library's own source files, as byte tokens."
    ),
    out: Path = typer.Option(..., "--out", help="Folder for train.bin, val.bin and meta.json."),
    val_fraction: float = typer.Option(
        0.05, "--val-fraction", help="Share of files held out for validation (by path hash)."
    ),
    max_bytes: int | None = typer.Option(
        None, "--max-bytes", help="Stop after about this many bytes (small corpora for tests)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Write uint16 token files (train.bin, val.bin) and meta.json for data.source tokens."""
    from hpcml.data.sources.tokens import prepare_pystdlib
    from hpcml.errors import DataError

    if corpus not in CORPORA:
        raise DataError(f"corpus '{corpus}' is not known; known corpora are: {', '.join(CORPORA)}.")
    meta = prepare_pystdlib(out, val_fraction=val_fraction, max_bytes=max_bytes)
    if json_out:
        print_json({"out": str(out), **meta})
        return
    from rich.table import Table

    table = Table(title=f"{corpus} -> {out}")
    table.add_column("split")
    table.add_column("files", justify="right")
    table.add_column("tokens", justify="right")
    for split in ("train", "val"):
        table.add_row(split, f"{meta['files'][split]:,}", f"{meta['tokens'][split]:,}")
    console.print(table)
    console.print(
        f"byte-level tokens (vocabulary {meta['vocab_size']}) from {meta['stdlib']}; "
        f"train with data.source=tokens data.path={out}",
        highlight=False,
    )


@app.command("shard")
def shard(
    source: str = typer.Argument(
        ...,
        help="digits, cifar10, synthetic, tokens, an image folder (a subfolder per class), "
        "a .parquet / .arrow table file, WebDataset .tar shards (a .tar or a folder of them: "
        "KEY.jpg/png + KEY.cls) or a Hugging Face datasets folder (save_to_disk).",
    ),
    out: Path = typer.Option(..., "--out", help="New folder for the shards and manifest.json."),
    shard_size: str = typer.Option(
        "64MB", "--shard-size", help="Sample bytes per shard before compression (64MB, 512KiB)."
    ),
    compression: str = typer.Option("none", "--compression", help="none, lz4 or zstd."),
    path: str | None = typer.Option(
        None, "--path", help="cifar10 / tokens: the data folder (as data.path)."
    ),
    val_fraction: float = typer.Option(0.2, "--val-fraction", help="Share held out."),
    image_size: int = typer.Option(32, "--image-size", help="Image folders: resize to N x N."),
    label: str = typer.Option("label", "--label", help="Tables: the label column."),
    features: str | None = typer.Option(
        None,
        "--features",
        help="Tables: the feature columns, comma-separated (default: every column but the "
        "label); each must hold numbers.",
    ),
    encoded: bool = typer.Option(
        False,
        "--encoded",
        help="Image folders: store each image file's bytes as they are and decode (convert, "
        "resize to --image-size) when read, in the loader's workers.",
    ),
    fill: float | None = typer.Option(
        None,
        "--fill",
        help="Tables: the number written for an empty (null) feature value (default: such a "
        "value is refused, naming its column).",
    ),
    seq_len: int = typer.Option(
        256, "--seq-len", help="tokens, and token documents packed: tokens per window."
    ),
    eot: int = typer.Option(
        0, "--eot", help="Token documents (a datasets folder's input_ids): the id after each."
    ),
    synthetic_samples: int = typer.Option(4096, "--synthetic-samples", help="synthetic: samples."),
    workers: int = typer.Option(
        1,
        "--workers",
        help="Processes writing shard files (serialize, compress, sync, hash) while the source "
        "is read; the output is byte for byte the same for any number.",
    ),
    encrypt: bool = typer.Option(
        False,
        "--encrypt",
        help="Seal each shard file with AES-GCM, the key from $HPCML_ENCRYPTION_KEY or "
        "$HPCML_ENCRYPTION_KEY_FILE; reading it needs the same key in the environment.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Write a shard set (Arrow IPC shards + manifest.json) for data.source shards."""
    from hpcml.data.shards.convert import shard as write

    result = write(
        source,
        out,
        path=path,
        shard_size=shard_size,
        compression=compression,
        val_fraction=val_fraction,
        image_size=image_size,
        label=label,
        seq_len=seq_len,
        synthetic_samples=synthetic_samples,
        features=[c.strip() for c in features.split(",") if c.strip()] if features else None,
        fill=fill,
        encoded=encoded,
        eot=eot,
        workers=workers,
        encrypt=encrypt,
    )
    if json_out:
        print_json(_info(result["manifest"], result["out"]))
        return
    _print_info(result["manifest"], out)
    console.print(f"train with data.source=shards data.path={out}", highlight=False)


def _info(manifest: dict[str, Any], root: str | Path) -> dict[str, Any]:
    from hpcml.data.shards import version_id

    return {
        "path": str(root),
        "version": version_id(manifest),
        "format": manifest["format"],
        "hpcml": manifest.get("hpcml"),
        "source": manifest.get("source"),
        "transform": manifest.get("transform"),
        "sample": manifest["sample"],
        "num_classes": manifest.get("num_classes"),
        "compression": manifest.get("compression"),
        "splits": {
            split: {
                "samples": entry["samples"],
                "shards": len(entry["shards"]),
                "bytes": sum(s["bytes"] for s in entry["shards"]),
            }
            for split, entry in manifest["splits"].items()
        },
    }


def _print_info(manifest: dict[str, Any], root: str | Path) -> None:
    from rich.table import Table

    info = _info(manifest, root)
    table = Table(title=f"shard set {root}  version {info['version'][:16]}")
    for col in ("split", "samples", "shards", "bytes"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for split, s in info["splits"].items():
        table.add_row(split, f"{s['samples']:,}", str(s["shards"]), f"{s['bytes']:,}")
    console.print(table)
    src = info["source"] or {}
    console.print(
        f"source {src.get('name')} ({src.get('path') or 'built in'}), sample {info['sample']['x']}, "
        f"{info['num_classes']} classes, compression {info['compression']}, hpcml {info['hpcml']}",
        highlight=False,
        emoji=False,
        markup=False,
    )


@app.command("info")
def info(
    folder: str = typer.Argument(..., help="A shard set folder, or s3://BUCKET/PREFIX."),
    check: bool = typer.Option(
        False, "--verify", help="Also check every shard's sha256 against the manifest."
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Version id, source, transform and per-split counts of a shard set."""
    from hpcml.data.shards import read_manifest, verify

    manifest = read_manifest(folder)
    if check:
        verify(folder, manifest, deep=True)
    if json_out:
        print_json({**_info(manifest, folder), "verified": check})
        return
    _print_info(manifest, folder)
    if check:
        console.print("every shard matches its sha256", highlight=False)


@app.command("diff")
def diff(
    a: str = typer.Argument(..., help="A shard set folder, or s3://BUCKET/PREFIX."),
    b: str = typer.Argument(..., help="Another shard set folder, or s3://BUCKET/PREFIX."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """What differs between two shard sets: version, source, transform, samples, shards.

    Exits 0 when both are the same version, 1 when they differ (as diff(1) does), 2 on bad
    input."""
    from hpcml.data.shards import read_manifest, version_id

    ma, mb = read_manifest(a), read_manifest(b)
    changes: list[dict[str, Any]] = []
    for key in ("hpcml", "source", "transform", "sample", "num_classes", "compression"):
        if ma.get(key) != mb.get(key):
            changes.append({"key": key, "a": ma.get(key), "b": mb.get(key)})
    for split in sorted(set(ma["splits"]) | set(mb["splits"])):
        sa = ma["splits"].get(split, {"samples": 0, "shards": []})
        sb = mb["splits"].get(split, {"samples": 0, "shards": []})
        if sa["samples"] != sb["samples"]:
            changes.append({"key": f"{split}.samples", "a": sa["samples"], "b": sb["samples"]})
        ha, hb = [s["sha256"] for s in sa["shards"]], [s["sha256"] for s in sb["shards"]]
        if ha != hb:
            only_a, only_b = sorted(set(ha) - set(hb)), sorted(set(hb) - set(ha))
            changes.append(
                {
                    "key": f"{split}.shards",
                    "a": f"{len(ha)} shards, {len(only_a)} not in b",
                    "b": f"{len(hb)} shards, {len(only_b)} not in a",
                }
            )
    va, vb = version_id(ma), version_id(mb)
    result: dict[str, Any] = {
        "a": {"path": str(a), "version": va},
        "b": {"path": str(b), "version": vb},
        "same": va == vb,
        "changes": changes,
    }
    if json_out:
        print_json(result)
        if va != vb:
            raise typer.Exit(1)
        return
    if va == vb:
        console.print(f"same version {va}", highlight=False)
        return
    console.print(f"a {va[:16]}  b {vb[:16]}", highlight=False)
    for c in changes:
        console.print(
            f"{c['key']}: {c['a']!r} -> {c['b']!r}",
            highlight=False,
            soft_wrap=True,
            emoji=False,
            markup=False,
        )
    raise typer.Exit(1)


@app.command("to-webdataset")
def to_webdataset(
    shard_set: str = typer.Argument(..., help="A shard set (folder or s3:// prefix)."),
    out: Path = typer.Option(..., "--out", help="New folder for the .tar shards."),
    split: str = typer.Option("train", "--split", help="train or val."),
    maxcount: int = typer.Option(10_000, "--maxcount", min=1, help="Samples per .tar shard."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Write a shard set's split as WebDataset .tar shards (KEY.png or KEY.npy, KEY.cls)."""
    from hpcml.data.sources.interop import export_webdataset

    result = export_webdataset(shard_set, out, split, maxcount)
    if json_out:
        print_json(result)
        return
    console.print(
        f"wrote {result['samples']} samples in {len(result['shards'])} shards to {out}",
        highlight=False,
    )


@app.command("drift")
def drift(
    reference: Path = typer.Argument(..., help="The reference profile (reference_profile.json)."),
    current: Path = typer.Argument(..., help="The current profile (e.g. saved by hpcml serve)."),
    psi_threshold: float = typer.Option(
        0.1, "--psi-threshold", help="A drifted feature's PSI is over this (and its p under alpha)."
    ),
    alpha: float = typer.Option(
        0.001,
        "--alpha",
        help="False-alarm rate: a drifted feature's chi-square p-value times the number of "
        "features is under this.",
    ),
    ks_alpha: float = typer.Option(
        0.01, "--ks-alpha", help="KS test level: p below it is reported as a rejection."
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """PSI, the chi-square test and the KS test per feature between two drift profiles.

    Exits 1 when any feature has drifted (PSI over the threshold and Bonferroni-corrected
    p-value under alpha; drift found, as `data diff` exits 1 on a difference), 0 when none
    has, 2 on bad input."""
    from hpcml.data.drift import load_profile
    from hpcml.data.drift_compare import compare

    result = compare(load_profile(reference), load_profile(current), psi_threshold, ks_alpha, alpha)
    result = {"reference": str(reference), "current": str(current), **result}
    if json_out:
        print_json(result)
    else:
        _print_drift(result)
    if result["drifted"]:
        raise typer.Exit(1)


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _print_drift(result: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"drift {result['reference']} -> {result['current']}")
    cols = ("feature", "psi", "p corrected", "ks p", "ref mean", "cur mean", "samples", "drifted")
    for col in cols:
        table.add_column(col, justify="left" if col == "feature" else "right")
    for r in result["features"]:
        table.add_row(
            r["feature"],
            _num(r["psi"], ".4f"),
            _num(r["pvalue_corrected"], ".3g"),
            _num(r["ks_pvalue"], ".3g"),
            _num(r["reference_mean"], ".4g"),
            _num(r["current_mean"], ".4g"),
            f"{r['current_samples']:,}",
            "DRIFT" if r["drifted"] else "",
        )
    console.print(table)
    if result["warning"]:
        console.print(f"note: {result['warning']}", highlight=False, markup=False)
    if result["drifted"]:
        console.print(
            f"drifted (PSI > {result['psi_threshold']}, corrected p < {result['alpha']}): "
            f"{', '.join(result['drifted'])}",
            highlight=False,
        )
    else:
        console.print(f"no feature over PSI {result['psi_threshold']}", highlight=False)
