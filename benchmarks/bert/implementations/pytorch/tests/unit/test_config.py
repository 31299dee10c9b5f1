import json

import pytest

from bert.config import Config, ConfigError, build_config, dumps, eval_interval_samples, load_file, parse_overrides


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
    variable's type (a launcher passes strings), EXTRA_PARAMS' key=value words come after the
    variables, flags are the command line's, and docs/cluster.md lists the table as it is."""
    from pathlib import Path

    from bert.config import LAUNCHER_VARIABLES, launcher_overrides

    cfg = build_config(launcher_overrides({var: "" for var in LAUNCHER_VARIABLES}))
    assert cfg == Config()  # empty variables leave the defaults
    for var, key in LAUNCHER_VARIABLES.items():
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), (var, key)
    got = launcher_overrides({"LR": "0.5", "BATCHSIZE": "3", "EXTRA_PARAMS": "--dry-run optim.lr=0.25 run.seed=4"})
    assert got == {"optim.lr": "0.25", "run.local_batch_size": "3", "run.seed": "4"}
    assert launcher_overrides({"LR": "0.5", "EXTRA_PARAMS": "optim.lr=0.25"}, extra=False) == {"optim.lr": "0.5"}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    rows = [f"| `{var}` | `{key}` |" for var, key in LAUNCHER_VARIABLES.items()]
    assert "\n".join(["| variable | override |", "|---|---|", *rows]) in doc


def test_what_a_resume_may_change_names_real_keys_and_the_doc_lists_it():
    """RESUME_MAY_DIFFER: each entry a config key or a section; resume_changes names every
    other setting that differs from the checkpointed run's, with both values, compares a key
    the saved config lacks (a field added since) with its default and ignores one only it has
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
    now.model.fused_qkv, now.data.token_budgets = False, "auto"
    assert resume_changes(then, now) == ["model.fused_qkv=false (the checkpointed run's: true)",
                                         "data.token_budgets=\"auto\" (the checkpointed run's: [1024, 4096])",
                                         "optim.lr=0.25 (the checkpointed run's: 0.5)"]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "faults.md").read_text()
    assert all(f"`{entry}`" in doc for entry in RESUME_MAY_DIFFER), [e for e in RESUME_MAY_DIFFER if f"`{e}`" not in doc]
