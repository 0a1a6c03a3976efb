"""What unpack.sh reads besides the packages: each package's file list and conda-meta record.

pack writes them into channelsmith-unpack/ of the bundle, so that unpack.sh, with no channelsmith
and no Python, only copies files, replaces text prefixes and writes records.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rattler import PathsJson, RepoDataRecord
from rattler.package_streaming import extract

from channelsmith.bundle.layout import FILES_NAME, META_DIR, package_member, package_stem
from channelsmith.expansion import check_expansion


def unpack_sh_inputs(records: Sequence[RepoDataRecord], files: dict[str, Path]) -> tuple[dict[str, bytes], str]:
    """What unpack.sh reads (name under UNPACK_DIR -> bytes), and why it cannot install, if it cannot.

    The file list maps each package's files to where they go in the prefix (noarch: python packages
    move into the lock's python's site-packages, their entry points become scripts), so unpack.sh only
    copies, replaces text prefixes and writes records.
    """
    python = next((r for r in records if r.name.normalized == "python"), None)
    site_packages = None
    if python is not None:
        major_minor = ".".join(str(python.version).split(".")[:2])
        site_packages = python.python_site_packages_path or f"lib/python{major_minor}/site-packages"
    lines = []
    metas: dict[str, bytes] = {}
    refusal = ""
    for record in records:
        archive = package_member(record)
        stem = package_stem(record.file_name)
        # The most bytes unpack.sh lets the package's payload tar decompress to (it counts them before it
        # extracts): measured here, where a package that holds more than its paths.json records is refused.
        lines.append(f"P\t{archive}\t{stem}\t{check_expansion(files[archive]).tar_bound}")
        noarch_python = record.noarch.python
        if noarch_python and site_packages is None:
            refusal = refusal or f"{record.name.normalized} is a noarch: python package but the lock has no python"
        paths = PathsJson.from_package_archive(files[archive])
        installed = []
        for entry in paths.paths:
            source = str(entry.relative_path)
            target = source
            if noarch_python and site_packages is not None:
                if source.startswith("site-packages/"):
                    target = site_packages + source[len("site-packages") :]
                elif source.startswith("python-scripts/"):
                    target = "bin" + source[len("python-scripts") :]
            if any(c in source + target for c in "\t\n"):
                refusal = refusal or f"{record.file_name} holds a path with a tab or newline: {source!r}"
            kind = "D" if entry.path_type.directory else "F"
            placeholder = entry.prefix_placeholder
            if placeholder is not None:
                kind = "T" if placeholder.file_mode.text else "B"
                if kind == "B":
                    refusal = refusal or f"{record.file_name} needs binary prefix replacement in {source}"
                lines.append(f"{kind}\t{source}\t{target}\t{placeholder.placeholder}")
            else:
                lines.append(f"{kind}\t{source}\t{target}")
            installed.append(
                (target, "directory" if kind == "D" else "softlink" if entry.path_type.softlink else "hardlink")
            )
        if noarch_python and site_packages is not None:
            for name, module, function in _entry_points(files[archive]):
                python_bin = f"bin/python{major_minor}"
                lines.append(f"E\tbin/{name}\t{python_bin}\t{module}\t{function}")
                installed.append((f"bin/{name}", "unix_python_entry_point"))
        meta = json.loads(record.to_json())
        meta["files"] = [target for target, kind in installed if kind != "directory"]
        meta["paths_data"] = {"paths_version": 1, "paths": [{"_path": t, "path_type": k} for t, k in installed]}
        meta["requested_specs"] = []
        metas[f"{META_DIR}/{stem}.json"] = json.dumps(meta, indent=2).encode()
    inputs = {FILES_NAME: ("\n".join(lines) + "\n").encode()}
    inputs.update(metas)
    return inputs, refusal


def _entry_points(archive: Path) -> list[tuple[str, str, str]]:
    """(script name, module, function) of each entry point a noarch: python package's info/link.json declares."""
    with tempfile.TemporaryDirectory(prefix="channelsmith-link-") as scratch:
        extract(archive, scratch)
        link = Path(scratch) / "info" / "link.json"
        document = json.loads(link.read_text()) if link.is_file() else {}
    points = []
    for spec in document.get("noarch", {}).get("entry_points", []):
        name, _, target = (part.strip() for part in spec.partition("="))
        module, _, function = (part.strip() for part in target.partition(":"))
        points.append((name, module, function))
    return points
