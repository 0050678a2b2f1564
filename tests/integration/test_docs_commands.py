"""Every command the docs show runs as written, so the docs cannot rot.

The pages are README.md, CONTRIBUTING.md and docs/**/*.md. Every fenced block labelled
`bash`, `console` (its `$ ` lines) or `python` is run, page by page, in the order of the page,
in one scratch folder per page (with `examples/`, `tests/`, `src/`, `benchmarks/` and
`pyproject.toml` linked into it, as if typed in the repository's root), so a page's later blocks use
what its earlier ones made. A block that looks like commands but has no label fails the test
(label it, so it runs). A block that cannot run here is preceded by
`<!-- docs-test: skip REASON -->`, and REASON must name the test or CI step that covers it
(`tests/....py` or `.ci/run`, a file that exists).

Short settings, and nothing else, are overridden (the same overrides for every page):

- `hpcml train`: `train.max_steps=3` appended (what a page says about the result, e.g. the demo's
  accuracy, is not checked here; the tests named on the page check it);
- `hpcml loadtest`: `--duration 2`;
- `hpcml data prepare pystdlib`: `--max-bytes 1500000`;
- (not an override) an `hpcml train ... --run-dir DIR` or `hpcml data prepare ... --out DIR`
  line that another page already ran, with the same inputs, gets a copy of that page's DIR and
  output instead of running again (`docs_cache.py`: once per session, shared by the workers);
- `curl` gets `--fail-with-body`, so an HTTP error fails the page instead of printing;
- ports 8000 to 8009 are replaced by free ones, so pages can run beside other tests;
- (a check, not an override) every number a `console` block shows under a command, or in its
  trailing comment, must appear in what that command printed;
- a line that starts `hpcml serve` runs in the background (with `&` added when the page does
  not have it) and the page goes on once `/v2/health/ready` answers 200; servers are stopped
  when the page ends.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests import forked
from tests.conftest import session_shared_dir, system_binary
from tests.fork_shim import ShimServer

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "docs").rglob("*.md")),
]
RUN = {"bash", "console", "python"}
LOOKS_LIKE_COMMANDS = re.compile(
    r"^(\$ |hpcml |python |make |curl |torchrun |sbatch |pip |jq |mlflow |export )"
)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s+(.*?)\s*-->", re.S)
PAGE_TIMEOUT_S = 420
# System programs the pages' commands call (.ci/install_docs_tools.sh installs them).
DOCS_TOOLS = ("curl", "jq", "openssl")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str
    skip: str | None


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(\S*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        before = "\n".join(lines[max(0, i - 4) : i])
        skips = SKIP.findall(before)
        out.append(
            Block(page, i + 1, lang, "\n".join(lines[i + 1 : j]), skips[-1] if skips else None)
        )
        i = j + 1
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _logical_lines(script: str) -> list[str]:
    out: list[str] = []
    for line in script.split("\n"):
        if out and out[-1].rstrip().endswith("\\"):
            out[-1] = out[-1] + "\n" + line
        else:
            out.append(line)
    return out


def _split_comment(line: str) -> tuple[str, str]:
    """A command and its trailing `  # comment` (only a `#` after two spaces, outside quotes)."""
    m = re.search(r"\s{2,}#[^'\"]*$", line)
    return (line[: m.start()], line[m.start() :]) if m else (line, "")


def shorten(script: str, ports: dict[str, int]) -> str:
    """The page's commands with the short settings of this module's docstring."""
    for old, new in ports.items():
        script = re.sub(rf"\b{old}\b", str(new), script)
    out = []
    for line in _logical_lines(script):
        cmd, comment = _split_comment(line)
        stripped = cmd.strip()
        if stripped.startswith("hpcml train "):
            cmd += " train.max_steps=3"
        elif stripped.startswith("hpcml loadtest "):
            cmd = re.sub(r"--duration\s+\S+", "--duration 2", cmd)
        elif stripped.startswith("hpcml data prepare pystdlib"):
            cmd += " --max-bytes 1500000"
        elif stripped.startswith("curl "):
            cmd = "curl --fail-with-body " + stripped[len("curl ") :]
        makes = MAKES_ONE_FOLDER.match(stripped)
        if makes:
            indent = cmd[: len(cmd) - len(cmd.lstrip())]
            cmd = f"{indent}docs_cached {makes.group(2)} {cmd.strip()}"
        if stripped.startswith("hpcml serve "):
            port = re.search(r"--port\s+(\d+)", cmd)
            background = stripped.endswith("&")
            cmd = cmd if background else cmd + " &"
            out.append(cmd + comment)
            out.append(f"wait_ready {port.group(1) if port else ports['8000']}")
            continue
        out.append(cmd + comment)
    return "\n".join(out)


# A command whose whole product is one folder it names (docs_cache.py says what is shared).
MAKES_ONE_FOLDER = re.compile(r"^hpcml (?:train|data prepare) [^|;&]*?--(run-dir|out) (\S+)")

PRELUDE = """\
set -eo pipefail
docs_cached() {
  local out=$1; shift
  if [ -n "${HPCML_DOCS_CACHE:-}" ]; then
    python "$HPCML_DOCS_CACHE_PY" "$HPCML_DOCS_CACHE" "$out" -- "$@"
  else
    "$@"
  fi
}
stop_servers() {
  local rc=$? pids
  pids=$(jobs -p)
  if [ -n "$pids" ]; then kill $pids 2>/dev/null || true; wait 2>/dev/null || true; fi
  exit $rc
}
trap stop_servers EXIT
wait_ready() {
  for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$1/v2/health/ready" >/dev/null; then return 0; fi
    sleep 0.5
  done
  echo "server on port $1 not ready after 120 s" >&2; return 1
}
"""


NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _numbers(text: str) -> list[str]:
    return NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", text))


def console_claims(block: Block) -> list[tuple[str, list[str]]]:
    """Each `$ ` command of a console block with the numbers the page claims it prints: those
    of the output lines shown under it and of its trailing `# comment`."""
    out: list[tuple[str, list[str]]] = []
    going_on = False
    for line in block.text.split("\n"):
        if line.startswith("$ ") or going_on:
            cmd = line[2:] if line.startswith("$ ") else line
            if line.startswith("$ "):
                out.append(("", []))
            _, comment = _split_comment(cmd)
            out[-1] = (
                out[-1][0] + ("\n" if out[-1][0] else "") + cmd,
                out[-1][1] + _numbers(comment),
            )
            going_on = cmd.rstrip().endswith("\\")
        elif out:
            out[-1][1].extend(_numbers(line))
    return out


def page_script(page: Path, ports: dict[str, int]) -> str:
    parts = [PRELUDE]
    for b in blocks(page):
        if b.lang not in RUN or b.skip:
            continue
        rel = b.page.relative_to(REPO)
        parts.append(f"echo '== {rel}:{b.line}' >&2")
        if b.lang == "python":
            text = b.text
            for old, new in ports.items():
                text = re.sub(rf"\b{old}\b", str(new), text)
            parts.append(f"python - <<'HPCML_DOCS_PY'\n{text}\nHPCML_DOCS_PY")
        elif b.lang == "console":
            for k, (cmd, _) in enumerate(console_claims(b)):
                parts.append(f"echo '@@docs-out {rel}:{b.line}:{k}'")
                parts.append(shorten(cmd, ports))
        else:
            parts.append(shorten(b.text, ports))
    return "\n".join(parts) + "\n"


def unmet_claims(page: Path, stdout: str) -> list[str]:
    """The numbers a console block shows that its command did not print."""
    segments = dict(re.findall(r"^@@docs-out (\S+)\n(.*?)(?=^@@docs-out |\Z)", stdout, re.M | re.S))
    missing = []
    for b in blocks(page):
        if b.lang != "console" or b.skip:
            continue
        for k, (cmd, claims) in enumerate(console_claims(b)):
            printed = re.sub(
                r"(?<=\d),(?=\d{3})",
                "",
                segments.get(f"{b.page.relative_to(REPO)}:{b.line}:{k}", ""),
            )
            absent = [n for n in claims if n not in printed]
            if absent:
                missing.append(
                    f"{b.page.relative_to(REPO)}:{b.line}: `{cmd.strip()}` did not print {absent}"
                )
    return missing


def _ids(p: Path) -> str:
    return str(p.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_command_block_is_labelled_and_every_skip_names_its_test(page: Path) -> None:
    for b in blocks(page):
        first = next((x for x in b.text.split("\n") if x.strip()), "")
        where = f"{b.page.relative_to(REPO)}:{b.line}"
        if b.lang not in RUN | {"yaml", "json", "text", "toml", "proto", ""}:
            pytest.fail(f"{where}: fenced block labelled '{b.lang}'; use bash, console or python")
        if not b.lang and LOOKS_LIKE_COMMANDS.match(first):
            pytest.fail(f"{where}: commands in an unlabelled block; label it bash so it runs")
        if b.skip is not None:
            named = re.findall(r"(tests/[\w/.-]+\.py|\.ci/run)", b.skip)
            assert named, f"{where}: a skip must name the test that covers it: {b.skip!r}"
            for path in named:
                assert (REPO / path).exists(), f"{where}: {path} does not exist"


@pytest.fixture(scope="session")
def docs_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per pytest session, shared by its xdist workers."""
    return session_shared_dir(tmp_path_factory, "docs-cache")


@pytest.fixture(scope="module")
def shim_path() -> Iterator[str]:
    """PATH's first folder: an `hpcml` that forks its run-to-the-end verbs from this worker's
    pre-imported server (tests/fork_shim.py); empty with HPCML_TEST_FORK=0."""
    if not forked.ENABLED:
        yield ""
        return
    server = ShimServer()
    yield str(server.bin_dir) + os.pathsep
    server.close()


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if any(b.lang in RUN and not b.skip for b in blocks(p))],
    ids=_ids,
)
def test_the_page_commands_run_as_written(
    page: Path, tmp_path: Path, docs_cache: Path, shim_path: str
) -> None:
    for tool in DOCS_TOOLS:
        system_binary(tool, installer=".ci/install_docs_tools.sh")
    # The page's commands are typed in the repository's root; what they write lands here.
    for name in ("examples", "tests", "src", "benchmarks", "pyproject.toml"):
        (tmp_path / name).symlink_to(REPO / name)
    ports = {str(p): _free_port() for p in range(8000, 8010)}
    script = page_script(page, ports)
    (tmp_path / "page.sh").write_text(script)
    bindir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": shim_path + bindir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": str(REPO / "src"),
        "NO_COLOR": "1",
        # One thread per process, as hpcml_env gives the other tests: two workers' runs of
        # two processes each on 2 cores otherwise spin-wait on each other's cores.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "HPCML_DOCS_CACHE": str(docs_cache),
        "HPCML_DOCS_CACHE_PY": str(Path(__file__).with_name("docs_cache.py")),
    }
    proc = subprocess.run(
        ["bash", "page.sh"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
        start_new_session=True,
    )
    if proc.returncode != 0:
        where = [x for x in proc.stderr.split("\n") if x.startswith("== ")]
        pytest.fail(
            f"{page.relative_to(REPO)}: the commands after {where[-1][3:] if where else '?'} "
            f"exited {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-3000:]}\n"
            f"--- stderr (tail)\n{proc.stderr[-3000:]}"
        )
    missing = unmet_claims(page, proc.stdout)
    assert not missing, "the page shows output its commands did not print:\n" + "\n".join(missing)


def test_shorten_overrides_only_the_short_settings() -> None:
    ports = {"8000": 18000, "8001": 18001}
    script = (
        "hpcml train examples/x.yaml --nproc 2   # two processes\n"
        "hpcml loadtest http://127.0.0.1:8000 --model m --rate 5 --duration 30 --json\n"
        "hpcml serve runs/a --name a --port 8000\n"
        "hpcml plan memory --model llama-7b --devices 64 \\\n    --zero 3\n"
        "hpcml train examples/x.yaml --run-dir runs/b --quiet  # shared\n"
        "  hpcml data prepare pystdlib --out data/p\n"
    )
    assert shorten(script, ports) == (
        "hpcml train examples/x.yaml --nproc 2 train.max_steps=3   # two processes\n"
        "hpcml loadtest http://127.0.0.1:18000 --model m --rate 5 --duration 2 --json\n"
        "hpcml serve runs/a --name a --port 18000 &\n"
        "wait_ready 18000\n"
        "hpcml plan memory --model llama-7b --devices 64 \\\n    --zero 3\n"
        "docs_cached runs/b hpcml train examples/x.yaml --run-dir runs/b --quiet"
        " train.max_steps=3  # shared\n"
        "  docs_cached data/p hpcml data prepare pystdlib --out data/p --max-bytes 1500000\n"
    )


@pytest.mark.parametrize("page", [REPO / "README.md", REPO / "CONTRIBUTING.md"], ids=_ids)
def test_links_of_the_pages_outside_the_site_resolve(page: Path) -> None:
    """README.md and CONTRIBUTING.md are not part of the strict MkDocs build, so their links
    to the docs are checked here: every relative link names a file that exists."""
    text = page.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [x.split("#")[0] for x in links if not re.match(r"^[a-z]+:|#", x)]
    for target in relative:
        assert (page.parent / target).exists(), (
            f"{page.name}: link to {target}, which does not exist"
        )
