"""`make audit`: a CycloneDX SBOM of the installed environment, and its known vulnerabilities.

Writes build/sbom.cdx.json (cyclonedx-py, every package installed in the interpreter running
this script) and build/pip-audit.json (pip-audit against PyPI's advisory data, the project
itself skipped: it is not on PyPI). Exit 1 when a package has a known vulnerability. Where the
vulnerability service cannot be reached (no network), one line says so and the exit code is 0:
CI never fails for lack of network. HPCML_AUDIT_SERVICE names another URL to probe first (a
mirror; the tests point it at a closed port).

cyclonedx-py runs with --no-validate: its self-check of the document it wrote parses every
IRI in it with a general Earley grammar (rfc3987-syntax), 93% of a 36 s SBOM of this
environment (cProfile); without it the SBOM takes ~3 s. What the document holds is checked by
tests/unit/test_make_audit.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

SERVICE = os.environ.get("HPCML_AUDIT_SERVICE", "https://pypi.org/pypi/pip/json")
OUT = Path(os.environ.get("HPCML_AUDIT_OUT", "build"))


def unreachable(url: str) -> str | None:
    """Why `url` cannot be fetched now, or None when it can."""
    try:
        with urllib.request.urlopen(url, timeout=15) as response:
            response.read(1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))
    return None


def sbom(out: Path) -> Path:
    target = out / "sbom.cdx.json"
    subprocess.run(
        [sys.executable, "-m", "cyclonedx_py", "environment", "--output-format", "JSON",
         "--no-validate", "--output-file", str(target), sys.executable],
        check=True,
    )  # fmt: skip
    return target


def audit(out: Path) -> int:
    report = out / "pip-audit.json"
    report.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip_audit", "--skip-editable", "--progress-spinner", "off",
         "--format", "json", "--output", str(report)],
        capture_output=True, text=True,
    )  # fmt: skip
    if not report.is_file():
        why = unreachable(SERVICE)
        if why is not None:  # the service went away during the audit
            print(f"make audit: the vulnerability service went unreachable ({why}); not checked.")
            return 0
        sys.stderr.write(proc.stderr[-3000:])
        print(f"make audit: pip-audit failed (exit {proc.returncode}); see its output above.")
        return proc.returncode or 1
    found = [
        (dep["name"], dep["version"], vuln["id"], ", ".join(vuln.get("fix_versions") or []) or "-")
        for dep in json.loads(report.read_text()).get("dependencies", [])
        for vuln in dep.get("vulns", [])
    ]
    for name, version, vid, fixes in found:
        print(f"  {name} {version}: {vid} (fixed in {fixes})")
    print(f"make audit: {len(found)} known vulnerabilities; report in {report}.")
    return 1 if found else 0


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"make audit: SBOM in {sbom(OUT)}.")
    why = unreachable(SERVICE)
    if why is not None:
        print(
            f"make audit: the vulnerability service {SERVICE} is unreachable ({why}); "
            "vulnerabilities were not checked (exit 0: no network is not a failure)."
        )
        return 0
    return audit(OUT)


if __name__ == "__main__":
    sys.exit(main())
