"""The built-in components: plugins like any third party's.

One subpackage per stage (``datasets``, ``transforms``, ``models``,
``schedulers``, ``guards``, ``loggers``, ``checkpointers``, ``evaluators``);
in each, one module or package per component holding its config, its code
and its registration (an ``octfw_register_<stage>`` hook). The registry
imports them by name (:data:`octfw.registry.BUILTIN_PLUGINS`), as it loads a
third-party package through its entry point; no core module imports them
(the import contracts in ``pyproject.toml``, checked by
``tests/test_architecture.py``). What each stage must provide is a declared
protocol in :mod:`octfw.types`.
"""
