"""The command line a person uses: python -m specdec_client streams text as it arrives (one
write per streamed chunk), a stats line on stderr, --json for the machine-readable result;
python -m deploy.local --log-dir creates the folder."""
from __future__ import annotations

import io
import json
import subprocess
import sys

from deploy.local import ROOT, start_stack
from specdec_client import Chunk
from specdec_client import __main__ as cli

PROMPT = "Name three colours."


class Writes(io.StringIO):
    """stdout that records each write."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def test_streams_each_chunk_then_stats(stack, client, monkeypatch, capsys):
    chunks = [c.text for c in client.stream(messages=[{"role": "user", "content": PROMPT}], max_tokens=12)
              if isinstance(c, Chunk) and c.text]
    expected = client.generate(messages=[{"role": "user", "content": PROMPT}], max_tokens=12)
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main([PROMPT, "--address", stack.address, "--max-tokens", "12"]) == 0
    assert len(chunks) > 1 and out.writes[:len(chunks)] == chunks  # text written as each chunk arrived
    assert out.getvalue() == expected.text + "\n"
    err = capsys.readouterr().err
    assert f"{expected.completion_tokens} tokens in" in err and "tok/s" in err
    assert f"tau {expected.stats.mean_accept_length:.2f} over {expected.stats.rounds} rounds" in err


def test_json_and_errors(stack, client):
    run = lambda *a: subprocess.run([sys.executable, "-m", "specdec_client", *a, "--address", stack.address],
                                    cwd=ROOT, capture_output=True, text=True, timeout=300)
    r = run(PROMPT, "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    expected = client.generate(messages=[{"role": "user", "content": PROMPT}], max_tokens=8)
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    assert out["stats"]["rounds"] == expected.stats.rounds and out["tokens_per_second"] > 0
    bad = run(PROMPT, "--max-tokens", "0")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr


def test_timeout_flag_is_the_deadline(stack, capsys):
    assert cli.main([PROMPT, "--address", stack.address, "--max-tokens", "500", "--timeout", "0.3", "--json"]) == 1
    assert json.loads(capsys.readouterr().err)["error"] == "DEADLINE_EXCEEDED"


def test_local_log_dir_is_created(tmp_path):
    log_dir = tmp_path / "new" / "logs"
    s = start_stack(log_dir=str(log_dir))
    s.stop()
    assert sorted(p.name for p in log_dir.iterdir()) == ["draft.log", "orchestrator.log", "target.log"]
