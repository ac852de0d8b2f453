"""Seed failure: TorchInductor's compile workers ("compile_worker (1 of 32)")
swamped the TPU host before the first optimizer step; the fix was
``TORCH_COMPILE_DISABLE=1``.

In octfw ``engine.compile`` defaults to false, and ``engine.compile = true``
with ``run.device = "xla"`` is refused by ``octfw check`` and ``octfw run``
(exit 2): torch_xla compiles its own graphs."""

import attrs

from octfw.recipe.config import EngineConfig

from seedkit import cli, cli_subprocess, write_tiny

MESSAGE = "engine.compile = true is refused on xla"


def test_compile_is_off_by_default(tmp_path, capsys):
    assert attrs.fields(EngineConfig).compile.default is False
    recipe = write_tiny(tmp_path)
    code, out, _ = cli(capsys, "show", recipe, "--set", 'run.device="xla"')
    assert code == 0 and "compile = false" in out


def test_compile_on_xla_is_refused_by_check(tmp_path, capsys):
    recipe = write_tiny(tmp_path)
    code, out, err = cli(capsys, "check", recipe, "--set", 'run.device="xla"', "--set", "engine.compile=true")
    assert code == 2 and MESSAGE in err and "check passed" not in out


def test_compile_on_xla_is_refused_by_run(tmp_path):
    # A subprocess: choosing the xla device imports torch_xla, which patches torch process-wide.
    recipe = write_tiny(tmp_path)
    result = cli_subprocess(tmp_path, "run", recipe, "--set", 'run.device="xla"', "--set", "engine.compile=true",
                            env={"PJRT_DEVICE": "CPU"})
    assert result.returncode == 2 and MESSAGE in result.stderr
    assert not list(tmp_path.glob("runs/**/metrics.jsonl"))
