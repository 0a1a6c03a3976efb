"""Every command's --help (issue 75): each option says what it does and its default, each command ends with an
example and its exit statuses, an option name means one thing across channelsmith and torch_dist_check, and
the old spellings of renamed options still work and warn.

In-process (the parsers, and `main(... --help)` with its output captured): no interpreter per command."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from channelsmith import cli as channelsmith_cli
from channelsmith.cli import _help
from channelsmith.errors import DeployError
from torch_dist_check import cli as suite_cli
from torch_dist_check.harness.launch import SPAWNED_ENV
from torch_dist_check.peerloss import cases as peerloss

import gen_reference as GEN  # scripts/gen_reference.py, on the path with the package's other modules

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = GEN.parsers()
COMMAND_IDS = [name for name, _ in COMMANDS]
# The first words of each command's examples: the command as a user types it.
RUN_AS = {"channelsmith": "channelsmith", "python -m torch_dist_check": "python -m torch_dist_check"}


def documented(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in GEN.options(parser) if not isinstance(a, argparse._HelpAction) and a.dest != "help"]


def test_the_generator_finds_every_command_users_run():
    assert {"channelsmith", "channelsmith verify", "channelsmith patches port", "python -m torch_dist_check",
            "python -m torch_dist_check.tables net"} <= set(COMMAND_IDS)  # fmt: skip
    assert {f"channelsmith {name}" for name in channelsmith_cli.COMMAND_MODULES} <= set(COMMAND_IDS)


@pytest.mark.parametrize("name,parser", COMMANDS, ids=COMMAND_IDS)
def test_each_command_ends_with_an_example_and_its_exit_statuses(name, parser):
    epilog = parser.epilog or ""
    assert "examples:" in epilog and "exit status:" in epilog, f"{name}: no examples or exit statuses"
    examples = epilog.split("examples:", 1)[1].split("exit status:", 1)[0]
    lines = [line.strip() for line in examples.strip().splitlines()]
    assert lines, f"{name}: no example"
    top = name.split(" ", 3)[0] if name.startswith("channelsmith") else " ".join(name.split(" ")[:3])
    assert all(top in line for line in lines), (name, lines)
    codes = [int(m) for m in re.findall(r"^  (\d+) ", epilog.split("exit status:", 1)[1], re.MULTILINE)]
    assert codes and codes[0] == 0 and codes == sorted(set(codes)), (name, codes)


def example_commands(epilog: str) -> list[list[str]]:
    """Each command of each example line, as words, up to a redirection."""
    examples = epilog.split("examples:", 1)[1].split("exit status:", 1)[0]
    commands = []
    for line in examples.strip().splitlines():
        for command in line.split("&&"):
            words = shlex.split(command)
            commands.append(words[: words.index(">")] if ">" in words else words)
    return commands


@pytest.mark.parametrize("name,parser", COMMANDS, ids=COMMAND_IDS)
def test_each_example_parses_as_its_command(name, parser):
    from torch_dist_check.report.tables import parser as tables_parser

    for words in example_commands(parser.epilog):
        if words[0] == "channelsmith":
            channelsmith_cli.build_parser().parse_args(words[1:])
            continue
        module = words.index("-m") + 1  # after a launcher (srun -n 8 python -m ...)
        make = tables_parser if words[module] == "torch_dist_check.tables" else suite_cli.build_parser
        assert words[module] in ("torch_dist_check", "torch_dist_check.tables"), words
        make().parse_args(words[module + 1 :])


@pytest.mark.parametrize("name,parser", COMMANDS, ids=COMMAND_IDS)
def test_every_option_says_what_it_does_and_its_default(name, parser):
    undocumented = [a.option_strings or [a.dest] for a in documented(parser) if not (a.help or "").strip()]
    assert undocumented == [], f"{name}: options without help: {undocumented}"
    # An option that takes a value says what happens without it: its default, or that it is required.
    silent = [
        a.option_strings or [a.metavar or a.dest]
        for a in documented(parser)
        if a.nargs != 0 and not re.search(r"default|required|at least one", a.help, re.IGNORECASE)
    ]
    assert silent == [], f"{name}: options whose help gives no default: {silent}"


def test_the_suite_options_the_issue_named_have_help_and_the_init_timeout_its_default():
    parser = suite_cli.build_parser()
    helps = {flag: a.help for a in parser._actions for flag in a.option_strings}
    for flag in ("--collectives", "--fault-ops", "--fault-init-timeout", "--peerloss-ops"):
        assert helps[flag], flag
    formatter = parser._get_formatter()
    init = next(a for a in parser._actions if "--fault-init-timeout" in a.option_strings)
    assert "(default 120)" in formatter._expand_help(init)


def test_the_peerloss_goals_help_explains_each_goal_with_the_judges_figures():
    text = suite_cli.goals_help()
    for mark in ("(a)", "(b)", "(c)", "(d)", "(e)", "(f)"):
        assert mark in text
    assert f"(a) the survivor's exception, <= {peerloss.GOALS['exception_s']:g}" in text
    assert f"<= {peerloss.GOALS['shrunk_group_s']:g}" in text
    assert f"{peerloss.TRAIN_GOALS['train-fresh']:g} (train-fresh)" in text


def test_help_prints_examples_and_exit_statuses_for_each_channelsmith_command(capsys):
    for name, _ in COMMANDS:
        if not name.startswith("channelsmith"):
            continue
        with pytest.raises(SystemExit) as done:
            channelsmith_cli.main([*name.split()[1:], "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: {name}") and "\nexamples:\n" in out and "\nexit status:\n  0 " in out, name


def test_the_suite_help_is_short_and_the_full_list_one_flag_away(capsys):
    with pytest.raises(SystemExit) as done:
        suite_cli.main(["--help"])
    assert done.value.code == 0
    brief = capsys.readouterr().out
    with pytest.raises(SystemExit):
        suite_cli.main(["--help-all"])
    full = capsys.readouterr().out
    assert "--help-all" in brief and "--nproc" in brief and "exit status:" in brief
    assert "--peerloss-goals" not in brief and "--peerloss-goals" in full and "--fault-init-timeout" in full
    assert len(brief.splitlines()) <= 80 < len(full.splitlines())
    # Every option still parses after the brief help's parser hid most of them.
    assert suite_cli.build_parser().parse_args(["--peerloss-runs", "3"]).peerloss_runs == 3


def test_help_names_only_docs_that_exist():
    named = set()
    for _, parser in COMMANDS:
        texts = [parser.description or "", parser.epilog or "", *(a.help or "" for a in parser._actions)]
        for text in texts:
            named |= set(re.findall(r"docs/[\w./-]+\.md", text))
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert missing == [], f"--help names docs that do not exist: {missing}"


def test_timeout_means_the_whole_suite_in_verify_and_the_suite_calls_its_own_limit_stage_timeout():
    verify = next(p for n, p in COMMANDS if n == "channelsmith verify")
    timeout = next(a for a in verify._actions if "--timeout" in a.option_strings)
    assert timeout.default == 3600 and "whole suite" in timeout.help
    stage = next(a for a in suite_cli.build_parser()._actions if "--stage-timeout" in a.option_strings)
    assert stage.default == 900 and "stage" in stage.help


def test_the_suite_old_timeout_still_sets_the_stage_limit_and_warns(capsys, monkeypatch):
    monkeypatch.delenv(SPAWNED_ENV, raising=False)
    args = suite_cli.build_parser().parse_args(["--timeout", "42"])
    assert args.stage_timeout == 42
    assert "--timeout is deprecated and will be removed; use --stage-timeout" in capsys.readouterr().err
    # A rank the launcher started parses the same options again: the launcher warned once already.
    monkeypatch.setenv(SPAWNED_ENV, "1")
    assert suite_cli.build_parser().parse_args(["--timeout", "7"]).stage_timeout == 7
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as done:
        suite_cli.build_parser().parse_args(["--timeout", "0"])
    assert done.value.code == 2


def test_the_suite_json_alone_means_stdout_as_in_channelsmith_and_a_file_still_works(capsys):
    parser = suite_cli.build_parser()
    assert parser.parse_args(["--json"]).json == "-"
    assert parser.parse_args(["--json", "--quick"]).json == "-"
    assert parser.parse_args(["--json", "report.json"]).json == "report.json"
    assert parser.parse_args([]).json is None
    assert capsys.readouterr().err == ""  # not deprecated: channelsmith verify passes --json FILE


def test_patches_old_cache_spelling_still_works_and_warns(capsys, tmp_path):
    parser = channelsmith_cli.build_parser()
    for action in ("check", "port", "compile-check"):
        extra = ["pytorch/nccl-fault", "--from", "2.6.0", "--to", "2.7.1"] if action == "port" else []
        new = parser.parse_args(["patches", action, *extra, "--cache-dir", str(tmp_path)])
        assert capsys.readouterr().err == ""
        old = parser.parse_args(["patches", action, *extra, "--cache", str(tmp_path)])
        assert old.cache == new.cache == str(tmp_path)
        err = capsys.readouterr().err
        assert "--cache is deprecated and will be removed; use --cache-dir" in err, err
    assert GEN.deprecated(next(p for n, p in COMMANDS if n == "channelsmith patches check")) == [("--cache", "--cache-dir")]


def test_cache_dir_is_channelsmiths_cache_in_pack_too(monkeypatch, tmp_path):
    # pack keeps its packages in DIR/packages of the cache every command shares (patches keeps sources in it).
    seen = []

    def fake_pack(lock, output, **kwargs):
        seen.append(kwargs["cache_dir"])
        raise DeployError("stop here", hint="")

    monkeypatch.setattr("channelsmith.cli.pack.pack", fake_pack)
    assert channelsmith_cli.main(["pack", "--lock", str(tmp_path / "x.lock"), "--cache-dir", str(tmp_path / "c")]) == 2
    monkeypatch.setenv("CHANNELSMITH_CACHE", str(tmp_path / "env-cache"))
    assert channelsmith_cli.main(["pack", "--lock", str(tmp_path / "x.lock")]) == 2
    assert seen == [(tmp_path / "c" / "packages").resolve(), (tmp_path / "env-cache" / "packages").resolve()]


def test_an_epilog_keeps_its_lines_and_wraps_a_long_status_under_its_meaning():
    text = _help.epilog(["tool run --fast"], [(0, "done"), (2, "word " * 30)])
    lines = text.splitlines()
    assert lines[:2] == ["examples:", "  tool run --fast"]
    assert lines[4] == "  0    done"
    assert all(len(line) <= 79 for line in lines) and lines[6].startswith("       word")
    formatter = _help.HelpFormatter(prog="tool", width=40)
    assert formatter._fill_text(text, 40, "") == text
