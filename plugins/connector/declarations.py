"""The built-in KV connectors as the registry knows them before their code is imported: their options, and where
each class is (``conveyor.hookspecs.Declaration``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from conveyor.hookspecs import Declaration, hookimpl


class NoOptions(msgspec.Struct, forbid_unknown_fields=True):
    pass


class TiersOptions(msgspec.Struct, forbid_unknown_fields=True):
    # host memory for the host tier, GiB per worker (pinned on CUDA)
    host_gb: Annotated[float, msgspec.Meta(gt=0)] = 4.0
    # a directory for the disk tier (it survives restarts); "": no disk tier
    disk_dir: str = ""
    # disk space for the disk tier, GiB per worker
    disk_gb: Annotated[float, msgspec.Meta(gt=0)] = 32.0


@hookimpl
def conveyor_register_connectors(register):
    register(Declaration("none", NoOptions, "conveyor.plugins.connector.none:NoConnector",
                         "No connector: KV lives in the device pool only (the engine does not consult this one)."))
    register(Declaration("tiers", TiersOptions, "conveyor.plugins.connector.tiers:TieredConnector",
                         "A tiered prefix cache: blocks the device pool evicted come back from host memory or disk."))
