"""The gcs checkpointer against a real GCS emulator: pointer last, size-checked latest,
pruning, retries, and whole training runs that save, resume, and survive a lost store."""

from __future__ import annotations

import importlib
import io
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from octfw.plugins.checkpointers.gcs import GcsCheckpointConfig, GcsCheckpointer, StorageError, build
from octfw.cli.main import main
from octfw.display.errors import UserError
from octfw.recipe.fields import Location
from octfw.types import BuildContext, Checkpointer

from conftest import make_dist

BUCKET = "octfw-test"


def make_ctx(rank: int = 0) -> BuildContext:
    return BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0, rank=rank)


def small_state(step: int) -> dict:
    return {"update_step": step, "model": {"w": torch.full((4, 4), float(step))},
            "rng": {"torch": torch.random.get_rng_state(), "python": [3, (1, 2), None]}}


@pytest.fixture
def bucket(gcs):
    gcs.make_bucket(BUCKET)
    return gcs


def objects(emulator, prefix: str) -> list[str]:
    fs = emulator.filesystem()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/{prefix}", detail=False, refresh=True))


def test_save_latest_load_and_keep_last_round_trip(bucket):
    url = f"gs://{BUCKET}/run"
    ckpt = build(GcsCheckpointConfig(dir=Location(url), keep_last=2), make_ctx())
    assert isinstance(ckpt, Checkpointer)
    assert ckpt.latest() is None
    for step in (10, 20, 30):
        assert ckpt.save(step, small_state(step)) == f"{url}/step_{step:08d}.pt"
    assert objects(bucket, "run") == ["latest", "step_00000020.pt", "step_00000020.pt.sha256", "step_00000030.pt", "step_00000030.pt.sha256"]
    pointer = json.loads(bucket.filesystem().cat_file(f"{BUCKET}/run/latest"))
    assert [e["name"] for e in pointer["checkpoints"]] == ["step_00000030.pt", "step_00000020.pt"]
    assert ckpt.latest() == f"{url}/step_00000030.pt"
    loaded = ckpt.load(ckpt.latest())
    assert loaded["update_step"] == 30
    assert torch.equal(loaded["model"]["w"], torch.full((4, 4), 30.0))
    assert torch.equal(loaded["rng"]["torch"], small_state(0)["rng"]["torch"])
    # Another rank reads the same checkpoints but never writes.
    reader = build(GcsCheckpointConfig(dir=Location(url)), make_ctx(rank=1))
    assert reader.save(40, small_state(40)) == ""
    assert reader.latest() == f"{url}/step_00000030.pt"


def test_latest_never_names_a_truncated_or_unlisted_object(bucket):
    url = f"gs://{BUCKET}/trunc"
    ckpt = GcsCheckpointer(url)
    ckpt.save(1, small_state(1))
    ckpt.save(2, small_state(2))
    fs = bucket.filesystem()
    # The newest object lost its tail: latest falls back to the one before.
    fs.pipe_file(f"{BUCKET}/trunc/step_00000002.pt", b"half a checkpoint")
    assert ckpt.latest() == f"{url}/step_00000001.pt"
    # An upload that finished without its pointer is not trusted.
    fs.pipe_file(f"{BUCKET}/trunc/step_00000003.pt", b"no pointer names me")
    assert ckpt.latest() == f"{url}/step_00000001.pt"
    fs.rm_file(f"{BUCKET}/trunc/latest")
    assert ckpt.latest() is None


def test_load_refuses_a_pickled_arbitrary_object_and_names_a_missing_one(bucket):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    fs = bucket.filesystem()
    buffer = io.BytesIO()
    torch.save({"model": Payload()}, buffer)
    fs.pipe_file(f"{BUCKET}/evil/step_00000001.pt", buffer.getvalue())
    ckpt = GcsCheckpointer(f"gs://{BUCKET}/evil", retries=0)
    with pytest.raises(UserError, match="cannot be loaded safely .*GLOBAL posix.system"):
        ckpt.load(f"gs://{BUCKET}/evil/step_00000001.pt")
    with pytest.raises(UserError, match="step_00000009.pt does not exist"):
        ckpt.load(f"gs://{BUCKET}/evil/step_00000009.pt")


def test_transient_failures_are_retried_with_exponential_backoff(tmp_path):
    waits: list[float] = []
    ckpt = GcsCheckpointer(f"memory://{tmp_path.name}/flaky", retries=3, backoff_s=0.5, sleep=waits.append)
    real_pipe = ckpt.fs.pipe_file
    failures = {"left": 2}

    def flaky_pipe(path, data, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionResetError("connection reset by peer")
        return real_pipe(path, data, **kwargs)

    ckpt.fs.pipe_file = flaky_pipe
    location = ckpt.save(5, small_state(5))
    assert waits == [0.5, 1.0]
    assert ckpt.latest() == location

    failures["left"] = 100
    waits.clear()
    with pytest.raises(StorageError, match=r"upload .*step_00000006.pt failed after 4 attempts: "
                                           r"ConnectionResetError"):
        ckpt.save(6, small_state(6))
    assert waits == [0.5, 1.0, 2.0]
    assert ckpt.latest() == location


def test_state_that_weights_only_cannot_load_is_refused_before_upload(tmp_path):
    import numpy as np

    ckpt = GcsCheckpointer(f"memory://{tmp_path.name}/plain")
    with pytest.raises(TypeError, match=r"state\['rng'\] is a numpy.ndarray"):
        ckpt.save(1, {"rng": np.zeros(3)})
    assert ckpt.latest() is None


def test_missing_gcsfs_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # `import gcsfs` now raises ImportError
    with pytest.raises(UserError, match=r"pip install 'octfw\[gcs\]'"):
        build(GcsCheckpointConfig(dir=Location("gs://bucket/run")), make_ctx())


def test_dir_is_required():
    with pytest.raises(TypeError):
        GcsCheckpointConfig()  # type: ignore[call-arg]


# --- whole runs -------------------------------------------------------------

# A guard that calls a test's function at a chosen log step (here: stop the emulator).
STOPPER_PLUGIN = '''
import attrs
from octfw.hookspecs import hookimpl

ON_LOG_STEP = {}

@attrs.frozen
class StopperConfig:
    pass

class Stopper:
    def before_step(self, inputs):
        return None
    def at_log_step(self, update_step, metrics):
        action = ON_LOG_STEP.pop(update_step, None)
        if action is not None:
            action()

@hookimpl
def octfw_register_guards(register):
    register("stopper", StopperConfig, lambda c, ctx: Stopper(), "runs a test's action at a log step")
'''


@pytest.fixture
def stopper(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("stopper-site")
    make_dist(root, "octfw-stopper", "plug_stopper", STOPPER_PLUGIN)
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("plug_stopper", None)
    module = importlib.import_module("plug_stopper")
    yield module
    sys.modules.pop("plug_stopper", None)


def stop_once_saved(emulator, prefix: str) -> None:
    """Stop the store once the background save in flight has written its pointer (saves
    run beside training, so the log step can come before the save is done)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if "latest" in objects(emulator, prefix):
                break
        except FileNotFoundError:  # nothing under the prefix yet
            pass
        assert time.monotonic() < deadline, "the checkpoint was never written"
        time.sleep(0.05)
    emulator.stop()


def octfw_run(recipe: Path, *extra: str) -> int:
    return main(["run", str(recipe), *extra])


def summary_of(recipe: Path) -> dict:
    run_dir = sorted((recipe.parent / "runs" / recipe.stem).iterdir())[-1]
    return json.loads((run_dir / "summary.json").read_text())


def test_training_checkpoints_to_gcs_and_resume_auto_continues(bucket, tiny_recipe):
    url = f"gs://{BUCKET}/train"
    # extended below (--allow-recipe-change): a constant LR cannot rise when the run grows
    sets = ["--set", "checkpointer.name=gcs", "--set", f"checkpointer.dir={url}", "--set", "scheduler.name=constant",
            "--set", "scheduler.ema_shape=constant"]
    assert octfw_run(tiny_recipe, *sets, "--set", "run.max_steps=2") == 0
    assert summary_of(tiny_recipe)["checkpoint"] == f"{url}/step_00000002.pt"

    assert octfw_run(tiny_recipe, *sets, "--set", "run.max_steps=3", "--resume", "auto", "--allow-recipe-change") == 0
    summary = summary_of(tiny_recipe)
    assert summary["update_steps"] == 3 and summary["failed_saves"] == []
    assert summary["checkpoint"] == f"{url}/step_00000003.pt"
    run_dir = Path(summary["run_dir"])
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the resumed run went on from step 2, in the same folder
    assert objects(bucket, "train") == ["latest", "step_00000002.pt", "step_00000002.pt.sha256", "step_00000003.pt", "step_00000003.pt.sha256"]


def test_store_lost_mid_run_the_final_state_goes_to_the_fallback_and_reaches_the_store_once_back(
        bucket, tiny_recipe, stopper):
    from octfw.engine.trainer import SAVE_FAILED_EXIT_CODE

    url = f"gs://{BUCKET}/lost"
    stopper.ON_LOG_STEP[3] = lambda: stop_once_saved(bucket, "lost")  # after the step-2 save, before step 4
    text = tiny_recipe.read_text() + '\n[[guard]]\nname = "stopper"\n'
    tiny_recipe.write_text(text)
    sets = ["--set", "checkpointer.name=gcs", "--set", f"checkpointer.dir={url}",
            "--set", "checkpointer.retries=1", "--set", "checkpointer.backoff_s=0.05",
            "--set", "checkpointer.timeout_s=3", "--set", "engine.checkpoint_every_steps=2"]
    # The run trains to the end, but its weights never reached the store: that is a failure.
    assert octfw_run(tiny_recipe, *sets) == SAVE_FAILED_EXIT_CODE
    summary = summary_of(tiny_recipe)
    assert summary["update_steps"] == 4 and summary["final_save_failed"] is True
    assert summary["checkpoint"] == f"{url}/step_00000002.pt"
    [failed] = summary["failed_saves"]
    assert failed.startswith("step 4: ") and "failed after 2 attempts" in failed
    fallback = Path(summary["fallback_checkpoint"])
    assert fallback.name == "step_00000004.pt" and fallback.exists()

    # The store comes back (empty: the emulator keeps nothing in memory across restarts).
    bucket.start()
    bucket.make_bucket(BUCKET)
    stopper.ON_LOG_STEP.clear()
    # --resume auto does not take the run as finished: it continues from the fallback copy and
    # writes it to the store, then drops the copy.
    assert octfw_run(tiny_recipe, *sets, "--resume", "auto") == 0
    summary = summary_of(tiny_recipe)
    assert summary["final_save_failed"] is False and summary["checkpoint"] == f"{url}/step_00000004.pt"
    assert "step_00000004.pt" in objects(bucket, "lost") and not fallback.parent.exists()
    restored = GcsCheckpointer(url).load(f"{url}/step_00000004.pt")
    assert restored["update_step"] == 4
    assert octfw_run(tiny_recipe, *sets, "--resume", "auto") == 0  # now finished: nothing to do


def test_resume_auto_on_a_fresh_disk_continues_from_the_gcs_checkpoint(bucket, tiny_recipe):
    """A recreated spot VM: the local run folders are gone, the gs:// checkpoints are not."""
    import shutil

    url = f"gs://{BUCKET}/spot"
    # extended below (--allow-recipe-change): a constant LR cannot rise when the run grows
    sets = ["--set", "checkpointer.name=gcs", "--set", f"checkpointer.dir={url}", "--set", "scheduler.name=constant",
            "--set", "scheduler.ema_shape=constant"]
    assert octfw_run(tiny_recipe, *sets, "--set", "run.max_steps=2") == 0
    shutil.rmtree(tiny_recipe.parent / "runs")
    assert octfw_run(tiny_recipe, *sets, "--set", "run.max_steps=3", "--resume", "auto", "--allow-recipe-change") == 0
    summary = summary_of(tiny_recipe)
    assert summary["update_steps"] == 3 and summary["checkpoint"] == f"{url}/step_00000003.pt"
    steps = [json.loads(line)["step"] for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3]  # a new run folder, continuing from the step-2 checkpoint


def test_one_writer_per_gcs_checkpoint_folder_through_a_lease_that_expires_when_its_holder_is_gone(
        bucket, caplog):
    """Two VMs (a recreated spot VM and the old one, say) on one gs:// checkpoint folder."""
    from octfw.storage.owner import FolderInUse

    url = f"gs://{BUCKET}/leased"
    first, second = GcsCheckpointer(url), GcsCheckpointer(url)
    first.claim(1024)
    lease = json.loads(bucket.filesystem().cat_file(f"{BUCKET}/leased/owner.lock"))
    assert lease["pid"] == os.getpid() and lease["expires"] > time.time()
    with pytest.raises(FolderInUse, match=rf"checkpoint folder {url} is in use by pid {os.getpid()}"):
        second.claim(1024)
    first.release()
    assert not bucket.filesystem().exists(f"{BUCKET}/leased/owner.lock")
    second.claim(1024)  # free again
    second.release()

    # A holder whose VM vanished stops renewing: once its lease has expired, the folder is taken over.
    stale = {"host": "old-vm", "pid": 4242, "started": "2026-11-24T00:00:00+00:00", "expires": time.time() - 1}
    bucket.filesystem().pipe_file(f"{BUCKET}/leased/owner.lock", json.dumps(stale).encode())
    first.claim(1024)
    assert "taking over checkpoint folder" in caplog.text and "pid 4242 on old-vm" in caplog.text
    first.release()


def test_an_unreachable_gcs_checkpoint_folder_is_refused_in_seconds_before_training(tiny_recipe, monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    assert octfw_run(tiny_recipe, "--set", "checkpointer.name=gcs", "--set", "checkpointer.dir=gs://away/run") == 2
    assert time.monotonic() - started < 60  # building and a first batch included; the probe itself takes < 5 s
    error = capsys.readouterr().err
    assert f"checkpointer.dir = 'gs://away/run': cannot reach http://127.0.0.1:{port}" in error
    assert not (tiny_recipe.parent / "runs" / "tiny").exists() or not any((tiny_recipe.parent / "runs" / "tiny").iterdir())


def test_store_stopped_and_restarted_mid_run_the_saves_in_between_fail_and_the_run_ends_saved(
        bucket, tiny_recipe, stopper):
    url = f"gs://{BUCKET}/restart"

    def restart() -> None:  # the store is back (empty: the emulator keeps its objects in memory)
        time.sleep(8)  # longer than the step-4 save's two attempts of 3 s: it has failed by now
        bucket.start()
        bucket.make_bucket(BUCKET)

    stopper.ON_LOG_STEP[3] = lambda: stop_once_saved(bucket, "restart")  # after the step-2 save
    stopper.ON_LOG_STEP[5] = restart  # after the step-4 save failed
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[[guard]]\nname = "stopper"\n')
    code = octfw_run(tiny_recipe, "--set", "run.max_steps=8", "--set", "checkpointer.name=gcs",
                     "--set", f"checkpointer.dir={url}", "--set", "checkpointer.retries=1",
                     "--set", "checkpointer.backoff_s=0.05", "--set", "checkpointer.timeout_s=3",
                     "--set", "engine.checkpoint_every_steps=2")
    assert code == 0
    summary = summary_of(tiny_recipe)
    assert summary["final_save_failed"] is False and summary["checkpoint"] == f"{url}/step_00000008.pt"
    assert [failure.split(":")[0] for failure in summary["failed_saves"]] == ["step 4"]
    assert GcsCheckpointer(url).latest() == f"{url}/step_00000008.pt"


def test_a_store_down_for_good_while_saves_retry_is_named_unreachable_and_no_save_goes_unsaid(
        bucket, tiny_recipe, stopper, capsys):
    """gcsfs keeps retrying the save in flight while the store is down: the saves that come due
    meanwhile cannot start. Each is a warning line and a failed save in the summary, and every
    line says why: the store is unreachable, not merely 'still being written'."""
    from octfw.engine.trainer import SAVE_FAILED_EXIT_CODE

    url = f"gs://{BUCKET}/down"
    stopper.ON_LOG_STEP[3] = lambda: stop_once_saved(bucket, "down")  # after the step-2 save
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[[guard]]\nname = "stopper"\n')
    capsys.readouterr()
    code = octfw_run(tiny_recipe, "--set", "run.max_steps=40", "--set", "checkpointer.name=gcs",
                     "--set", f"checkpointer.dir={url}", "--set", "checkpointer.retries=20",
                     "--set", "checkpointer.backoff_s=0.5", "--set", "checkpointer.timeout_s=3",
                     "--set", "engine.checkpoint_every_steps=2", "--set", "engine.save_deadline_s=2")
    err = capsys.readouterr().err
    assert code == SAVE_FAILED_EXIT_CODE, err
    assert "Traceback" not in err
    skipped = [line for line in err.splitlines() if "the next due save tries again" in line]
    assert skipped and all("the store is unreachable: cannot reach http://127.0.0.1:" in line for line in skipped)
    summary = summary_of(tiny_recipe)
    assert len(summary["failed_saves"]) >= len(skipped) + 1  # the skipped ones count, the final one too
    [final] = [line for line in err.splitlines() if line.startswith("octfw: error:")]
    assert "the store is unreachable" in final and summary["fallback_checkpoint"]
