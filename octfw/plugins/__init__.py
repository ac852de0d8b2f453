"""Built-in components. Each module registers the components of one stage
through the same hooks a third-party plugin uses; heavy imports happen inside
factories, never at module import. :data:`octfw.registry.BUILTIN_PLUGINS`
lists the modules; nothing outside this package imports it."""
