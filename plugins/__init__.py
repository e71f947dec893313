"""Conveyor's built-in plugins, and how to write your own.

Everything with a policy in it is a plugin: schedulers, KV cache layouts,
quantization methods and transports. The built-ins in this package are
ordinary plugin modules; a third-party plugin takes exactly the same path.

Writing a plugin
----------------
1. Subclass the base class of its kind and give the class a ``name`` (what a
   config selects) and an ``Options`` msgspec Struct (the other keys of its
   TOML table, validated at start-up)::

       from conveyor.scheduler import Scheduler, SchedulerOptions

       class ShortestFirst(Scheduler):
           '''Shortest prompt first; the base class does admission, batching, preemption.'''
           name = "sjf"
           Options = SchedulerOptions

           def waiting_key(self, request):
               return (request.num_prompt_tokens, request.arrival_order)

2. Declare it from a hook implementation, in a module that imports nothing
   heavy (the server's frontend imports it to check a config; the class is
   imported where the plugin runs)::

       from conveyor.hookspecs import Declaration, hookimpl
       from conveyor.scheduler import SchedulerOptions

       @hookimpl
       def conveyor_register_schedulers(register):
           register(Declaration("sjf", SchedulerOptions, "conveyor_sjf.scheduler:ShortestFirst"))

   A plugin that is one light module may register its class instead:
   ``register(ShortestFirst)``.

3. Make Conveyor find the declaring module, either as an installed package with an
   entry point in its pyproject.toml::

       [project.entry-points.conveyor]
       sjf = "conveyor_sjf"

   or, for a local module, by listing it in the config: ``plugins = ["my_module"]``.

4. Select it: ``[scheduler]`` / ``plugin = "sjf"``. ``conveyor plugins``
   lists every installed plugin with its options.

Hooks and interfaces
--------------------
=================================== ================================
hook                                interface
=================================== ================================
``conveyor_register_schedulers``    ``conveyor.scheduler.Scheduler``
``conveyor_register_kvcaches``      ``conveyor.kvcache.KVCacheManager``
``conveyor_register_quant_methods`` ``conveyor.quant.QuantMethod``
``conveyor_register_transports``    ``conveyor.transport.Transport``
=================================== ================================

See docs/plugins.md for a complete example package (examples/conveyor-sjf).
"""
