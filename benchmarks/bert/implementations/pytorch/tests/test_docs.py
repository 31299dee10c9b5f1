"""The documentation holds: every relative link and anchor of every Markdown file resolves,
and every command block a reader may paste is tested.

Each command block (``bash``, ``sh``, ``python``, ... fences; ``text`` shows output) of the
README, ``docs/`` and the root README is claimed by exactly one entry of ``BLOCKS``, keyed
by (page, the heading above it, the start of its first line):

- ``RUN``: this module runs it, with the substitutions its test lists (cheap commands);
- the README's "Quick start on a cluster": tests/test_launchers.py runs every block of that
  section as written (its QUICK_START_CHANGES);
- ``Covered(test, needles, why)``: a block that needs what a test cannot have here as
  written (GPUs, pyxis, a user's paths, minutes of benchmark) is run in its tested form by
  ``test``, which must exist and must name each of ``needles`` (the scripts the block calls).

A new command block without an entry fails, and so does an entry no block matches.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from docblocks import PKG, QUICK_START, ROOT, anchors, command_blocks, section, strip_code

PAGES = [PKG / "README.md", *sorted((PKG / "docs").glob("*.md")), ROOT / "README.md"]
RUN = "run here"


@dataclass(frozen=True)
class Covered:
    test: str  # tests/<file>.py::<function>
    needles: tuple[str, ...]  # what the block calls, each named in that test file
    why: str  # why the block is not run here as written


CPU_DEMO = Covered("tests/conftest.py::trained", ("run_and_time.sh", "config_CPU_1x2.sh"),
                   "make demo is demo.sh: config_CPU_1x2.sh through run_and_time.sh, then the checker; the "
                   "session's trained run is that run (and CI runs make test itself)")
ONE_NODE = Covered("tests/test_launchers.py::test_run_and_time_status_is_the_trainers_under_torchrun",
                   ("run_and_time.sh", "DATADIR", "EVALDIR"), "/data/train and /data/eval stand for your data")
IMAGE = Covered("tests/docker_engine.py::build", ("docker", "build", "FROM_IMAGE_NAME", "ngc_standin.sh"),
                "NGC's base cannot be pulled here: the Dockerfile is built on the stand-in tools/ngc_standin.sh makes")
ONE_NODE_DOCKER = Covered("tests/test_image.py::test_image_trains_the_demo_with_run_with_docker",
                          ("run_with_docker.sh", "CONT", "NEXP"),
                          "a DGX config needs GPUs and NGC's image; the test runs config_CPU_1x2.sh in the stand-in's")
CHECKER = Covered("tests/conftest.py::run_checker", ("compliance_checker", "5.0.0"),
                  "the path is make demo's log; the tests run the same command on every log they write")

BLOCKS: dict[tuple[str, str, str], object] = {
    ("README.md", "Quick start on a CPU", "make demo"): CPU_DEMO,
    ("../../../../README.md", "MLPerf Training BERT in PyTorch", "make demo"): CPU_DEMO,
    ("README.md", "On one node", "source config_CPU_1x2.sh"): ONE_NODE,
    ("docs/cluster.md", "Running", "source config_CPU_1x2.sh"): ONE_NODE,
    ("README.md", "Build the image", "docker build"): IMAGE,
    ("docs/cluster.md", "The container image", "docker build"): IMAGE,
    ("docs/cluster.md", "The container image", "sudo tools/ngc_standin.sh"): IMAGE,
    ("README.md", "Build the image", "source config_DGXA100_1x8x56x1.sh"): ONE_NODE_DOCKER,
    ("docs/cluster.md", "One node with docker: `run_with_docker.sh`", "source config_DGXA100_1x8x56x1.sh"):
        ONE_NODE_DOCKER,
    ("README.md", "Check a log", "python -m mlperf_logging.compliance_checker"): CHECKER,
    ("docs/rules.md", "Checking a log", "python -m mlperf_logging.compliance_checker"): CHECKER,
    ("docs/cluster.md", "Running on a SLURM cluster: `run.sub`", "source config_DGXA100_8x8x48x1.sh"): Covered(
        "tests/test_launchers.py::test_readme_quick_start_on_a_cluster", ("run.sub", "sbatch"),
        "a DGX config needs GPUs and pyxis; the quick start submits run.sub with the CPU config"),
    ("docs/cluster.md", "Launchers", "./run_and_time.sh"): Covered(
        "tests/test_launchers.py::test_mpirun_two_ranks_through_mpi4py", ("run_and_time.sh", "mpirun", "LAUNCHER"),
        "srun runs inside run.sub (the quick start), mpirun and torchrun in tests/test_launchers.py"),
    ("docs/configuration.md", "How a run resolves its settings", "python -m bert.train --config my.yaml"): Covered(
        "tests/test_config.py::test_file_then_overrides", ("build_config", "yaml"),
        "my.yaml is yours, and the defaults train BERT-Large"),
    ("docs/data.md", "Data: from text to training shards, and the phase-1 checkpoint",
     "python -m input_preprocessing <"): RUN,
    ("docs/data.md", "Your own corpus", "TOKENIZERS_PARALLELISM=false flock /tmp/bench.lock python bench/preprocessing.py"):
        RUN,
    ("docs/data.md", "Checking a dataset made elsewhere", "python -m input_preprocessing create --input TEXT_DIR"): RUN,
    ("docs/faults.md", "Preemption, checkpoints and resume", "sbatch --signal=B:USR1@300 --requeue"): Covered(
        "tests/test_launchers.py::test_slurm_usr1_checkpoints_requeues_and_resumes",
        ("--signal=B:USR1", "--requeue", "run.sub"), "a 24-hour BERT-Large job; the test's run is the CPU demo's"),
    ("docs/faults.md", "Preemption, checkpoints and resume", "scancel --batch --signal=USR1 JOB"): Covered(
        "tests/test_launchers.py::test_slurm_usr1_checkpoints_requeues_and_resumes", ("scancel", "--batch"),
        "JOB is your job's id"),
    ("docs/grad_sync.md", "Gradient clipping and synchronisation (`bert/grad_sync.py`)",
     "flock /tmp/bench.lock python bench/grad_sync.py"): Covered(
        "tests/test_bench.py::test_grad_sync_bench_smoke_prints_the_interface_keys", ("grad_sync",),
        "minutes of BERT-base steps on two cores; the test runs it at smoke size"),
    ("docs/pretraining.md", "Pretraining from scratch (outside MLPerf's rules)", "for p in"): Covered(
        "tests/test_pretrain.py::test_pretrain_demo_small_both_phases_and_transformers", ("pretrain_demo.sh",),
        "TEXT and HELD_OUT_TEXT are your corpus; pretrain_demo.sh runs these steps for both phases on docstrings"),
    ("docs/pretraining.md", "Pretraining from scratch (outside MLPerf's rules)", "DATADIR1=..."): Covered(
        "tests/test_pretrain.py::test_submit_pretrain_chains_phases_and_survives_a_preemption",
        ("submit_pretrain.sh",), "the paths are yours, and the configs want 32 GPUs"),
    ("docs/pretraining.md", "The plan before the spend (`tools/plan.py`)", "python tools/plan.py --configs"): RUN,
    ("docs/pretraining.md", "The plan before the spend (`tools/plan.py`)", "python tools/plan.py --recipe"): Covered(
        "tests/test_plan.py::test_throughput_from_a_bench_json", ("throughputs_from_bench",),
        "gpu_bert_large.json comes from a device run"),
    ("docs/published_recipe.md", "The paper's recipe, as published (Kim et al. 2024, open division)",
     "python tools/schedule.py"): RUN,
    ("docs/published_recipe.md", "The paper's recipe, as published (Kim et al. 2024, open division)",
     "import torch"): RUN,
    ("docs/rules.md", "Packaging a submission: `tools/package.py`", "python tools/package.py"): Covered(
        "tests/test_package.py::test_package_ten_cpu_runs_succeeds", ("package.py",),
        "<DATESTAMP> names your runs' logs"),
    ("docs/tuning.md", "Tuning the optimizer: `tools/tune.py`, `tools/tune.sub`", "source config_CPU_1x2.sh"): Covered(
        "tests/test_tune.py::test_study_on_slurm_prunes_tiny_rate_and_picks_a_setting_that_reaches_target",
        ("tune.sub", "worker", "report"), "DATADIR and EVALDIR are yours; the test runs the study on its SLURM cluster"),
    ("docs/study.md", "Running it", "python tools/study.py"): Covered(
        "tests/test_study.py::test_quick_study_stops_continues_and_reports_what_the_logs_say",
        ("tools/study.py", "--quick", "--report-only", "--tune"),
        "the default study takes about 45 minutes of two cores; the test runs the same tool on --quick's plan"),
}


def all_blocks():
    return [b for page in PAGES for b in command_blocks(page)]


def claim(block) -> object:
    """The entry that claims ``block`` (the quick start's blocks are claimed by their section)."""
    if block.page == "README.md" and block.heading == QUICK_START:
        return "quick start"
    hits = [v for (page, head, start), v in BLOCKS.items()
            if page == block.page and head == block.heading and block.first_line.startswith(start)]
    assert len(hits) == 1, (f"{block.page}:{block.line} ({block.heading!r}, {block.first_line!r}): "
                            f"{'no' if not hits else len(hits)} entries of tests/test_docs.py BLOCKS claim it")
    return hits[0]


def run_block(block, subs: dict[str, str]) -> subprocess.CompletedProcess:
    """A bash block with ``subs`` applied (each must occur), run in PKG."""
    text = block.text
    for old, new in subs.items():
        assert old in text, f"{block.page}:{block.line} no longer says {old!r}"
        text = text.replace(old, new)
    return subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=PKG, capture_output=True, text=True,
                          timeout=300)


def the_block(page: str, start: str):
    return next(b for b in all_blocks() if b.page == page and b.first_line.startswith(start))


# ---------------------------------------------------------------- every block is claimed


def test_every_command_block_is_tested():
    claims = [claim(b) for b in all_blocks()]
    assert "quick start" in claims  # the README's quick start is still where test_launchers reads it
    unused = [k for k, v in BLOCKS.items()
              if not any(b.page == k[0] and b.heading == k[1] and b.first_line.startswith(k[2]) for b in all_blocks())]
    assert not unused, f"entries of BLOCKS that no block matches any more: {unused}"


@pytest.mark.parametrize("covered", sorted({v for v in BLOCKS.values() if isinstance(v, Covered)}, key=str),
                         ids=lambda c: c.test.split("::")[1])
def test_covered_blocks_name_a_test_that_runs_their_scripts(covered):
    path, name = covered.test.split("::")
    source = (PKG / path).read_text()
    names = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert name in names, f"{covered.test} does not exist"
    missing = [n for n in covered.needles if n not in source]
    assert not missing, f"{path} no longer names {missing}"


# ---------------------------------------------------------------- the blocks run here


def test_data_steps_block_lists_every_step_and_each_help_works(capsys):
    from input_preprocessing.__main__ import STEPS, main

    block = the_block("docs/data.md", "python -m input_preprocessing <")
    listed = re.search(r"<([a-z|]+)>", block.text).group(1).split("|")
    assert sorted(listed) == sorted(STEPS), f"docs/data.md lists {listed}; the CLI has {sorted(STEPS)}"
    for step in listed:
        with pytest.raises(SystemExit) as e:
            main([step, "--help"])
        assert e.value.code == 0, step
        assert "usage:" in capsys.readouterr().out


def test_preprocessing_bench_block_runs(tmp_path):
    block = the_block("docs/data.md", "TOKENIZERS_PARALLELISM=false")
    r = run_block(block, {"flock /tmp/bench.lock ": "", "--mb 4 --workers 1 2": "--mb 0.05 --part-mb 0.05 "
                          "--vocab-size 300 --dupe-factor 1 --workers 1", "prep_bench.json": str(tmp_path / "p.json")})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "p.json").read_text())
    assert out  # the JSON the block writes


def test_digests_block_runs_and_says_two_layouts_hold_the_same_examples(tmp_path):
    """The block as written, on a small corpus; "theirs" is the same text made in the other
    layout: another file, the same examples."""
    from input_preprocessing.create import CreateOptions, create
    from input_preprocessing.toy_corpus import make_corpus, train_vocab

    parts = make_corpus(tmp_path / "text", parts=2, docs_per_part=20, seed=3)
    vocab = train_vocab(parts, tmp_path / "vocab.txt", size=400)
    small = ["--max-seq-length", "64", "--max-predictions-per-seq", "10", "--dupe-factor", "1"]
    create(tmp_path / "text", vocab, tmp_path / "theirs", CreateOptions(64, 10, dupe_factor=1, layout="variable"))
    block = the_block("docs/data.md", "python -m input_preprocessing create --input TEXT_DIR")
    r = run_block(block, {"TEXT_DIR": str(tmp_path / "text"), "vocab.txt": str(vocab),
                          "--output ours": f"--output {tmp_path / 'ours'} {' '.join(small)}",
                          "--input ours": f"--input {tmp_path / 'ours'} --max-seq-length 64",
                          "THEIRS_DIR": f"{tmp_path / 'theirs'} --max-seq-length 64",
                          "ours.md5": str(tmp_path / "ours.md5"), "theirs.md5": str(tmp_path / "theirs.md5")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the same examples, part for part" in r.stdout
    assert len((tmp_path / "ours.md5").read_text().splitlines()) == 2


def test_plan_block_runs():
    r = run_block(the_block("docs/pretraining.md", "python tools/plan.py --configs"), {})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "phase1" in r.stdout and "phase2" in r.stdout


def test_schedule_block_runs_with_its_options():
    block = the_block("docs/published_recipe.md", "python tools/schedule.py")
    r = run_block(block, {"[--steps N] [--json] [--plot lr.png] [--set PRECISION=fp16]": "--steps 3 --json"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(json.loads(r.stdout)["lr"]) == 3


def test_ring_sum_snippet_prints_the_table_it_stands_under():
    """The published recipe's precision snippet, run as written; its numbers are the table's
    (to the two digits shown)."""
    block = the_block("docs/published_recipe.md", "import torch")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.text, "published_recipe.md", "exec"), {})
    printed = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out.getvalue().splitlines()}
    table = section(PKG / "docs" / "published_recipe.md", "The paper's recipe, as published (Kim et al. 2024, open division)")
    for row in re.findall(r"^\| (fp32|fp16|bf16) \| ([\d.e-]+) \| ([\d.e-]+) \|$", table, re.M):
        got = printed[f"torch.{ {'fp32': 'float32', 'fp16': 'float16', 'bf16': 'bfloat16'}[row[0]]}"]
        for want, value in zip(row[1:], got):
            assert f"{value:.1e}" == f"{float(want):.1e}", (row, got)


# ---------------------------------------------------------------- links


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tracked = [ROOT / p for p in out.split()]
    return sorted(set(tracked) | set(PAGES))  # pages not yet committed count too


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_and_anchor_resolves():
    dead = []
    for md in markdown_files():
        text = strip_code(md.read_text())
        text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                dead.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{where}: no heading with anchor #{anchor}")
    assert not dead, "\n".join(dead)


def test_the_link_check_sees_dead_links_and_anchors(tmp_path, monkeypatch):
    page = tmp_path / "a.md"
    page.write_text("# A\n\n## Two words\n\n[ok](#two-words) [bad](#none) [gone](b.md) `[code](x.md)`\n")
    assert anchors(page) == {"a", "two-words"}
    monkeypatch.setattr(sys.modules[__name__], "markdown_files", lambda: [page])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as e:
        test_every_relative_link_and_anchor_resolves()
    assert "#none" in str(e.value) and "b.md" in str(e.value) and "x.md" not in str(e.value)
    assert "#two-words" not in str(e.value)
