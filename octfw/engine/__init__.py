"""The training engine. Its submodules import torch, but for :mod:`octfw.engine.schedules`
(the scheduler configs and the schedule arithmetic, which validating a recipe imports):
import the others only when training or checking."""
