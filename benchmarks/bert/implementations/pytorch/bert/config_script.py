"""A launcher's config script (``config_<SYSTEM>.sh``) as the trainer reads it: sourced by
bash as a user's shell does, its variables turned into overrides by the one table
(``bert.config.LAUNCHER_VARIABLES``, plus EXTRA_PARAMS), then into a ``Config``. Tools,
benchmarks and tests read config scripts through here; run_and_time.sh hands the same
variables to ``python -m bert.train --from-env``."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Mapping

from .config import Config, ConfigError, build_config, launcher_overrides

SHELL_OWN = ("PWD", "OLDPWD", "SHLVL", "_")  # bash's bookkeeping, not the script's


def source(path: str | Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment after bash sources ``path`` with ``set -a`` (everything it sets is
    exported), starting from ``env`` (default: only PATH, so nothing of the caller's leaks in).
    The script's own relative ``source`` lines resolve from its directory."""
    path = Path(path).resolve()
    start = dict(env) if env is not None else {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    r = subprocess.run(["bash", "-c", 'set -a; source "$1" >/dev/null; env -0', "bash", str(path)],
                       cwd=path.parent, env=start, capture_output=True)
    if r.returncode != 0:
        raise ConfigError(f"{path}: bash could not source it: {r.stderr.decode().strip()}")
    out = dict(item.split("=", 1) for item in r.stdout.decode().split("\0") if "=" in item)
    return {k: v for k, v in out.items() if k not in SHELL_OWN}


def load(path: str | Path, env: Mapping[str, str] | None = None) -> tuple[Config, dict[str, str]]:
    """The ``Config`` a run of this script trains with (defaults <- its variables <-
    EXTRA_PARAMS), and the variables themselves (the job's shape: DGXNNODES, DGXNGPU, ...)."""
    variables = source(path, env)
    return build_config(launcher_overrides(variables)), variables
