#!/usr/bin/env python3
"""A config script as the shell launchers apply it (submit_pretrain.sh, pretrain_demo.sh,
run.sub), and what a run of it would do, before any job is submitted: the one precedence of
bert/config_script.py, from bash.

    eval "$(python3 tools/config_env.py env CONFIG_SH)"   # this shell, as a job of CONFIG_SH gets it
    python3 tools/config_env.py show CONFIG_SH [key=value ...]   # the run's settings, checked
    python3 tools/config_env.py get KEY [KEY ...] [key=value ...]  # resolved values, from this environment
    python3 tools/config_env.py phases PHASE1_SH PHASE2_SH  # phase 2 can start from phase 1's weights
    python3 tools/config_env.py split NODES [key=value ...]  # the config's global batch on NODES nodes

``env`` prints ``export``/``unset`` lines: the config script sourced, then every value you set
put back over it; the values of a config script this shell sourced earlier (CONFIG_SCRIPT)
are that script's, not yours, and are dropped. ``show`` prints what the run's first lines
will say (each setting that is not the default and where it came from; the global batch; how
the run ends) and checks what can be checked on a login node: DATADIR and EVALDIR, when set,
exist, and the eval set holds data.eval_samples (counted from the shards' metadata, where h5py
is importable). ``get`` prints one value a line (lists as N,N,...). ``key=value`` words are
the trainer's command line. ``phases``: exit 2 naming each model setting that would stop phase
2 from loading phase 1's weights (positions, vocab, sizes). ``split``: how a job on NODES nodes of
DGXNGPU ranks keeps the global batch the environment's config has on its DGXNNODES (run.sub, on
another node count): "MICRO_BATCH MICRO_STEPS GLOBAL_BATCH" (bert/config.py batch_split), or
exit 2 naming the node counts that keep it.

Standard library only, but for ``show``'s count (h5py): run by the host's python3 (3.10 or
newer), outside the image. Exit status 2 for a bad config, environment or data, with a line
saying why.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PKG))

from bert import config_script  # noqa: E402
from bert.config import (COMMAND_LINE, ConfigError, Setting, batch_split, global_batch_size,  # noqa: E402
                         handover_problems, launcher_settings, origin_lines, parse_overrides, resolve,
                         start_notes, timed_run_problems)


def env_lines(path: str, caller: dict[str, str]) -> list[str]:
    """What makes a shell with environment ``caller`` that of a job of ``path``."""
    env, _ = config_script.job_environment(path, caller)
    out = [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k.isidentifier() and caller.get(k) != v]
    return out + [f"unset {k}" for k in sorted(caller) if k.isidentifier() and k not in env]


def resolved(words: list[str], caller: dict[str, str]) -> list[str]:
    keys = [w for w in words if "=" not in w]
    cfg, _ = resolve(config_script.environment_settings(caller) + _command_line([w for w in words if "=" in w]))
    out = []
    for key in keys:
        section, _, name = key.partition(".")
        if not hasattr(cfg, section) or not hasattr(getattr(cfg, section), name):
            raise ConfigError(f"unknown config key {key!r}")
        value = getattr(getattr(cfg, section), name)
        out.append(",".join(map(str, value)) if isinstance(value, list) else str(value))
    return out


def _command_line(words: list[str]) -> list[Setting]:
    return [Setting(k, v, COMMAND_LINE) for k, v in parse_overrides(words).items()]


def show(path: str, words: list[str], caller: dict[str, str]) -> list[str]:
    """The run of ``path`` (with ``words`` as its command line) as its first lines will say,
    and its inputs checked; ConfigError for what would stop it."""
    env, script = config_script.job_environment(path, caller)
    cfg, origins = resolve(launcher_settings(env, script, Path(path).name) + _command_line(words))
    world = int(env.get("DGXNNODES", "1")) * int(env.get("DGXNGPU", "1"))
    lines = [f"{Path(path).name}: {world} rank(s) ({env.get('DGXNNODES', '1')} node(s) x {env.get('DGXNGPU', '1')}), "
             f"device {cfg.run.device}, global batch {global_batch_size(cfg, world)} = run.local_batch_size "
             f"{cfg.run.local_batch_size} x run.grad_accum_steps {cfg.run.grad_accum_steps} x {world}; "
             f"settings that differ from the defaults:"]
    lines += [f"  {line}" for line in origin_lines(cfg, origins)]
    lines += [f"note: {n}" for n in start_notes(cfg, world)]
    lines += [f"note: a timed run would exit 2: {problem}" for problem in timed_run_problems(cfg)]
    for key, directory in (("data.train_dir", cfg.data.train_dir), ("data.eval_dir", cfg.data.eval_dir)):
        if directory and not Path(directory).exists():
            raise ConfigError(f"{key}={directory}: no such file or directory")
    if cfg.data.eval_dir and cfg.data.eval_samples:
        try:
            from bert.shards import DataError, list_shards, shard_size
        except ImportError:
            lines.append(f"note: the eval set is not counted here (no h5py for {sys.executable})")
        else:
            d = Path(cfg.data.eval_dir)
            try:
                held = sum(shard_size(f) for f in ([d] if d.is_file() else list_shards(d)))
            except DataError as e:
                raise ConfigError(f"data.eval_dir: {e}") from None
            if held < cfg.data.eval_samples:
                raise ConfigError(f"data.eval_samples={cfg.data.eval_samples} but data.eval_dir={d} holds {held} "
                                  f"samples: point EVALDIR at a larger eval set, or set data.eval_samples={held} "
                                  "(0 = all of it)")
            lines.append(f"eval set: {held} samples in {d}, {cfg.data.eval_samples} read")
    return lines


def split(nodes: str, words: list[str], caller: dict[str, str]) -> list[str]:
    """The config's global batch (this environment's, ``words`` its command line) on ``nodes`` nodes."""
    cfg, _ = resolve(config_script.environment_settings(caller) + _command_line(words))
    counts = {}
    for var, value in (("NODES", nodes), ("DGXNNODES", caller.get("DGXNNODES", "")), ("DGXNGPU", caller.get("DGXNGPU", ""))):
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{var}={value!r}: not a number of nodes or ranks per node")
        counts[var] = int(value)
    return [" ".join(map(str, batch_split(cfg, counts["DGXNNODES"], counts["DGXNGPU"], counts["NODES"])))]


def phases(first: str, second: str, caller: dict[str, str]) -> list[str]:
    (c1, e1, _), (c2, e2, _) = (config_script.load(p, caller) for p in (first, second))
    problems = handover_problems(c1, c2)
    if problems:
        raise ConfigError(f"phase 2 ({Path(second).name}) could not start from phase 1's weights "
                          f"({Path(first).name}): " + "; ".join(problems))
    return [f"phase {i}: {Path(p).name}: {e['DGXNNODES']} x {e['DGXNGPU']}, seq {c.data.max_seq_length}, "
            f"{c.optim.total_steps} steps, model {c.model.num_layers} x {c.model.hidden_size}, vocab {c.model.vocab_size}, "
            f"{c.model.max_position_embeddings} positions, device {c.run.device}"
            for i, (p, c, e) in enumerate(((first, c1, e1), (second, c2, e2)), 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 tools/config_env.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("env").add_argument("config")
    p = sub.add_parser("show")
    p.add_argument("config")
    p.add_argument("words", nargs="*", metavar="key=value")
    sub.add_parser("get").add_argument("words", nargs="+", metavar="KEY or key=value")
    p = sub.add_parser("phases")
    p.add_argument("phase1")
    p.add_argument("phase2")
    p = sub.add_parser("split")
    p.add_argument("nodes")
    p.add_argument("words", nargs="*", metavar="key=value")
    a = ap.parse_args(argv)
    caller = dict(os.environ)
    try:
        if a.command == "env":
            lines = env_lines(a.config, caller)
        elif a.command == "show":
            lines = show(a.config, a.words, caller)
        elif a.command == "get":
            lines = resolved(a.words, caller)
        elif a.command == "split":
            lines = split(a.nodes, a.words, caller)
        else:
            lines = phases(a.phase1, a.phase2, caller)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
