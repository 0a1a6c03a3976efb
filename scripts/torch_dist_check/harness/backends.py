"""Which backends a run may test, and each one's profile: the devices it serves, its launch, its dtypes.

gloo, nccl and mpi have built-in profiles. Any other backend registered with torch.distributed (an
out-of-tree plug-in that calls ``torch.distributed.Backend.register_backend`` when its module is
imported, such as recipes/torch-mpi-backend's ``cudampi``) gets a profile from ``--plugin``, or the
default one: CPU and CUDA, no MPI launch, the dtypes every backend maps (no half types).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch_dist_check.harness import startup

BUILTIN_BACKENDS = ("gloo", "nccl", "mpi")
KNOWN_DEVICES = ("cpu", "cuda")
ALL_DTYPES = ("int32", "int64", "float16", "bfloat16", "float32", "float64")
# Without a declared list a plug-in is tested on the dtypes every MPI library and gloo map.
PLUGIN_DEFAULT_DTYPES = ("int32", "int64", "float32", "float64")

# What backend_list holds that is no backend to test.
_NOT_BACKENDS = ("undefined",)


class BackendError(ValueError):
    """A --backends, --plugin or --import value the run cannot use (exit status 2)."""


@dataclass(frozen=True)
class BackendProfile:
    """How the suite tests one backend."""

    name: str
    # None until resolved: a --plugin that names no devices gets those the backend registered.
    devices: tuple[str, ...] | None
    mpi_launch: bool
    dtypes: tuple[str, ...]
    plugin: bool

    def describe(self) -> dict[str, object]:
        """The profile as the JSON report records it."""
        return {"devices": list(self.devices or ()), "mpi_launch": self.mpi_launch, "dtypes": list(self.dtypes), "plugin": self.plugin}


BUILTIN_PROFILES = {
    "gloo": BackendProfile("gloo", ("cpu",), False, ("int32", "int64", "float16", "float32", "float64"), False),
    "nccl": BackendProfile("nccl", ("cuda",), False, ALL_DTYPES, False),
    # torch's MPI backend maps no half types to MPI datatypes, and takes its ranks from MPI.
    "mpi": BackendProfile("mpi", ("cpu", "cuda"), True, PLUGIN_DEFAULT_DTYPES, False),
}


def parse_plugin(text: str) -> BackendProfile:
    """``NAME[:devices=cpu+cuda][:launch=mpi|any][:dtypes=int32+float32]`` to a profile.

    Omitted keys take the plug-in defaults: the devices (of cpu, cuda) the backend registered for,
    no MPI launch, int32/int64/float32/float64.
    """
    name, *fields = [part.strip() for part in text.split(":")]
    name = name.lower()
    if not name:
        raise BackendError(f"--plugin {text!r}: no backend name before the first ':'")
    if name in BUILTIN_BACKENDS:
        raise BackendError(f"--plugin {text!r}: {name} is built in and has its own profile")
    devices: tuple[str, ...] | None = None
    mpi_launch = False
    dtypes = PLUGIN_DEFAULT_DTYPES
    for field in fields:
        key, sep, value = field.partition("=")
        items = tuple(v.strip() for v in value.split("+") if v.strip())
        if not sep or not items:
            raise BackendError(f"--plugin {text!r}: expected KEY=VALUE, got {field!r}")
        if key == "devices":
            _check_items(text, key, items, KNOWN_DEVICES)
            devices = items
        elif key == "launch":
            _check_items(text, key, items, ("mpi", "any"))
            if len(items) != 1:
                raise BackendError(f"--plugin {text!r}: launch takes one value (mpi or any)")
            mpi_launch = items[0] == "mpi"
        elif key == "dtypes":
            _check_items(text, key, items, ALL_DTYPES)
            dtypes = items
        else:
            raise BackendError(f"--plugin {text!r}: unknown key {key!r} (devices, launch, dtypes)")
    return BackendProfile(name, devices, mpi_launch, dtypes, True)


def _check_items(text: str, key: str, items: Sequence[str], allowed: Sequence[str]) -> None:
    bad = [item for item in items if item not in allowed]
    if bad:
        raise BackendError(f"--plugin {text!r}: unknown {key} {', '.join(bad)} (choose from {', '.join(allowed)})")


def import_modules(modules: Iterable[str]) -> None:
    """Import each module, so the backends it registers exist; a failing import is a BackendError.
    Imported with the cycle collector paused (harness/startup.py): such a module imports torch."""
    for module in modules:
        try:
            startup.import_all([module])
        except Exception as exc:  # any import failure is the user's to see, with its cause
            raise BackendError(f"--import {module}: {type(exc).__name__}: {exc}") from exc


def registered_backends() -> list[str]:
    """Every backend name torch.distributed knows now: built-ins and registered plug-ins."""
    import torch.distributed as dist

    names = [n for n in dist.Backend.backend_list if n not in _NOT_BACKENDS]
    names += [n.lower() for n in getattr(dist.Backend, "_plugins", {}) if n.lower() not in names]
    return names


def resolve(backends: Sequence[str], plugins: Sequence[BackendProfile], imports: Sequence[str]) -> list[BackendProfile]:
    """The profile of each requested backend; an unregistered name is a BackendError naming the known ones."""
    if not imports and all(name in BUILTIN_PROFILES for name in backends):
        # Every torch.distributed has gloo, nccl and mpi in Backend.backend_list (available or not), so
        # nothing needs torch here: the --nproc launcher then starts its ranks without importing torch
        # itself (1.4 s of CPU and as much wall time per run on a 2-core machine).
        return [BUILTIN_PROFILES[name] for name in backends]
    import torch.distributed as dist

    declared = {p.name: p for p in plugins}
    known = registered_backends()
    unknown = [b for b in backends if b not in known]
    if unknown:
        hint = (
            f" (after importing {', '.join(imports)})" if imports else
            "; a plug-in backend registers itself when its module is imported: add --import MODULE"
        )  # fmt: skip
        raise BackendError(
            f"unknown backend {', '.join(unknown)}: torch.distributed has {', '.join(known)}{hint}"
        )
    capability: Mapping[str, Sequence[str]] = getattr(dist.Backend, "backend_capability", {})
    profiles = []
    for name in backends:
        if name in BUILTIN_PROFILES:
            profiles.append(BUILTIN_PROFILES[name])
            continue
        registered = capability.get(name)
        profile = declared.get(name) or BackendProfile(name, None, False, PLUGIN_DEFAULT_DTYPES, True)
        if profile.devices is None:
            # Only the devices the backend registered for: a process group has no backend behind any other.
            devices = tuple(d for d in KNOWN_DEVICES if registered is None or d in registered)
            profile = BackendProfile(name, devices, profile.mpi_launch, profile.dtypes, True)
        missing = [d for d in profile.devices if registered is not None and d not in registered]
        if missing:
            raise BackendError(
                f"--plugin {name}: devices {', '.join(missing)} declared, but {name} registered only "
                f"{', '.join(registered or [])}"
            )
        profiles.append(profile)
    return profiles
