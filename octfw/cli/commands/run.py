"""``octfw run RECIPE [--set k=v ...] [--resume auto|PATH] [--nproc-per-node N ...]``: train."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from octfw.cli.commands._common import add_recipe_arguments, load_recipe_from_args
from octfw.engine.launcher import (JOB_STATUS_ENV, Outcome, die_with_launcher,  # light: no torch
                                   exit_without_teardown, job_command, report_outcome)
from octfw.display.errors import UserError
from octfw.cli.exit_codes import (CRASHED, FINISHED, INTERRUPTED_EXIT_CODE, PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE,
                              SAVE_FAILED_EXIT_CODE, STOPPED_BY_GUARD)

__all__ = ["add_parser"]

HELP = "Train: validate the recipe, build the components and run the engine."
EPILOG = ("exit codes (of the whole job under --nproc-per-node): 0 finished; 1 stopped by a guard, or a crash "
          "(a bug: its traceback is printed); 2 a user mistake or a refusal; 74 the final checkpoint could not be "
          "written; 75 preempted, state saved (run it again with --resume auto); 76 a process of the job vanished, "
          "was killed by a signal or stopped answering (run it again with --resume auto); 130 stopped at once by a "
          "second Ctrl-C. A requeue loop retries 75 and 76 only. Several processes: docs/distributed.md")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help=HELP, description=HELP, epilog=EPILOG)
    add_recipe_arguments(parser)
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="auto: continue the run of this recipe started last (by its recorded sequence, "
                             "never the clock) from its last complete checkpoint, "
                             "start a new run when there is none, and do nothing when it finished (safe to "
                             "repeat, e.g. in a preemptible VM's startup script); PATH: a checkpoint file")
    parser.add_argument("--allow-recipe-change", action="store_true",
                        help="continue a run whose recipe now trains otherwise (another LR, length, model, ...): "
                             "every change is listed, and the whole schedule must still pass the pre-flight "
                             "check from the resumed step; without it such a resume is refused")
    job = parser.add_argument_group(
        "several processes (DDP, started on torch.distributed.elastic's rendezvous as torchrun starts them; "
        "docs/distributed.md)")
    job.add_argument("--nproc-per-node", metavar="N|auto",
                     help="start N training processes on this node (auto: one per visible GPU) and wait for "
                          "them; the job prints one status line and exits with the codes below")
    job.add_argument("--nnodes", type=int, default=1, metavar="M",
                     help="nodes of the job (default 1); every node runs the same command")
    job.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                     help="where the nodes meet (several nodes: required, e.g. the first node's address)")
    job.add_argument("--rdzv-id", metavar="ID",
                     help="the job's name at the rendezvous, the same on every node (default: the recipe's name)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Signals are the run's from its first instruction: a SIGTERM while torch imports, the
    # recipe builds or a cohort is written ends the start cleanly (exit 75), never with 143.
    from octfw.engine.preemption import StoppedBeforeTraining, StopRequests

    die_with_launcher()  # a worker of `--nproc-per-node`: never outlives its launcher
    with StopRequests(exit_before_training=True) as stop_requests:
        # A stop while starting ends the process from the handler: it says so first.
        stop_requests.abandon_hooks.append(
            lambda stopped: report_outcome(Outcome(PREEMPTED_EXIT_CODE, f"octfw: {stopped}")))
        try:
            if args.nproc_per_node is not None:
                code = _launch_job(args, stop_requests)
            else:
                code = _run_this_process(args, stop_requests)
        except StoppedBeforeTraining as stopped:
            print(f"octfw: {stopped}", file=sys.stderr)
            code = PREEMPTED_EXIT_CODE
    if args.nproc_per_node is not None or os.environ.get(JOB_STATUS_ENV):
        exit_without_teardown(code)  # the launcher, or one of its workers: the job's outcome is said
    return code


def _launch_job(args: argparse.Namespace, stop_requests) -> int:
    recipe, _registry = load_recipe_from_args(args)  # a mistake is one line here, not one per process
    from octfw.engine.launcher import launch_job

    worker_argv = ["run", args.recipe, *(f"--set={item}" for item in args.set or ())]
    if args.resume:
        worker_argv += ["--resume", args.resume]
    if args.allow_recipe_change:
        worker_argv.append("--allow-recipe-change")
    if args.debug:
        worker_argv.insert(0, "--debug")
    return launch_job(worker_argv, recipe, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, command=_resume_command(args))


def _resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run: under a launcher, the launcher's (the whole job)."""
    job = []
    if args.nproc_per_node is not None:
        job = [f"--nproc-per-node={args.nproc_per_node}"]
        if args.nnodes > 1 or args.rdzv_endpoint:
            job += [f"--nnodes={args.nnodes}", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        if args.rdzv_id:
            job += [f"--rdzv-id={args.rdzv_id}"]
    return job_command(shlex.join(["octfw", "run", args.recipe, *(f"--set={item}" for item in args.set or ()),
                                   *job, "--resume", "auto"]))


def _run_this_process(args: argparse.Namespace, stop_requests) -> int:
    from octfw.engine.preemption import StoppedBeforeTraining

    launched = bool(os.environ.get(JOB_STATUS_ENV))
    if launched and int(os.environ.get("RANK", "0")) != 0:
        from octfw.display.logs import silence_console

        silence_console()  # one process of the job speaks: rank 0 (its final line goes to the launcher)
    try:
        outcome = _train(args, stop_requests)
    except StoppedBeforeTraining as stopped:
        outcome = Outcome(PREEMPTED_EXIT_CODE, f"octfw: {stopped}")
    except UserError as mistake:  # the same one line on every process: the launcher prints it once
        if args.debug:
            raise
        outcome = Outcome(mistake.exit_code, mistake.console_text())
    except Exception as bug:  # noqa: BLE001 - a crash of one process of a job: said, not lost
        if not (launched or os.environ.get(TORCH_ERROR_FILE_ENV)):
            raise  # alone: the traceback, exit 1, as for any program
        outcome = Outcome(CRASHED, _crash(bug, again=_resume_command(args)))
    finally:
        stop_requests.done()  # a launcher tearing down the job's last processes changes nothing now
    report_outcome(outcome)
    return outcome.code


#: Where torch's launchers (torchrun, octfw's) ask a worker to write its failure.
TORCH_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def _crash(bug: Exception, again: str) -> str:
    """A bug in one process of a job: its traceback printed by this process alone, written to
    torch's error file (torchrun's summary shows it), and the job's one line naming the rank."""
    import traceback

    traceback.print_exception(bug)
    if os.environ.get(TORCH_ERROR_FILE_ENV):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(bug)
    rank = int(os.environ.get("RANK", "0"))
    first = (str(bug).strip().splitlines() or [""])[0]
    return (f"octfw: error: rank {rank} crashed: {type(bug).__name__}{': ' + first if first else ''} (its "
            f"traceback is above); the job stopped, and nothing after the newest checkpoint is saved. A bug is not "
            f"retried: once fixed, continue with: {again}")


def _train(args: argparse.Namespace, stop_requests) -> Outcome:
    """How this process ended: its code, its final line, whether it is a cause of the job's end
    rather than a lost peer's consequence, and the newest checkpoint it knows."""
    # A launched job's worker: its launcher loaded the same plugins and named their failures once.
    recipe, registry = load_recipe_from_args(args, report_failures=not os.environ.get(JOB_STATUS_ENV))
    from octfw.engine.distributed import PeerLost
    from octfw.engine.launch import AlreadyFinished, launch  # imports torch: only when the command runs

    again = _resume_command(args)
    try:
        summary = launch(recipe, registry, resume=args.resume, stop_requests=stop_requests,
                         allow_recipe_change=args.allow_recipe_change)
    except AlreadyFinished as done:  # --resume auto: nothing left to train
        return Outcome(STOPPED_BY_GUARD if done.summary.get("stopped") else FINISHED,
                       f"octfw: nothing to resume: {done}")
    except PeerLost as lost:  # before the first update step: nothing of this attempt to save
        return Outcome(PEER_LOST_EXIT_CODE,
                       f"octfw: error: {lost}; nothing was trained in this attempt. Run again: {again}", cause=False)
    newest = summary.checkpoint
    if summary.peer_lost:
        return Outcome(PEER_LOST_EXIT_CODE, (
            f"octfw: error: {summary.peer_lost}; stopped after update step {summary.update_steps}; nothing after "
            f"the newest checkpoint ({newest or 'none yet'}) is saved. Run again: {again}"), cause=False,
            checkpoint=newest)
    if summary.final_save_failed:
        kept = (f"the final state is in {summary.fallback_checkpoint}" if summary.fallback_checkpoint
                else f"the newest complete checkpoint is {newest or '(none)'}")
        return Outcome(SAVE_FAILED_EXIT_CODE, (
            f"octfw: error: the final checkpoint could not be written ({summary.failed_saves[-1]}); {kept}. "
            f"When the checkpoint location works again, resume with: {again}"), checkpoint=newest)
    if summary.preempted:
        code = INTERRUPTED_EXIT_CODE if summary.interrupted else PREEMPTED_EXIT_CODE
        return Outcome(code, f"octfw: stopped by {summary.stopped}; checkpoint {newest or '(none written)'}. "
                             f"Resume with: {again}", checkpoint=newest)
    if summary.stopped:
        return Outcome(STOPPED_BY_GUARD, f"stopped early: {summary.stopped}", checkpoint=newest)
    return Outcome(FINISHED, "", checkpoint=newest)
