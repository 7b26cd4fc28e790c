"""Which code a benchmark ran: the commit *and* the content of the working tree.

On the lent device the command runs in a copy of the working tree whose ``.git`` can be older
than the files (session 9: ``bench.concurrency`` recorded the session's first HEAD for code
committed hours later), so ``git rev-parse HEAD`` alone misleads. ``code_identity`` also hashes
the working tree as git would store it (tracked and untracked-not-ignored files) through a
throw-away index and a throw-away object directory, so the repository's own index and object
store are not touched; ``git log --format='%h %T' | grep TREE`` here then names the commit whose
content ran, and no match means uncommitted code.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
_GIT_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES",
             "GIT_COMMON_DIR", "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES")


def code_identity(root: pathlib.Path | str = ROOT, timeout: float = 60.0) -> dict:
    """{"commit": HEAD (short) as .git says, "tree": the working tree's git tree hash, "dirty":
    whether that tree differs from HEAD's}. The repository is the one containing ``root``
    (``GIT_DIR`` and the like in the environment are ignored). "" (dirty None) for what cannot be
    read: no git, no repository, a tree git cannot hash (a nested repository, an unreadable file)
    or one that takes longer than ``timeout`` s to hash (the commit is kept then). Never raises."""
    env = {k: v for k, v in os.environ.items() if k not in _GIT_VARS}

    def git(*args, extra=None) -> str | None:  # stdout, or None when git failed
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=timeout,
                           env={**env, **(extra or {})})
        return r.stdout.strip() if r.returncode == 0 else None

    out = {"commit": "", "tree": "", "dirty": None}
    try:
        out["commit"] = git("rev-parse", "--short", "HEAD") or ""
        head_tree, objects = git("rev-parse", "HEAD^{tree}"), git("rev-parse", "--path-format=absolute",
                                                                    "--git-path", "objects")
        if objects is None:
            return out
        with tempfile.TemporaryDirectory() as d:  # new blobs and the index go here, the repository keeps its own
            os.mkdir(os.path.join(d, "objects"))
            extra = {"GIT_INDEX_FILE": os.path.join(d, "index"), "GIT_OBJECT_DIRECTORY": os.path.join(d, "objects"),
                     "GIT_ALTERNATE_OBJECT_DIRECTORIES": objects}
            if git("add", "-A", extra=extra) is None:
                return out
            tree = git("write-tree", extra=extra)
    except (OSError, subprocess.SubprocessError):
        return out
    if tree:
        out["tree"], out["dirty"] = tree, (tree != head_tree) if head_tree else None
    return out
