"""The ``longshield-fx`` program: flags, help, and its two entry points.

- bad flags give one line on stderr, no traceback, a non-zero exit, and write nothing;
- every flag of every subcommand prints its actual default in ``--help`` (and the check that
  says so rejects a flag that does not);
- the console script and ``python -m longshield_fx`` are the same program.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from cli_runs import PYTHON_M, run_cli
from longshield_fx import cli
from longshield_fx.cli.common import Formatter, Parser


@pytest.mark.parametrize("argv, says", [
    (["train", "--steps", "-3"], "--steps: must be > 0"),
    (["train", "--steps", "0"], "--steps: must be > 0"),
    (["train", "-T", "100", "--cp", "3"], "not a multiple of 2*cp = 6"),
    (["inspect", "-T", "30", "--cp", "2"], "not a multiple of 2*cp = 4"),
    (["train", "--clipping", "bogus"], "invalid choice: 'bogus'"),
    (["train", "--checkpoint", "everything"], "invalid choice: 'everything'"),
    (["train", "--hf-config", "no/such/config.json"], "--hf-config: no such file"),
    (["train", "--model", "huge"], "--model huge: neither a reference model name (tiny, small"),
    (["train", "--lora", "4"], "--lora adapts Hugging Face models: pass --model DIR or --hf-config"),
    (["train", "--eval-fraction", "0.1"], "--eval-data/--eval-fraction need --data"),
    (["train", "--data", "no/such/dir"], "no such file or directory: no/such/dir"),
    (["train", "--model", "tiny", "--hf-config", "x.json"], "--hf-config: no such file"),
    (["train", "--cp", "2", "-T", "64"], "needs 2 processes: torchrun"),
    (["train", "--resume", "no/such/run"], "--resume: no such directory"),
    (["train", "--sigma", "-1"], "--sigma: must be >= 0"),
    (["train", "--sigma", "1", "--target-epsilon", "3"], "not allowed with argument"),
    (["audit", "--canaries", "0"], "--canaries: must be > 0"),
    (["audit", "--canaries", "1", "-T", "32", "--max-files", "20"], "--canaries 1: even all-correct guesses"),
    (["audit", "--kind", "grey"], "invalid choice: 'grey'"),
    (["audit", "--confidence", "1.5"], "--confidence: must be in (0, 1)"),
    (["audit", "--resume", "runs/train"], "audit: error: unrecognized arguments: --resume runs/train (see longshield-fx audit --help)"),
    (["train", "--bogus"], "train: error: unrecognized arguments: --bogus (see longshield-fx train --help)"),
    (["audit", "--cp", "2", "-T", "64"], "audit runs in one process"),
    (["train", "-T", "1"], "--seq-len must be >= 2"),
    (["inspect", "--timeline", "TPU"], "invalid choice: 'TPU'"),
])
def test_bad_flags_exit_nonzero_with_one_line(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert says in err and err.startswith("longshield-fx"), err
    assert not (tmp_path / "runs").exists()  # nothing written


def test_hf_config_without_transformers_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "llama.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert cli.main(["train", "--hf-config", str(tmp_path / "llama.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "longshield-fx train: error: --hf-config needs the transformers package: pip install transformers"


# --- every flag's help prints its default ---------------------------------------------------------

def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)  # help text is re-wrapped: compare without whitespace


def undocumented_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """Flags whose printed help does not show their actual default: "(default: X)" with X the
    parser's default, or, for a default of None (computed or unset), "(default: <words>)"."""
    printed = _squeeze(parser.format_help())
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if action.default == argparse.SUPPRESS:  # --help
            continue
        text = formatter._expand_help(action) if action.help else ""
        shows_value = f"(default: {action.default})" in text
        explains_none = action.default is None and re.search(r"\(default: [^)\s][^)]*\)", text)
        if not (shows_value or explains_none) or _squeeze(text) not in printed:
            missing.append(f"{'/'.join(action.option_strings) or action.dest}: {text!r}")
    return missing


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_the_default_check_rejects_a_flag_that_hides_its_default():
    """The check can fail: the old ``%(default).0s`` trick (prints nothing), a help without a
    default, and a default that the help misstates are all reported."""
    bad = Parser(prog="x", formatter_class=argparse.HelpFormatter)
    bad.add_argument("--a", type=int, default=3, help="hides it%(default).0s")
    bad.add_argument("--b", type=int, default=4, help="says nothing")
    bad.add_argument("--c", type=int, default=5, help="lies (default: 6)")
    bad.add_argument("--d", default=None, help="unset, unexplained")
    assert [m.split(":")[0] for m in undocumented_defaults(bad)] == ["--a", "--b", "--c", "--d"]
    good = Parser(prog="x", formatter_class=Formatter)
    good.add_argument("--a", type=int, default=3, help="a number")
    good.add_argument("--d", default=None, help="computed (default: from --a)")
    assert undocumented_defaults(good) == []


def test_every_flag_of_every_subcommand_prints_its_default(capsys):
    subs = subparsers(cli.build_parser())
    assert set(subs) == {"train", "audit", "inspect", "plan"}
    for name, sub in subs.items():
        assert undocumented_defaults(sub) == [], name
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        out = _squeeze(capsys.readouterr().out)
        assert "(default:50)" in out if name == "train" else "(default:" in out  # --steps' default, printed


def test_python_m_and_the_console_script_are_one_program(tmp_path, capsys):
    """The console script is a required install (``pip install -e .``): its absence fails."""
    script = Path(sys.executable).with_name("longshield-fx")
    assert script.exists(), "pip install -e . installs the longshield-fx console script next to python"
    for launcher, argv in ((PYTHON_M, ["train", "-T", "30", "--cp", "2"]), ([str(script)], ["train", "--steps", "-1"])):
        res = run_cli(*argv, cwd=tmp_path, launcher=launcher)
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.startswith("longshield-fx train: error: ")
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: longshield-fx [-h] {train,audit,inspect,plan}")
