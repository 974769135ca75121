"""The ``tierflow`` command line: entry point, config files, help formatting, tables.

The subcommands live with the code they drive (``tierflow.partitioner.commands``,
``tierflow.edge.commands``, ...); ``main`` wires them together.
"""
