"""Which file names a checkpoint may list.

The names in manifest.json and in part records come from storage that others may write (a
shared bucket, a checkpoint someone published): a name joined to a local folder unchecked
could put a file anywhere the user can write. A name is taken only as a plain relative POSIX
path that stays inside the checkpoint's folder, and one is written only if it reads back so.
"""

from __future__ import annotations


def unsafe_reason(name: object) -> str | None:
    """Why ``name`` cannot be a checkpoint's file name, or None when it can."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        return "it holds a control character"
    if "\\" in name:  # a separator on Windows, and never one our writers produce
        return "it holds a backslash"
    if name.startswith("/"):
        return "it is an absolute path"
    parts = name.split("/")
    if "" in parts:
        return "it has an empty part ('//' or a trailing '/')"
    if ".." in parts:
        return "it has a '..' part"
    if "." in parts:
        return "it has a '.' part"
    return None


def check_names(names, where: str, error: type[Exception]) -> None:
    """Raise ``error`` naming the first unsafe name among ``names`` (listed in ``where``)."""
    for name in names:
        why = unsafe_reason(name)
        if why is not None:
            raise error(f"{where} lists the file {name!r}: {why}; a checkpoint's files must "
                        "stay inside its folder")
