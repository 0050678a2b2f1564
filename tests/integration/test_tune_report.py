"""`hpcml tune --report`'s page in headless chromium: every plot on it is decoded at its
size, and loading it logs no console message. The study is made in memory
(tests/unit/test_tune_space.py), so no trial trains."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from tests.conftest import system_binary
from tests.unit.test_tune_space import _study_with

from hpcml.tune.report import PLOTS, summary, write_report

# Added to a copy of the page (beside it, so the plots' relative paths resolve): once the page
# has loaded, the size chromium decoded each image at goes into the DOM that --dump-dom prints.
PROBE = """<script>
window.addEventListener("load", () => {
  const sizes = [...document.images].map(i => [i.getAttribute("src"), i.naturalWidth, i.naturalHeight]);
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(sizes);
  document.body.appendChild(out);
});
</script>"""


def test_the_report_page_renders_each_plot_in_headless_chromium(tmp_path: Path) -> None:
    browser = system_binary("chromium", "chromium-browser", installer=".ci/install_chromium.sh")
    study = _study_with(3, True)
    page = write_report(study, tmp_path / "report", summary(study, "memory"))  # type: ignore[arg-type]
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text() + PROBE)
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
         "--enable-logging=stderr", "--v=0", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    found = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert found, proc.stdout[-2000:]
    sizes = {src: (w, h) for src, w, h in json.loads(found.group(1))}
    assert sorted(sizes) == sorted(f"{name}.png" for name in PLOTS)
    for src, (w, h) in sizes.items():  # a missing or corrupt PNG decodes as 0 x 0
        assert w > 100 and h > 100, (src, w, h)
