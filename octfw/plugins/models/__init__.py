"""Models (recipe table ``[model]``): ``vjepa3d`` and ``mae3d``.

Each is a package holding its config, its code and its registration; the
networks and parts they share (the 3D ViT, masks, health metrics, FLOP
counts, preset scaffolding) are in :mod:`octfw.models`.
"""
