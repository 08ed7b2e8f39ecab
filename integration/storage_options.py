"""Options both engine adapters read from their engine's config: a storage directory only this user
may write, and a storage budget. Checked at construction, with errors that name the option."""

from __future__ import annotations

import math
import os
import stat


def path_option(option: str, value) -> str:
    """A non-empty path from an engine's config, or a ValueError naming ``option``."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"{option} must be a directory path, got {value!r}")
    return os.fspath(value)


def budget_bytes(budget_gb) -> int:
    """``budget_gb`` (GiB, a positive finite number) in bytes, or a ValueError naming the option."""
    if isinstance(budget_gb, bool):
        raise ValueError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}")
    try:
        gb = float(budget_gb)
    except (TypeError, ValueError):
        raise ValueError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}") from None
    if not math.isfinite(gb) or gb <= 0:
        raise ValueError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}")
    return int(gb * 2**30)


def private_directory(path: str, option: str) -> None:
    """Create ``path`` with mode 0700 if absent; refuse (ValueError naming ``option``) a symbolic link, a
    non-directory, or a directory another user owns or that group or others may write: anyone who can
    write there could plant pages this backend would load."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # created meanwhile (another thread, or someone else): checked below
            pass
        info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"{option} {path!r} is a symbolic link; give the real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{option} {path!r} exists and is not a directory")
    if info.st_uid != os.geteuid():
        raise ValueError(f"{option} {path!r} is owned by uid {info.st_uid}, not by this user "
                         f"(uid {os.geteuid()}); use a directory of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{option} {path!r} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
                         "use a directory only you can write (chmod 700)")
