"""Property-based fuzz: whatever recipe text, ``--set`` item or manifest row a user
hands octfw, it answers with exit code 0, 1 or 2, never an unexpected exception
or a traceback, and writes nothing while it only reads.

Recipes and ``--set`` items go through ``octfw.cli.main`` in this process (tens
of milliseconds a call); manifests through the ``dicom`` dataset's factory and
the data pipeline's sample loading, as ``octfw check`` does. Derandomized, so CI
sees the same examples every time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from octfw.cli.main import main
from octfw.display.errors import UserError

from conftest import TINY_RECIPE

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@contextlib.contextmanager
def sandbox():
    """A fresh folder as the current directory and cache; yields it."""
    with tempfile.TemporaryDirectory(prefix="octfw-fuzz-") as parent:
        folder = Path(parent)
        before_cwd, before_cache = os.getcwd(), os.environ.get("OCTFW_CACHE_DIR")
        os.chdir(folder)
        os.environ["OCTFW_CACHE_DIR"] = str(folder / "cache")
        try:
            yield folder
        finally:
            os.chdir(before_cwd)
            if before_cache is None:
                os.environ.pop("OCTFW_CACHE_DIR", None)
            else:
                os.environ["OCTFW_CACHE_DIR"] = before_cache


def octfw_in_process(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``octfw ARGS`` run by ``main``.

    stdout is UTF-8 with strict errors, like a terminal's: a value that cannot
    be printed must be refused, not crash the print."""
    out_bytes = io.BytesIO()
    stdout = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict")
    stderr = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's usage errors and --help
            code = exit.code if isinstance(exit.code, int) else 2
        stdout.flush()
    return code, out_bytes.getvalue().decode("utf-8"), stderr.getvalue()


def assert_answered(code: int, err: str) -> None:
    """Exit 0, 1 or 2, no traceback, and every line of stderr octfw's own: an error or
    warning line, a recipe problem (indented), or argparse's usage."""
    assert code in (0, 1, 2), (code, err)
    assert "Traceback" not in err, err
    for line in err.splitlines():
        assert line.startswith(("octfw", "usage:", " ")), err


# --- (a) arbitrary recipe text ------------------------------------------------

RECIPE_LINES = TINY_RECIPE.strip().splitlines()

# Text a user could type, including the characters TOML gives meaning to.
typed = st.text(alphabet=st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs"))
                | st.sampled_from("=[]{}\"'.,#\\\n\t\r \x00\x7f\ufeff"), max_size=30)

toml_values = st.one_of(
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).replace("inf", "inf")),
    st.sampled_from(["nan", "inf", "-inf", "true", "false", "0x1F", "1_000", "1979-05-27", "[]", "{}",
                     '""', "''", '"none"', '"null"', "[1, 2, 3]", "[8, 32, 32]", '{ name = "x" }',
                     "[[1], [2]]", "99999999999999999999999", "-1", "0", "1e999"]),
    typed.map(json.dumps),  # a quoted string, any characters
    typed,  # bare text: often not TOML at all
    st.lists(st.integers(-10, 100), max_size=4).map(str),
)


@st.composite
def mutated_recipe(draw) -> str:
    lines = list(RECIPE_LINES)
    for _ in range(draw(st.integers(1, 5))):
        if not lines:
            break
        index = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(["value", "key", "delete", "duplicate", "insert", "table"]))
        key, sep, value = lines[index].partition("=")
        if kind == "value" and sep:
            lines[index] = f"{key}= {draw(toml_values)}"
        elif kind == "key" and sep:
            lines[index] = f"{draw(typed)} = {value.strip()}"
        elif kind == "delete":
            del lines[index]
        elif kind == "duplicate":
            lines.insert(index, lines[index])
        elif kind == "insert":
            lines.insert(index, draw(st.one_of(typed, st.builds(lambda k, v: f"{k} = {v}", typed, toml_values))))
        elif kind == "table":
            lines.insert(index, draw(st.sampled_from(["[{}]", "[[{}]]"])).format(draw(typed)))
    return "\n".join(lines) + "\n"


def show_recipe(content: bytes) -> None:
    with sandbox() as folder:
        recipe = folder / "recipe.toml"
        recipe.write_bytes(content)
        before = listing(folder)
        code, _out, err = octfw_in_process("show", str(recipe))
        assert_answered(code, err)
        assert listing(folder) == before


@FUZZ
@given(st.binary(max_size=400) | st.binary(max_size=200).map(lambda b: b"\xef\xbb\xbf" + b))
def test_any_bytes_as_a_recipe_are_answered_not_crashed(content):
    show_recipe(content)


@FUZZ
@given(mutated_recipe())
def test_any_mutation_of_a_valid_recipe_is_answered_not_crashed(text):
    show_recipe(text.encode("utf-8", "surrogatepass"))


# --- (b) arbitrary --set items --------------------------------------------------

# Real keys, so that values get past the key checks to structuring and printing.
real_keys = st.sampled_from([
    "run.name", "run.seed", "run.max_steps", "run.output_dir", "run.cache_dir", "run.device", "engine.base_lr",
    "engine.per_device_batch", "dataset.name", "dataset.n_volumes", "transform.image_size", "model.name",
    "model.preset", "model.patch_size", "scheduler.warmup", "guard.0.name", "logger.0.name", "logger.5.name",
    "extends", "run"])
any_keys = st.one_of(
    typed,
    st.lists(st.sampled_from(["run", "engine", "dataset", "model", "guard", "logger", "0", "1", "99", "name",
                              "base_lr", "image_size", "seed", "cache_dir", "output_dir", ""]) | typed,
             min_size=1, max_size=4).map(".".join),
)
# Lone surrogates: what Python makes of command-line bytes that are not UTF-8.
# (joined from a list: st.text would filter them out with codec="utf-8").
argv_text = st.lists(st.characters(codec="utf-8") | st.sampled_from("\udcff\udc80"), max_size=20).map("".join)
set_items = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", any_keys, toml_values | argv_text),
    argv_text,  # no '=' or several, anywhere
    st.builds(lambda a, b: f"{a}={b}=", argv_text, argv_text),
)
# Options that keep any string: what they hold is printed back by octfw show.
string_keys = st.sampled_from(["run.name", "run.output_dir", "run.cache_dir"])


@FUZZ
@given(st.lists(set_items, min_size=1, max_size=3))
def test_any_set_items_are_answered_not_crashed(items):
    with sandbox() as folder:
        recipe = folder / "tiny.toml"
        recipe.write_text(TINY_RECIPE, encoding="utf-8")
        before = listing(folder)
        code, _out, err = octfw_in_process("show", str(recipe), *(f"--set={item}" for item in items))
        assert_answered(code, err)
        assert listing(folder) == before


@FUZZ
@given(key=real_keys | string_keys, value=toml_values | argv_text)
def test_any_value_of_a_real_key_is_answered_not_crashed(key, value):
    test_any_set_items_are_answered_not_crashed.hypothesis.inner_test([f"{key}={value}"])


# --- (c) arbitrary manifest rows --------------------------------------------------

# Paths a manifest may hold (never "/": a series row walks the whole folder).
manifest_paths = st.one_of(
    st.sampled_from(["vol.dcm", "./vol.dcm", "missing.dcm", "series/", "missing/", ".", "..", "",
                     "file:///nonexistent/x.dcm", "nosuch://bucket/x.dcm", "nosuch://bucket/dir/",
                     "memory://fuzz/a.dcm", "memory://fuzz/dir/", "vol.dcm/", "\x00", "a\nb"]),
    typed,
)
cells = st.one_of(st.sampled_from(["train", "val", " ", [1], {"a": 1}]), st.none(), typed, st.integers(),
                  st.floats(), st.booleans())
labels = st.one_of(st.sampled_from(["1", "1.0", "1.5", "-3", "x", "nan", "1e400", 10**400, -(2**70), 2**63,
                                    float("inf"), float("nan"), True]), cells)


@st.composite
def manifest_row(draw) -> dict:
    """A valid row with up to two of its cells replaced by odd values, or a column dropped
    or added: a row with every cell random fails at its first cell and tests little else."""
    row = {"path": draw(st.sampled_from(["vol.dcm", "./vol.dcm", "series/", "missing.dcm"])),
           "domain": draw(st.sampled_from(["heidelberg", "zeiss", None])),
           "split": draw(st.sampled_from(["train", "val", None])),
           "label": draw(st.sampled_from([0, 1, None])),
           "patient": draw(st.sampled_from(["p1", "p2", None]))}
    odd = {"path": manifest_paths, "label": labels, "domain": cells, "split": cells, "patient": cells}
    for _ in range(draw(st.integers(1, 3))):
        column = draw(st.sampled_from([*odd, "drop", "add"]))
        if column == "drop":
            row.pop(draw(st.sampled_from(sorted(odd))), None)
        elif column == "add":  # a column of the user's own bookkeeping
            row[draw(typed)] = draw(cells)
        else:
            row[column] = draw(odd[column])
    return row


manifest_rows = st.lists(manifest_row(), min_size=1, max_size=4)


def _jsonl(rows, raw_lines) -> bytes:
    lines = [json.dumps(row) for row in rows] + raw_lines
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def _csv(rows, raw_lines) -> bytes:
    import csv

    buffer = io.StringIO()
    columns = sorted({str(k) for row in rows for k in row}) or ["path"]
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="")
    writer.writeheader()
    for row in rows:
        writer.writerow({str(k): "" if v is None else v for k, v in row.items()})
    return (buffer.getvalue() + "\n".join(raw_lines)).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    """One real volume and one series of three B-scans, for rows to name."""
    import numpy as np

    from octfw.dicom.writing import write_oct_dicom

    folder = tmp_path_factory.mktemp("fuzz-cohort")
    rng = np.random.default_rng(0)
    write_oct_dicom(folder / "vol.dcm", rng.integers(0, 4096, (4, 16, 16), dtype=np.uint16),
                    (0.2, 0.01, 0.01), "Heidelberg Engineering", "Spectralis")
    for i in range(3):
        write_oct_dicom(folder / "series" / f"b{i}.dcm", rng.integers(0, 4096, (1, 16, 16), dtype=np.uint16),
                        (0.2, 0.01, 0.01), "Carl Zeiss Meditec", "Cirrus", uid_entropy=["series", "1"])
    return folder


@pytest.fixture(scope="module")
def pipeline_parts(tmp_path_factory):
    """The ``dicom`` component and a transform, as ``octfw check`` builds them."""
    from octfw.plugins.transforms.oct_standard import OCTStandardConfig, build
    from octfw.registry import load_registry
    from octfw.types import BuildContext

    cache = tmp_path_factory.mktemp("fuzz-cache")
    ctx = BuildContext(recipe_dir=cache, cache_dir=cache, run_dir=None, seed=0,
                       image_size=(4, 16, 16), patch_size=(2, 8, 8))
    return load_registry().get("dataset", "dicom"), build(OCTStandardConfig(image_size=(4, 16, 16), cache=False),
                                                          ctx), ctx


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# Found by this fuzz (run with more examples): an integer label beyond any float
# (OverflowError) and a series row of an unknown protocol (fsspec's ValueError).
@example(rows=[{"path": "vol.dcm", "label": 10**400}], raw_lines=[], kind="jsonl", split=None,
         domain_from="header")
@example(rows=[{"path": "nosuch://bucket/dir/"}], raw_lines=[], kind="csv", split=None, domain_from="header")
@given(rows=manifest_rows, raw_lines=st.lists(typed, max_size=2), kind=st.sampled_from(["jsonl", "csv"]),
       split=st.sampled_from([None, "train"]), domain_from=st.sampled_from(["header", "manifest", "folder"]))
def test_any_manifest_rows_build_a_dataset_or_one_user_error(cohort, pipeline_parts, rows, raw_lines, kind,
                                                             split, domain_from):
    from octfw.plugins.datasets.dicom.config import DicomConfig
    from octfw.engine.data import SampleSource
    from octfw.recipe.fields import Location

    component, transform, ctx = pipeline_parts
    before = listing(cohort)
    manifest = cohort / f"manifest.{kind}"
    manifest.write_bytes((_jsonl if kind == "jsonl" else _csv)(rows, raw_lines))
    config = DicomConfig(path=Location(str(manifest)), split=split, domain_from=domain_from)
    try:
        dataset = component.build(config, ctx)
        source = SampleSource(dataset, transform, seed=0)  # reads every domain, as a run's start does
        for index in range(min(len(dataset), 3)):
            source[(0, index)]  # an unusable file is quarantined, never raised
    except UserError:
        pass  # the mistake, named: what the CLI prints on one line (octfw.display.errors.one_line)
    finally:
        manifest.unlink()
    assert listing(cohort) == before


def test_set_followed_by_the_end_of_options_marker_is_a_user_error():
    """`--set=--` (found by the fuzz above): argparse hands over [] instead of a string."""
    with sandbox() as folder:
        recipe = folder / "tiny.toml"
        recipe.write_text(TINY_RECIPE, encoding="utf-8")
        code, _out, err = octfw_in_process("show", str(recipe), "--set=0=0", "--set=--")
        assert code == 2 and "--set --: expected TABLE.KEY=VALUE" in err
