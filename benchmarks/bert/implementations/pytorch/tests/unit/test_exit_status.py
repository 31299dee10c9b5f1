"""The exit statuses live in one enum (bert/exit_status.py); everything that names them is
checked against it: the README's table, ``--help``, the launchers' headers and the codes
run.sub acts on, the launcher doc's summary."""

from __future__ import annotations

import re

from bert.exit_status import ExitStatus, describe, markdown_table
from bert.train import main
from conftest import PKG

VALUES = {int(s) for s in ExitStatus}


def _numbers(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\b(\d+) [a-zA-Z]", text)}


def test_readme_table_is_the_enum():
    assert markdown_table() in (PKG / "README.md").read_text()


def test_help_lists_every_status(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert describe() in out
    for s in ExitStatus:
        assert re.search(rf"^ +{s.value}  {re.escape(s.meaning)}$", out, re.M), s


def test_launcher_headers_and_docs_name_every_status():
    header = (PKG / "run_and_time.sh").read_text().split("\n\n")[0]
    (summary,) = re.findall(r"# Exit status: the trainer's own \((.*?)\), under torchrun", header, re.S)
    assert _numbers(summary) == VALUES, summary
    cluster = (PKG / "docs" / "cluster.md").read_text()
    (summary,) = re.findall(r"Its exit status is the worst run's: the run's training exit \((.*?); the\s",
                            cluster, re.S)
    assert _numbers(summary) == VALUES, summary


def test_run_sub_acts_on_enum_statuses():
    text = (PKG / "run.sub").read_text()
    tested = {int(n) for n in re.findall(r"\(\( rc == (\d+) \)\)", text)}
    assert tested == {ExitStatus.PREEMPTED, ExitStatus.INTERRUPTED}
    (failing,) = re.findall(r"A run that fails \((.*?)\) counts as failed", text, re.S)
    assert _numbers(failing) | {ExitStatus.SUCCESS} | tested == VALUES, failing
    assert "exit 3\n" in text and "exit 130\n" in text  # what a requeue-less stop passes on
