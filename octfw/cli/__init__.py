"""The command line: ``octfw`` and its subcommands.

- :mod:`octfw.cli.main`: the ``octfw`` entry point: the parser of every command
  (octfw's and the plugins'), dispatch, user mistakes as one line and exit 2;
  ``python -m octfw.cli`` runs it (:mod:`octfw.cli.__main__`);
- :mod:`octfw.cli.commands`: one module per subcommand, its arguments and a
  ``run(args)`` that calls the feature it serves;
- :mod:`octfw.cli.arguments`: what every command shares, octfw's and the
  plugins' (the recipe arguments and the command's one registry);
- :mod:`octfw.cli.exit_codes`: what each exit code of ``octfw run`` means. The
  job launcher (:mod:`octfw.engine.launcher`) decides a job's code with them,
  so they sit at the bottom of the layers; the other modules here at the top.

This ``__init__`` imports nothing, so that importing the exit codes or the
arguments does not import the commands.
"""
