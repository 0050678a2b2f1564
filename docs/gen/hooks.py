"""MkDocs hook: fills the generated pages from the code and from the benchmark results.

A page holds a marker line `<!-- hpcml:generated NAME -->`; at build time the hook replaces it:

- `config`: every key of the pydantic `RunConfig` and `ServeConfig` trees (config_ref.py);
- `cli`: every visible command of the typer app `hpcml.cli.app:app` (cli_ref.py);
- `benchmarks`: the questions of questions.py and their result files under
  `benchmarks/results/` (benchmarks_page.py); `on_files` adds the JSON files and their PNG
  plots (archive/ included) to the site under `benchmarks/results/`, without copies in docs/.

The generators are small hand-written modules beside this file rather than plugins:
mkdocstrings, mkdocs-click or mkdocs-typer are not installed here (nor is anything that reads
our result JSON), and plain functions that take their inputs as arguments are easy to test
(tests/unit/test_docs_generated.py). An unknown marker, or a marker whose generator fails,
fails the build.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

# MkDocs puts this file's folder on sys.path only while it imports the hook.
import benchmarks_page
import cli_ref
import config_ref

MARKER = re.compile(r"^<!-- hpcml:generated (?P<name>[a-z-]+) -->[ \t]*$", re.MULTILINE)
RESULTS = "benchmarks/results"  # in the repository and in the site


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def generate_config() -> str:
    from hpcml.config import RunConfig
    from hpcml.serve.config import ServeConfig

    return config_ref.render_config_reference(
        [
            config_ref.ConfigRoot(
                "Training run",
                RunConfig,
                intro="The YAML file given to `hpcml train`, `hpcml profile` and "
                "`hpcml launch slurm`; any key can be overridden on their command line as "
                "`key=value` (`optim.lr=3e-4`).",
            ),
            config_ref.ConfigRoot(
                "Serving",
                ServeConfig,
                anchor_prefix="serve-",
                intro="The YAML file given to `hpcml serve PATH --config FILE`; its command-line "
                "options override the top-level keys.",
            ),
        ]
    )


def generate_cli() -> str:
    import typer.main

    from hpcml.cli.app import app

    return cli_ref.render_cli_reference(typer.main.get_command(app), "hpcml")


def generate_benchmarks(root: Path, page_src_uri: str) -> str:
    page_dir = posixpath.dirname(page_src_uri) or "."
    return benchmarks_page.render_benchmarks(
        root / RESULTS, asset_base=posixpath.relpath(RESULTS, page_dir)
    )


def on_files(files, config):
    from mkdocs.structure.files import File

    results = _root(config) / RESULTS
    for path in benchmarks_page.result_assets(results):
        name = path.relative_to(results).as_posix()  # archive/ files keep their folder
        files.append(File.generated(config, f"{RESULTS}/{name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name == "config":
            return generate_config()
        if name == "cli":
            return generate_cli()
        if name == "benchmarks":
            return generate_benchmarks(_root(config), page.file.src_uri)
        raise ValueError(
            f"{page.file.src_uri}: unknown generated section '{name}'; "
            "known ones are config, cli and benchmarks (docs/gen/hooks.py)."
        )

    return MARKER.sub(replace, markdown)


def on_serve(server, config, builder):
    # Rebuild when a result is added or re-measured while `mkdocs serve` runs.
    server.watch(str(_root(config) / RESULTS))
    return server
