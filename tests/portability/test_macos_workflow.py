"""The macOS workflow runs the README's quick start, as written, on an arm64 Mac runner. (It was checked
with actionlint when written; nothing here can run it.) Read as text: no YAML parser is a dependency."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "macos.yml"


def test_the_workflow_runs_the_quick_start_on_an_arm64_mac() -> None:
    text = WORKFLOW.read_text()
    assert re.search(r"^\s+runs-on: macos-15\b", text, re.M)  # GitHub's macOS 15 runner is Apple silicon
    assert re.search(r"uses: actions/setup-python@v\d+\s+id: python\s+with:\s+python-version: \"3\.11\"", text)
    runs = re.findall(r"^\s+run: (.+)$", text, re.M)
    assert runs[0] == "bash scripts/demo.sh" and runs[1].startswith("bash scripts/test.sh")
    quick = (REPO / "README.md").read_text().split("### Quick start")[1].split("\n### ")[0]
    assert "bash scripts/demo.sh" in quick and "bash scripts/test.sh" in quick


def test_the_readme_says_it_exists_and_has_not_run() -> None:
    readme = (REPO / "README.md").read_text()
    assert ".github/workflows/macos.yml" in readme and "has not run yet" in readme
