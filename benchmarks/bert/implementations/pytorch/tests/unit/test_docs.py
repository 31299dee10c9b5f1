"""The documentation holds: every relative link and anchor of every Markdown file resolves,
and every command block a reader may paste is tested.

Each command block (``bash``, ``sh``, ``python``, ... fences; ``text`` shows output) of the
README, ``docs/`` and the root README is claimed by exactly one entry of ``BLOCKS``, keyed
by (page, the heading above it, the start of its first line):

- ``RUN``: this module runs it, with the substitutions its test lists (cheap commands);
- the README's "Quick start on a cluster": tests/integration/test_launchers.py runs every block of that
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
import re
from dataclasses import dataclass

import pytest

from docblocks import PKG, QUICK_START, section
from docs_helpers import all_blocks, the_block


RUN = "run here"


@dataclass(frozen=True)
class Covered:
    test: str  # tests/<file>.py::<function>
    needles: tuple[str, ...]  # what the block calls, each named in that test file
    why: str  # why the block is not run here as written


CPU_DEMO = Covered("tests/conftest.py::trained", ("run_and_time.sh", "config_CPU_1x2.sh"),
                   "make demo is demo.sh: config_CPU_1x2.sh through run_and_time.sh, then the checker; the "
                   "session's trained run is that run (and CI runs make test itself)")


ONE_NODE = Covered("tests/integration/test_launchers.py::test_run_and_time_status_is_the_trainers_under_torchrun",
                   ("run_and_time.sh", "DATADIR", "EVALDIR"), "/data/train and /data/eval stand for your data")


IMAGE = Covered("tests/support/docker_engine.py::build", ("docker", "build", "FROM_IMAGE_NAME", "ngc_standin.sh"),
                "NGC's base cannot be pulled here: the Dockerfile is built on the stand-in tools/ngc_standin.sh makes")


ONE_NODE_DOCKER = Covered("tests/integration/test_image.py::test_image_trains_the_demo_with_run_with_docker",
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
        "tests/integration/test_launchers.py::test_readme_quick_start_on_a_cluster", ("run.sub", "sbatch"),
        "a DGX config needs GPUs and pyxis; the quick start submits run.sub with the CPU config"),
    ("docs/cluster.md", "On another node count: resubmitted or requeued", "source config_DGXA100_8x8x48x1.sh"): Covered(
        "tests/integration/test_two_nodes.py::test_two_nodes_submit_pretrain_resubmitted_on_more_nodes_continues",
        ("run.sub", "sbatch", "submit_pretrain.sh", "NODES", "DGXNNODES"),
        "a DGX config needs GPUs and pyxis, the paths are yours: the test continues a run.sub job requeued from 2 "
        "nodes on 1, and submit_pretrain.sh's phase 1 from 1 node on NODES=2, on its two-node cluster"),
    ("docs/cluster.md", "Launchers", "./run_and_time.sh"): Covered(
        "tests/integration/test_launchers.py::test_mpirun_two_ranks_through_mpi4py", ("run_and_time.sh", "mpirun", "LAUNCHER"),
        "srun runs inside run.sub (the quick start), mpirun and torchrun in tests/integration/test_launchers.py"),
    ("docs/configuration.md", "How a run resolves its settings", "python -m bert.train --config my.yaml"): Covered(
        "tests/unit/test_config.py::test_file_then_overrides", ("build_config", "yaml"),
        "my.yaml is yours, and the defaults train BERT-Large"),
    ("docs/data.md", "Data: from text to training shards, and the phase-1 checkpoint",
     "python -m input_preprocessing <"): RUN,
    ("docs/data.md", "Your own corpus", "TOKENIZERS_PARALLELISM=false flock /tmp/bench.lock python bench/preprocessing.py"):
        RUN,
    ("docs/data.md", "Checking a dataset made elsewhere", "python -m input_preprocessing create --input TEXT_DIR"): RUN,
    ("docs/faults.md", "Preemption, checkpoints and resume", "sbatch --signal=B:USR1@300 --requeue"): Covered(
        "tests/integration/test_launchers.py::test_slurm_usr1_checkpoints_requeues_and_resumes",
        ("--signal=B:USR1", "--requeue", "run.sub"), "a 24-hour BERT-Large job; the test's run is the CPU demo's"),
    ("docs/faults.md", "Preemption, checkpoints and resume", "scancel --batch --signal=USR1 JOB"): Covered(
        "tests/integration/test_launchers.py::test_slurm_usr1_checkpoints_requeues_and_resumes", ("scancel", "--batch"),
        "JOB is your job's id"),
    ("docs/grad_sync.md", "Gradient clipping and synchronisation (`bert/grad_sync.py`)",
     "flock /tmp/bench.lock python bench/grad_sync.py"): Covered(
        "tests/integration/test_bench.py::test_grad_sync_bench_smoke_prints_the_interface_keys", ("grad_sync",),
        "minutes of BERT-base steps on two cores; the test runs it at smoke size"),
    ("docs/pretraining.md", "Pretraining from scratch (outside MLPerf's rules)", "set -euo pipefail"): RUN,
    ("docs/pretraining.md", "Locally, without SLURM", "set -e"): Covered(
        "tests/integration/test_pretrain.py::test_pretrain_demo_small_both_phases_and_transformers",
        ("pretrain_demo.sh", "config_CPU_1x2_pretrain_phase1.sh", "run_and_time.sh"),
        "vocab.txt and p1/, p2/ are your data; pretrain_demo.sh runs both configs through run_and_time.sh "
        "on its own, smaller"),
    ("docs/pretraining.md", "A downstream task from your own text (`tools/glue.py same-doc`)",
     "python tools/glue.py same-doc"): Covered(
        "tests/integration/test_pretrain.py::test_pretrain_demo_small_both_phases_and_transformers",
        ("pretrain_demo.sh", "SAME-DOC", "same_doc_compare"),
        "HELD_OUT_TEXT and OUTDIR are yours; pretrain_demo.sh makes the task from its set-apart docstrings and "
        "runs this grid, table and compare"),
    ("docs/configuration.md", "One precedence, whichever launcher", "python3 tools/config_env.py show"): RUN,
    ("docs/pretraining.md", "A walkthrough: a few MB of your own text, end to end", "# Man pages as text"): RUN,
    ("docs/cluster.md", "A config for your own cluster", "cat > config_H100_4x8.sh"): RUN,
    ("docs/pretraining.md", "Extending a phase", "source config_CPU_1x2_pretrain_phase1.sh"): Covered(
        "tests/integration/test_checkpoint.py::test_a_finished_run_continued_to_a_later_step_limit",
        ("--resume", "run.max_steps"), "a phase's data and minutes of training: the test continues a tiny run ended "
        "by run.max_steps=6 to 12 with --resume, through python -m bert.train as run_and_time.sh starts it"),
    ("docs/pretraining.md", "On a SLURM cluster", "DATADIR1=..."): Covered(
        "tests/integration/test_two_nodes.py::test_two_nodes_submit_pretrain_resubmitted_on_more_nodes_continues",
        ("submit_pretrain.sh",), "the paths are yours, and the configs want 32 GPUs"),
    ("docs/pretraining.md", "The plan before the spend (`tools/plan.py`)", "python tools/plan.py --configs"): RUN,
    ("docs/pretraining.md", "The plan before the spend (`tools/plan.py`)", "python tools/plan.py --recipe"): Covered(
        "tests/unit/test_plan.py::test_throughput_from_a_bench_json", ("throughputs_from_bench",),
        "gpu_bert_large.json comes from a device run"),
    ("docs/pretraining.md", "From the pretrained model to a GLUE table (`tools/glue.py`)",
     "python -m input_preprocessing checkpoint"): Covered(
        "tests/integration/test_pretrain.py::test_pretrain_demo_small_both_phases_and_transformers", ("pretrain_demo.sh",),
        "OUTDIR is your run's; pretrain_demo.sh exports its phase-2 weights this way, then fine-tunes them"),
    ("docs/pretraining.md", "From the pretrained model to a GLUE table (`tools/glue.py`)", "python tools/glue.py plan"):
        Covered("tests/integration/test_glue.py::test_array_on_slurm_runs_one_run_per_task_and_the_table_follows",
                ("glue.sub", "plan", "table"),
                "GLUE's data and a GPU cluster are yours; the test runs the array over generated tasks on its cluster"),
    ("docs/watching.md", "Turning them on", "TENSORBOARD=1 CONT=<image>"): Covered(
        "tests/integration/test_curves.py::test_two_ranks_resumed_and_the_server_returns_the_curves",
        ("run_and_time.sh", "TENSORBOARD_DIR", "tensorboard", "--logdir", "--host", "127.0.0.1"),
        "the image, your data and a cluster are yours: run.sub's TENSORBOARD=1 sets TENSORBOARD_DIR for "
        "run_and_time.sh, which the test sets on 2 CPU ranks, then serves the folder on a free port"),
    ("docs/watching.md", "Which samples a step took", "python -m bert.trace --config results/result_0_config.json"):
        Covered("tests/integration/test_elastic.py::test_the_step_command_says_what_the_trace_says",
                ("bert.trace", "--config", "--step", "--vocab"),
                "results/ and step 41000 stand for your run; the test runs the command on its runs' resolved configs"),
    ("docs/published_recipe.md", "The paper's recipe, as published (Kim et al. 2024, open division)",
     "python tools/schedule.py"): RUN,
    ("docs/published_recipe.md", "The paper's recipe, as published (Kim et al. 2024, open division)",
     "import torch"): RUN,
    ("docs/rules.md", "Packaging a submission: `tools/package.py`", "python tools/package.py"): Covered(
        "tests/integration/test_package.py::test_package_ten_cpu_runs_succeeds", ("package.py",),
        "<DATESTAMP> names your runs' logs"),
    ("docs/tuning.md", "Tuning the optimizer: `tools/tune.py`, `tools/tune.sub`", "source config_CPU_1x2.sh"): Covered(
        "tests/integration/test_tune.py::test_study_on_slurm_prunes_tiny_rate_and_picks_a_setting_that_reaches_target",
        ("tune.sub", "worker", "report"), "DATADIR and EVALDIR are yours; the test runs the study on its SLURM cluster"),
    ("docs/model.md", "The TensorFlow oracle in the suite (`tests/integration/test_tf_oracle.py`)", "make venv"): Covered(
        "tests/integration/test_tf_oracle.py::oracle", ("tf_oracle.py", "TF_PYTHON", "make venv"),
        "make test runs the test (and needs make venv first); the block is how to run it alone"),
    ("docs/study.md", "Running it", "python tools/study.py"): Covered(
        "tests/integration/test_study.py::test_quick_study_stops_continues_and_reports_what_the_logs_say",
        ("tools/study.py", "--quick", "--report-only", "--tune"),
        "the default study takes about 45 minutes of two cores; the test runs the same tool on --quick's plan"),
}


def claim(block) -> object:
    """The entry that claims ``block`` (the quick start's blocks are claimed by their section)."""
    if block.page == "README.md" and block.heading == QUICK_START:
        return "quick start"
    hits = [v for (page, head, start), v in BLOCKS.items()
            if page == block.page and head == block.heading and block.first_line.startswith(start)]
    assert len(hits) == 1, (f"{block.page}:{block.line} ({block.heading!r}, {block.first_line!r}): "
                            f"{'no' if not hits else len(hits)} entries of tests/unit/test_docs.py BLOCKS claim it")
    return hits[0]


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
