"""Built-in plugins: each module is a pluggy plugin registered like a third-party one."""
