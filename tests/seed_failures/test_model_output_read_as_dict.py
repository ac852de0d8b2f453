"""Seed failure: the training loop logged ``outputs.get('ema_momentum', 0.0)``
while the model returned a ``(loss, predictions, targets)`` tuple: a
``NameError``/``AttributeError`` in the logging code, after the step ran.

octfw's models return the typed :class:`octfw.types.ModelOutput` (no
``.get``, no guessing at keys); ``octfw check`` refuses a model that returns
anything else, naming the type, before training."""

import pytest
import torch

from octfw.types import ModelOutput

from seedkit import cli, install_plugin, write_tiny

UNTYPED = '''
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class UntypedConfig:
    patch_size: tuple[int, int, int] = (4, 16, 16)
    returns: str = "dict"

def build(config, ctx):
    import torch
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build as vjepa

    class Untyped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = vjepa(VJEPA3DConfig(preset="tiny", patch_size=config.patch_size), ctx)
            self.inputs = self.inner.inputs
        def forward(self, batch):
            out = self.inner(batch)
            if config.returns == "dict":
                return {"loss": out.loss, "per_sample_loss": out.per_sample_loss}
            return out.loss, out.per_sample_loss, out.metrics
    return Untyped()

@hookimpl
def octfw_register_models(register):
    register("untyped", UntypedConfig, build, "vjepa3d returning a dict or a tuple")
'''


@pytest.mark.parametrize("returns, type_name", [("dict", "dict"), ("tuple", "tuple")])
def test_model_returning_an_untyped_output_is_refused_by_check(tmp_path, monkeypatch, capsys, returns, type_name):
    install_plugin(monkeypatch, tmp_path, "plug_untyped", UNTYPED)
    recipe = write_tiny(tmp_path)
    code, out, err = cli(capsys, "check", recipe, "--set", f'model={{name="untyped", returns="{returns}"}}')
    assert code == 2
    assert f"model 'untyped' returned {type_name}; it must return octfw.types.ModelOutput" in err


def test_model_output_is_typed_and_has_no_dict_access():
    out = ModelOutput(loss=torch.tensor(1.0), per_sample_loss=torch.ones(2))
    assert not hasattr(out, "get") and not hasattr(out, "keys")
    with pytest.raises(AttributeError):
        out.get("ema_momentum", 0.0)
    with pytest.raises(TypeError):
        out["loss"]
