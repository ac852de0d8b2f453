"""What a person sees: errors in one line, log lines, progress bars, tables and plots.

- :mod:`octfw.display.errors`: the errors octfw shows to users (a
  :class:`~octfw.display.errors.UserError` is one line and exit 2) and its one
  warning class;
- :mod:`octfw.display.logs`: the console's log lines, ``RUN/octfw.log`` and
  the one warnings channel;
- :mod:`octfw.display.progress`: progress bars, in a terminal or Jupyter;
- :mod:`octfw.display.tables`: rich tables and counted nouns ("3 volumes");
- :mod:`octfw.display.plots`: a run's metrics drawn (``octfw plot``).

Light at import: rich and matplotlib are imported when something is drawn.
This ``__init__`` imports nothing.
"""
