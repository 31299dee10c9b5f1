"""Entry point: one training run (bert/trainer.py) from the command line.

    python -m bert.train [--config FILE] [--dry-run] [--resume] key.sub=value ...

``--exit-status-dir DIR`` (what run_and_time.sh passes): each rank writes its exit status, and
whether it trained, to ``DIR/rank_<R>`` and exits 0 for these expected ends. torchrun turns
any non-zero worker exit into 1 and a ChildFailedError traceback; this way the launcher
script reads the true status and torchrun stays quiet. A crash still exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from . import checkpoint, config_script, console, distributed, runlock, storage, watchdog
from .config import (COMMAND_LINE, EXTRA_PARAMS, Config, ConfigError, Setting, global_batch_size, max_samples,
                     origin_lines, parse_overrides, resolve, timed_run_problems)
from .exit_status import ExitStatus, describe
from .mlperf_log import MLPerfLogger, logged_seed
from .shards import DataError
from .trainer import RunFiles, Trainer

BAD_INPUT = (ConfigError, DataError, checkpoint.CheckpointError, runlock.InUse, runlock.NoLocks)  # exit 2, no traceback

log = logging.getLogger("bert.train")  # not __name__: "__main__" under python -m bert.train


def run(cfg: Config, dry_run: bool = False, pending_signals: Path | None = None,
        origins: dict[str, str] | None = None) -> ExitStatus:
    """One run of ``cfg`` on this process's rank: the exit status; every expected failure is
    one line on stderr (from each rank) and its own status. ``pending_signals``: signals the
    launcher got before this process could catch them (checkpoint.StopFlag.installed);
    ``origins``: where each setting came from (the run's first lines name them)."""
    denv = distributed.job_env(cfg.dist)
    device = distributed.device_for(cfg.run.device, denv.local_rank)
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    files = RunFiles.of(cfg)
    # One run per log and checkpoint directory (bert/runlock.py): rank 0 locks them before
    # anything is read or written there; a refusal reaches every rank at the first collective.
    locks: list[runlock.Lock] = []
    refused = None
    if denv.is_main and cfg.run.exclusive:
        try:
            locks, notes = runlock.acquire_run(files.log, files.checkpoints)
        except (runlock.InUse, runlock.NoLocks) as e:
            refused = str(e)
        else:
            for note in notes:
                print(note, flush=True)
    end = max_samples(cfg, denv.world_size)  # where this run's limits end it
    try:  # filesystem only: before the log opens
        start_from = checkpoint.plan(files.checkpoints, cfg.ckpt.resume, end_samples=end,
                                     target=cfg.eval.target_accuracy if cfg.run.mode == "mlperf" else None)
        continued = checkpoint.ended(files.checkpoints) if start_from is not None else None
    except checkpoint.CheckpointError as e:
        distributed.rank_line(f"error: {e}")
        for lock in locks:  # refused as it should be: the next run there takes no "ended without releasing" note
            lock.release()
        return ExitStatus.BAD_INPUT
    # A resumed run appends to the log of the run it continues, so the log shows both parts
    # (and the compliance checker rejects it: a timed result must not be resumed). A refused
    # run never opens it: it is another run's.
    mine = denv.is_main and refused is None
    mllog = MLPerfLogger(files.log if mine else None, enabled=mine, echo=cfg.log.echo_mllog,
                         append=start_from is not None)
    stop = checkpoint.StopFlag()
    peers = distributed.Peers()
    comm_failed = False
    try:
        with console.rank_zero(denv.is_main), stop.installed(cfg.ckpt.on_signal, pending_signals):
            lines = origin_lines(cfg, origins or {})
            log.info(f"settings: {len(lines)} differ from the defaults" + (", from:" if lines else ""))
            for line in lines:
                log.info(f"  {line}")
            problems = timed_run_problems(cfg)
            if problems and not dry_run:
                raise ConfigError("; ".join(problems))
            distributed.init_process_group(denv, cfg.dist, device, peers)
            # Every rank must pick the same checkpoint; they differ when ckpt.dir is not shared.
            chosen, refused = distributed.broadcast_object((str(start_from), refused))
            if refused:  # rank 0 could not lock the log or the checkpoint directory
                raise runlock.InUse(refused)
            if chosen != str(start_from):
                raise checkpoint.CheckpointError(f"rank {denv.rank} found checkpoint {start_from} but rank 0 found "
                                             f"{chosen}: ckpt.dir={files.checkpoints} must be one shared directory")
            if start_from is None and denv.is_main and not dry_run:  # a dry run writes no checkpoint
                checkpoint.clear(files.checkpoints)  # a finished run's checkpoints must not mix with this run's
            if start_from is not None:  # the newest that proves its bytes on every rank
                start_from = checkpoint.choose(files.checkpoints, start_from, cfg.ckpt.resume, denv.rank,
                                               denv.world_size)
                checkpoint.check_settings(start_from, cfg)  # under the settings it was written with
                if continued is not None:
                    log.info(f"continuing a finished run: it ended at step {continued['step']} ({continued['samples']} "
                             f"samples, run_stop {continued.get('status')}); this run ends at step "
                             f"{-(-end // global_batch_size(cfg, denv.world_size))} ({end} samples)")
            # Only now: a resume refused above adds nothing to the log of the run it would continue.
            mllog.init_start(cfg.run.cache_cleared)
            status = Trainer(cfg, denv, device, mllog, stop).run(start_from, dry_run)
            if dry_run:
                for problem in problems:
                    log.info(f"warning: a timed run would exit 2: {problem}")
                log.info("dry run: everything built, nothing trained")
            return status
    except BAD_INPUT as e:
        distributed.rank_line(f"error: rank {denv.rank}: {e}")
        # Bad input outranks a dead peer: the others learn what it was, not just that this
        # rank is gone (distributed.Peers), and exit 2 too.
        peers.report(str(e))
        peers.abort()
        peers.linger(cfg.dist.timeout_s + 10)
        comm_failed = peers.store is not None  # the group is aborted: nothing to destroy
        return ExitStatus.BAD_INPUT
    except watchdog.Stopped as e:  # a stop while this rank waited for data: its peers wait in a collective
        code = ExitStatus.INTERRUPTED if stop.interrupted else ExitStatus.PREEMPTED
        distributed.rank_line(f"rank {denv.rank}: {e}; {_resume_from(files.checkpoints)}")
        peers.report(f"{e}; {_resume_from(files.checkpoints)}", int(code))
        peers.abort()
        peers.linger(cfg.dist.timeout_s + 10)
        comm_failed = peers.store is not None
        return code
    except storage.WriteFailed as e:  # every rank, at the same point, with the same text
        distributed.rank_line(f"error: rank {denv.rank} of {denv.world_size}: {e}; "
                              f"{_after_write_failure(e, files.checkpoints)}")
        return ExitStatus.WRITE_FAILED
    except distributed.ConnectError as e:  # names the addresses and interfaces; not a peer's death
        comm_failed = True
        distributed.rank_line(f"error: {e}")
        return ExitStatus.PEER_FAILED
    except Exception as e:
        if denv.world_size == 1 or not distributed.is_comm_failure(e):
            raise
        comm_failed = True  # destroying the group could block on the dead peer: skip it
        bad = peers.reported()
        if bad is not None and bad[1] == ExitStatus.BAD_INPUT:  # what this run ended on
            distributed.rank_line(f"error: rank {denv.rank} of {denv.world_size}: rank {bad[0]} stopped on bad "
                                  f"input: {bad[2]}")
            return ExitStatus.BAD_INPUT
        if bad is not None:  # a stop that rank got while it waited for data
            distributed.rank_line(f"rank {denv.rank} of {denv.world_size}: rank {bad[0]} {bad[2]}")
            return ExitStatus(bad[1])
        distributed.rank_line(f"error: rank {denv.rank} of {denv.world_size}: a collective failed: another rank "
                              f"died or did not answer within dist.timeout_s={cfg.dist.timeout_s:g} s ({e})")
        return ExitStatus.PEER_FAILED
    finally:
        mllog.close()
        for lock in locks:
            lock.release()
        if not comm_failed:
            distributed.shutdown()


def _resume_from(ckpt_dir: Path) -> str:
    """What the same command continues from."""
    try:
        found = checkpoint.complete_checkpoints(ckpt_dir)
    except OSError:
        found = []
    return (f"the same command resumes from {found[-1].name}" if found
            else "no checkpoint to resume from: the same command starts afresh")


def _after_write_failure(e: storage.WriteFailed, ckpt_dir: Path) -> str:
    """What a rerun continues from, and what to change first."""
    try:
        found = checkpoint.complete_checkpoints(ckpt_dir)
    except OSError:
        found = []
    setting = e.first.setting
    where = f"free space or point {setting} elsewhere" + (" (with that checkpoint copied there)"
                                                         if found and setting == "ckpt.dir" else "")
    if not found:
        return f"no complete checkpoint to resume from; {where}, then rerun the same command"
    return f"the newest complete checkpoint is {found[-1].name}; {where}, then rerun the same command to resume"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bert.train", description=__doc__ + "\nExit status:\n" + describe(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML or JSON file of config sections (overrides the defaults)")
    ap.add_argument("--dry-run", action="store_true", help="build every part, train nothing")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in ckpt.dir; fail if there is none; a finished "
                         "run's too, when this run's limits lie past its end (same as ckpt.resume=require; the "
                         "default, auto, resumes an unfinished run and starts a finished one's directory afresh)")
    ap.add_argument("--from-env", action="store_true",
                    help="take the launcher's settings from the environment (what run_and_time.sh passes): "
                         "the config's CONFIG_PARAMS, the variables of the table bert.config.LAUNCHER_VARIABLES "
                         "(LR, BATCHSIZE, DATADIR, ...), EXTRA_PARAMS (its flags too), in that order, after "
                         "--config and before the overrides; the run's first lines say where each came from")
    ap.add_argument("overrides", nargs="*", help="key.sub=value (applied after --config and --from-env)")
    ap.add_argument("--exit-status-dir", metavar="DIR",
                    help="write '<exit status> trained|none [seed]' to DIR/rank_<R> and exit 0 for the expected "
                         "ends (the statuses above; seed: rank 0's, as its MLPerf log has it, for a run that "
                         "trained; for launcher scripts: torchrun reports any non-zero exit as a failure)")
    args = ap.parse_intermixed_args(argv)
    variables = distributed.launcher_variables() if args.from_env else {}
    flags = [w for w in variables.get(EXTRA_PARAMS, "").split() if w.startswith("--")]
    if flags:  # EXTRA_PARAMS' flags (--dry-run), as run_and_time.sh's users write them
        args = ap.parse_intermixed_args([*flags, *(argv if argv is not None else sys.argv[1:])])
    distributed.tether_to_launcher()  # killed with run_and_time.sh / torchrun, whatever kills them
    rank = distributed.launch_rank()
    origins: dict[str, str] = {}
    try:
        settings = config_script.environment_settings(variables) if args.from_env else []
        settings += [Setting(k, v, COMMAND_LINE) for k, v in parse_overrides(args.overrides).items()]
        if args.resume:
            settings.append(Setting("ckpt.resume", "require", f"{COMMAND_LINE} --resume"))
        cfg, origins = resolve(settings, args.config)
        # Before anything is read: a config that names a GPU system runs on one or not at all.
        distributed.check_device(cfg.run.device)
    except ConfigError as e:
        if rank == 0:  # every rank reads the same arguments: say it once
            print(f"config error: {e}", file=sys.stderr)
        code = ExitStatus.BAD_INPUT
    else:
        code = run(cfg, dry_run=args.dry_run, origins=origins,
                   pending_signals=Path(args.exit_status_dir, "signals") if args.exit_status_dir else None)
    if args.exit_status_dir is None:
        return int(code)
    # 0, 1 and 6 end a run that trained (run_stop logged); a dry run or an error trained nothing.
    trained = code in (ExitStatus.SUCCESS, ExitStatus.NOT_CONVERGED, ExitStatus.DIVERGED) and not args.dry_run
    line = f"{int(code)} {'trained' if trained else 'none'}"
    if trained and rank == 0:  # the seed the run used (drawn when unset; a resume keeps its run's)
        line += f" {logged_seed(RunFiles.of(cfg).log)}"
    Path(args.exit_status_dir, f"rank_{rank}").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    distributed.exit_process(main())  # not sys.exit: see exit_process (a torch 2.13 gloo race)
