"""The orchestrator is torch-free (plans/0004): its package, the wire layer, the acceptance walk
and its tokenizer load without torch or model code."""
import subprocess
import sys

from deploy.local import ROOT

FORBIDDEN = ["torch", "modeling.llama", "modeling.dflash", "modeling.sampling", "modeling.weights",
             "modeling.kv_cache", "target_service.engine", "draft_service.engine"]

CODE = f"""
import importlib, pkgutil, sys
import orchestrator
for m in pkgutil.iter_modules(orchestrator.__path__):
    importlib.import_module("orchestrator." + m.name)
from modeling.model_files import default_gguf_path
from modeling.tokenizer import TextTokenizer
TextTokenizer.from_file(default_gguf_path()).encode("hello")
print(sorted(m for m in {FORBIDDEN!r} if m in sys.modules))
"""


def test_orchestrator_imports_no_torch_or_model_code():
    r = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_check_can_fail():
    """The same probe reports torch once something imports it."""
    code = CODE.replace("import orchestrator\n", "import orchestrator, modeling.sampling\n", 1)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "torch" in r.stdout
