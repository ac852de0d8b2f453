"""The launcher's decisions without processes: which outcome is the job's, how many threads each
process gets, and that octfw touches no private name of torch (the processes themselves are
started for real in tests/test_job_exits.py and tests/test_multiprocess_faults.py)."""

from __future__ import annotations

import ast
import signal
from pathlib import Path

from octfw.engine.launcher import Outcome, job_outcome, threads_per_process
from octfw.cli.exit_codes import CRASHED, FINISHED, PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE, USER_ERROR

OCTFW = Path(__file__).resolve().parents[1] / "octfw"
AGAIN = "octfw run r.toml --nproc-per-node=4 --resume auto"


def lost(rank: int, at: float, checkpoint: str | None = None) -> Outcome:
    return Outcome(PEER_LOST_EXIT_CODE, f"octfw: error: the process of rank 9 stopped answering (seen by {rank})",
                   cause=False, checkpoint=checkpoint, at=at, rank=rank)


def test_a_crash_is_the_jobs_outcome_over_the_ranks_that_lost_it():
    reports = {0: lost(0, 3.0), 1: Outcome(CRASHED, "octfw: error: rank 1 crashed: RuntimeError: x", at=2.0, rank=1),
               2: lost(2, 2.5), 3: lost(3, 3.5)}
    outcome = job_outcome(reports, {0: 76, 1: 1, 2: 76, 3: 76}, {}, AGAIN)
    assert (outcome.code, outcome.rank) == (CRASHED, 1) and "rank 1 crashed" in outcome.line


def test_the_first_cause_in_time_decides_the_code_and_the_lowest_rank_with_it_says_the_line():
    refusal = Outcome(USER_ERROR, "octfw: error: checkpointer.dir is in use", at=1.0, rank=2)
    later_crash = Outcome(CRASHED, "octfw: error: rank 3 crashed", at=5.0, rank=3)
    shared = Outcome(USER_ERROR, "octfw: error: checkpointer.dir is in use (rank 0's line)", at=1.2, rank=0)
    outcome = job_outcome({0: shared, 2: refusal, 3: later_crash}, {}, {}, AGAIN)
    assert outcome == shared


def test_a_process_killed_without_a_word_is_named_by_its_signal_exit_76_with_the_newest_checkpoint():
    reports = {0: lost(0, 1.0, "runs/r/checkpoints/step_00000008.pt"), 2: lost(2, 1.0, None)}
    outcome = job_outcome(reports, {0: 76, 1: -signal.SIGKILL, 2: 76}, {}, AGAIN)
    assert outcome.code == PEER_LOST_EXIT_CODE and outcome.checkpoint == "runs/r/checkpoints/step_00000008.pt"
    assert outcome.line.startswith("octfw: error: the process of rank 1 was killed by SIGKILL;")
    assert "nothing after the newest checkpoint (runs/r/checkpoints/step_00000008.pt) is saved" in outcome.line
    assert outcome.line.endswith(f"Run again: {AGAIN}")


def test_a_process_ended_while_waiting_for_a_silent_one_names_the_silent_one_first():
    """NCCL's watchdog ends (SIGABRT) the rank whose collective timed out, not the one that went
    silent: the line names the rank whose liveness marks had stopped, and the job is 76."""
    outcome = job_outcome({}, {0: -signal.SIGABRT, 1: -signal.SIGKILL}, {}, AGAIN,
                          ended_at={0: 1.0, 1: 9.0}, ended_by_launcher=frozenset({1}), unresponsive=frozenset({1}))
    assert outcome.code == PEER_LOST_EXIT_CODE
    assert outcome.line.startswith("octfw: error: the process of rank 1 stopped answering (rank 0, waiting for it, "
                                   "was killed by SIGABRT);"), outcome.line
    # A kill is its own cause: the killed rank is named, whatever the others' marks looked like.
    killed = job_outcome({}, {2: -signal.SIGKILL}, {}, AGAIN, unresponsive=frozenset({1, 3}))
    assert killed.line.startswith("octfw: error: the process of rank 2 was killed by SIGKILL;"), killed.line


def test_a_crash_before_octfw_could_report_it_is_named_from_torchs_error_file():
    outcome = job_outcome({}, {0: 0, 1: 1}, {1: "ImportError: no module named plug"}, AGAIN)
    assert outcome.code == PEER_LOST_EXIT_CODE and "rank 1 ended with exit code 1 (ImportError" in outcome.line


def test_ranks_that_only_lost_a_peer_give_76_in_the_lowest_ranks_words():
    outcome = job_outcome({1: lost(1, 2.0), 0: lost(0, 3.0)}, {0: 76, 1: 76}, {}, AGAIN)
    assert (outcome.code, outcome.rank) == (PEER_LOST_EXIT_CODE, 0)


def test_a_shared_stop_is_said_in_rank_0s_words_and_a_finished_job_in_none():
    stops = {rank: Outcome(PREEMPTED_EXIT_CODE, f"octfw: stopped by SIGTERM (rank {rank})", at=1.0 + rank / 10,
                         rank=rank)
             for rank in (3, 1, 0, 2)}
    assert job_outcome(stops, {}, {}, AGAIN).rank == 0
    assert job_outcome({}, {0: 0, 1: 0}, {}, AGAIN) == Outcome(FINISHED, "")


def test_each_process_gets_its_share_of_the_cores_unless_the_user_chose():
    assert threads_per_process(4, {"OMP_NUM_THREADS": "3"}) == "3"
    cores = len(__import__("os").sched_getaffinity(0))
    assert threads_per_process(1, {}) == str(cores)
    assert threads_per_process(cores * 4, {}) == "1"


#: Underscored names of torch that octfw relies on, each for a reason no public name serves (torch
#: offers no public alias); anything else private fails the test below. The launcher has none.
ALLOWED_PRIVATE = {
    "torch._foreach_": "the fused multi-tensor kernels torch.optim's own foreach paths call: one XLA graph "
                       "node per step for the EMA, the optimizer's decoupled decay, the gradient norm and clip",
    "torch.utils._python_dispatch": "TorchDispatchMode: torch's documented way to watch which kernels run "
                                    "(the attention kernel named in the summary)",
    "torch._subclasses.fake_tensor": "FakeTensorMode: octfw check's memory estimate without allocating",
    "torch._dynamo": "graph-break counters of octfw check --compile (torch.compile's diagnostics)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": "an operator's name, matched in the memory estimate",
    "torch_xla._XLAC": "the TPU preemption sync manager, which torch_xla exposes nowhere else",
    "torch_xla._internal.tpu": "the TPU generation's peak FLOPs for MFU",
}


def _private_torch_names(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in {"torch", "torch_xla"}:
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") or any(p.startswith("_") for p in node.module.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in {"torch", "torch_xla"}:
                found.append(ast.unparse(node))
    return found


def test_octfw_uses_no_private_name_of_torch_beyond_the_reviewed_few():
    """torch's private internals change without notice (the launcher once overrode the elastic
    agent's ``_monitor_workers`` and read its ``_pcontext``): public names only, in every module
    of octfw, but for the reviewed few above, each with its reason."""
    unexpected = sorted({f"{path.relative_to(OCTFW)}: {name}" for path in OCTFW.rglob("*.py")
                         for name in _private_torch_names(path)
                         if not any(name.startswith(allowed) for allowed in ALLOWED_PRIVATE)})
    assert unexpected == []


def test_the_launcher_uses_no_private_name_of_torch_at_all():
    launcher = OCTFW / "engine" / "launcher.py"
    assert _private_torch_names(launcher) == []
    source = launcher.read_text(encoding="utf-8")
    for name in ("_pcontext", "_start_workers", "_monitor_workers", "_worker_group", "subprocess_handlers"):
        assert name not in source


def test_silent_deaths_are_ordered_by_when_they_ended_and_the_launchers_own_kills_are_no_cause():
    """Under NCCL's watchdog every survivor may end by SIGABRT: the first to end is the one named;
    a process the launcher killed after the grace is a consequence, never the job's cause."""
    codes = {0: -signal.SIGABRT, 1: -signal.SIGKILL, 2: -signal.SIGABRT}
    outcome = job_outcome({}, codes, {}, AGAIN, ended_at={0: 5.0, 1: 9.0, 2: 4.0}, ended_by_launcher=frozenset({1}))
    assert outcome.rank == 2 and "rank 2 was killed by SIGABRT" in outcome.line
    only_killed = job_outcome({0: lost(0, 1.0)}, {0: 76, 1: -signal.SIGKILL}, {}, AGAIN,
                              ended_by_launcher=frozenset({1}))
    assert only_killed.code == PEER_LOST_EXIT_CODE and only_killed.rank == 0


def test_each_worker_gets_torchruns_environment_with_its_global_rank_and_its_share_of_threads():
    """Node 1 of 2, 4 processes each: global ranks 4-7, the job's store as MASTER_ADDR:PORT."""
    import types

    from torch.distributed import HashStore

    from octfw.engine.launcher import _Node

    store = HashStore()
    for node in (0, 1):
        store.set(f"octfw/nproc/{node}", "4")
    rendezvous = types.SimpleNamespace(store=store, rank=1, world_size=2, bootstrap_store_info=types.SimpleNamespace(
        master_addr="node0.cluster", master_port=29400))
    node = _Node(rendezvous, 4, "job-7", use_agent_store=True)
    env = node.environment(2, threads_per_process(4, {}))
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == \
        ("6", "2", "8", "4", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["TORCHELASTIC_RUN_ID"]) == ("node0.cluster", "29400", "job-7")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["OMP_NUM_THREADS"] == threads_per_process(4, {})


def test_nodes_that_run_different_process_counts_are_refused_in_one_line():
    import types

    import pytest
    from torch.distributed import HashStore

    from octfw.engine.launcher import _Node
    from octfw.display.errors import UserError

    store = HashStore()
    store.set("octfw/nproc/0", "8")
    rendezvous = types.SimpleNamespace(store=store, rank=1, world_size=2, bootstrap_store_info=None)
    with pytest.raises(UserError, match="--nproc-per-node differs between the nodes"):
        _Node(rendezvous, 4, "job", use_agent_store=True)
