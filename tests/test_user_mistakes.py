"""User mistakes through the real command line: one ``octfw: error:`` line naming the
file, key or value, exit code 2, and no traceback (issue #26, item 6)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_RECIPE, make_dist

REPO = Path(__file__).resolve().parents[1]


def octfw(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``octfw ARGS`` in a subprocess, run in ``cwd`` with its caches under it."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), "PJRT_DEVICE": "CPU",
                   "OCTFW_CACHE_DIR": str(cwd / "cache"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "octfw.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=environment, timeout=300)


def refused(out: subprocess.CompletedProcess) -> str:
    """The one ``octfw: error:`` line of a command that refused a user mistake."""
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("octfw: error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- 1. a recipe that is not UTF-8 text -------------------------------------


def a_checkpoint(path: Path) -> Path:
    """A real torch checkpoint: a zip of pickles, not text."""
    import torch

    torch.save({"model": {"weight": torch.arange(64, dtype=torch.float32)}}, path)
    return path


def test_a_checkpoint_given_as_the_recipe_is_named_not_a_recipe(tmp_path):
    checkpoint = a_checkpoint(tmp_path / "step_00000004.pt")
    line = refused(octfw("show", str(checkpoint), cwd=tmp_path))
    assert line.startswith(f"octfw: error: {checkpoint}: not a recipe: byte 0x")
    assert "is not UTF-8 text" in line


def test_a_recipe_that_extends_a_file_that_is_not_utf8_names_that_file(tmp_path):
    a_checkpoint(tmp_path / "base.pt")
    child = write(tmp_path / "child.toml", 'extends = "base.pt"\n')
    line = refused(octfw("check", str(child), cwd=tmp_path))
    assert line.startswith(f"octfw: error: {tmp_path / 'base.pt'}: not a recipe")


# --- 2. a recipe with a UTF-8 byte order mark -------------------------------


def test_a_recipe_with_a_utf8_byte_order_mark_reads_like_one_without(tmp_path):
    plain = write(tmp_path / "plain.toml", TINY_RECIPE)
    marked = tmp_path / "marked.toml"
    marked.write_bytes(b"\xef\xbb\xbf" + TINY_RECIPE.encode("utf-8"))
    without, with_mark = octfw("show", str(plain), cwd=tmp_path), octfw("show", str(marked), cwd=tmp_path)
    assert (without.returncode, with_mark.returncode) == (0, 0), with_mark.stderr
    # the same recipe; only the run name that octfw show derives from the file name differs, and the
    # file its warnings name (this recipe has no grad-clip guard)
    assert with_mark.stdout.replace('# name = "marked"', '# name = "plain"').replace(
        str(marked), str(plain)) == without.stdout


# --- 3. a cache folder that cannot be written --------------------------------


def test_a_cache_dir_under_a_regular_file_is_refused_at_start_naming_run_cache_dir(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    recipe = write(tmp_path / "tiny.toml", TINY_RECIPE)
    cache = tmp_path / "afile" / "cache"
    line = refused(octfw("check", str(recipe), "--set", f'run.cache_dir="{cache}"', cwd=tmp_path))
    assert line == (f"octfw: error: run.cache_dir = '{cache}': cannot write there (Not a directory); "
                    "set run.cache_dir or OCTFW_CACHE_DIR to a writable folder")


def test_octfw_lr_by_epochs_refuses_an_unwritable_cache_dir_before_building_the_dataset(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    recipe = write(tmp_path / "tiny.toml", TINY_RECIPE.replace("max_steps = 4", "epochs = 2"))
    out = octfw("lr", str(recipe), cwd=tmp_path,
                env={"OCTFW_CACHE_DIR": str(tmp_path / "afile" / "cache")})
    assert refused(out).startswith(f"octfw: error: OCTFW_CACHE_DIR={tmp_path}/afile/cache: cannot write there")


@pytest.fixture
def read_only_folder(tmp_path):
    """A real read-only filesystem (a tmpfs mounted ro): root can write anywhere else."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root and mount rights): "
                    f"{mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_an_octfw_cache_dir_on_a_read_only_mount_is_refused_at_start(tmp_path, read_only_folder):
    recipe = write(tmp_path / "tiny.toml", TINY_RECIPE)
    out = octfw("check", str(recipe), cwd=tmp_path, env={"OCTFW_CACHE_DIR": str(read_only_folder)})
    assert refused(out) == (f"octfw: error: OCTFW_CACHE_DIR={read_only_folder}: cannot write there "
                            "(Read-only file system); set run.cache_dir or OCTFW_CACHE_DIR to a writable folder")


def test_the_default_cache_folder_on_a_read_only_home_is_refused_with_how_to_move_it(tmp_path,
                                                                                  read_only_folder):
    recipe = write(tmp_path / "tiny.toml", TINY_RECIPE)
    out = octfw("check", str(recipe), cwd=tmp_path, env={"OCTFW_CACHE_DIR": "", "HOME": str(read_only_folder)})
    line = refused(out)
    assert line.startswith(f"octfw: error: the default cache folder {read_only_folder}/.cache/octfw: "
                           "cannot write there (Read-only file system)")
    assert line.endswith("set run.cache_dir or OCTFW_CACHE_DIR to a writable folder")


def test_a_writable_cache_folder_is_created_and_left_without_probe_files(tmp_path):
    from octfw.storage.files import require_writable_folder

    require_writable_folder(tmp_path / "new" / "cache", "run.cache_dir")
    assert list((tmp_path / "new" / "cache").iterdir()) == []


# --- 4. a plugin whose factory raises ----------------------------------------

BROKEN_PLUGIN = '''
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class Config:
    pass

def build(config, ctx):
    raise RuntimeError("cannot open the vendor SDK\\nsecond line of detail")

@hookimpl
def octfw_register_datasets(register):
    register("broken-data", Config, build, "Always fails to build.")
'''


def test_a_plugin_factory_that_raises_is_one_line_naming_component_stage_and_distribution(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "octfw-broken-data", "broken_data", BROKEN_PLUGIN, version="0.4.2")
    recipe = write(tmp_path / "tiny.toml", TINY_RECIPE)
    env = {"PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    args = ("check", str(recipe), "--set", "dataset.name=broken-data")
    line = refused(octfw(*args, cwd=tmp_path, env=env))
    assert line == ("octfw: error: dataset 'broken-data' from octfw-broken-data 0.4.2 failed to build: "
                    "RuntimeError: cannot open the vendor SDK (octfw --debug shows the traceback)")
    debug = octfw("--debug", *args, cwd=tmp_path, env=env)
    assert debug.returncode != 0
    assert 'raise RuntimeError("cannot open the vendor SDK' in debug.stderr  # the plugin's own frame


# --- 5. a component that is not installed -------------------------------------


def test_an_unknown_component_hints_that_its_plugin_may_be_missing(tmp_path):
    recipe = write(tmp_path / "tiny.toml", TINY_RECIPE)
    out = octfw("show", str(recipe), "--set", "model.name=retfound", cwd=tmp_path)
    refused(out)
    assert ("  --set model.name=retfound: unknown model component 'retfound'; available: mae3d, vjepa3d; "
            "is the plugin that provides it installed? (octfw list --stage model)") in out.stderr.splitlines()


def test_a_misspelled_component_keeps_its_did_you_mean_without_the_plugin_hint(tmp_path):
    recipe = write(tmp_path / "tiny.toml", TINY_RECIPE)
    out = octfw("show", str(recipe), "--set", "model.name=vjepa", cwd=tmp_path)
    refused(out)
    assert ("  --set model.name=vjepa: unknown model component 'vjepa' (did you mean 'vjepa3d'?); available: mae3d, vjepa3d"
            in out.stderr.splitlines())


def test_list_with_a_plural_stage_suggests_the_stage(tmp_path):
    line = refused(octfw("list", "--stage", "models", cwd=tmp_path))
    assert line.startswith("octfw: error: --stage 'models': unknown stage (did you mean 'model'?); stages: ")


# --- 6. a gs:// dataset whose endpoint cannot be reached ----------------------


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("path", ["gs://cohorts/oct/", "gs://cohorts/oct/manifest.jsonl"])
def test_an_unreachable_gcs_endpoint_is_named_within_seconds_not_a_missing_path(tmp_path, path):
    port = closed_port()
    recipe = write(tmp_path / "gs.toml", TINY_RECIPE.replace(
        'name = "synthetic-oct"\nn_volumes = 8', f'name = "dicom"\npath = "{path}"'))
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    started = time.monotonic()
    out = octfw("check", str(recipe), cwd=tmp_path, env=env)
    took = time.monotonic() - started
    assert refused(out) == (f"octfw: error: dataset.path = '{path}': cannot reach http://127.0.0.1:{port} "
                            "(Connection refused); the endpoint is STORAGE_EMULATOR_HOST's")
    said = [line for line in out.stderr.splitlines() if not line.startswith("octfw: warning:")]  # the recipe's own
    assert len(said) == 1  # no gcsfs or aiohttp line besides it
    assert took < 30, f"took {took:.0f} s (gcsfs's retries alone take over a minute)"


def test_a_running_gcs_endpoint_passes_the_reachability_check(gcs):
    from octfw.storage.reach import require_reachable

    require_reachable("gs://any-bucket/cohort/", "dataset.path")  # raises nothing


def test_library_log_records_stay_off_the_console(tmp_path):
    # A subprocess: pytest's own logging handlers would hide Python's last-resort
    # handler, which is what prints a library's records when nothing else does.
    program = """if True:
        import logging
        from octfw.display.logs import setup_console_logging
        setup_console_logging()
        try:
            raise ConnectionRefusedError(111, "Connect call failed")
        except ConnectionRefusedError:
            logging.getLogger("gcsfs").error("_request out of retries on exception", exc_info=True)
        logging.getLogger("aiohttp.client").warning("Unclosed client session")
        logging.getLogger("octfw.plugins.datasets").warning("octfw's own warnings still show")
    """
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "octfw: warning: octfw's own warnings still show\n"


# --- 7. quarantine: once per file; single-frame 2D files; counts say files ---


@pytest.fixture
def mixed_cohort(tmp_path):
    """Three real OCT volumes, a file that is no DICOM, a CT slice (pydicom's
    CT_small.dcm) and a single-frame OCT B-scan, in one cohort folder."""
    import shutil

    import numpy as np
    from pydicom.data import get_testdata_file

    from octfw.dicom.writing import write_oct_dicom

    folder = tmp_path / "cohort"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        write_oct_dicom(folder / f"vol{i}.dcm", rng.integers(0, 4096, (4, 16, 16), dtype=np.uint16),
                        (0.2, 0.01, 0.01), "Heidelberg Engineering", "Spectralis")
    (folder / "notes.dcm").write_bytes(b"not a DICOM file at all")
    shutil.copy(get_testdata_file("CT_small.dcm"), folder / "ct_slice.dcm")
    write_oct_dicom(folder / "bscan.dcm", rng.integers(0, 4096, (1, 16, 16), dtype=np.uint16),
                    (0.2, 0.01, 0.01), "TOPCON Corporation", "3D OCT-2000")
    return folder


def test_single_frame_2d_files_are_quarantined_as_not_a_3d_volume(mixed_cohort):
    from octfw.dicom.dataset import DicomDataset
    from octfw.display.errors import CorruptFile

    dataset = DicomDataset.from_location(mixed_cohort)
    reasons = {}
    for index in range(len(dataset)):
        try:
            dataset.load(index)
        except CorruptFile as bad:
            reasons[Path(bad.url).name] = bad.reason
    single = "single-frame 2D image; a 3D OCT volume needs several B-scans"
    assert reasons["ct_slice.dcm"] == reasons["bscan.dcm"] == single
    assert set(reasons) == {"ct_slice.dcm", "bscan.dcm", "notes.dcm"}


def _transform(tmp_path):
    from octfw.plugins.transforms.oct_standard import OCTStandardConfig, build
    from octfw.types import BuildContext

    ctx = BuildContext(recipe_dir=tmp_path, cache_dir=tmp_path / "cache", run_dir=None, seed=0,
                       image_size=(4, 16, 16), patch_size=(2, 8, 8))
    return build(OCTStandardConfig(image_size=(4, 16, 16), cache=False), ctx)


def test_each_broken_file_is_in_quarantine_jsonl_once_across_epochs_workers_and_a_resume(tmp_path,
                                                                                          mixed_cohort):
    import itertools
    import json

    from octfw.dicom.dataset import DicomDataset
    from octfw.engine.data import SampleSource, make_loader
    from octfw.engine.quarantine import Quarantine

    dataset = DicomDataset.from_location(mixed_cohort)
    source = SampleSource(dataset, _transform(tmp_path), seed=0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for _process in range(2):  # a run, then the same run resumed: a new Quarantine on the same folder
        quarantine = Quarantine(run_dir)
        loader = make_loader(source, batch_size=2, seed=0, start=0, num_workers=2)
        for batch in itertools.islice(loader, 9):  # three epochs of six files, two workers
            quarantine.record(batch["quarantined"])
    lines = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert sorted(Path(entry["url"]).name for entry in lines) == ["bscan.dcm", "ct_slice.dcm", "notes.dcm"]
    assert len(quarantine) == 3


def test_a_quarantine_line_cut_short_by_a_kill_does_not_stop_a_resume(tmp_path):
    from octfw.engine.quarantine import Quarantine

    (tmp_path / "quarantine.jsonl").write_text('{"url": "/a.dcm", "reason": "truncated"}\n{"url": "/b.d')
    quarantine = Quarantine(tmp_path)
    assert quarantine.seen == {"/a.dcm": "truncated"}


def test_counts_before_reading_say_files_and_series(tmp_path, mixed_cohort):
    import numpy as np

    from octfw.dicom.dataset import DicomDataset
    from octfw.dicom.writing import write_oct_dicom
    from octfw.engine.domains import domain_report

    # Three B-scans of one series, one file each: one series entry.
    for i in range(3):
        write_oct_dicom(mixed_cohort / "series" / f"b{i}.dcm", np.full((1, 8, 8), i, np.uint16),
                        (0.2, 0.01, 0.01), "Carl Zeiss Meditec", "Cirrus", uid_entropy=["series", "1"])
    dataset = DicomDataset.from_location(mixed_cohort)
    assert domain_report(dataset).startswith("dataset: 6 files and 1 series in ")
    assert repr(dataset) == f"DicomDataset(6 files, 1 series from {mixed_cohort})"


def test_a_batch_that_skipped_one_file_twice_records_it_once(tmp_path):
    from octfw.engine.quarantine import Quarantine

    Quarantine(tmp_path).record([("/a.dcm", "truncated"), ("/a.dcm", "truncated")])
    assert (tmp_path / "quarantine.jsonl").read_text().count("/a.dcm") == 1


# --- 8. regressions found by the fuzz (tests/test_fuzz.py) --------------------


def test_a_set_value_that_is_not_utf8_is_refused_not_a_crash_when_printed(tmp_path):
    recipe = write(tmp_path / "tiny.toml", TINY_RECIPE)
    # Bytes on the command line, as a shell passes a Latin-1 name; stdout strict UTF-8, as a terminal's.
    out = subprocess.run([sys.executable, "-m", "octfw.cli", "show", str(recipe), "--set", b"run.name=caf\xe9"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"})
    assert refused(out) == ("octfw: error: --set 'run.name=caf\\udce9': not UTF-8 text (the command line "
                            "passed bytes that are not UTF-8)")


def test_a_manifest_label_beyond_any_float_is_a_user_error(tmp_path):
    from octfw.dicom.manifest import read_manifest
    from octfw.display.errors import UserError

    manifest = write(tmp_path / "m.jsonl", '{"path": "a.dcm", "label": 1' + "0" * 400 + "}\n")
    with pytest.raises(UserError, match=r"m.jsonl:1: label must be an integer, got 10{36}\.\.\.$"):
        read_manifest(str(manifest))


def test_a_manifest_series_row_of_an_unknown_protocol_is_a_user_error(tmp_path):
    from octfw.dicom.dataset import DicomDataset
    from octfw.display.errors import UserError

    manifest = write(tmp_path / "m.csv", "path\nnosuch://bucket/scan/\n")
    with pytest.raises(UserError, match="'nosuch://bucket/scan/': Protocol not known: nosuch"):
        DicomDataset.from_location(manifest)


def test_a_path_with_a_newline_stays_on_the_error_line(tmp_path):
    recipe = write(tmp_path / "nl.toml", TINY_RECIPE.replace(
        'name = "synthetic-oct"\nn_volumes = 8', f'name = "dicom"\npath = "{tmp_path}/new\\nline"'))
    line = refused(octfw("check", str(recipe), cwd=tmp_path))
    assert line == f"octfw: error: dataset.path does not exist: {tmp_path}/new\\nline"


def test_a_recipe_key_with_a_newline_stays_on_its_problem_line(tmp_path):
    recipe = write(tmp_path / "nl.toml", TINY_RECIPE.replace("[run]\n", '[run]\n"a\\nb" = 1\n'))
    out = octfw("show", str(recipe), cwd=tmp_path)
    refused(out)
    assert out.stderr.splitlines()[1].startswith("  run.a\\nb: unknown key")


def test_a_csv_manifest_with_a_lone_carriage_return_in_a_cell_is_a_user_error(tmp_path):
    from octfw.dicom.manifest import read_manifest
    from octfw.display.errors import UserError

    manifest = tmp_path / "m.csv"
    manifest.write_bytes(b"path,label\nvol.dcm,1\nscan\rb.dcm,0\n")
    with pytest.raises(UserError, match=r"m.csv:\d: not valid CSV \(new-line character seen in unquoted field\)$"):
        read_manifest(str(manifest))
