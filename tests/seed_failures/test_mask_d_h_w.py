"""Seed failure: the transform emitted a full-resolution mask ``[D, H, W]``
where the model expected patch indices; XLA died in the first forward with
``Check failed: lhs_shape.rank() == rhs_shape.rank() (1 vs. 4)``.

octfw's batch contract is the transform's declaration (``batch_spec``): this one
declares oct-standard's int64 patch indices ``[N]`` and returns a voxel mask; ``octfw
check`` refuses it naming the key and both shapes, and exits with 2."""

from seedkit import cli, install_plugin, write_tiny

VOXEL_MASK = '''
import attrs
import numpy as np
from octfw.hookspecs import hookimpl

@attrs.frozen
class VoxelMaskConfig:
    image_size: tuple[int, int, int] = (8, 32, 32)
    ratio: float = 0.6

class VoxelMask:
    """oct-standard's views, with the seeds' JEPAMaskGeneratord mask: patch
    choices repeated up to image resolution."""
    def __init__(self, inner, config, patch):
        self.inner, self.config, self.patch = inner, config, patch
    def __call__(self, sample, rng):
        arrays = dict(self.inner(sample, rng))
        grid = [s // p for s, p in zip(self.config.image_size, self.patch)]
        masked = rng.random(grid) < self.config.ratio
        for axis, p in enumerate(self.patch):
            masked = np.repeat(masked, p, axis=axis)  # [D, H, W]
        arrays["context_idx"], arrays["target_idx"] = ~masked, masked
        return arrays
    def batch_spec(self):
        return self.inner.batch_spec()  # declares patch indices, returns a voxel mask

def build(config, ctx):
    from octfw.plugins.transforms.oct_standard import OCTStandardConfig, build as standard
    return VoxelMask(standard(OCTStandardConfig(image_size=config.image_size), ctx), config, ctx.patch_size)

@hookimpl
def octfw_register_transforms(register):
    register("voxel-mask", VoxelMaskConfig, build, "the seeds' [D, H, W] mask")
'''


def test_voxel_mask_is_refused_by_check_with_a_clear_message(tmp_path, monkeypatch, capsys):
    install_plugin(monkeypatch, tmp_path, "plug_voxel_mask", VOXEL_MASK)
    recipe = write_tiny(tmp_path)
    code, out, err = cli(capsys, "check", recipe, "--set", 'transform={name="voxel-mask", image_size=[8, 32, 32]}')
    assert code == 2
    assert "transform output 'context_idx' has shape [8, 32, 32] per sample; its batch_spec declares [" in err
    assert "check passed" not in out
