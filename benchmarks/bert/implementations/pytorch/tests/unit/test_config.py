import json

import pytest

from bert.config import (Config, ConfigError, batch_split, build_config, dumps, eval_interval_samples, load_file,
                         parse_overrides)


def test_defaults_are_the_benchmark():
    cfg = build_config()
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (1024, 24, 16)
    assert cfg.data.max_seq_length == 512 and cfg.data.max_predictions_per_seq == 76
    assert cfg.eval.target_accuracy == pytest.approx(0.72)


def test_overrides_are_typed():
    cfg = build_config(parse_overrides(["optim.lr=1e-3", "model.unpad=false", "run.local_batch_size=8",
                                        "optim.name=adamw", "log.system=X"]))
    assert cfg.optim.lr == 1e-3 and cfg.model.unpad is False and cfg.run.local_batch_size == 8
    assert cfg.optim.name == "adamw" and cfg.log.system == "X"


@pytest.mark.parametrize("override, key", [
    ("optim.lrr=1", "optim.lrr"),
    ("nosuch.lr=1", "nosuch"),
    ("optim=1", "optim"),
    ("run.local_batch_size=abc", "run.local_batch_size"),
    ("run.local_batch_size=1.5", "run.local_batch_size"),
    ("model.unpad=maybe", "model.unpad"),
    ("optim.lr=fast", "optim.lr"),
    ("optim.name=sgd", "optim.name"),
    ("run.division=Closed", "run.division"),
    ("model.num_heads=5", "model.hidden_size"),  # 1024 % 5 != 0
    ("eval.batch_size=0", "eval.batch_size"),
])
def test_bad_key_or_value_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(parse_overrides([override]))


def test_override_syntax():
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["optim.lr"])


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 0.5\n  warmup_steps: 7\nmodel:\n  num_layers: 2\n")
    cfg = build_config(parse_overrides(["optim.lr=0.25"]), str(f))
    assert cfg.optim.lr == 0.25 and cfg.optim.warmup_steps == 7 and cfg.model.num_layers == 2
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"run": {"seed": 3, "bogus": 1}}))
    with pytest.raises(ConfigError, match=r"run\.bogus"):
        build_config(config_file=str(j))
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_file(tmp_path / "nope.yaml")


def test_eval_interval_rule():
    cfg = Config()
    cfg.run.local_batch_size, cfg.run.grad_accum_steps = 56, 1
    # GBS 448: floor(0.05*(230.23*448 + 3e6)/25000)*25000 = 150000
    assert eval_interval_samples(cfg, 8) == 150000
    cfg.eval.interval_samples = 640
    assert eval_interval_samples(cfg, 8) == 640


def test_dump_round_trips(tmp_path):
    cfg = build_config(parse_overrides(["optim.lr=0.125"]))
    (tmp_path / "cfg.json").write_text(dumps(cfg, {"world_size": 2}))
    tree = json.loads((tmp_path / "cfg.json").read_text())
    assert tree["optim"]["lr"] == 0.125 and tree["resolved"]["world_size"] == 2
    again = build_config(config_file=str(tmp_path / "cfg.json"))
    assert again == cfg


def test_launcher_variables_name_real_keys_and_the_doc_lists_them():
    """The one table of launcher variables: every key it names is a config key of its
    variable's type (a launcher passes strings), and docs/cluster.md lists the table as it is."""
    from pathlib import Path

    from bert.config import LAUNCHER_VARIABLES, launcher_overrides

    cfg = build_config(launcher_overrides({var: "" for var in LAUNCHER_VARIABLES}))
    assert cfg == Config()  # empty variables leave the defaults
    for var, key in LAUNCHER_VARIABLES.items():
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), (var, key)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    rows = [f"| `{var}` | `{key}` |" for var, key in LAUNCHER_VARIABLES.items()]
    assert "\n".join(["| variable | override |", "|---|---|", *rows]) in doc


def test_one_precedence_and_where_each_setting_came_from():
    """Lowest first: the defaults, a --config file, the config script (its CONFIG_PARAMS and its
    variables), the user's variables set over the script's and EXTRA_PARAMS, the command line.
    A variable is the script's where the script sets it to that value, else the environment's;
    flags in EXTRA_PARAMS are not settings; the start of a run lists the settings that differ
    from the defaults with their origin, in the sections' order."""
    from bert.config import COMMAND_LINE, Setting, launcher_settings, origin_lines, resolve

    script = {"LR": "0.5", "BATCHSIZE": "3", "CONFIG_PARAMS": "optim.lr=0.9 run.seed=1 data.eval_samples=7"}
    env = {**script, "BATCHSIZE": "4", "WARMUP_STEPS": "2",
           "EXTRA_PARAMS": "--dry-run run.seed=2 model.vocab_size=8000", "CONFIG_SCRIPT": "/x/config_X.sh"}
    settings = launcher_settings(env, script, "config_X.sh") + [Setting("model.vocab_size", "9000", COMMAND_LINE)]
    cfg, origins = resolve(settings)
    assert (cfg.optim.lr, cfg.run.local_batch_size, cfg.optim.warmup_steps) == (0.5, 4, 2)  # LR over CONFIG_PARAMS
    assert (cfg.run.seed, cfg.model.vocab_size, cfg.data.eval_samples) == (2, 9000, 7)
    assert origins == {"optim.lr": "LR in config_X.sh", "run.seed": "EXTRA_PARAMS",
                       "data.eval_samples": "CONFIG_PARAMS in config_X.sh", "run.local_batch_size": "BATCHSIZE in the environment",
                       "optim.warmup_steps": "WARMUP_STEPS in the environment", "model.vocab_size": COMMAND_LINE}
    assert origin_lines(cfg, origins) == [
        "model.vocab_size=9000 (command line)", "data.eval_samples=7 (CONFIG_PARAMS in config_X.sh)",
        "optim.lr=0.5 (LR in config_X.sh)", "optim.warmup_steps=2 (WARMUP_STEPS in the environment)",
        "run.local_batch_size=4 (BATCHSIZE in the environment)", "run.seed=2 (EXTRA_PARAMS)"]
    # Without the script's own values every variable is the environment's.
    assert resolve(launcher_settings({"LR": "0.5"}))[1] == {"optim.lr": "LR in the environment"}


def test_what_a_resume_may_change_names_real_keys_and_the_doc_lists_it():
    """RESUME_MAY_DIFFER: each entry a config key or a section; resume_changes names every
    other setting that differs from the checkpointed run's, with both values, compares a key
    the saved config lacks (a field added since) with what its absence meant, else its default, and ignores one only it has
    (a field removed since); lists compare as lists; docs/faults.md names every entry."""
    from pathlib import Path

    from bert.config import RESUME_MAY_DIFFER, resume_changes

    for entry in RESUME_MAY_DIFFER:
        section, _, name = entry.partition(".")
        assert hasattr(Config(), section) and (name == "*" or hasattr(getattr(Config(), section), name)), entry
    budgets = "data.token_budgets=1024,4096"
    then = json.loads(dumps(build_config(parse_overrides(["optim.lr=0.5", "ckpt.keep=3", "data.train_dir=/a", budgets]))))
    now = build_config(parse_overrides(["optim.lr=0.25", "ckpt.keep=5", "data.train_dir=/b", "log.output_dir=x",
                                        "run.seed=4", "dist.timeout_s=300", budgets]))
    assert resume_changes(then, now) == ["optim.lr=0.25 (the checkpointed run's: 0.5)"]
    del then["model"]["fused_qkv"]
    then["model"]["removed_since"] = 1
    assert resume_changes(then, now) == ["optim.lr=0.25 (the checkpointed run's: 0.5)"]
    # the split of the global batch (a resume on another number of ranks) may differ; the model may not
    now.model.fused_qkv, now.data.token_budgets, now.run.local_batch_size = False, "auto", 28
    assert resume_changes(then, now) == ["model.fused_qkv=false (the checkpointed run's: true)",
                                         "optim.lr=0.25 (the checkpointed run's: 0.5)"]
    # A checkpoint from before model.activation existed ran the erf GELU: resuming it under the
    # tanh default is a change (ABSENT_MEANT), resuming it with gelu_erf is not.
    del then["model"]["activation"]
    assert "model.activation=\"gelu_tanh\" (the checkpointed run's: \"gelu_erf\")" in resume_changes(then, now)
    now.model.activation = "gelu_erf"
    assert not any(c.startswith("model.activation") for c in resume_changes(then, now))
    doc = (Path(__file__).resolve().parents[2] / "docs" / "faults.md").read_text()
    assert all(f"`{entry}`" in doc for entry in RESUME_MAY_DIFFER), [e for e in RESUME_MAY_DIFFER if f"`{e}`" not in doc]


def test_how_a_run_ends_and_what_its_start_says():
    """A pretraining phase ends at its step count whatever run.max_samples says (said, below or
    above); a benchmark run at run.max_samples, said when it cuts the schedule short; neither
    trains past the update from which the rate stays 0 (said), nor past run.max_steps."""
    from bert.config import run_end, start_notes

    def end(*words):
        return run_end(build_config(parse_overrides(["run.local_batch_size=32", "optim.total_steps=150", *words])), 2)

    assert end("run.mode=pretrain") == (9600, [])
    samples, (note,) = end("run.mode=pretrain", "run.max_samples=256000")
    assert samples == 9600 and "run.max_samples=256000 (MAX_SAMPLES_TERMINATION) is above the step count" in note
    samples, (note,) = end("run.mode=pretrain", "run.max_samples=640")
    assert samples == 9600 and "is below the step count and does not end a pretraining phase" in note
    assert end("run.mode=pretrain", "run.max_steps=20")[0] == 1280
    samples, (note,) = end("run.max_samples=256000")  # end_lr 0: past step 150 nothing changes
    assert samples == 9600 and note.startswith("the rate is 0 from step 150") and "not at 256000" in note
    samples, (note,) = end("run.max_samples=256000", "optim.end_lr=1e-5")
    assert samples == 256000 and "trains past the schedule's end (step 150) at the rate optim.end_lr=1e-05" in note
    samples, (note,) = end("run.max_samples=640")
    assert samples == 640 and note == "run.max_samples=640 ends the run at step 10, before its schedule's end " \
                                      "(optim.total_steps=150)"
    samples, (note,) = end("optim.lr_max_steps=100")  # the decay (to 0) ends before the step count
    assert samples == 6400 and note.startswith("the rate is 0 from step 100")
    assert end()[1] == [] and end("run.max_steps=150")[1] == []
    with pytest.raises(ConfigError, match="optim.lr_max_steps: the schedule's rate is 0 from the first update"):
        build_config(parse_overrides(["run.division=open", "optim.schedule=published", "optim.lr_max_steps=1"]))
    phase1 = build_config(parse_overrides(["run.mode=pretrain", "model.max_position_embeddings=128",
                                           "data.max_seq_length=128"]))
    assert any("a phase 2 at a longer sequence cannot start from these weights" in n for n in start_notes(phase1, 1))


def test_the_rate_is_zero_from_the_step_the_config_says():
    """zero_rate_step against the trainer's own schedule (bert.optim.lr_at), for both formulas."""
    from bert.config import zero_rate_step
    from bert.optim import lr_at

    for words in (["optim.total_steps=50", "optim.warmup_steps=5"], ["optim.total_steps=80", "optim.lr_max_steps=30"],
                  ["run.division=open", "optim.schedule=published", "optim.total_steps=60", "optim.lr_max_steps=40",
                   "optim.warmup_steps=8", "optim.start_warmup_step=-2"]):
        o = build_config(parse_overrides(words)).optim
        z = zero_rate_step(o)
        assert lr_at(z - 1, o) > 0 and all(lr_at(k, o) == 0 for k in range(z, z + 30)), (words, z)
    assert zero_rate_step(build_config(parse_overrides(["optim.end_lr=1e-6"])).optim) is None


def test_phase_two_must_have_the_model_phase_one_makes():
    from bert.config import handover_problems

    p2 = build_config(parse_overrides(["model.vocab_size=8000"]))
    p1 = build_config(parse_overrides(["model.vocab_size=8000", "model.max_position_embeddings=128",
                                       "data.max_seq_length=128"]))
    assert handover_problems(p1, p2) == ["model.max_position_embeddings: phase 1 has 128, phase 2 needs 512 "
                                         "(data.max_seq_length=512)"]
    assert handover_problems(p2, p2) == []


def test_another_node_count_keeps_the_global_batch_with_the_fewest_micro_steps():
    """run.sub on another node count than the config's: the global batch kept, the micro-batch
    never above the config's (it must fit), the fewest micro-steps that allow it."""
    def split(batch, steps, config_nodes, per_node, nodes):
        cfg = build_config({"run.local_batch_size": batch, "run.grad_accum_steps": steps})
        return batch_split(cfg, config_nodes, per_node, nodes)

    assert split(32, 1, 2, 1, 1) == (32, 2, 64)  # fewer nodes: more micro-steps of the same batch
    assert split(32, 1, 1, 1, 2) == (16, 1, 32)  # more nodes at one micro-step: a smaller micro-batch
    assert split(16, 64, 8, 4, 4) == (16, 128, 32768)
    assert split(64, 32, 8, 4, 16) == (64, 16, 65536)
    assert split(48, 2, 4, 8, 4) == (48, 2, 3072)  # the config's own count: its own split
    assert split(12, 1, 2, 1, 3) == (8, 1, 24)
    with pytest.raises(ConfigError, match=r"the config's global batch 65536 \(run.local_batch_size 64 x "
                                          r"run.grad_accum_steps 32 x 8 node\(s\) x 4\) does not split over 3 node\(s\) x "
                                          r"4 = 12 ranks; node counts that keep it: 1, 2, 4, 8, 16, 32"):
        split(64, 32, 8, 4, 3)
