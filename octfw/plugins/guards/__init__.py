"""Built-in guards: decide on the device whether an update may be applied."""

from octfw.hookspecs import Register, hookimpl
from octfw.plugins.guards.collapse import CollapseConfig
from octfw.plugins.guards.grad_clip import GradClipConfig
from octfw.plugins.guards.loss_spike import LossSpikeConfig
from octfw.plugins.guards.lr_positive import LRPositiveConfig
from octfw.plugins.guards.nan_skip import NanSkipConfig


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register("nan-skip", NanSkipConfig, "octfw.plugins.guards.nan_skip:build",
             "Skip an update whose loss or gradient is non-finite; decided on the device.")
    register("grad-clip", GradClipConfig, "octfw.plugins.guards.grad_clip:build",
             "Clip the global gradient norm (measured once, before clipping).")
    register("lr-positive", LRPositiveConfig, "octfw.plugins.guards.lr_positive:build",
             "Refuse to train when the learning rate of the first update is not > 0.")
    register("loss-spike", LossSpikeConfig, "octfw.plugins.guards.loss_spike:build",
             "Warn or stop when the logged loss exceeds factor x its running median.")
    register("collapse", CollapseConfig, "octfw.plugins.guards.collapse:build",
             "Warn or stop when the target features collapse (low std or effective rank).")
