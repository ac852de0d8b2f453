"""Schedulers (recipe table ``[scheduler]``): ``cosine-no-restart`` and
``constant``. One module per scheduler holds its config, its code and its
registration; the schedule arithmetic they share is :mod:`octfw.engine.schedules`."""
