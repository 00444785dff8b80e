"""The docs a newcomer reads (issue 40): generated pages are not stale, and the README stays short.

Each page under docs/ that scripts/gen-docs writes is regenerated into a temporary folder and compared with the
committed one; a difference names the page and the command that rewrites it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("cli.md", "spec.md", "spec.schema.json", "exit-codes.md", "modules.md")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-docs"), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("page", GENERATED)
def test_a_generated_page_matches_what_its_tool_writes_now(regenerated, page):
    committed = ROOT / "docs" / page
    assert committed.exists(), f"docs/{page} is missing: run scripts/gen-docs and commit it"
    assert (regenerated / page).read_text() == committed.read_text(), (
        f"docs/{page} is stale (the code it is generated from changed): run scripts/gen-docs and commit docs/{page}")


def test_gen_docs_writes_exactly_the_pages_this_test_checks(regenerated):
    assert sorted(p.name for p in regenerated.iterdir()) == sorted(GENERATED)


def test_the_cli_reference_lists_every_command_of_the_typer_app(regenerated):
    from typer.main import get_command

    from pdctl.console.cli import app

    text = (regenerated / "cli.md").read_text()
    for name in get_command(app).commands:  # type: ignore[attr-defined]
        assert f"## `pdctl {name}`" in text, name


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert first_block and text.index("```sh") < text.index("\n## "), "the two commands come first"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["./scripts/demo", "./scripts/test"], commands
    assert len(text.split()) <= 1200, f"README.md has {len(text.split())} words; move detail to docs/"


def test_every_doc_the_readme_links_exists():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links, "the README says where to read on"
    assert [link for link in links if not (ROOT / link).exists()] == []
