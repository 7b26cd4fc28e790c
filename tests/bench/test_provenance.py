"""bench.provenance.code_identity on a real git repository in tmp_path."""
import subprocess

from bench.provenance import code_identity


def git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_tree_names_the_content_that_ran_not_the_stale_head(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "one")
    first = code_identity(tmp_path)
    assert first["commit"] == git(tmp_path, "rev-parse", "--short", "HEAD")
    assert first["tree"] == git(tmp_path, "rev-parse", "HEAD^{tree}") and first["dirty"] is False

    # the device's situation: newer files under an older .git — HEAD stays, the tree moves
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("y = 1\n")           # untracked, not ignored: part of what runs
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_bytes(b"0")  # ignored: not part of it
    objects = sorted(p for p in (tmp_path / ".git" / "objects").rglob("*") if p.is_file())
    now = code_identity(tmp_path)
    assert now["commit"] == first["commit"] and now["tree"] != first["tree"] and now["dirty"] is True
    assert "new.py" not in git(tmp_path, "diff", "--cached", "--name-only")  # the repository's own index untouched
    assert sorted(p for p in (tmp_path / ".git" / "objects").rglob("*") if p.is_file()) == objects  # and its objects

    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "two")
    assert git(tmp_path, "rev-parse", "HEAD^{tree}") == now["tree"]  # the commit of that content is findable


def test_outside_a_repository_it_reports_nothing_and_does_not_raise(tmp_path):
    assert code_identity(tmp_path / "missing") == {"commit": "", "tree": "", "dirty": None}


def test_a_tree_git_cannot_hash_reports_no_tree_but_keeps_the_commit(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "one")
    (tmp_path / "sub").mkdir()
    git(tmp_path / "sub", "init", "-q")  # a nested repository without a commit: `git add -A` fails on it
    other = tmp_path / "elsewhere"
    git(tmp_path, "init", "-q", str(other))
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))  # the environment's repository is not the one asked about
    got = code_identity(tmp_path)
    assert got == {"commit": git(tmp_path, "--git-dir", str(tmp_path / ".git"), "rev-parse", "--short", "HEAD"),
                   "tree": "", "dirty": None}
