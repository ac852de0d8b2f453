"""The training engine. Submodules other than :mod:`octfw.config`
import torch; import them only when training or checking."""
