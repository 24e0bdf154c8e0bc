"""engines/__init__.py: oneDNN's shape-keyed caches are capped, so ever-new batch shapes do not
grow the main process by hundreds of MB."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env_after_import(env: dict) -> list[str]:
    code = ("import engines, os; "
            "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_caps_are_set_on_import():
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env["PYTHONPATH"] = str(ROOT)
    from engines import ONEDNN_CACHE_ENTRIES
    assert _env_after_import(env) == [ONEDNN_CACHE_ENTRIES, ONEDNN_CACHE_ENTRIES]


def test_a_value_in_the_environment_wins():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "7"}
    assert _env_after_import(env) == ["1024", "7"]
