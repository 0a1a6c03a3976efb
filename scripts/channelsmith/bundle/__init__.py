"""Air-gapped deploys: pack a deploy's lock into one tar, and install that tar where no network is.

One module per concern, each importing only the ones above it in this list:

- ``anchors``: what vouches for a bundle from outside it (its sha256, an OpenSSH signature) and how
  each is made and checked;
- ``layout``: the bundle's members (pixi-pack's layout plus channelsmith's own), the names pack
  writes and an install reads; ``unpack.sh``, the POSIX installer every bundle carries, lies beside it;
- ``fetching``: the packages a lock pins, from the package cache, the lock's URL or a download,
  each checked against the lock's sha256;
- ``unpack_inputs``: the file lists and conda-meta records unpack.sh reads;
- ``packing``: ``channelsmith pack``, the bundle and its anchors written;
- ``checking``: a bundle read once and checked (its anchors, platform, lock and packages) before
  anything inside it is used;
- ``installing``: ``channelsmith deploy --bundle``, the checked packages installed into a new prefix.

The lock itself (reading it, and ``--channel-map`` for a channel that moved) is channelsmith.lock,
which deploy uses too. The names below are what the command line and the tests use.
"""

from channelsmith.bundle.fetching import default_cache_dir
from channelsmith.bundle.installing import activate_script, install_bundle
from channelsmith.bundle.layout import (
    ACTIVATE_NAME,
    METADATA_NAME,
    PIXI_PACK_VERSION_MATCHED,
    UNPACK_SCRIPT,
    unpack_script,
    unpack_script_path,
)
from channelsmith.bundle.packing import BundledPackage, PackReport, pack

__all__ = [
    "ACTIVATE_NAME",
    "METADATA_NAME",
    "PIXI_PACK_VERSION_MATCHED",
    "UNPACK_SCRIPT",
    "BundledPackage",
    "PackReport",
    "activate_script",
    "default_cache_dir",
    "install_bundle",
    "pack",
    "unpack_script",
    "unpack_script_path",
]
