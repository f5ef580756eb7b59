"""The binding to Megatron-LM's DistributedOptimizer.

Owns the binding that puts a :class:`~miles_plugins.optimizers.store.StreamingStore`
under a built ``DistributedOptimizer`` (``binding``), the command-line flags and
the one table of what cannot be streamed (``args``), and the pins of upstream
code the binding reproduces or relies on, which ``python -m megatron_hooks
drift`` reads through the ``megatron_hooks.pins`` entry point (``pins``). May
import everything below it in the package (the store, ``step``, ``homes``,
``formats``, ``config``, ``errors``) and ``megatron_hooks``. This ``__init__``
imports nothing and ``pins`` imports only ``megatron_hooks``, so reading the
pins never imports torch.
"""
