"""A launcher's config script (``config_<SYSTEM>.sh``) as the trainer reads it, and the one
precedence every launcher and tool applies, lowest first: the defaults (bert/config.py), the
config script (its variables and CONFIG_PARAMS), the user's environment (a variable of the
table set over the script's value) and EXTRA_PARAMS, the command line.

A script is sourced by bash as a user's shell does; each shipped one sets CONFIG_SCRIPT to its
own path, so that its values can be told from the user's afterwards: the trainer names where
each setting came from, and a launcher that sources a script itself (submit_pretrain.sh, the
tools) puts back every value the user set, but not the values of a script the user's shell
sourced earlier (they are that script's, not the user's). Standard library only: launchers
run it with the host's python3, outside the image.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Mapping

from .config import (CONFIG_PARAMS, CONFIG_SCRIPT, EXTRA_PARAMS, Config, ConfigError, Setting, launcher_settings,
                     resolve)

SHELL_OWN = ("PWD", "OLDPWD", "SHLVL", "_")  # bash's bookkeeping, not the script's
PKG = Path(__file__).resolve().parent.parent  # where the shipped config scripts are
BARE_PATH = "/usr/local/bin:/usr/bin:/bin"


def source(path: str | Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment after bash sources ``path`` with ``set -a`` (everything it sets is
    exported), starting from ``env`` (default: only PATH, so nothing of the caller's leaks in).
    The script's own relative ``source`` lines resolve from its directory."""
    path = Path(path).resolve()
    start = dict(env) if env is not None else {"PATH": BARE_PATH}
    r = subprocess.run(["bash", "-c", 'set -a; source "$1" >/dev/null; env -0', "bash", str(path)],
                       cwd=path.parent, env=start, capture_output=True)
    if r.returncode != 0:
        raise ConfigError(f"{path}: bash could not source it: {r.stderr.decode().strip()}")
    out = dict(item.split("=", 1) for item in r.stdout.decode().split("\0") if "=" in item)
    return {k: v for k, v in out.items() if k not in SHELL_OWN}


def sourced_script(variables: Mapping[str, str]) -> Path | None:
    """The config script ``variables`` say a shell sourced (CONFIG_SCRIPT), where it can be
    read: that path, else the file of that name among the shipped ones (a container's copy of
    the same tree); None when none is named or found."""
    named = variables.get(CONFIG_SCRIPT, "")
    if not named:
        return None
    for candidate in (Path(named), PKG / Path(named).name):
        if candidate.is_file():
            return candidate.resolve()
    return None


def _script_values(path: Path, start: Mapping[str, str]) -> dict[str, str]:
    """What ``path`` sets when sourced on top of ``start``: the variables it adds or changes."""
    after = source(path, start)
    return {k: v for k, v in after.items() if start.get(k) != v}


def users_own(caller: Mapping[str, str]) -> dict[str, str]:
    """``caller``'s variables that the user set: without CONFIG_PARAMS and CONFIG_SCRIPT (a
    config script's), and without the values of the script the caller's shell sourced, where
    they still hold that script's value (CONFIG_SCRIPT says which; refused when it cannot be
    read, as then a stale config's values would pass for the user's)."""
    own = {k: v for k, v in caller.items() if k not in (CONFIG_PARAMS, CONFIG_SCRIPT)}
    if caller.get(CONFIG_SCRIPT):
        path = sourced_script(caller)
        if path is None:
            raise ConfigError(f"{CONFIG_SCRIPT}={caller[CONFIG_SCRIPT]}: this shell sourced that config script and it "
                              "cannot be read now, so its values cannot be told from yours: start from a fresh shell "
                              f"(or unset {CONFIG_SCRIPT} and the variables it set)")
        stale = _script_values(path, {"PATH": caller.get("PATH", BARE_PATH)})
        own = {k: v for k, v in own.items() if stale.get(k) != v}
    return own


def job_environment(path: str | Path, caller: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The environment a launcher gives a job of config script ``path`` for a caller whose
    environment is ``caller``: the script sourced on top of the user's own variables
    (``users_own``), then those put back over it, as the precedence has it; and what the
    script set (the values the start of the run names as the script's). A script may not set
    EXTRA_PARAMS: that is the user's."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ConfigError(f"{path}: no such config script")
    own = users_own(caller)
    script = _script_values(path, own)
    if EXTRA_PARAMS in script:
        raise ConfigError(f"{path.name} sets {EXTRA_PARAMS}, which is the user's: put its key=value words in "
                          f"{CONFIG_PARAMS}")
    env = {**own, **script, **{k: v for k, v in own.items() if k in script}}
    env.setdefault(CONFIG_SCRIPT, str(path))
    return env, script


def environment_settings(variables: Mapping[str, str]) -> list[Setting]:
    """The settings of a launcher's ``variables`` (the trainer's environment under
    --from-env), each named by where it came from: the config script that CONFIG_SCRIPT names
    is sourced again, alone, to tell its values from those the user set over them."""
    path = sourced_script(variables)
    script = source(path, {"PATH": variables.get("PATH", BARE_PATH)}) if path else None
    name = path.name if path else Path(variables.get(CONFIG_SCRIPT, "")).name
    return launcher_settings(variables, script, name)


def load(path: str | Path, caller: Mapping[str, str] | None = None
         ) -> tuple[Config, dict[str, str], dict[str, str]]:
    """A run of config script ``path`` for a caller with environment ``caller`` (default:
    none, only PATH): its ``Config`` (the precedence above), its variables (the job's shape:
    DGXNNODES, DGXNGPU, ...), and where each setting came from."""
    env, script = job_environment(path, caller if caller is not None else {"PATH": BARE_PATH})
    cfg, origins = resolve(launcher_settings(env, script, Path(path).name))
    return cfg, env, origins
