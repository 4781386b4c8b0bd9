"""The `ragserve` command as users run it: a real subprocess."""

import re
import subprocess
import sys

from ragserve import __version__


def ragserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ragserve.cli", *args], capture_output=True, text=True)


def test_help_lists_every_subcommand_and_all_are_available_here():
    from ragserve.cli import SUBCOMMANDS

    out = ragserve("--help")
    assert out.returncode == 0
    assert re.findall(r"^    (\S+)", out.stdout, re.M) == list(SUBCOMMANDS)
    assert "unavailable" not in out.stdout  # every component is installed in the dev tree


def test_a_subcommand_that_cannot_load_is_listed_and_fails_clearly(monkeypatch, tmp_path, capsys):
    from ragserve import cli

    (tmp_path / "ragserve_broken_cli.py").write_text("import no_such_dependency_15\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", ("ragserve_ghost.cli", "a component not installed"))
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", ("ragserve_broken_cli", "a component whose import fails"))
    help_text = " ".join(cli.build_parser().format_help().split())
    assert "ghost a component not installed [unavailable: not installed (pip install ragserve-ghost)]" in help_text
    assert "broken a component whose import fails [unavailable: ragserve_broken_cli fails to import" in help_text
    assert cli.main(["broken", "--port", "1"]) == 2
    assert "no_such_dependency_15" in capsys.readouterr().err


def test_version():
    out = ragserve("--version")
    assert out.returncode == 0 and __version__ in out.stdout


def test_bad_flag_exits_nonzero_with_message():
    out = ragserve("--no-such-flag")
    assert out.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in out.stderr


def test_no_subcommand_prints_help_and_fails():
    out = ragserve()
    assert out.returncode != 0 and "usage:" in out.stdout


def test_info_reads_default_model_metadata():
    out = ragserve("info", "--json")
    assert out.returncode == 0, out.stderr
    assert '"num_layers": 30' in out.stdout and '"num_kv_heads": 3' in out.stdout


def test_unknown_model_is_a_clear_error():
    out = ragserve("info", "--model", "no-such-model")
    assert out.returncode == 2
    assert "unknown model 'no-such-model'" in out.stderr and "Traceback" not in out.stderr


def test_boolean_flags_read_false_from_the_environment(monkeypatch):
    from ragserve.cli import build_parser

    monkeypatch.setenv("RAGSERVE_ENABLE_PREFIX_CACHING", "false")
    assert build_parser().parse_args(["generate"]).enable_prefix_caching is False
    monkeypatch.setenv("RAGSERVE_ENABLE_PREFIX_CACHING", "yes")
    assert build_parser().parse_args(["generate"]).enable_prefix_caching is True
