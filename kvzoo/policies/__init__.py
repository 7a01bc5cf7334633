"""Built-in policies, one per file. Build them by name with ``kvzoo.registry.get(name, **params)``."""
