"""Models (recipe table ``[model]``) and the networks they share.

:mod:`octfw.models.vit3d` (the 3D ViT encoder every model and the exported
encoder use) and :mod:`octfw.models.flops` are shared code; each model is a
package holding its config, its code and its registration
(:mod:`octfw.models.vjepa3d`, :mod:`octfw.models.mae3d`).
"""
