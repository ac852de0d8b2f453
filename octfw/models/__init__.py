"""The model parts the built-in models, third-party ones and the core share.

:mod:`octfw.models.vit3d` (the 3D ViT encoder every model and the exported
encoder use), :mod:`octfw.models.masks` (patch masks), :mod:`octfw.models.health`,
:mod:`octfw.models.flops`, :mod:`octfw.models.masked_decoder` and
:mod:`octfw.models.presets`. The models themselves are plugins
(:mod:`octfw.plugins.models`).
"""
