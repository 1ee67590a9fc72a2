"""Moving layers between live pipeline stages (device- and framework-neutral parts).

The Megatron glue (what a layer's state is, how to rebuild DDP and the optimizer)
lives in `dynmo_plugin.megatron.migration.migrate`.
"""
from dynmo_plugin.migration.result import MigrationError, MigrationResult
from dynmo_plugin.migration.wire import Header, checksum, pack, unpack

__all__ = ["MigrationError", "MigrationResult", "Header", "checksum", "pack", "unpack"]
