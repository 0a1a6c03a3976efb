"""The generated references (issue 75) are what the code gives now: docs/reference/cli.md from the parsers,
docs/reference/packages.md from `channelsmith plan --json`. A change to an option or a recipe that leaves them
stale fails here with the command that rewrites them."""

from __future__ import annotations

from pathlib import Path

import gen_reference as GEN  # scripts/gen_reference.py, on the path with the package's other modules

ROOT = Path(__file__).resolve().parents[1]


def assert_current(path: Path, text: str) -> None:
    committed = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
    if committed != text:
        changed = [n + 1 for n, (a, b) in enumerate(zip(committed.splitlines(), text.splitlines())) if a != b][:5]
        raise AssertionError(
            f"{path} is not what the code gives now (first differing lines: {changed or 'its length'}): "
            f"run {GEN.COMMAND} and commit the result"
        )


def test_the_cli_reference_is_generated_from_the_parsers_and_current():
    text = GEN.cli_reference()
    assert_current(GEN.CLI_MD, text)
    # Every option of every command is in it, with its default where it has one.
    for name, parser in GEN.parsers():
        assert f"## `{name}`" in text
        for action in GEN.options(parser):
            assert GEN._spelling(action) in text, (name, action.option_strings)
    assert "| `--stage-timeout SECONDS` | `900` |" in text
    assert "Deprecated spellings, still accepted with a warning on stderr: `--cache` (use `--cache-dir`)" in text


def test_the_cli_reference_does_not_depend_on_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = GEN.cli_reference()
    monkeypatch.setenv("COLUMNS", "250")
    assert GEN.cli_reference() == narrow


def test_the_packages_reference_is_generated_from_plan_json_and_current():
    text = GEN.packages_reference(ROOT)
    assert_current(GEN.PACKAGES_MD, text)
    for package in ("libtorch", "pytorch-gpu", "pytorch-nccl-fault", "site-env-derecho", "torch-peer-watcher"):
        assert f"| `{package}` |" in text


def test_check_names_a_missing_or_stale_reference(tmp_path):
    texts = {GEN.CLI_MD: GEN.cli_reference()}
    assert GEN.stale(tmp_path, texts) == [GEN.CLI_MD]
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / GEN.CLI_MD).write_text("old\n")
    assert GEN.stale(tmp_path, texts) == [GEN.CLI_MD]
    (tmp_path / GEN.CLI_MD).write_text(texts[GEN.CLI_MD])
    assert GEN.stale(tmp_path, texts) == []
