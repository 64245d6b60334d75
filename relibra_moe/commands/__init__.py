"""Subcommands of the ``relibra`` CLI: one module per command group, each with ``register(subparsers)``.

A module's ``register`` adds its subparser(s) and sets ``func`` (``args -> int`` exit code) on each.
"""

COMMAND_MODULES = (
    "relibra_moe.commands.trace",     # relibra trace import|synth|stats
    "relibra_moe.commands.plan",      # relibra plan, relibra score
    "relibra_moe.commands.simulate",  # relibra simulate
    "relibra_moe.commands.demo",      # relibra demo
    "relibra_moe.commands.compare",   # relibra compare
    "relibra_moe.commands.calibrate",  # relibra calibrate
)
