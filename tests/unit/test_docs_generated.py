"""The generated docs pages: configuration and CLI references, benchmarks page, strict build.

The generators live in docs/gen/ (not a package): that folder is put on sys.path here, as
MkDocs does while it loads docs/gen/hooks.py. The config and CLI checks walk the pydantic
models and the command tree with their own code, not the generators' walks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
import typer.main
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "docs" / "gen"
RESULTS = ROOT / "benchmarks" / "results"
if str(GEN) not in sys.path:
    sys.path.insert(0, str(GEN))

import benchmarks_page  # noqa: E402
import cli_ref  # noqa: E402
import config_ref  # noqa: E402
import questions  # noqa: E402

from hpcml.cli.app import app  # noqa: E402
from hpcml.config import RunConfig  # noqa: E402
from hpcml.serve.config import ServeConfig  # noqa: E402


def _load_hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("hpcml_docs_hooks", GEN / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()


@pytest.fixture(scope="module")
def config_page() -> str:
    return hooks.generate_config()


@pytest.fixture(scope="module")
def cli_page() -> str:
    return hooks.generate_cli()


def _rows(page: str) -> dict[str, list[str]]:
    """Key -> cells of every reference table row whose first cell is a code span."""
    rows = {}
    for line in page.splitlines():
        m = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2).split(" | ")
    return rows


def _optional_inner(annotation: typing.Any) -> typing.Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, typing.Any]:
    """Dotted key -> FieldInfo for every field that is not itself a nested model."""
    out = {}
    for name, field in model.model_fields.items():
        inner = _optional_inner(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            out.update(_leaves(inner, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field
    return out


def _models_reachable(model: type[BaseModel], seen: set[type]) -> set[type]:
    seen.add(model)
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel) and t not in seen:
                _models_reachable(t, seen)
            stack.extend(typing.get_args(t))
    return seen


def _yaml_scalar(value: typing.Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@pytest.mark.parametrize("root", [RunConfig, ServeConfig], ids=["run", "serve"])
def test_config_page_lists_every_leaf_key_with_its_default(config_page, root):
    rows = _rows(config_page)
    leaves = _leaves(root)
    assert len(leaves) > 20
    for key, field in leaves.items():
        assert key in rows, f"config key {key} missing from the configuration reference"
        default_cell = rows[key][1]
        if field.is_required():
            assert default_cell == "required", key
            continue
        value = field.get_default(call_default_factory=True)
        if isinstance(value, list | tuple | dict):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for _, item in items:
                assert _yaml_scalar(item) in default_cell, (key, default_cell)
        else:
            assert default_cell == f"`{_yaml_scalar(value)}`", (key, default_cell)


def test_config_page_documents_every_field_of_every_model(config_page):
    """Models reached only through a map (serve `versions: dict[str, VersionConfig]`) too."""
    keys = set(_rows(config_page))
    for root in (RunConfig, ServeConfig):
        for model in _models_reachable(root, set()):
            names = sorted(_leaves(model, "").keys() & model.model_fields.keys())
            if not names:
                continue
            # All leaf fields of a model sit under one prefix (e.g. `defaults.versions.<name>.`).
            prefixes = {k[: -len(names[0])] for k in keys if k.endswith(names[0])}
            assert any(all(f"{p}{n}" in keys for n in names) for p in prefixes), (
                f"the keys of {model.__name__} ({', '.join(names)}) are not documented together"
            )


def test_config_page_types_and_descriptions_from_the_models(config_page):
    rows = _rows(config_page)
    # type, default, description as written in src/hpcml/config.py
    assert rows["train.max_steps"][:2] == ["`int`, > 0", "`300`"]
    assert rows["optim.lr"][1] == "`0.001`"
    assert rows["fault.nan_policy"][0] == "one of `skip`, `rollback`, `stop`"
    assert rows["train.checkpoint_every_s"][0].startswith("`float` or null")
    assert rows["data.batch_size"][2] == "Samples per process per micro-batch."
    assert "SIGTERM" in rows["fault.preempt_signals"][1]
    assert "SIGHUP" in rows["fault.preempt_signals"][0]
    assert rows["data.synthetic_shape"][1] == "`[3, 32, 32]`"
    assert rows["defaults.max_batch_size"][1] == "`32`"  # serve config
    assert rows["overload_status"][0] == "one of `503`, `429`"
    # A section heading per top-level model field, for both trees.
    for section in ("model", "data", "optim", "train", "parallel", "fault", "tracking", "observe"):
        assert re.search(rf"^### {section} \{{#{section}\}}$", config_page, re.M), section
    for section in ("defaults", "generation", "drift", "models"):
        assert f"### {section} {{#serve-{section}}}" in config_page


def test_attribute_docstrings_match_pydantics_own_reading(tmp_path):
    """config_ref reads attribute docstrings itself; pydantic's use_attribute_docstrings
    must read the same text from the same class."""
    src = tmp_path / "docmodel.py"
    src.write_text(
        "from pydantic import BaseModel, ConfigDict\n"
        "class M(BaseModel):\n"
        "    model_config = ConfigDict(use_attribute_docstrings=True)\n"
        "    a: int = 1\n"
        '    """First line\n    second line."""\n'
        "    b: int = 2  # a comment, not a description\n"
        "    c: str = 'x'\n"
        '    """C."""\n'
    )
    spec = importlib.util.spec_from_file_location("docmodel", src)
    module = importlib.util.module_from_spec(spec)
    sys.modules["docmodel"] = module
    try:
        spec.loader.exec_module(module)
        by_pydantic = {n: f.description for n, f in module.M.model_fields.items() if f.description}
        assert by_pydantic == {"a": "First line\nsecond line.", "c": "C."}
        assert config_ref.attribute_docstrings(module.M) == by_pydantic
    finally:
        del sys.modules["docmodel"]


def _command_paths(command, path: str) -> list[str]:
    paths = [path]
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        if not sub.hidden:
            paths += _command_paths(sub, f"{path} {name}")
    return paths


def _section(page: str, path: str) -> str:
    """The text under the heading of command `path`, up to the next heading."""
    m = re.search(rf"^#+ {re.escape(path)} \{{#[^}}]+\}}$(.*?)(?=^#+ |\Z)", page, re.M | re.S)
    assert m, f"no section for {path}"
    return m.group(1)


def test_cli_page_has_every_command_of_the_app(cli_page):
    paths = _command_paths(typer.main.get_command(app), "hpcml")
    for known in ("hpcml plan memory", "hpcml plan cost run", "hpcml export onnx", "hpcml train"):
        assert known in paths
    assert len(paths) > 30
    for path in paths:
        _section(cli_page, path)


def test_cli_page_shows_usage_options_and_help(cli_page):
    train = _section(cli_page, "hpcml train")
    assert "hpcml train [OPTIONS]" in train
    assert "Train a model from a YAML config" in train
    assert re.search(
        r"^\| `--max-restarts` \| `int` \| `0` \| Elastic restarts of the whole group", train, re.M
    )
    assert re.search(r"^\| `config` \| `path` \| required \| YAML config", train, re.M)
    memory = _section(cli_page, "hpcml plan memory")
    assert "Per-device bytes of parameters" in memory
    assert "`--devices` / `-n`" in memory
    # A group lists its sub-commands with links to their sections.
    assert "[`hpcml plan memory`](#hpcml-plan-memory)" in _section(cli_page, "hpcml plan")


def test_cli_page_leaves_out_hidden_commands_and_options():
    demo = typer.Typer()

    @demo.command()
    def shown(
        level: int = typer.Option(3, help="How loud."),
        secret: int = typer.Option(0, hidden=True, help="Never documented."),
    ) -> None:
        """Shown command."""

    @demo.command(hidden=True)
    def internal() -> None:
        """Hidden command."""

    page = cli_ref.render_cli_reference(typer.main.get_command(demo), "demo")
    assert "demo shown" in page and "How loud." in page
    assert "internal" not in page and "Hidden command" not in page
    assert "--secret" not in page and "Never documented" not in page


def test_benchmarks_page_has_a_section_and_plot_per_result():
    """Each result is linked (a question's answer under its own heading; the files it was
    computed from beside it); each plot is shown (tests/unit/test_benchmark_questions.py)."""
    page = benchmarks_page.render_benchmarks(RESULTS, asset_base="benchmarks/results")
    stems = [p.stem for p in RESULTS.glob("*.json")]
    assert len(stems) >= 20
    for stem in stems:
        assert f"[{stem}.json](benchmarks/results/{stem}.json)" in page
        if (RESULTS / f"{stem}.png").exists():
            assert f"![{stem}](benchmarks/results/{stem}.png)" in page
    for q in questions.QUESTIONS:
        assert re.search(rf"^## .+ \{{#{re.escape(q.stem.replace('_', '-'))}\}}$", page, re.M)


def test_benchmark_tables_come_from_the_json(tmp_path):
    """A copy of a result with one number changed changes the page (no .md is read)."""
    for name in ("plan_activations.json", "drift_cost.json"):
        shutil.copy(RESULTS / name, tmp_path / name)
    before = benchmarks_page.render_benchmarks(tmp_path)
    doc = json.loads((tmp_path / "plan_activations.json").read_text())
    measured = doc["rows"][0]["measured_bytes"]
    assert f"| {measured:,} |" in before
    doc["rows"][0]["measured_bytes"] = 777_777
    (tmp_path / "plan_activations.json").write_text(json.dumps(doc))
    drift = json.loads((tmp_path / "drift_cost.json").read_text())
    drift["check_ms"]["median"] = 12345.678
    (tmp_path / "drift_cost.json").write_text(json.dumps(drift))
    after = benchmarks_page.render_benchmarks(tmp_path)
    assert f"| {measured:,} |" not in after
    assert "| 777,777 |" in after
    assert "| check\\_ms | 12,350 (" in after


def test_benchmark_shapes_render_as_tables(tmp_path):
    doc = {
        "question": "does it work?",
        "command": "python benchmarks/x.py --fast",
        "machine": {"cpus": 2, "load": [0.5, 0.25]},
        "rows": [
            {"name": "a", "t": {"median": 1.23456, "min": 1, "max": 2}, "deep": {"x": 0.000123}},
            {"name": "b|c", "t": {"median": 3, "min": 2, "max": 4}, "deep": {"x": 12}},
        ],
        "wide": [{f"c{i}": i for i in range(20)}, {f"c{i}": -i for i in range(20)}],
    }
    (tmp_path / "shape.json").write_text(json.dumps(doc))
    page = benchmarks_page.render_benchmarks(tmp_path)
    assert "**question:** does it work?" in page
    assert "```text\npython benchmarks/x.py --fast\n```" in page
    assert "| machine.cpus | 2 |" in page and "| machine.load | 0.5, 0.25 |" in page
    assert "| name | t | deep.x |" in page
    assert "| a | 1.235 (1 – 2) | 1.230e-04 |" in page
    assert "| b\\|c | 3 (2 – 4) | 12 |" in page
    wide = page[page.index("### wide") :]
    alignment_rows = [line for line in wide.splitlines() if line.startswith("| ---")]
    assert len(alignment_rows) >= 2, "a 20-column table is split"
    assert all(line.count("|") - 1 <= benchmarks_page.MAX_COLUMNS for line in alignment_rows)
    for i in range(20):
        assert f" c{i} |" in wide


def test_hook_fills_markers_and_refuses_unknown_ones(tmp_path):
    config = SimpleNamespace(config_file_path=str(ROOT / "mkdocs.yml"))
    page = SimpleNamespace(file=SimpleNamespace(src_uri="sub/page.md"))
    text = "# T\n\nIntro.\n\n<!-- hpcml:generated benchmarks -->\n"
    out = hooks.on_page_markdown(text, page, config, None)
    assert out.startswith("# T\n\nIntro.\n\n") and "hpcml:generated" not in out
    assert "](../benchmarks/results/strategies_cpu.png)" in out
    with pytest.raises(ValueError, match="unknown generated section 'cfg'"):
        hooks.on_page_markdown("<!-- hpcml:generated cfg -->\n", page, config, None)


def test_strict_site_build(tmp_path):
    """`mkdocs build --strict` (as `make docs` runs it): no broken links or anchors."""
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        # Not --quiet: it hides the warnings that --strict counts, and the build then passes.
        [sys.executable, "-m", "mkdocs", "build", "--strict"]
        + ["-f", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for png in [*RESULTS.glob("*.png"), *RESULTS.glob("archive/*.png")]:
        if png.with_suffix(".json").exists():
            name = png.relative_to(RESULTS)
            assert (site / "benchmarks" / "results" / name).is_file(), name
    assert (site / "benchmarks" / "results" / "archive" / "serving.json").is_file()
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert 'id="hpcml-plan-memory"' in cli and "hpcml:generated" not in cli
    config = (site / "reference" / "configuration" / "index.html").read_text()
    assert "train.max_steps" in config and "hpcml:generated" not in config
    bench = (site / "benchmarks" / "index.html").read_text()
    assert 'src="results/strategies_cpu.png"' in bench
