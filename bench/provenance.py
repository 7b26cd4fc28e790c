"""Which code a benchmark ran: the commit *and* the content of the working tree.

On the lent device the command runs in a copy of the working tree whose ``.git`` can be older
than the files (session 9: ``bench.concurrency`` recorded the session's first HEAD for code
committed hours later), so ``git rev-parse HEAD`` alone misleads. ``code_identity`` also hashes
the working tree as git would store it (tracked and untracked-not-ignored files, through a
throw-away index: the repository's own index is not touched); ``git log --format='%h %T' | grep
TREE`` here then names the commit whose content ran, and no match means uncommitted code.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def code_identity(root: pathlib.Path | str = ROOT) -> dict:
    """{"commit": HEAD (short) as .git says, "tree": the working tree's git tree hash, "dirty":
    whether that tree differs from HEAD's}. Values are "" (and dirty None) where git or the
    repository is missing; never raises."""
    def git(*args, env=None) -> str:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, env=env, timeout=60)
        return r.stdout.strip() if r.returncode == 0 else ""

    try:
        commit, head_tree = git("rev-parse", "--short", "HEAD"), git("rev-parse", "HEAD^{tree}")
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "GIT_INDEX_FILE": os.path.join(d, "index")}
            tree = git("add", "-A", env=env) == "" and git("write-tree", env=env)
    except (OSError, subprocess.SubprocessError):
        return {"commit": "", "tree": "", "dirty": None}
    return {"commit": commit, "tree": tree or "", "dirty": (tree != head_tree) if tree and head_tree else None}
