"""Speed features of the worker, one module each; the model class reaches them through :mod:`.registry`."""
