"""Drift profiles, PSI / KS and `hpcml data drift` on seeded Gaussian inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.stats import norm
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.data.drift import build_profile, load_profile
from hpcml.data.drift_compare import compare

N = 20_000
BINS = 10


def expected_psi_of_shift(shift: float, bins: int = BINS) -> float:
    """PSI of N(shift, 1) against N(0, 1) on N(0, 1)'s exact quantile bins (each share 1/bins)."""
    z = norm.ppf(np.linspace(0.0, 1.0, bins + 1))
    a = np.diff(norm.cdf(z - shift))
    e = np.full(bins, 1.0 / bins)
    return float(np.sum((a - e) * np.log(a / e)))


def psi_tolerance(true_psi: float, n: int, m: int, bins: int) -> float:
    """Four standard deviations plus the bias of the PSI estimate from n and m samples. With
    counts, PSI * n*m/(n+m) is about a noncentral chi-square with bins-1 degrees of freedom and
    noncentrality true_psi * n*m/(n+m) (PSI is the symmetric Kullback-Leibler divergence, whose
    plug-in estimate is asymptotically that law); its variance is 2 * (k + 2 * lambda)."""
    scale = (n + m) / (n * m)
    k, lam = bins - 1, true_psi / scale
    return 4.0 * np.sqrt(2.0 * (k + 2.0 * lam)) * scale + k * scale


def test_unshifted_gaussian_has_small_psi_shifted_by_half_sigma_drifts() -> None:
    rng = np.random.default_rng(11)
    reference = build_profile(rng.normal(size=(N, 2)), seed=1)
    current = reference.empty_like(seed=2)
    x = rng.normal(size=(N, 2))
    x[:, 1] += 0.5  # feature x1 moves by half a standard deviation
    current.update(x)
    result = compare(reference, current, psi_threshold=0.2)
    by = {r["feature"]: r for r in result["features"]}
    # Unshifted: the null PSI is about (bins + 1) * (1/n + 1/m) = 0.0012 (12 bins with under-
    # and overflow), its sd about 0.0005: 0.02 is far above any seed's value, far under 0.2.
    assert by["x0"]["psi"] < 0.02
    assert not by["x0"]["drifted"]
    expected = expected_psi_of_shift(0.5)
    assert expected > 0.2  # the analytic value (0.2377) is itself over the threshold
    assert abs(by["x1"]["psi"] - expected) < psi_tolerance(expected, N, N, BINS)
    assert by["x1"]["drifted"]
    assert result["drifted"] == ["x1"]
    # KS on the 2048-value reservoirs: a half-sigma shift has D = 2*Phi(0.25) - 1 = 0.197,
    # whose p-value at n = m = 2048 is below 1e-30; the unshifted one is a uniform p-value.
    assert by["x1"]["ks_pvalue"] < 1e-10
    assert abs(by["x1"]["ks_statistic"] - (2 * norm.cdf(0.25) - 1)) < 0.06  # 1.36*sqrt(2/2048)*2


def test_histogram_counts_and_reservoir_are_bounded_and_right() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(50_000, 1))
    profile = build_profile(x[:1000], reservoir=512, seed=3)
    edges = profile.features[0].edges
    for part in np.array_split(x[1000:], 7):
        profile.update(part)
    feat = profile.features[0]
    assert feat.seen == 50_000
    assert feat.reservoir.size == 512  # bounded whatever the traffic
    v = x[:, 0]
    under, over = int((v < edges[0]).sum()), int((v > edges[-1]).sum())
    inner, _ = np.histogram(v[(v >= edges[0]) & (v <= edges[-1])], bins=edges)
    assert feat.counts.tolist() == [under, *inner.tolist(), over]
    # A uniform sample of N(0,1) of 512: its mean is within 4 / sqrt(512) = 0.18 of 0; a
    # reservoir that kept only the first values would still pass, so also check it holds
    # values from the last part of the stream (about 512 * 49/50 of them).
    assert abs(feat.reservoir.mean()) < 4 / np.sqrt(512)
    late = np.isin(feat.reservoir, v[25_000:]).sum()
    assert late > 512 * 0.35  # expected 256; binomial sd 11


def test_cli_exit_codes_image_profiles(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    ref_x = rng.normal(size=(400, 3, 8, 8)).astype(np.float32)
    reference = build_profile(ref_x, seed=0)
    ref_path = reference.save(tmp_path / "reference_profile.json")
    assert [f["name"] for f in json.loads(ref_path.read_text())["features"]] == [
        "channel0",
        "channel1",
        "channel2",
    ]
    same = reference.empty_like(seed=1)
    same.update(rng.normal(size=(400, 3, 8, 8)))
    same_path = same.save(tmp_path / "same.json")
    shifted_x = rng.normal(size=(400, 3, 8, 8))
    shifted_x[:, 2] += 0.5
    shifted_path = build_profile(shifted_x, seed=2).save(tmp_path / "shifted.json")

    cli = CliRunner()
    ok = cli.invoke(app, ["data", "drift", str(ref_path), str(same_path), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["drifted"] == []
    drifted = cli.invoke(app, ["data", "drift", str(ref_path), str(shifted_path), "--json"])
    assert drifted.exit_code == 1, drifted.output
    doc = json.loads(drifted.output)
    assert doc["drifted"] == ["channel2"]
    assert doc["features"][2]["binned_from"] == "reservoir"  # its own bins: re-binned
    table = cli.invoke(app, ["data", "drift", str(ref_path), str(shifted_path)])
    assert table.exit_code == 1
    assert "channel2" in table.output and "DRIFT" in table.output
    # A higher threshold finds no drift in the same pair.
    high = cli.invoke(
        app, ["data", "drift", str(ref_path), str(shifted_path), "--psi-threshold", "5"]
    )
    assert high.exit_code == 0, high.output
    # The saved file reads back to the same comparison.
    back = compare(load_profile(ref_path), load_profile(same_path))
    assert back["features"][0]["psi"] == compare(reference, same)["features"][0]["psi"]


def test_cli_bad_input_exits_2_with_one_sentence(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    ref_path = build_profile(rng.normal(size=(100, 3, 4, 4))).save(tmp_path / "ref.json")
    other_path = build_profile(rng.normal(size=(100, 5))).save(tmp_path / "vec.json")
    not_profile = tmp_path / "model.json"
    not_profile.write_text(json.dumps({"format": "hpcml-export/1"}))
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x80not json")
    cli = CliRunner()
    cases = {
        str(tmp_path / "missing.json"): "does not exist",
        str(not_profile): "is not a drift profile",
        str(garbage): "is not a drift profile",
        str(other_path): "different features",
    }
    for current, sentence in cases.items():
        before = Path(ref_path).read_bytes()
        r = cli.invoke(app, ["data", "drift", str(ref_path), current])
        assert r.exit_code == 2, (current, r.output)
        assert sentence in " ".join(r.output.split()), r.output
        assert "Traceback" not in r.output
        assert Path(ref_path).read_bytes() == before


def test_inputs_turning_nan_are_drift_and_the_comparison_stays_json() -> None:
    """Non-finite inputs count in a bin of their own: a feature that turns NaN has drifted
    (PSI of a share of 1 against the floor), and a feature with no finite value left reports
    None rather than NaN, so the comparison is valid JSON (the server's drift endpoint
    returned 500 on such traffic before)."""
    rng = np.random.default_rng(5)
    reference = build_profile(rng.normal(size=(N, 2)), seed=1)
    current = reference.empty_like(seed=2)
    x = rng.normal(size=(1000, 2))
    x[:, 1] = np.nan
    current.update(x)
    result = compare(reference, current, psi_threshold=0.2)
    by = {r["feature"]: r for r in result["features"]}
    assert not by["x0"]["drifted"] and by["x0"]["current_nonfinite"] == 0
    # All of x1 in the non-finite bin: (1 - 1e-4) * ln(1 / 1e-4) plus the emptied bins' share.
    assert by["x1"]["drifted"] and by["x1"]["psi"] > 9.0
    assert by["x1"]["current_nonfinite"] == 1000 and by["x1"]["current_mean"] is None
    assert result["drifted"] == ["x1"]
    json.dumps(result, allow_nan=False)  # raises on NaN
