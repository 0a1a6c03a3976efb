"""Auto-start: with ``TORCH_PEER_WATCHER=1``, every process group is watched without code changes.

The conda package installs ``torch_peer_watcher.pth`` into site-packages; its one line imports this
module only when the variable is on, so an interpreter without it pays nothing. :func:`install`
does not import torch: it waits for ``torch.distributed.distributed_c10d`` to be imported and then
wraps three functions of it (before ``torch.distributed`` re-exports them):

- ``init_process_group``: then :func:`torch_peer_watcher.start` (default store, default group);
- ``new_group`` (and so ``new_subgroups``): then ``watch()`` the new group on its members;
- ``destroy_process_group``: first ``stop()`` (whole world) or ``forget(group)``.

Without a secret, a watcher that cannot connect (a peer without the watcher, a firewall) warns and
the job runs on unwatched. With a secret set (``TORCH_PEER_WATCHER_SECRET`` or ``_SECRET_FILE``: the
job shares its node with strangers), any failure to set the watcher up raises :class:`WatcherError`
from ``init_process_group`` or ``new_group``, naming the cause: a stranger who can make the setup fail
(a replayed address, a port taken) must not leave a job training unwatched. An invalid
``TORCH_PEER_WATCHER_*`` value (the secret file among them) raises :class:`WatcherConfigError`, a
``WatcherError``, either way.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from torch_peer_watcher import c10dhook

_PATCHED = "_torch_peer_watcher_patched"


def install() -> None:
    """Arrange for the wrappers (at once if torch.distributed is already imported)."""
    from torch_peer_watcher.settings import enabled

    try:
        if not enabled():
            return
    except ValueError as exc:
        warnings.warn(f"torch_peer_watcher: {exc}; the watcher stays off", stacklevel=2)
        return
    c10dhook.when_imported(patch)


def patch(c10d: Any) -> None:
    """Wrap init_process_group, new_group and destroy_process_group of ``c10d`` (once)."""
    if getattr(c10d, _PATCHED, False):
        return
    setattr(c10d, _PATCHED, True)
    init_process_group = c10d.init_process_group
    new_group = c10d.new_group
    destroy_process_group = c10d.destroy_process_group

    @functools.wraps(init_process_group)
    def init_and_watch(*args: Any, **kwargs: Any) -> Any:
        result = init_process_group(*args, **kwargs)
        _quietly(lambda: _watcher().start())
        return result

    @functools.wraps(new_group)
    def new_and_watch(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        watcher = _watcher().current()
        if watcher is not None and group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            _quietly(lambda: watcher.watch(group))
        return group

    @functools.wraps(destroy_process_group)
    def forget_and_destroy(group: Any = None) -> Any:
        watcher = _watcher().current()
        if watcher is not None:
            if group is None or group is c10d.GroupMember.WORLD:
                _watcher().stop()
            else:
                watcher.forget(group)
        return destroy_process_group(group)

    c10d.init_process_group = init_and_watch
    c10d.new_group = new_and_watch
    c10d.destroy_process_group = forget_and_destroy


def _watcher() -> Any:
    import torch_peer_watcher

    return torch_peer_watcher


def _quietly(action: Any) -> None:
    """Run a watcher step. Without a secret, a failure to connect leaves the job unwatched, with a
    warning; with one, and for an invalid setting, it raises :class:`WatcherError` naming the cause."""
    import os

    from torch_peer_watcher.losses import WatcherError
    from torch_peer_watcher.settings import SECRET_ENV, SECRET_FILE_ENV, WatcherConfigError

    try:
        action()
    except WatcherConfigError:
        raise
    except (WatcherError, OSError) as exc:
        if os.environ.get(SECRET_ENV, "").strip() or os.environ.get(SECRET_FILE_ENV, "").strip():
            if isinstance(exc, WatcherError):
                raise
            raise WatcherError(f"torch_peer_watcher could not set up ({type(exc).__name__}: {exc}); with a secret set "
                               f"({SECRET_ENV} or {SECRET_FILE_ENV}), a job is never left unwatched") from exc  # fmt: skip
        warnings.warn(f"torch_peer_watcher: {exc}; this group is not watched", stacklevel=3)
